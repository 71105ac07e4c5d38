"""Retention under memory pressure: the `memory-pressure` scenario (32 live sessions with long think times, five times
what the decode worker's retained budget holds) against four legs, one after the other on this machine:

    colocated           the greedy reference answers
    retain/drop-oldest  past the budget, the oldest lease is dropped (kvturn without a host tier)
    retain/host-tier    past the budget, leases move whole to a host tier and are read there
    retain/unbounded    a pool that holds every lease: the ceiling

    python benchmarks/memory_pressure.py [--sessions 32] [--turns 4] [--rounds 1] [--kv-cache-mb 512]
                                         [--pin-workers] [--out results/memory-pressure]

It prints one table and checks the targets: later turns reused >= 95% with the host tier; its TTFT p50 within 15% of
the unbounded pool's; its host-tier reads at >= 80% of the raw NIXL READ bandwidth between two processes; no answer
differing from the colocated worker's. JSON (with the machine) goes to --out.

The raw bandwidth is measured while each leg runs, by a probe of its own (a process pair doing a raw READ of
PROBE_BYTES every 0.2 s): this machine's bandwidth changed 2x from one minute to the next, and the leg's own load
(client, router, P and D on the same cores) takes its share of it, so a raw read timed on the idle machine afterwards
(also reported) is not what the leg's reads could have had.
"""
import argparse
import asyncio
import statistics
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvturn.bench import catalog, client, workload
from kvturn.bench.compare import leg_stack, warm_up
from kvturn.bench.machine import machine, write_json
from kvturn.bench.nixl_read import RawReadProbe, ReadBench
from kvturn.model.make_model import default_model_dir
from kvturn.model.tokenizer import ChatTokenizer

LEGS = ("colocated", *catalog.RETENTION_LEGS)
PROBE_BYTES = 6 * 2**20  # about the median history a later turn of the scenario reads (1-2.5k tokens, tiny model)
WORKER_METRICS = {  # name in the table -> (metric line prefix, role)
    "moves_to_host": ('kvturn_kv_tier_moves_total{from="pool",to="host"}', "decode0"),
    "leases_dropped": ('kvturn_kv_leases_total{event="reclaimed"}', "decode0"),
    "host_bytes_at_end": ('kvturn_kv_tier_retained_bytes{tier="host"}', "decode0"),
    "pool_bytes_at_end": ('kvturn_kv_tier_retained_bytes{tier="pool"}', "decode0"),
}


def scrape(stack) -> dict:
    values = {}
    for name, (prefix, role) in WORKER_METRICS.items():
        if role not in stack.urls:
            continue
        for line in httpx.get(f"{stack.urls[role]}/metrics", timeout=10).text.splitlines():
            if line.startswith(prefix + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def run_leg(model_dir: str, name: str, conversations, args, source, console: Console) -> tuple:
    """The leg's turns, its decode worker's metrics and the seconds of each raw read the probe timed meanwhile."""
    scenario = catalog.SCENARIOS["memory-pressure"]
    console.print(f"[bold]{name}[/bold]: starting")
    with leg_stack(model_dir, name, args.out / "logs" / name.replace("/", "_"), args.kv_cache_mb, scenario,
                   args.pin_workers) as stack:
        warm_up(stack.url, source)
        with RawReadProbe(model_dir, PROBE_BYTES) as probe:
            result = asyncio.run(client.run(stack.url, conversations, sessions=args.sessions, seed=args.seed,
                                            count_tokens=source.tokenizer.count))
            raw_read_s = probe.stop()
        metrics = scrape(stack)
    failed = sum(1 for r in result.requests if r.error)
    console.print(f"  {len(result.requests)} turns, {failed} failed, {result.runtime_s:.0f} s")
    return result, metrics, raw_read_s


def own_read_s(record) -> float:
    """P's read of the history, less P's steps for other prompts that ran before it was seen done."""
    return max((record.d_to_p_read_ms or 0.0) - (record.d_to_p_read_step_ms or 0.0), 0.0) / 1e3


def summary(name: str, result, metrics: dict, raw_read_s: list[float], reference: dict) -> dict:
    done = [r for r in result.requests if r.error is None]
    later = [r for r in done if r.turn > 0]
    reads = [r for r in done if r.reuse == "reused" and r.bytes_d_to_p and own_read_s(r) > 0]
    by_tier = {tier: [r for r in reads if (r.kv_tier or "pool") == tier] for tier in ("pool", "host")}
    differing = [r for r in done if reference.get((r.conversation_id, r.turn), r.answer_digest) != r.answer_digest]
    return {
        "leg": name, "turns": len(result.requests), "failed": len(result.requests) - len(done),
        "reused_share_of_later_turns": sum(r.reuse == "reused" for r in later) / len(later) if later else None,
        "reuse_outcomes": {k: sum((r.reuse or "none") == k for r in later) for k in {r.reuse or "none" for r in later}},
        "ttft_p50_ms": statistics.median(r.ttft_ms for r in done) if done else None,
        "later_ttft_p50_ms": statistics.median(r.ttft_ms for r in later) if later else None,
        # Each read's own speed, the median of them: a read the machine's load starved of CPU (its engine thread or
        # the NIXL progress thread waiting for a core) is a tail of the load, not of the tier.
        "read_mib_per_s": {tier: (statistics.median(r.bytes_d_to_p / 2**20 / own_read_s(r) for r in rs)
                                  if rs else None) for tier, rs in by_tier.items()},
        "read_mib_per_s_overall": {tier: (sum(r.bytes_d_to_p for r in rs) / 2**20 / sum(own_read_s(r) for r in rs)
                                          if rs else None) for tier, rs in by_tier.items()},
        "median_read_bytes": {tier: (int(statistics.median(r.bytes_d_to_p for r in rs)) if rs else None)
                              for tier, rs in by_tier.items()},
        "raw_read_mib_per_s_during_leg": PROBE_BYTES / 2**20 / statistics.median(raw_read_s) if raw_read_s else None,
        "raw_reads_during_leg": len(raw_read_s),
        "answers_differing": len(differing), "answers_compared": sum(1 for r in done if r.answer_digest),
        **metrics,
    }


def raw_read_mib_per_s(model_dir: str, nbytes: int) -> float:
    with ReadBench(model_dir, nbytes // 2**20 + 2) as bench:
        return nbytes / 2**20 / bench.raw_read_s(nbytes, repeats=9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--legs", default=",".join(LEGS))
    parser.add_argument("--rounds", type=int, default=1, help="run the legs this many times in alternating order "
                        "(ABC, CBA, ...), so that a shared machine's changing load falls on each alike; their turns "
                        "are pooled (the colocated reference runs once)")
    parser.add_argument("--pin-workers", action="store_true", help="P and D on cores of their own (as on machines "
                        "of their own); the router, the client and the raw-read probe share all cores")
    parser.add_argument("--out", type=Path, default=Path("results/memory-pressure"))
    args = parser.parse_args()
    console = Console(width=160)
    model_dir = str(default_model_dir("tiny"))
    source = workload.TextSource(ChatTokenizer(model_dir))
    conversations = catalog.build_workload("memory-pressure", source, args.seed, 0, args.turns)[:args.sessions]
    legs = [leg.strip() for leg in args.legs.split(",") if leg.strip()]
    runs, raw_read_s = {}, {}
    for round_ in range(args.rounds):
        for name in legs if round_ % 2 == 0 else legs[::-1]:
            if name == "colocated" and name in runs:
                continue
            result, metrics, raw = run_leg(model_dir, name, conversations, args, source, console)
            raw_read_s.setdefault(name, []).extend(raw)
            if name in runs:
                runs[name][0].requests.extend(result.requests)
                runs[name][0].runtime_s += result.runtime_s
                before = runs[name][1]
                result, metrics = runs[name][0], {k: max(v, before.get(k, 0.0)) if k.endswith("_at_end") else
                                                  v + before.get(k, 0.0) for k, v in metrics.items()}
            runs[name] = (result, metrics)
    reference = {(r.conversation_id, r.turn): r.answer_digest for r in runs["colocated"][0].requests
                 if r.error is None} if "colocated" in runs else {}
    summaries = {name: summary(name, result, metrics, raw_read_s[name], reference)
                 for name, (result, metrics) in runs.items()}
    host = summaries.get("retain/host-tier")
    idle_raw = None
    if host and host["median_read_bytes"]["host"]:
        idle_raw = raw_read_mib_per_s(model_dir, host["median_read_bytes"]["host"])
    table = Table(title=f"memory-pressure: {len(conversations)} sessions, budget {catalog.RETAINED_BUDGET_MB} MiB, "
                        f"host tier {catalog.RETAINED_HOST_MB} MiB")
    for column in ("leg", "failed", "later reused", "TTFT p50 ms", "later TTFT p50", "read MiB/s p50 pool/host",
                   "raw MiB/s meanwhile", "moves to host", "dropped", "answers differing"):
        table.add_column(column)
    for s in summaries.values():
        speeds = "/".join(f"{v:.0f}" if v else "-" for v in s["read_mib_per_s"].values())
        share = s["reused_share_of_later_turns"]
        table.add_row(s["leg"], str(s["failed"]), f"{share:.0%}" if share is not None else "-",
                      f"{s['ttft_p50_ms']:.0f}", f"{s['later_ttft_p50_ms']:.0f}", speeds,
                      f"{s['raw_read_mib_per_s_during_leg']:.0f}" if s["raw_read_mib_per_s_during_leg"] else "-",
                      f"{s.get('moves_to_host', 0):.0f}", f"{s.get('leases_dropped', 0):.0f}",
                      f"{s['answers_differing']}/{s['answers_compared']}")
    console.print(table)
    targets = targets_met(summaries, idle_raw)
    for line in targets["lines"]:
        console.print(line)
    path = write_json(args.out / "results.json", {
        "scenario": "memory-pressure", "command": "python benchmarks/memory_pressure.py " + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
            if k != "out" and v is not False),
        "machine": machine(), "raw_nixl_read_mib_per_s_idle": idle_raw, "probe_bytes": PROBE_BYTES, "targets": targets,
        "summaries": summaries,
        "legs": {name: result.to_json() for name, (result, _) in runs.items()}})
    console.print(f"JSON: {path}")


def targets_met(summaries: dict, idle_raw: float | None) -> dict:
    host, ceiling = summaries.get("retain/host-tier"), summaries.get("retain/unbounded")
    out = {"lines": []}
    if host is None:
        return out
    out["reused"] = host["reused_share_of_later_turns"]
    out["lines"].append(f"host tier: later turns reused {out['reused']:.0%} (target >= 95%)")
    if ceiling:
        out["ttft_ratio"] = host["ttft_p50_ms"] / ceiling["ttft_p50_ms"]
        out["lines"].append(f"host tier: TTFT p50 {out['ttft_ratio']:.2f}x the unbounded pool's (target <= 1.15)")
    speed, raw = host["read_mib_per_s"]["host"], host["raw_read_mib_per_s_during_leg"]
    if speed and raw:
        out["read_fraction_of_raw"] = speed / raw
        out["lines"].append(f"host tier: reads at {speed:.0f} MiB/s (median of reads), "
                            f"{out['read_fraction_of_raw']:.0%} of the raw NIXL READs timed while the leg ran "
                            f"({raw:.0f} MiB/s, {PROBE_BYTES >> 20} MiB each; target >= 80%)")
    if speed and idle_raw:
        out["read_fraction_of_idle_raw"] = speed / idle_raw
        out["lines"].append(f"  and {out['read_fraction_of_idle_raw']:.0%} of a raw READ of the median read's size on "
                            f"the idle machine after the legs ({idle_raw:.0f} MiB/s)")
    out["answers_differing"] = sum(s["answers_differing"] for s in summaries.values())
    out["lines"].append(f"answers differing from the colocated worker's: {out['answers_differing']} (target 0)")
    return out


if __name__ == "__main__":
    main()
