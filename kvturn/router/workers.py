"""The router's view of its prefill and decode workers: health and load."""
import asyncio
import hashlib
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvturn.router.upstream import Unreachable, Upstream

log = logging.getLogger("kvturn.router")


class UpstreamError(Exception):
    """A worker's answer (or the lack of any worker) to pass on to the client as it is, and the outcome it counts."""
    def __init__(self, response, outcome: str = "prefill_error"):
        self.response, self.outcome = response, outcome


@dataclass(slots=True)
class WorkerState:
    url: str
    role: str
    healthy: bool = True
    in_flight: int = 0
    backend: str = "unknown"  # kvturn or vllm, once asked (router/vllm_backend.py)
    pending: dict = field(default_factory=dict)  # id(claim) -> (its predicted work in ms, when it came)
    token_gaps_ms: deque = field(default_factory=lambda: deque(maxlen=64))  # between tokens of streams relayed
    calibration_asked: bool = False  # its start-up prefill timings were asked for (router app: learn_calibration)
    last_done: float = 0.0  # when a request's predicted work was last done: the worker then took up the others
    # A decode worker with a host tier: how long its least recently used lease still in its pool has gone unused, as
    # its last /health said (None: no lease has had to move; router/lease_tier.py)
    pool_horizon_s: float | None = None
    # A worker found in the registry: its newest signed registration's time (the worker's clock), and until when it
    # stays in the rotation (ours)
    announced_at: float = 0.0
    registered_until: float = 0.0
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)  # seconds; `kvturn plan` simulates it

    @property
    def step_ms(self) -> float:
        """How long one of its engine steps takes now (the median recent gap between two streamed tokens)."""
        return statistics.median(self.token_gaps_ms) if self.token_gaps_ms else 0.0

    def backlog_ms(self, now: float | None = None) -> float:
        """Predicted work the worker has still to do before a request sent now gets its turn: what the
        requests it holds were predicted to cost, less what it can have done on them since it took them up (when
        the oldest came, or when the last one before them was done, whichever is later)."""
        if not self.pending:
            return 0.0
        now = self.clock() if now is None else now
        started = max(min(came for _, came in self.pending.values()), self.last_done)
        return max(sum(ms for ms, _ in self.pending.values()) - max(now - started, 0.0) * 1e3, 0.0)


@dataclass(slots=True)
class Claim:
    """One request's share of a worker's load, released exactly once whichever way the request ends."""
    worker: WorkerState
    released: bool = field(default=False)

    def work_done(self) -> None:
        """The request's predicted work (its prompt) is done, though the request may go on (decoding): the worker
        has taken up what waited behind it."""
        if self.worker.pending.pop(id(self), None) is not None:
            self.worker.last_done = self.worker.clock()

    def release(self) -> None:
        """The request is over. Work it never reported done (a refusal, an error, a client that left) leaves the
        queue without counting as done: a run of failing requests must not make the worker's queue look fresh."""
        if not self.released:
            self.released = True
            self.worker.in_flight -= 1
            self.worker.pending.pop(id(self), None)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def pool_horizon(reply) -> float | None:
    """`retention.pool_horizon_s` of a kvturn worker's /health reply, if it says one."""
    try:
        value = reply.json()["retention"]["pool_horizon_s"]
    except (ValueError, KeyError, TypeError):
        return None
    return float(value) if type(value) in (int, float) and value >= 0 else None


class WorkerPool:
    def __init__(self, urls: list[str], role: str, clock: Callable[[], float] = time.perf_counter):
        """`clock`: what the load accounting reads as now (the simulated clock in `kvturn plan`)."""
        self.clock = clock
        self.workers = [WorkerState(url.rstrip("/"), role, clock=clock) for url in urls]
        self.role = role
        self.static_urls = {w.url for w in self.workers}

    def healthy(self) -> list[WorkerState]:
        return [w for w in self.workers if w.healthy]

    def least_loaded(self, exclude: set[str] = frozenset()) -> WorkerState | None:
        candidates = [w for w in self.healthy() if w.url not in exclude]
        now = self.clock()
        return min(candidates, key=lambda w: (w.backlog_ms(now), w.in_flight), default=None)

    def affine(self, key: str, exclude: set[str] = frozenset(), spill_ms: float = 0.0) -> WorkerState | None:
        """The conversation's own worker, by rendezvous hash of its key over the workers' URLs (a worker leaving
        moves only its own conversations, as llm-d keeps a prefix on one pod), so its later turns meet the prefix
        cache that holds its history; the least loaded one instead while the own one's backlog is `spill_ms`
        above it."""
        ranked = sorted((w for w in self.healthy() if w.url not in exclude),
                        key=lambda w: hashlib.blake2b(f"{w.url}\n{key}".encode(), digest_size=8).digest())
        if not ranked:
            return None
        own, least = ranked[-1], self.least_loaded(exclude)
        now = self.clock()
        return least if own.backlog_ms(now) > least.backlog_ms(now) + spill_ms else own

    def pick(self, key: str | None, choice: str, exclude: set[str] = frozenset(),
             spill_ms: float = 0.0) -> WorkerState | None:
        """A turn's worker by the router's `choice` (config.PREFILL_CHOICES); a turn without a key: least loaded."""
        if choice == "prefix-affine" and key is not None:
            return self.affine(key, exclude, spill_ms)
        return self.least_loaded(exclude)

    @staticmethod
    def claim(worker: WorkerState, work_ms: float = 0.0) -> Claim:
        """`work_ms`: the compute and transfer the request is predicted to cost the worker (see kvturn/costmodel/paths.py)."""
        worker.in_flight += 1
        claim = Claim(worker)
        if work_ms > 0:
            worker.pending[id(claim)] = (work_ms, worker.clock())
        return claim

    def find(self, url: str) -> WorkerState | None:
        return next((w for w in self.workers if w.url == url), None)

    def follow_registry(self, registered: dict, now: float | None = None) -> None:
        """Add the workers whose signed registrations (registry.Registration by URL) came (healthy once probed), and
        extend each one's time in the rotation by its registration's time to live, from when a newer one than any
        before was first seen: a replayed registration extends nothing. A discovered worker whose registration ran
        out leaves the rotation even if it still answers its probe (Redis lost its key: it registers again within a
        beat, well inside its time to live). Workers given on the command line stay."""
        now = self.clock() if now is None else now
        for url, registration in sorted(registered.items()):
            url = url.rstrip("/")
            worker = self.find(url)
            if worker is None:
                log.info("%s worker %s registered", self.role, url)
                worker = WorkerState(url, self.role, healthy=False, clock=self.clock)
                self.workers.append(worker)
            if registration.announced_at > worker.announced_at:
                worker.announced_at = registration.announced_at
                worker.registered_until = now + registration.ttl_s
        for worker in [w for w in self.workers if w.url not in self.static_urls and w.registered_until <= now]:
            log.warning("%s worker %s left the rotation: its registration was not renewed", self.role, worker.url)
            self.workers.remove(worker)

    def mark_dead(self, worker: WorkerState) -> None:
        if worker.healthy:
            log.warning("%s worker %s left the rotation", self.role, worker.url)
        worker.healthy = False

    async def check(self, client: Upstream, dead_only: bool = False) -> None:
        """Probe the workers' health (`dead_only`: those out of the rotation), taking back those that answer."""
        async def probe(worker: WorkerState):
            try:
                reply = await client.get(f"{worker.url}/health", timeout_s=2.0)
                ok = reply.status == 200
            except Unreachable:
                ok = False
            if ok:
                worker.pool_horizon_s = pool_horizon(reply)
            if ok and not worker.healthy:
                log.info("%s worker %s is back", self.role, worker.url)
            worker.healthy = ok
        await asyncio.gather(*(probe(w) for w in self.workers if not (dead_only and w.healthy)))
