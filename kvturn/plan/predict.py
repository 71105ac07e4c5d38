"""What one leg's simulation predicts: the figures `kvturn bench` measures, from the simulated turns; several
simulations of a large workload at once on the machine's cores."""
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvturn.bench.catalog import LEGS, Leg
from kvturn.plan.calibration import Calibration
from kvturn.plan.fit import WORKER_KINDS
from kvturn.plan.sim import Deployment, Simulation
from kvturn.plan.trace import Workload


@dataclass(slots=True)
class LegPrediction:
    leg: str
    ttft_p50_ms: float
    ttft_p90_ms: float
    later_ttft_p50_ms: float
    session_p50_s: float
    peak_retained_mib: float  # all decode workers' together
    peak_retained_mib_per_decode: float  # the decode worker that held the most: what a budget (per worker) caps
    reuse_share: float  # later turns whose history KV came from a decode worker's retention
    turns: int
    events: int
    paths: dict = field(default_factory=dict)
    reached: dict = field(default_factory=dict)  # fit.SEEN_SHAPES at their most in the simulated steps

    def public(self) -> dict:
        """The leg as plan.json shows it."""
        return {"ttft_p50_ms": self.ttft_p50_ms, "ttft_p90_ms": self.ttft_p90_ms,
                "later_ttft_p50_ms": self.later_ttft_p50_ms, "session_p50_s": self.session_p50_s,
                "peak_retained_mib": self.peak_retained_mib,
                "peak_retained_mib_per_decode": self.peak_retained_mib_per_decode, "reuse_share": self.reuse_share,
                "paths": self.paths}


def _percentile(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


def predict(sim: Simulation) -> LegPrediction:
    sim.run()

    def mib(tokens: int) -> float:
        return tokens * sim.calibration.kv_bytes_per_token / 2**20
    ttft = [r.ttft_ms for r in sim.results]
    later = [r for r in sim.results if r.turn > 0]
    sessions = [s.finished_s - s.start_s for s in sim.sessions if s.finished_s is not None]
    path_counts: dict[str, int] = {}
    for r in sim.results:
        path_counts[r.path or "colocated"] = path_counts.get(r.path or "colocated", 0) + 1
    return LegPrediction(
        sim.leg.name, _percentile(ttft, 50), _percentile(ttft, 90), _percentile([r.ttft_ms for r in later], 50),
        _percentile(sessions, 50), mib(sim.peak_retained_tokens), mib(sim.peak_worker_retained_tokens),
        sum(1 for r in later if r.reused_tokens) / len(later) if later else 0.0, len(sim.results), sim.events,
        path_counts, dict(sim.reached))


# A workload of fewer turns than this is simulated again with other draws of its steps' scatter, up to
# MAX_REPLICATIONS times (an odd number), and each figure is the median of the simulations': the bench's figures are
# the median of runs, and a few dozen turns' p50 moves with which of them queued.
SCATTER_TURNS = 2000
# `concurrent`'s 48 turns had a p50 of 102-139 ms over seven draws on the dev machine, and the median of seven moved
# by 7% from one seven to the next; 31 simulations of a few dozen turns take well under a second.
MAX_REPLICATIONS = 31


def replications(workload: Workload, calibration: Calibration) -> int:
    if not any(len(set(calibration.scatter(kind))) > 1 for kind in WORKER_KINDS):
        return 1  # every simulation is the same
    wanted = min(MAX_REPLICATIONS, -(-SCATTER_TURNS // max(workload.num_turns, 1)))
    return wanted if wanted % 2 else wanted + 1


def median_of(runs: list[LegPrediction]) -> LegPrediction:
    """Each figure of `runs` (simulations of one leg) as their median; the events of all of them, and the shapes
    the steps of any of them reached."""
    def median(name: str) -> float:
        return float(np.median([getattr(run, name) for run in runs]))
    paths = {path: int(np.median([run.paths.get(path, 0) for run in runs])) for run in runs for path in run.paths}
    return LegPrediction(runs[0].leg, median("ttft_p50_ms"), median("ttft_p90_ms"), median("later_ttft_p50_ms"),
                         median("session_p50_s"), median("peak_retained_mib"),
                         median("peak_retained_mib_per_decode"), median("reuse_share"), runs[0].turns,
                         sum(run.events for run in runs), paths,
                         {shape: max(run.reached[shape] for run in runs) for shape in runs[0].reached})


def simulate(workload: Workload, leg: Leg, deployment: Deployment, calibration: Calibration) -> LegPrediction:
    runs = [predict(Simulation(workload, leg, deployment, calibration, seed))
            for seed in range(replications(workload, calibration))]
    return runs[0] if len(runs) == 1 else median_of(runs)


PARALLEL_FROM_TURNS = 20_000  # below this a simulation takes less than starting a worker process
_shared: tuple = ()  # (workload, calibration), inherited by forked workers rather than pickled to each


def _share(workload: Workload, calibration: Calibration) -> None:
    global _shared
    _shared = (workload, calibration)


def _simulate_shared(job: tuple[str, Deployment]) -> LegPrediction:
    leg, deployment = job
    return simulate(_shared[0], LEGS[leg], deployment, _shared[1])


def simulate_many(workload: Workload, calibration: Calibration,
                  jobs: list[tuple[str, Deployment]]) -> list[LegPrediction]:
    """Each (leg name, deployment) simulated, in order; a large workload's on every core."""
    cores = os.cpu_count() or 1
    if len(jobs) < 2 or cores < 2 or workload.num_turns < PARALLEL_FROM_TURNS:
        return [simulate(workload, LEGS[leg], deployment, calibration) for leg, deployment in jobs]
    with ProcessPoolExecutor(min(cores, len(jobs)), mp_context=multiprocessing.get_context("fork"),
                             initializer=_share, initargs=(workload, calibration)) as pool:
        return list(pool.map(_simulate_shared, jobs))
