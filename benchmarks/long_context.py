"""One engine step on a long context: a decode step and a 150-token suffix prefill, at 4k/16k/32k tokens of context,
with the context's blocks consecutive (a fresh pool) and scattered (every other block, as a long-lived pool frees
them), plus a decode batch of eight sequences. The KV pool holds arbitrary values: attention's cost does not
depend on them.

    python benchmarks/long_context.py [--contexts 4096,16384,32768] [--out results/long_context.json]

Each step is timed `--repeats` times on `--threads` compute threads; the fastest counts. With `--cpu-time` the
process's CPU time is measured instead of the wall clock: on a machine shared with other work it tells what the step
costs rather than how long it waited for a core. Prints a table and writes JSON with the machine it ran on.
"""
import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from kvturn.bench.machine import machine, write_json
from kvturn.config import EngineConfig
from kvturn.engine.llm import LLM
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.model.make_model import default_model_dir

SUFFIX_TOKENS = 150


def best_ms(repeats: int, fn, clock) -> float:
    fn()  # the first run of a shape allocates
    times = []
    for _ in range(repeats):
        started = clock()
        fn()
        times.append(clock() - started)
    return min(times) * 1e3


def sequence(engine, name: str, context: int, new_tokens: int, scattered: bool) -> Sequence:
    """A sequence whose first `context` tokens count as computed, with blocks for `new_tokens` more."""
    blocks, size = engine.block_manager, engine.block_size
    needed = -(-(context + new_tokens) // size)
    if scattered:  # every other free block: no two of the sequence's blocks are neighbours
        taken = [blocks.allocate_new() for _ in range(2 * needed)]
        table, spare = taken[::2], taken[1::2]
        blocks.release_all(spare)
    else:
        table = sorted(blocks.allocate_new() for _ in range(needed))
    seq = Sequence(name, [(7919 * i) % 4000 + 3 for i in range(context + new_tokens + 1)],
                   SamplingParams(max_tokens=1, temperature=0.0))
    seq.block_table, seq.num_computed_tokens = table, context
    return seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu-time", action="store_true", help="time the process's CPU, not the wall clock")
    parser.add_argument("--out", default="results/long_context.json")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    tokens = 2 * (max(contexts) + SUFFIX_TOKENS) + 8192  # scattered: twice the blocks, one sequence at a time
    llm = LLM(default_model_dir(args.preset), EngineConfig(num_kv_blocks=tokens // 16, enable_prefix_caching=False))
    engine, runner = llm.engine, llm.engine.runner
    torch.manual_seed(0)
    engine.kv_cache.pool.normal_()
    rows = []
    for context in contexts:
        row = {"context_tokens": context}
        for layout in ("consecutive", "scattered"):
            seq = sequence(engine, "one", context, SUFFIX_TOKENS, layout == "scattered")
            row[f"decode_ms_{layout}"] = best_ms(args.repeats, lambda: runner.run([(seq, 1)]), clock)
            row[f"suffix_ms_{layout}"] = best_ms(args.repeats, lambda: runner.run([(seq, SUFFIX_TOKENS)]), clock)
            engine.block_manager.release_all(seq.block_table)
        batch = [sequence(engine, f"b{i}", context // 8, 1, False) for i in range(8)]
        row["decode_ms_batch_of_8"] = best_ms(args.repeats, lambda: runner.run([(s, 1) for s in batch]), clock)
        for seq in batch:
            engine.block_manager.release_all(seq.block_table)
        rows.append(row)
    info = machine()
    table = Table(title=f"one engine step on a long context, {args.preset} model ({info['cpu']}, "
                        f"{args.threads} threads); {'CPU' if args.cpu_time else 'wall'} ms, fastest of {args.repeats}")
    columns = ["context_tokens", "decode_ms_consecutive", "decode_ms_scattered", "suffix_ms_consecutive",
               "suffix_ms_scattered", "decode_ms_batch_of_8"]
    titles = ["context", "decode", "decode (scattered)", f"{SUFFIX_TOKENS}-token suffix",
              f"{SUFFIX_TOKENS}-token suffix (scattered)", "decode, 8 x context/8"]
    for title in titles:
        table.add_column(title, justify="right")
    for row in rows:
        table.add_row(*(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    Console(width=160).print(table)
    print(f"JSON: {write_json(args.out, {'machine': info, 'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
