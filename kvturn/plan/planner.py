"""`kvturn plan`: simulate every leg on the workload, sweep the candidate's TTL and retention budget, and turn the
numbers into a verdict: does bidirectional transfer pay on this workload, from what history length, and what it
holds in memory."""
import math
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from kvturn.bench.catalog import Scenario
from kvturn.config import ConnectorConfig, RouterConfig, default_of
from kvturn.plan.calibration import SPREAD_PROMPT, Calibration
from kvturn.plan.predict import LegPrediction, simulate_many
from kvturn.plan.sim import Deployment
from kvturn.plan.trace import Workload, resend_answers, reusable

POLICY_LEGS = {"pull": "bidir/P-cache-{cache}", "compute_on_decode": "compute-on-D", "adaptive": "adaptive"}
BUDGET_SHARES = (0.5, 0.25)  # budgets swept beside the deployment's own: shares of its peak retained KV
KEEP_GAIN = 0.95
# The router forgets a lease a little before the decode worker ends it, as the defaults do (450 s against 480 s).
ROUTER_TTL_SHARE = (default_of(RouterConfig, "conversation_ttl_s")
                    / default_of(ConnectorConfig, "decoder_kv_blocks_ttl_s"))
MAX_HISTORY_TOKENS = 262_144
LEFT_OUT = (
    "contention between processes sharing cores or a GPU beyond what the calibration run itself saw (a fit to its "
    "steps in service holds the run's own mix, whatever the planned load)",
    "bandwidth shared by concurrent KV reads (each read runs at the calibrated MiB/s alone)",
    "the decode worker's steps waiting for its read of P's prompt KV (that read runs beside them; P's read of D's "
    "retained KV holds up P's step, as kvturn's scheduler reads over shared memory)",
    "preemption of running requests when a pool fills (leases are reclaimed, no request is ever preempted)",
    "the router relearning compute and read costs from the workers' reports (its fits stay as calibrated; its "
    "corrections, backlog estimates and exploration of paths run as in kvturn/router)",
    "failures and declines other than TTL, budget and threshold: read errors, epoch or hash mismatches, dead workers",
    "each resent answer's own length as the next prompt tokenizes it: a workload of conversations resends every "
    "answer at the calibration's ratio of text tokens to tokens generated, pooled over its answers (at its "
    "generated length from a calibration that did not count them); how much of it the next turn can reuse from "
    "retention is calibrated too",
    "router, HTTP and the workers' tokenizing as a time per leg that grows by calibrated ms with each request in "
    "flight beside the turn, up to the most the calibration run saw, not a queue of its own (from a bench run that "
    "did not record the engines' own wait, a worker's tokenizing is counted as its queue, and left out)",
    "the scatter of decode steps (prompt steps draw their times from the calibration's scatter; decode steps take "
    "the fit's)",
    "with a calibration from requests alone (a bench that kept no steps in service), a decode step's attention "
    "over the batch's longest context for every request (kvturn's engine pads to it): that fit charges the sum of "
    "the contexts, less than that in batches of uneven histories",
)

# Said where the calibration measured no time outside compute and transfer (one fitted to workers by URL)
OTHER_UNMEASURED = ("The calibration is of the workers alone: a turn's time outside compute and transfer (the "
                    "router, HTTP, tokenizing; 10-22 ms a turn of a P/D leg in a calibration run on the dev "
                    "machine) is not in these TTFTs.")
# Said where the calibration did not measure how much of an answer the next turn reuses
ANSWER_UNMEASURED = ("The calibration did not measure how much of an answer the next turn reuses from retention "
                     "(read off workers, saved before it was measured, or no turn of its run read from a decode "
                     "worker after another): every answer is taken as reusable whole, "
                     "as it is only where answers tokenize back as they were generated (of the embedded "
                     "random-weight model's, hardly any is).")

# Calibration runs whose own fits of a kind of worker lie further apart than this are named in the verdict
SPREAD_SAID = 0.15
WORKER_WORDS = {"prefill": "the prefill worker", "decode": "the decode worker", "colocated": "a colocated worker"}


def spread_words(calibration: Calibration) -> str | None:
    """The verdict's sentence on calibration runs that disagree (Calibration.run_spread), or None."""
    apart = {kind: share for kind, share in calibration.run_spread.items() if share > SPREAD_SAID}
    if not apart:
        return None
    n, context = SPREAD_PROMPT
    kinds = ", ".join(f"{share:.0%} apart on {WORKER_WORDS.get(kind, kind)}" for kind, share in apart.items())
    return (f"The calibration runs disagree: for a prompt of {n} new tokens after {context}, their own fits lie "
            f"{kinds}. The machine's speed moved between them; legs on that worker are planned at the pooled fit "
            f"and are no surer than that. Calibrate again, or from more runs, when the machine is quiet.")


# Shapes the simulated steps reached beyond the calibration's by more than this share are named in the verdict.
BEYOND_SHARE = 0.1
SHAPE_WORDS = {"prompt_tokens": "prompt steps compute up to {planned} new tokens of a prompt",
               "prompt_context": "prompt steps attend to up to {planned} tokens",
               "decode_batch": "decode steps run up to {planned} requests",
               "decode_attended": "decode steps attend to up to {planned} tokens"}


def beyond_calibration(predictions: dict[str, LegPrediction], calibration: Calibration) -> dict[str, dict]:
    """The shapes the legs' simulated steps reached more than BEYOND_SHARE beyond the most the calibration run
    measured, where its fits are extrapolated: {shape: {"planned", "calibrated"}}. A shape the calibration does not
    say is not compared, nor the TTL and budget sweep's simulations (the same workload, other retention)."""
    beyond = {}
    for shape, seen in calibration.seen.items():
        planned = max((p.reached.get(shape, 0) for p in predictions.values()), default=0)
        if planned > seen * (1 + BEYOND_SHARE):
            beyond[shape] = {"planned": planned, "calibrated": seen}
    return beyond


def beyond_words(beyond: dict[str, dict]) -> str:
    """The verdict's sentence on the shapes `beyond_calibration` found."""
    shapes = [SHAPE_WORDS[shape].format(planned=f"{v['planned']:,.0f}") + f" (the calibration's {v['calibrated']:,.0f})"
              for shape, v in beyond.items()]
    return (f"The calibrated costs are extrapolated here: {'; '.join(shapes)}; a calibration run that reaches these "
            f"shapes makes a closer plan.")


@dataclass(slots=True)
class SweepPoint:
    ttl_s: float
    budget_mib: float | None
    later_ttft_p50_ms: float
    peak_retained_mib: float
    reuse_share: float
    gain_share: float | None = None  # of the TTFT gain at the deployment's own TTL and budget


def candidate_leg(policy: str, prefix_caching_on_prefill: bool) -> str:
    return POLICY_LEGS[policy].format(cache="on" if prefix_caching_on_prefill else "off")


def baseline_leg(prefix_caching_on_prefill: bool) -> str:
    return f"pd/P-cache-{'on' if prefix_caching_on_prefill else 'off'}"


def break_even_history(calibration: Calibration, new_tokens: int, baseline: str, candidate: str) -> int | None:
    """Fewest history tokens from which reusing them (read back, or computed beside on D) beats recomputing them
    with `new_tokens` added, by the calibrated costs, for a turn that finds its worker idle; None if it never does
    up to MAX_HISTORY_TOKENS."""
    on_decode = candidate == "compute-on-D"

    def idle(compute_ms: float) -> float:
        return calibration.after_idle_ms(compute_ms, other_role_busy=False)

    def gain(history: int) -> float:
        recompute = idle(calibration.prefill_ms(new_tokens + history, 0)) + calibration.other(baseline)
        if on_decode:
            reuse = idle(calibration.prefill_ms(new_tokens, history, "decode"))
        else:
            reuse = calibration.read_ms(history, "d_to_p") + idle(calibration.prefill_ms(new_tokens, history))
        return recompute - reuse - calibration.other(candidate)

    history = 16
    while history <= MAX_HISTORY_TOKENS and gain(history) <= 0:
        history *= 2
    if history > MAX_HISTORY_TOKENS:
        return None
    low, high = history // 2, history  # the first multiple of 16 with a gain, between the last two tried
    while high - low > 16:
        middle = (low + high) // 32 * 16
        low, high = (middle, high) if gain(middle) <= 0 else (low, middle)
    return high


def with_scenario(deployment: Deployment, scenario: Scenario) -> Deployment:
    """`deployment` with the connector settings `kvturn bench` runs `scenario`'s workers with (its decode_args and
    worker_args, `--flag value` pairs naming Deployment fields), each where the deployment kept the default."""
    args = scenario.decode_args + scenario.worker_args
    defaults = Deployment()
    settings = {name: float(value) for name, value in
                ((flag.removeprefix("--").replace("-", "_"), value) for flag, value in zip(args[::2], args[1::2]))
                if getattr(deployment, name) == getattr(defaults, name)}
    return replace(deployment, **settings)


def sweep_settings(deployment: Deployment, ttl: float, budget_mb: int | None) -> Deployment:
    return replace(deployment, decoder_kv_blocks_ttl_s=ttl, retained_kv_budget_mb=budget_mb,
                   conversation_ttl_s=ttl * ROUTER_TTL_SHARE)


def sweep(workload: Workload, leg: str, deployment: Deployment, calibration: Calibration, ttls: list[float],
          budget_shares: tuple, reference: LegPrediction) -> list[SweepPoint]:
    """The leg at each TTL with the deployment's own budget and with each share of `reference`'s peak on one decode
    worker as the budget (each decode worker's, as `retained_kv_budget_mb` is); the deployment's own point is
    `reference` itself."""
    runs = {}
    for ttl in ttls:
        budgets = [deployment.retained_kv_budget_mb]
        if reference.peak_retained_mib_per_decode > 0:
            budgets += [max(int(reference.peak_retained_mib_per_decode * share), 1) for share in budget_shares]
        for budget in budgets:
            runs[(ttl, budget)] = sweep_settings(deployment, ttl, budget)
    own = (deployment.decoder_kv_blocks_ttl_s, deployment.retained_kv_budget_mb)
    others = [key for key in runs if key != own]
    results = dict(zip(others, simulate_many(workload, calibration, [(leg, runs[key]) for key in others])))
    results[own] = reference
    return [SweepPoint(ttl, budget, r.later_ttft_p50_ms, r.peak_retained_mib, r.reuse_share)
            for (ttl, budget), r in sorted(results.items(), key=lambda item: (item[0][0], -(item[0][1] or 1e18)))]


def reference_point(points: list[SweepPoint], deployment: Deployment) -> SweepPoint | None:
    """The sweep's point at the deployment's own TTL and budget."""
    return next((p for p in points if p.ttl_s == deployment.decoder_kv_blocks_ttl_s
                 and p.budget_mib == deployment.retained_kv_budget_mb), None)


def cheapest_ttl_keeping_gain(points: list[SweepPoint], budget_mib: int | None) -> SweepPoint | None:
    """Of the points with the deployment's budget, the one of least memory that keeps KEEP_GAIN of the gain."""
    keeping = [p for p in points if p.budget_mib == budget_mib and p.gain_share is not None
               and p.gain_share >= KEEP_GAIN]
    return min(keeping, key=lambda p: (p.peak_retained_mib, p.ttl_s), default=None)


def verdict(workload: Workload, legs: dict[str, LegPrediction], baseline: str, candidate: str,
            calibration: Calibration, deployment: Deployment, points: list[SweepPoint], beyond: dict) -> dict:
    base, cand = legs[baseline], legs[candidate]
    new_tokens = [t.prompt_tokens - reusable(before, t, calibration.answer_share)
                  for s in workload.sessions for before, t in zip(s.turns, s.turns[1:])]
    typical_new = int(np.median(new_tokens)) if new_tokens else 0
    break_even = break_even_history(calibration, typical_new, baseline, candidate)
    if break_even is not None:  # below the threshold the prefill worker declines to read at all
        break_even = max(break_even, deployment.kv_recompute_threshold_tokens)
    ttl = deployment.decoder_kv_blocks_ttl_s
    gib = cand.peak_retained_mib / 1024
    workload_words = f"On this workload ({len(workload.sessions)} sessions, {workload.num_turns} turns)"
    if not new_tokens:
        words = [f"{workload_words} no session has a second turn: there is no history to reuse, and {candidate} "
                 f"only holds memory (TTFT p50 {base.ttft_p50_ms:.0f} ms on {baseline}, {cand.ttft_p50_ms:.0f} on "
                 f"{candidate})."]
    else:
        words = [f"{workload_words}, {candidate} against {baseline} "
                 f"{'cuts' if cand.later_ttft_p50_ms < base.later_ttft_p50_ms else 'moves'} later-turn TTFT p50 "
                 f"from {base.later_ttft_p50_ms:.0f} to {cand.later_ttft_p50_ms:.0f} ms (all turns: "
                 f"{base.ttft_p50_ms:.0f} -> {cand.ttft_p50_ms:.0f} ms; {cand.reuse_share:.0%} of later turns reuse "
                 f"retained KV)."]
    if new_tokens and break_even is None:
        words.append(f"For a turn adding {typical_new} new tokens, reuse never beats recomputing by the calibrated "
                     f"costs.")
    elif new_tokens:
        words.append(f"Against recomputing the history (a prefill cache miss), reuse pays for turns whose history "
                     f"exceeds {break_even} tokens (adding {typical_new} new ones).")
    words.append(f"With TTL {ttl:.0f} s decode workers hold up to {gib:.2f} GiB of retained KV.")
    reference = reference_point(points, deployment)
    cheapest = cheapest_ttl_keeping_gain(points, deployment.retained_kv_budget_mb)
    if reference and cheapest and reference.peak_retained_mib > 0 and cheapest.ttl_s != ttl:
        memory = cheapest.peak_retained_mib / reference.peak_retained_mib
        if memory < 0.99:
            words.append(f"TTL {cheapest.ttl_s:.0f} s keeps {cheapest.gain_share:.0%} of the gain for {memory:.0%} "
                         f"of the memory.")
        else:
            words.append(f"A TTL as short as {cheapest.ttl_s:.0f} s keeps the gain but holds as much memory: turns "
                         f"come back sooner than that.")
    if beyond:
        words.append(beyond_words(beyond))
    if spread := spread_words(calibration):
        words.append(spread)
    if calibration.answer_reuse_share is None:
        words.append(ANSWER_UNMEASURED)
    if not calibration.other_ms:
        words.append(OTHER_UNMEASURED)
    return {"text": " ".join(words), "baseline_leg": baseline, "candidate_leg": candidate,
            "later_ttft_p50_ms": {"baseline": base.later_ttft_p50_ms, "candidate": cand.later_ttft_p50_ms},
            "pays_above_history_tokens": break_even, "typical_new_tokens": typical_new,
            "peak_retained_gib": gib, "cheapest_ttl_keeping_gain_s": cheapest.ttl_s if cheapest else None}


def with_gain_shares(points: list[SweepPoint], baseline_ms: float, reference: SweepPoint | None) -> None:
    full = baseline_ms - reference.later_ttft_p50_ms if reference else 0.0
    for p in points:
        p.gain_share = (baseline_ms - p.later_ttft_p50_ms) / full if full > 0 else None


def plan(workload: Workload, calibration: Calibration, deployment: Deployment, legs: list[str], policy: str,
         prefix_caching_on_prefill: bool, ttls: list[float], budget_shares: tuple = BUDGET_SHARES) -> dict:
    """`budget_shares`: the retention budgets to sweep beside the deployment's own, as shares of the candidate's
    peak retained KV."""
    started = time.perf_counter()
    resent_at = calibration.resent_answer_ratio if workload.answers_as_generated else None
    workload = resend_answers(workload, calibration.resent_answer_ratio)
    baseline, candidate = baseline_leg(prefix_caching_on_prefill), candidate_leg(policy, prefix_caching_on_prefill)
    chosen = list(dict.fromkeys([*legs, baseline, candidate]))
    predictions = dict(zip(chosen, simulate_many(workload, calibration, [(leg, deployment) for leg in chosen])))
    ttls = sorted({*ttls, deployment.decoder_kv_blocks_ttl_s})
    points = sweep(workload, candidate, deployment, calibration, ttls, budget_shares, predictions[candidate])
    with_gain_shares(points, predictions[baseline].later_ttft_p50_ms, reference_point(points, deployment))
    beyond = beyond_calibration(predictions, calibration)
    return json_safe({
        "workload": {"name": workload.name, "sessions": len(workload.sessions), "turns": workload.num_turns,
                     "clients": workload.clients, "answers_resent_at": resent_at},
        "deployment": asdict(deployment),
        "verdict": verdict(workload, predictions, baseline, candidate, calibration, deployment, points, beyond),
        "beyond_calibration": beyond,
        "legs": {leg: predictions[leg].public() for leg in chosen},
        "sweep": {"leg": candidate, "points": [asdict(p) for p in points]},
        "calibration": asdict(calibration),
        "left_out": list(LEFT_OUT) + ([ANSWER_UNMEASURED] if calibration.answer_reuse_share is None else []) +
                    ([OTHER_UNMEASURED] if not calibration.other_ms else []),
        "simulated_events": sum(p.events for p in predictions.values()),
        "elapsed_s": time.perf_counter() - started,
    })


def json_safe(value):
    """`value` with every NaN or infinite float as None: a figure with nothing to measure (no later turn, no
    session) is null in plan.json, which strict JSON readers must be able to parse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
