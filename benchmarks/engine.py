"""Prefill and decode throughput of the kvturn engine beside transformers (sdpa), same model, one run.

    python benchmarks/engine.py [--preset small] [--out results/engine.json]
"""
import argparse
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from kvturn.config import EngineConfig
from kvturn.engine.llm import LLM
from kvturn.engine.sampling import SamplingParams
from kvturn.bench.machine import machine, write_json
from kvturn.model.make_model import default_model_dir


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prefill-lengths", default="512,2048,8192")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="results/engine.json")
    args = parser.parse_args()
    model_dir = default_model_dir(args.preset)
    ours = LLM(model_dir, EngineConfig(kv_cache_mb=2048, enable_prefix_caching=False, max_num_batched_tokens=8192))
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = ours.engine.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []

    for length in [int(x) for x in args.prefill_lengths.split(",")]:
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        ours_s = best_of(args.repeats, lambda: ours.generate([prompt], one))
        with torch.inference_mode():
            theirs_s = best_of(args.repeats, lambda: theirs(torch.tensor([prompt]), use_cache=False).logits[:, -1].argmax())
        rows.append({"metric": f"prefill {length} tok", "unit": "tok/s", "kvturn": length / ours_s,
                     "transformers": length / theirs_s})

    n = args.decode_tokens
    for batch in (1, 8):
        prompts = [torch.randint(3, vocab, (128,), generator=g).tolist() for _ in range(batch)]
        decode = SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True)
        ours_prefill = best_of(args.repeats, lambda: ours.generate(prompts, one))
        ours_total = best_of(args.repeats, lambda: ours.generate(prompts, decode))
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            theirs_prefill = best_of(args.repeats, lambda: theirs.generate(ids, max_new_tokens=1, do_sample=False))
            theirs_total = best_of(args.repeats, lambda: theirs.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1,
                                                                        do_sample=False))
        rows.append({"metric": f"decode batch {batch}", "unit": "tok/s",
                     "kvturn": batch * n / (ours_total - ours_prefill),
                     "transformers": batch * n / (theirs_total - theirs_prefill)})

    for row in rows:
        row["ratio"] = row["kvturn"] / row["transformers"]
    b1 = next(r for r in rows if r["metric"] == "decode batch 1")["kvturn"]
    b8 = next(r for r in rows if r["metric"] == "decode batch 8")["kvturn"]
    table = Table(title=f"engine throughput, preset {args.preset}")
    for col in ("metric", "kvturn", "transformers", "kvturn / transformers"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(row["metric"], f"{row['kvturn']:.0f} {row['unit']}", f"{row['transformers']:.0f} {row['unit']}",
                      f"{row['ratio']:.2f}x")
    console = Console()
    console.print(table)
    info = machine()
    console.print(f"batch-8 / batch-1 decode throughput: {b8 / b1:.2f}x")
    console.print(f"machine: {info}")
    path = write_json(args.out, {"preset": args.preset, "machine": info, "rows": rows, "decode_batch8_over_batch1": b8 / b1})
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
