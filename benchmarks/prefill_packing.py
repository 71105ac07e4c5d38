"""What packing several prompts into one engine step does to their times to first token, one run, side by side.

Agent-loop's first turns arrive together: eight prompts of 2.4k-4.3k tokens. Each is computed on the kvturn
engine (offline, no server) one at a time, then all at once with `prefill_pack_tokens` at the step budget (every
prompt packed as far as the budget goes, as before this setting) and at smaller values (a step starts no other
prompt past that many prompt tokens).

    python benchmarks/prefill_packing.py [--prompts 8] [--pack 8192,2048,512] [--out results/prefill_packing.json]
"""
import argparse
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from kvturn.bench.machine import machine, write_json
from kvturn.config import EngineConfig
from kvturn.engine.llm import LLM
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.model.make_model import default_model_dir


def first_token_ms(llm: LLM, prompts: list[list[int]], tag: str) -> tuple[list[float], float]:
    """Submit all `prompts` at once; each one's time to first token and the time until the last, ms."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine = llm.engine
    seqs = [Sequence(f"{tag}-{i}", list(prompt), one) for i, prompt in enumerate(prompts)]
    start = time.perf_counter()
    for seq in seqs:
        engine.add_request(seq)
    while engine.has_work():
        engine.step()
    times = [(seq.timing.first_token - start) * 1e3 for seq in seqs]
    return times, max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="the embedded model kvturn serves by default")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=2400)
    parser.add_argument("--max-tokens", type=int, default=4300)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--pack", default="8192,2048,512", help="prefill_pack_tokens values to compare")
    parser.add_argument("--out", default="results/prefill_packing.json")
    args = parser.parse_args()
    rng = random.Random(0)
    model_dir = default_model_dir(args.preset)
    packs = [int(x) for x in args.pack.split(",")]

    def engine(pack: int) -> LLM:  # one at a time, with kvturn's own pool size: a bigger pool is slower to touch
        return LLM(model_dir, EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=args.budget,
                                           prefill_pack_tokens=pack))

    llm = engine(packs[0])
    vocab = llm.engine.runner.model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_tokens, args.max_tokens))]
               for _ in range(args.prompts)]
    # Each mode runs the whole workload once before it is measured: the first steps of a shape allocate.
    for warm in ("warm", "alone"):
        alone = [first_token_ms(llm, [p], f"{warm}{i}")[0][0] for i, p in enumerate(prompts)]
    # FCFS one at a time: the i-th prompt's first token after the ones before it and its own compute.
    sequential = [sum(alone[:i + 1]) for i in range(len(alone))]
    rows = [{"mode": "one at a time", "ttft_ms": sequential, "total_ms": sequential[-1]}]
    for pack in packs:
        llm = engine(pack)
        first_token_ms(llm, prompts, "warm")
        times, total = first_token_ms(llm, prompts, "measured")
        rows.append({"mode": f"together, pack {pack}", "ttft_ms": times, "total_ms": total})

    table = Table(title=f"{args.prompts} prompts of {args.min_tokens}-{args.max_tokens} tokens arriving together, "
                        f"step budget {args.budget} ({machine()['cpu']}, {machine()['cores']} cores)",
                  caption="one at a time: each prompt alone, queued behind the ones before it; pack N: "
                          "prefill_pack_tokens=N")
    for column in ("mode", "TTFT mean", "TTFT p50", "first's TTFT", "all done", "/ one at a time"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in rows:
        t = row["ttft_ms"]
        row.update(mean_ms=statistics.mean(t), p50_ms=statistics.median(t), ratio=row["total_ms"] / sequential[-1])
        table.add_row(row["mode"], f"{row['mean_ms']:.0f} ms", f"{row['p50_ms']:.0f} ms", f"{t[0]:.0f} ms",
                      f"{row['total_ms']:.0f} ms", f"{row['ratio']:.2f}x")
    Console().print(table)
    write_json(args.out, {"machine": machine(), "prompt_tokens": [len(p) for p in prompts], "alone_ms": alone,
                          "rows": rows})


if __name__ == "__main__":
    main()
