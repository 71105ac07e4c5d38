"""What one leg's simulation predicts: the figures `kvturn bench` measures, and retained KV per tier over time;
a small workload simulated again with other draws of its steps' scatter, a large one's legs on every core."""
import multiprocessing
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvturn.bench.catalog import LEGS, Leg
from kvturn.plan.calibration import WORKER_KINDS, Calibration
from kvturn.plan.sim import Deployment, Simulation
from kvturn.plan.trace import TraceError, Workload

TIMELINE_POINTS = 48  # of retained KV over time in plan.json, each the most of its span of time
# A workload of fewer turns is simulated again, an odd number of times up to MAX_REPLICATIONS, and each figure is
# the median: a few dozen turns' p50 moves with which of them queued, as a bench run's does.
SCATTER_TURNS, MAX_REPLICATIONS = 2000, 31
PARALLEL_FROM_TURNS = 20_000  # below this a simulation takes less than starting a worker process
# The most steps one leg's simulations (all its replications) may take: a trace of a hundred thousand turns of
# prompts up to a step each, or a few turns of 16M-token prompts. A plan simulates some 30 legs (its own, the sweep's,
# each again with the calibration's halves), all of them within a few minutes on one core.
MAX_SIMULATED_STEPS = 200_000
REPLICATED = ("ttft_p50_ms", "session_p50_s")
FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "later_ttft_p50_ms", "session_p50_s", "peak_retained_mib", "peak_pool_mib",
           "peak_host_mib", "peak_retained_mib_per_decode", "reuse_share")


@dataclass(slots=True)
class LegPrediction:
    leg: str
    ttft_p50_ms: float
    ttft_p90_ms: float
    later_ttft_p50_ms: float
    session_p50_s: float
    peak_retained_mib: float  # all decode workers' together, both tiers
    peak_pool_mib: float
    peak_host_mib: float
    peak_retained_mib_per_decode: float  # in the pool of the decode worker that held the most: what a budget caps
    reuse_share: float  # later turns whose history KV came from a decode worker's retention
    turns: int
    events: int
    paths: dict = field(default_factory=dict)
    retained_over_time: list = field(default_factory=list)  # [s, pool MiB, host MiB], all decode workers'
    # each simulation's TTFT p50 and session p50 (by seed), where the figures are their median: how far one run's
    # p50 moves with the scatter of its steps, as a bench run's does from one repeat to the next
    replicas: dict = field(default_factory=dict)

    def public(self) -> dict:
        """The leg as plan.json shows it."""
        return {name: getattr(self, name) for name in (*FIGURES, "paths", "retained_over_time", "replicas")}


def _percentile(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


def timeline(points: list[tuple[float, int, int]], mib: float) -> list[list[float]]:
    """(s, pool tokens, host tokens) at each change as at most TIMELINE_POINTS [s, pool MiB, host MiB], each the
    most of its span (no peak is lost)."""
    end, spans = (points[-1][0] or 1.0) if points else 1.0, {}
    for s, pool, host in points:
        span = min(int(s / end * TIMELINE_POINTS), TIMELINE_POINTS - 1)
        most = spans.setdefault(span, [span * end / TIMELINE_POINTS, 0.0, 0.0])
        most[1], most[2] = max(most[1], pool * mib), max(most[2], host * mib)
    return list(spans.values())


def predict(sim: Simulation) -> LegPrediction:
    sim.run()
    mib = sim.calibration.kv_bytes_per_token / 2**20
    ttft, later = [r.ttft_ms for r in sim.results], [r for r in sim.results if r.number > 0]
    sessions = [s.finished_s - s.start_s for s in sim.sessions if s.finished_s is not None]
    over_time = sim.retained_over_time or [(0.0, 0, 0)]
    return LegPrediction(
        sim.leg.name, _percentile(ttft, 50), _percentile(ttft, 90), _percentile([r.ttft_ms for r in later], 50),
        _percentile(sessions, 50),
        max(pool + host for _, pool, host in over_time) * mib, max(pool for _, pool, _ in over_time) * mib,
        max(host for *_, host in over_time) * mib, sim.peak_worker_retained_tokens * mib,
        sum(1 for r in later if r.reused_tokens) / len(later) if later else 0.0, len(sim.results), sim.events,
        dict(Counter(r.path or "colocated" for r in sim.results)), timeline(sim.retained_over_time, mib))


def replications(workload: Workload, calibration: Calibration) -> int:
    if not any(len(set(calibration.scatter(kind))) > 1 for kind in WORKER_KINDS):
        return 1  # every simulation is the same
    wanted = min(MAX_REPLICATIONS, -(-SCATTER_TURNS // max(workload.num_turns, 1)))
    return wanted if wanted % 2 else wanted + 1


def bounded(workload: Workload, calibration: Calibration) -> Workload:
    """`workload`, or TraceError when a leg's simulations of it would take more than MAX_SIMULATED_STEPS steps: a
    trace or workload file (anyone may have written it) is planned in bounded time or refused at once."""
    steps = workload.simulated_steps * replications(workload, calibration)
    if steps > MAX_SIMULATED_STEPS:
        raise TraceError(f"{workload.name}: simulating its {workload.num_turns} turns takes {steps} steps a leg "
                         f"(prompts of {sum(t.prompt_tokens for s in workload.sessions for t in s.turns)} tokens in "
                         f"all), over the {MAX_SIMULATED_STEPS} kvturn plan takes: plan a sample of it (some of its "
                         "conversations) or shorter prompts")
    return workload


def median_of(runs: list[LegPrediction]) -> LegPrediction:
    """Each figure of `runs` (simulations of one leg) as their median, and the events of all of them."""
    paths = {path: int(np.median([run.paths.get(path, 0) for run in runs])) for run in runs for path in run.paths}
    return LegPrediction(runs[0].leg, *(float(np.median([getattr(run, name) for run in runs])) for name in FIGURES),
                         runs[0].turns, sum(run.events for run in runs), paths, runs[0].retained_over_time,
                         {name: [getattr(run, name) for run in runs] for name in REPLICATED})


def simulate(workload: Workload, leg: Leg, deployment: Deployment, calibration: Calibration) -> LegPrediction:
    runs = [predict(Simulation(workload, leg, deployment, calibration, seed))
            for seed in range(replications(workload, calibration))]
    return runs[0] if len(runs) == 1 else median_of(runs)


def simulate_many(workload: Workload, calibration: Calibration,
                  jobs: list[tuple[str, Deployment]]) -> list[LegPrediction]:
    """Each (leg name, deployment) simulated, in order; a large workload's on every core."""
    runs = [(workload, LEGS[leg], deployment, calibration) for leg, deployment in jobs]
    if len(jobs) < 2 or workload.num_turns < PARALLEL_FROM_TURNS:
        return [simulate(*run) for run in runs]
    with multiprocessing.get_context("fork").Pool(min(os.cpu_count() or 1, len(jobs))) as pool:
        return pool.starmap(simulate, runs)
