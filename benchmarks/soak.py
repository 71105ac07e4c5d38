"""Soak: 32 concurrent multi-turn sessions against `kvturn serve`-style local stack, for a bounded time.

    python benchmarks/soak.py [--duration-s 180] [--sessions 32] [--retained-kv-budget-mb 64]

Loopback only; it stops by itself. Reports requests completed and failed (target 0),
p50/p99 TTFT, the peak RSS of each process, and whether KV retained on the decode worker
ever exceeded its budget (oldest leases are reclaimed first).
"""
import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvturn.bench import client, workload
from kvturn.bench.machine import machine, write_json
from kvturn.launch import LocalStack
from kvturn.model.make_model import default_model_dir
from kvturn.model.tokenizer import ChatTokenizer


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--retained-kv-budget-mb", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/soak.json")
    args = parser.parse_args()
    model_dir = default_model_dir("tiny")
    source = workload.TextSource(ChatTokenizer(model_dir))
    spec = workload.SyntheticSpec(num_sessions=args.sessions * 8,
                                  system_tokens={"distribution": "uniform", "min": 200, "max": 1500},
                                  num_turns={"distribution": "uniform", "min": 3, "max": 8}, new_tokens=80,
                                  answer_tokens={"distribution": "uniform", "min": 8, "max": 32},
                                  gap_s={"distribution": "uniform", "min": 0.0, "max": 1.0})
    conversations = workload.synthetic(spec, source, args.seed, "soak")
    console = Console(width=140)
    with tempfile.TemporaryDirectory() as logs, LocalStack(
            model_dir, kv_cache_mb=args.kv_cache_mb, log_dir=Path(logs),
            decode_args=["--retained-kv-budget-mb", str(args.retained_kv_budget_mb)]) as stack:
        console.print(f"soak: {args.sessions} sessions for {args.duration_s:.0f} s against {stack.url}")
        result = asyncio.run(client.run(stack.url, conversations, sessions=args.sessions, seed=args.seed,
                                        duration_s=args.duration_s))
        rss = {name: peak_rss_mib(p.pid) for name, p in stack.processes.items()}
    done = [r for r in result.requests if r.error is None and r.latency_ms is not None]
    failed = [r for r in result.requests if r.error is not None]
    ttft = [r.ttft_ms for r in done]
    peak_retained_mib = max((b for _, b in result.retained_kv), default=0.0) / 2**20
    block_mib = 4 * 2 * 16 * 2 * 64 * 4 / 2**20
    summary = {
        "duration_s": result.runtime_s, "sessions": args.sessions, "completed": len(done), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else None,
        "reuse_outcomes": {k: sum(1 for r in done if (r.reuse or "none") == k) for k in {r.reuse or "none" for r in done}},
        "peak_rss_mib": rss, "retained_kv_budget_mib": args.retained_kv_budget_mb,
        "peak_retained_kv_mib": peak_retained_mib,
        "retained_within_budget": peak_retained_mib <= args.retained_kv_budget_mb + block_mib,
    }
    table = Table(title="soak")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("duration_s", "sessions", "completed", "failed", "ttft_p50_ms", "ttft_p99_ms", "reuse_outcomes",
                "peak_rss_mib", "retained_kv_budget_mib", "peak_retained_kv_mib", "retained_within_budget"):
        value = summary[key]
        table.add_row(key, f"{value:.1f}" if isinstance(value, float) else str(value))
    console.print(table)
    info = machine()
    console.print(f"machine: {info}")
    console.print(f"wrote {write_json(args.out, {'machine': info, 'summary': summary})}")


if __name__ == "__main__":
    main()
