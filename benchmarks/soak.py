"""Soak: 32 concurrent multi-turn sessions against `kvturn serve`-style local stack, for a bounded time.

    python benchmarks/soak.py [--duration-s 180] [--sessions 32] [--retained-kv-budget-mb 64]
    python benchmarks/soak.py --routers 1 --no-prefix-caching-on-prefill
    python benchmarks/soak.py --routers 3 --no-prefix-caching-on-prefill --baseline results/soak-routers1.json

Loopback only; it stops by itself. Reports requests completed and failed (target 0),
p50/p99 TTFT, the peak RSS of each process, and whether KV retained on the decode worker
ever exceeded its budget (oldest leases are reclaimed first).

With `--routers N` (N > 1) the N router replicas share the conversation table in a
redis-server of the soak's own, and each turn of a session goes to the next replica; the
keys left in Redis are counted against the conversations started. Every run reports the
share of later turns that reused and the router's added latency (the client's TTFT less
the router's round trip to prefill and decode's own TTFT, both from the response's
`kvturn.timing`); `--baseline` compares both with a one-router run's JSON.

Nothing fails on purpose here: benchmarks/chaos_soak.py runs sessions while processes die.
"""
import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
import redis
from rich.console import Console
from rich.table import Table

from kvturn.bench import client, workload
from kvturn.bench.machine import machine, write_json
from kvturn.launch import LocalStack, RedisServer
from kvturn.model.make_model import default_model_dir
from kvturn.model.tokenizer import ChatTokenizer
from kvturn.router.redis_state import HISTORY_DIGESTS_KEPT

KEYS_PER_CONVERSATION = 2 + HISTORY_DIGESTS_KEPT  # its entry, its list of recent digests, those digests
NO_LEASE = (None, "state_unavailable", "expired")  # outcomes of a turn whose router had no lease to hand P


def share(records: list, condition) -> float | None:
    return sum(1 for r in records if condition(r)) / len(records) if records else None


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def redis_keys(url: str) -> dict[str, int]:
    """kvturn's keys in Redis by kind (conv, hist, recent, ...)."""
    counts: dict[str, int] = {}
    with redis.Redis.from_url(url, decode_responses=True) as connection:
        for key in connection.scan_iter(match="kvturn:*", count=1000):
            kind = key.split(":")[1]
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def soak_conversations(model_dir, sessions: int, seed: int, prefix: str) -> list:
    """The soaks' agent sessions: eight conversations per concurrent session, 200-1,500-token system prompts, 3-8
    turns of 80 new tokens and 8-32-token answers, up to 1 s of think time."""
    spec = workload.SyntheticSpec(num_sessions=sessions * 8,
                                  system_tokens={"distribution": "uniform", "min": 200, "max": 1500},
                                  num_turns={"distribution": "uniform", "min": 3, "max": 8}, new_tokens=80,
                                  answer_tokens={"distribution": "uniform", "min": 8, "max": 32},
                                  gap_s={"distribution": "uniform", "min": 0.0, "max": 1.0})
    return workload.synthetic(spec, workload.TextSource(ChatTokenizer(model_dir)), seed, prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--routers", type=int, default=1, help="router replicas; above 1 they share Redis")
    parser.add_argument("--state", choices=("auto", "memory", "redis"), default="auto",
                        help="the routers' conversation table (auto: Redis when --routers > 1)")
    parser.add_argument("--baseline", type=Path, help="a one-router run's JSON to compare reuse and latency with")
    parser.add_argument("--no-prefix-caching-on-prefill", action="store_true",
                        help="P keeps no cache of its own, so a later turn reuses only by reading from D")
    parser.add_argument("--retained-kv-budget-mb", type=int, default=64)
    parser.add_argument("--retained-host-mb", type=int, default=None,
                        help="the decode worker's host tier: leases past the budget move there instead of being dropped")
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="keep each process's log here")
    parser.add_argument("--out", default=None, help="JSON to write (default results/soak-routersN.json)")
    args = parser.parse_args()
    use_redis = args.state == "redis" or (args.state == "auto" and args.routers > 1)
    model_dir = default_model_dir("tiny")
    conversations = soak_conversations(model_dir, args.sessions, args.seed, "soak")
    console = Console(width=140)
    redis_server = RedisServer().start() if use_redis else None
    try:
        with LocalStack(model_dir, kv_cache_mb=args.kv_cache_mb, log_dir=args.log_dir, num_routers=args.routers,
                        prefix_caching_on_prefill=not args.no_prefix_caching_on_prefill,
                        decode_args=["--retained-kv-budget-mb", str(args.retained_kv_budget_mb),
                                     *(["--retained-host-mb", str(args.retained_host_mb)] if args.retained_host_mb else [])],
                        router_args=["--state", redis_server.url] if redis_server else []) as stack:
            urls = stack.router_urls
            console.print(f"soak: {args.sessions} sessions for {args.duration_s:.0f} s against {len(urls)} "
                          f"router(s) {urls} ({'Redis' if redis_server else 'in-memory'} conversation table); "
                          f"logs in {stack.log_dir}")
            result = asyncio.run(client.run(urls, conversations, sessions=args.sessions, seed=args.seed,
                                            duration_s=args.duration_s))
            rss = {name: peak_rss_mib(p.pid) for name, p in stack.processes.items()}
            keys = redis_keys(redis_server.url) if redis_server else None
    finally:
        if redis_server:
            redis_server.stop()
    done = [r for r in result.requests if r.error is None and r.latency_ms is not None]
    failed = [r for r in result.requests if r.error is not None]
    ttft = [r.ttft_ms for r in done]
    later_turns = [r for r in done if r.turn > 0]
    timed = [r for r in done if r.prefill_request_ms is not None and r.decode_ttft_ms is not None]
    router_added = [r.ttft_ms - r.prefill_request_ms - r.decode_ttft_ms for r in timed]
    conversations_started = len({r.conversation_id for r in done})
    peak_retained_mib = max((b for _, b in result.retained_kv), default=0.0) / 2**20
    block_mib = 4 * 2 * 16 * 2 * 64 * 4 / 2**20
    summary = {
        "duration_s": result.runtime_s, "sessions": args.sessions, "routers": args.routers,
        "state": "redis" if redis_server else "memory", "completed": len(done), "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:5],
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if ttft else None,
        "reuse_outcomes": {k: sum(1 for r in done if (r.reuse or "none") == k) for k in {r.reuse or "none" for r in done}},
        "reused_share_of_later_turns": share(later_turns, lambda r: r.reuse == "reused"),
        "lease_handed_share_of_later_turns": share(later_turns, lambda r: r.reuse not in NO_LEASE),
        "router_added_p50_ms": float(np.percentile(router_added, 50)) if router_added else None,
        "router_added_p99_ms": float(np.percentile(router_added, 99)) if router_added else None,
        "conversations_started": conversations_started,
        "redis_keys": keys,
        "redis_keys_bounded": (sum(keys.values()) <= KEYS_PER_CONVERSATION * conversations_started
                               if keys is not None else None),
        "peak_rss_mib": rss, "retained_kv_budget_mib": args.retained_kv_budget_mb,
        "peak_retained_kv_mib": peak_retained_mib,
        "retained_within_budget": peak_retained_mib <= args.retained_kv_budget_mb + block_mib,
    }
    if args.baseline and args.baseline.exists():
        base = json.loads(args.baseline.read_text())["summary"]
        if summary["reused_share_of_later_turns"] is not None and base.get("reused_share_of_later_turns") is not None:
            summary["reused_share_points_vs_baseline"] = 100 * (summary["reused_share_of_later_turns"]
                                                               - base["reused_share_of_later_turns"])
        if summary["router_added_p50_ms"] is not None and base.get("router_added_p50_ms") is not None:
            summary["router_added_p50_ms_vs_baseline"] = summary["router_added_p50_ms"] - base["router_added_p50_ms"]
        summary["baseline"] = str(args.baseline)
    table = Table(title=f"soak, {args.routers} router(s)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key != "errors":
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if failed:
        console.print(f"errors: {summary['errors']}")
    info = machine()
    console.print(f"machine: {info}")
    out = args.out or f"results/soak-routers{args.routers}.json"
    console.print(f"wrote {write_json(out, {'machine': info, 'summary': summary})}")


if __name__ == "__main__":
    main()
