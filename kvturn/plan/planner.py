"""`kvturn plan`: simulate every leg with the calibration and with each of its halves (the range a figure moves
in), sweep the candidate's TTL and host tier, and say whether bidirectional transfer pays and what memory in which
tier keeps the reuse it brings."""
import json
import math
import time
from dataclasses import asdict, replace

from kvturn.bench.catalog import Scenario
from kvturn.config import ConnectorConfig, RouterConfig, default_of
from kvturn.plan.calibration import Calibration
from kvturn.plan.predict import LegPrediction, simulate_many
from kvturn.plan.sim import Deployment
from kvturn.plan.trace import Workload

POLICY_LEGS = {"pull": "bidir/P-cache-{cache}", "compute_on_decode": "compute-on-D", "adaptive": "adaptive"}
EXTRAPOLATED = 1.1  # prompts longer than this times the calibration's longest prompt step are said to extrapolate
# The router forgets a lease a little before the decode worker ends it, as the defaults do.
ROUTER_TTL_SHARE = (default_of(RouterConfig, "conversation_ttl_s")
                    / default_of(ConnectorConfig, "decoder_kv_blocks_ttl_s"))


def with_scenario(deployment: Deployment, scenario: Scenario) -> Deployment:
    """`deployment` with the connector settings `kvturn bench` runs `scenario`'s workers with (`--flag value`
    pairs naming Deployment fields), each where the deployment kept the default."""
    args = scenario.decode_args + scenario.worker_args
    defaults = Deployment()
    settings = {name: float(value) for name, value in
                ((flag.removeprefix("--").replace("-", "_"), value) for flag, value in zip(args[::2], args[1::2]))
                if getattr(deployment, name) == getattr(defaults, name)}
    return replace(deployment, **settings)


def sweep_settings(deployment: Deployment, ttl: float, host_mb: int | None) -> Deployment:
    return replace(deployment, decoder_kv_blocks_ttl_s=ttl, retained_host_mb=host_mb,
                   conversation_ttl_s=ttl * ROUTER_TTL_SHARE)


def sweep(workload: Workload, leg: str, deployment: Deployment, calibration: Calibration, ttls: list[float],
          host_shares: tuple, reference: LegPrediction) -> list[dict]:
    """The leg at each TTL with the deployment's own host tier and with each share of `reference`'s peak retained
    KV on one decode worker as its host tier (`host_mib`, of each decode worker); the deployment's own point is
    `reference` itself."""
    own = (deployment.decoder_kv_blocks_ttl_s, deployment.retained_host_mb or 0)
    hosts = {own[1], *(max(int(reference.peak_retained_mib_per_decode * share), 1) for share in host_shares)}
    others = [(ttl, host) for ttl in ttls for host in sorted(hosts) if (ttl, host) != own]
    results = dict(zip(others, simulate_many(workload, calibration, [
        (leg, sweep_settings(deployment, ttl, host or None)) for ttl, host in others])))
    results[own] = reference
    return [{"ttl_s": ttl, "host_mib": host, "later_ttft_p50_ms": r.later_ttft_p50_ms,
             "peak_pool_mib": r.peak_pool_mib, "peak_host_mib": r.peak_host_mib, "reuse_share": r.reuse_share}
            for (ttl, host), r in sorted(results.items())]


def retention_answer(points: list[dict], target: float) -> dict:
    """The TTL and host tier of least memory (pool and host together, then host) whose reuse share keeps `target`
    of the most any point of the sweep reached."""
    best = max((p["reuse_share"] for p in points), default=0.0)
    keeping = [p for p in points if p["reuse_share"] >= target * best]
    chosen = min(keeping, key=lambda p: (p["peak_pool_mib"] + p["peak_host_mib"], p["host_mib"], p["ttl_s"]),
                 default=None)
    return {"reuse_target": target, "best_reuse_share": best, **({} if chosen is None else {
        "ttl_s": chosen["ttl_s"], "host_mib_per_decode": chosen["host_mib"], "reuse_share": chosen["reuse_share"],
        "peak_pool_mib": chosen["peak_pool_mib"], "peak_host_mib": chosen["peak_host_mib"]})}


def ranged(value: float, runs: list[float]) -> list[float]:
    """[value, low, high] over `value` and what the halves' calibrations gave (NaN left out)."""
    finite = [v for v in [value, *runs] if not math.isnan(v)]
    return [value, min(finite, default=value), max(finite, default=value)]


def speedup(baseline: LegPrediction, candidate: LegPrediction) -> float:
    """Later-turn TTFT p50 of the baseline over the candidate's: how many times faster reuse answers."""
    ok = candidate.later_ttft_p50_ms > 0 and not math.isnan(baseline.later_ttft_p50_ms)
    return baseline.later_ttft_p50_ms / candidate.later_ttft_p50_ms if ok else float("nan")


def verdict(workload: Workload, legs: dict[str, LegPrediction], speedups: list, baseline: str, candidate: str,
            calibration: Calibration, deployment: Deployment, answer: dict) -> dict:
    base, cand = legs[baseline], legs[candidate]
    about = f"On this workload ({len(workload.sessions)} sessions, {workload.num_turns} turns)"
    if workload.num_turns == len(workload.sessions):
        words = [f"{about} no session has a second turn: there is no history to reuse, and {candidate} only holds "
                 f"memory."]
    else:
        value, low, high = speedups
        words = [f"{about}, {candidate} against {baseline} moves later-turn TTFT p50 from "
                 f"{base.later_ttft_p50_ms:.0f} to {cand.later_ttft_p50_ms:.0f} ms: {value:.2f}x "
                 f"({low:.2f}-{high:.2f}x over the calibration's halves); {cand.reuse_share:.0%} of later turns "
                 f"reuse retained KV."]
    words.append(f"With TTL {deployment.decoder_kv_blocks_ttl_s:.0f} s decode workers hold up to "
                 f"{cand.peak_pool_mib:,.0f} MiB of retained KV in their pools and {cand.peak_host_mib:,.0f} MiB in "
                 f"host tiers.")
    longest = max((t.prompt_tokens for s in workload.sessions for t in s.turns), default=0)
    if longest > EXTRAPOLATED * calibration.context_seen:
        words.append(f"Its prompts reach {longest:,} tokens, beyond the {calibration.context_seen:,} the calibration's "
                     f"prompt steps attended to: the fits extrapolate, and the ranges do not say by how much.")
    if "ttl_s" in answer and answer["best_reuse_share"] > 0:
        words.append(f"TTL {answer['ttl_s']:.0f} s with a host tier of {answer['host_mib_per_decode']} MiB per "
                     f"decode worker keeps {answer['reuse_target']:.0%} of the reuse ({answer['reuse_share']:.0%} of "
                     f"later turns) with the least memory: {answer['peak_pool_mib']:,.0f} MiB in pools, "
                     f"{answer['peak_host_mib']:,.0f} MiB in host tiers.")
    return {"text": " ".join(words), "baseline_leg": baseline, "candidate_leg": candidate,
            "later_ttft_p50_ms": {"baseline": base.later_ttft_p50_ms, "candidate": cand.later_ttft_p50_ms},
            "speedup": speedups}


def plan(workload: Workload, calibration: Calibration, deployment: Deployment, legs: list[str], policy: str,
         prefix_caching_on_prefill: bool, ttls: list[float], host_shares: tuple, reuse_target: float) -> dict:
    """`host_shares`: the host tiers to sweep beside the deployment's own, as shares of the candidate's peak
    retained KV on one decode worker."""
    started = time.perf_counter()
    cache = "on" if prefix_caching_on_prefill else "off"
    baseline, candidate = f"pd/P-cache-{cache}", POLICY_LEGS[policy].format(cache=cache)
    chosen = list(dict.fromkeys([*legs, baseline, candidate]))
    jobs = [(leg, deployment) for leg in chosen]
    predictions = dict(zip(chosen, simulate_many(workload, calibration, jobs)))
    halves = [dict(zip(chosen, simulate_many(workload, half, jobs))) for half in calibration.halves]
    speedups = ranged(speedup(predictions[baseline], predictions[candidate]),
                      [speedup(h[baseline], h[candidate]) for h in halves])
    ttls = sorted({*ttls, deployment.decoder_kv_blocks_ttl_s})
    points = sweep(workload, candidate, deployment, calibration, ttls, host_shares, predictions[candidate])
    answer = retention_answer(points, reuse_target)
    # every NaN (a figure with nothing to measure) as None: null in plan.json, which strict JSON readers parse
    return json.loads(json.dumps({
        "workload": {"name": workload.name, "sessions": len(workload.sessions), "turns": workload.num_turns,
                     "clients": workload.clients},
        "deployment": asdict(deployment),
        "verdict": verdict(workload, predictions, speedups, baseline, candidate, calibration, deployment, answer),
        "retention": answer,
        "legs": {leg: {**p.public(),
                       "ttft_p50_ms_range": ranged(p.ttft_p50_ms, [h[leg].ttft_p50_ms for h in halves])[1:]}
                 for leg, p in predictions.items()},
        "sweep": {"leg": candidate, "points": points},
        "calibration": calibration.model_dump(exclude={"halves"}),
        "left_out": "docs/planner.md, 'What the model leaves out'",
        "simulated_events": sum(p.events for p in predictions.values()),
        "elapsed_s": time.perf_counter() - started,
    }), parse_constant=lambda constant: None)
