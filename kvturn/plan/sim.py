"""A discrete-event simulation of one deployment leg serving a workload: the router's choice of path per turn
(its own `paths.choose` for the adaptive leg), prefill and decode workers as step loops (steps.py), retention
leases and prefix caches (retention.py), think time between turns, and closed-loop clients or a trace's own
start times. A plain heapq loop: the whole state is a few dicts and lists, and 200,000 turns take about ten
seconds."""
import heapq
from dataclasses import dataclass
from operator import attrgetter

from kvturn.bench.compare import Leg
from kvturn.config import ConnectorConfig, EngineConfig, RouterConfig, default_of
from kvturn.plan.calibration import Calibration
from kvturn.plan.retention import Lease, Leases, PrefixCache
from kvturn.plan.steps import Job, StepLoop
from kvturn.plan.trace import Session, TurnDemand, Workload
from kvturn.router import paths


@dataclass(frozen=True, slots=True)
class Deployment:
    """The cluster to plan; each default is the one kvturn itself runs with."""
    num_prefill: int = 1
    num_decode: int = 1  # also the number of workers of a colocated leg
    kv_cache_mb: int = default_of(EngineConfig, "kv_cache_mb")
    decoder_kv_blocks_ttl_s: float = default_of(ConnectorConfig, "decoder_kv_blocks_ttl_s")
    retained_kv_budget_mb: int | None = default_of(ConnectorConfig, "retained_kv_budget_mb")
    kv_recompute_threshold_tokens: int = default_of(ConnectorConfig, "kv_recompute_threshold_tokens")
    kv_expiry_margin_s: float = default_of(ConnectorConfig, "kv_expiry_margin_s")
    conversation_ttl_s: float = default_of(RouterConfig, "conversation_ttl_s")
    max_in_flight_per_decode: int = default_of(RouterConfig, "max_in_flight_per_decode")
    stall_weight: float = default_of(RouterConfig, "stall_weight")
    max_num_seqs: int = default_of(EngineConfig, "max_num_seqs")
    max_num_batched_tokens: int = default_of(EngineConfig, "max_num_batched_tokens")
    block_size: int = default_of(EngineConfig, "block_size")
    one_host: bool = False  # every worker on one machine's cores, as `kvturn bench --compare` runs them


@dataclass(slots=True)
class TurnResult:
    session: int
    turn: int
    prompt_tokens: int
    history_tokens: int
    arrival_s: float
    path: str = ""
    reused_tokens: int = 0  # history KV that came from a decode worker's retention (read, or computed beside)
    ttft_ms: float = 0.0
    finished_s: float = 0.0


@dataclass(slots=True)
class Entry:
    """The router's record of a conversation: which decode worker retains it, under which lease."""
    decode: int
    lease: Lease
    forget_s: float


@dataclass(slots=True)
class SessionState:
    index: int
    session: Session
    start_s: float = 0.0
    next_turn: int = 0
    finished_s: float | None = None


LOAD = attrgetter("in_flight")  # the router sends a turn to the least loaded worker
FIT_POINTS = ((512, 0), (2048, 0), (4096, 0), (256, 4096), (128, 8192))  # at least paths.MIN_SAMPLES


def router_cost_model(calibration: Calibration) -> paths.CostModel:
    """The router's cost model as it stands once calibrated: each fit starts from its own points, so that
    `paths.choose` treats it as measured."""
    model = paths.CostModel()
    for role in ("prefill", "decode"):
        fit = paths.ComputeFit(calibration.compute_fits.get(role) or calibration.compute_fits["prefill"])
        for new, context in FIT_POINTS:
            fit.add(new, context, max(fit.predict(new, context), 1e-3))
        model.prefill[role] = fit
    model.read_ms_per_mib = paths.Mean(calibration.read_ms_per_mib["d_to_p"])
    model.bytes_per_token = paths.Mean(calibration.kv_bytes_per_token)
    for path, leg in ((paths.RECOMPUTE, "pd/P-cache-off"), (paths.PULL, "bidir/P-cache-off"),
                      (paths.COMPUTE_ON_DECODE, "compute-on-D")):
        model.other_ms[path] = paths.Typical(calibration.other(leg))
    return model


def fixed_path(policy: str, retained: bool, decode_available: bool) -> str:
    """What `paths.choose` gives a fixed policy, without pricing every path: its own path whenever it is possible,
    else pull if there is a lease, else recompute."""
    possible = {paths.RECOMPUTE, *((paths.PULL,) if retained else ()),
                *((paths.COMPUTE_ON_DECODE,) if retained and decode_available else ())}
    if policy in possible:
        return policy
    return paths.PULL if retained else paths.RECOMPUTE


class Simulation:
    def __init__(self, workload: Workload, leg: Leg, deployment: Deployment, calibration: Calibration):
        self.workload, self.leg, self.deployment, self.calibration = workload, leg, deployment, calibration
        self.now = 0.0
        self.events = 0
        self._queue: list = []
        self._order = 0
        d = deployment
        pool_tokens = int(d.kv_cache_mb * 2**20 / calibration.kv_bytes_per_token)
        loop = lambda kind, index: StepLoop(self, kind, index, d.max_num_seqs, d.max_num_batched_tokens)  # noqa: E731
        self.colocated = leg.mode == "colocated"
        self.prefill = [] if self.colocated else [loop("prefill", i) for i in range(d.num_prefill)]
        self.decode = [loop("colocated" if self.colocated else "decode", i) for i in range(d.num_decode)]
        self.pool_tokens = pool_tokens
        self.prefill_cache = [PrefixCache(pool_tokens) for _ in self.prefill] if leg.prefix_caching_on_prefill else []
        self.decode_cache = [PrefixCache(pool_tokens) for _ in self.decode]
        budget = (int(d.retained_kv_budget_mb * 2**20 / calibration.kv_bytes_per_token)
                  if d.retained_kv_budget_mb is not None else None)
        self.leases = [Leases(budget, self._retained_changed) for _ in self.decode]
        self.table: dict[str, Entry] = {}
        self.costs = router_cost_model(calibration)
        self.other_s = calibration.other(leg.name) / 1e3
        self.retained_tokens = 0
        self.peak_retained_tokens = 0
        self.results: list[TurnResult] = []
        self.sessions = [SessionState(i, s) for i, s in enumerate(workload.sessions)]
        self._pending_sessions = list(reversed(self.sessions))

    def contention(self, loop: StepLoop) -> tuple[float, float]:
        """(factor on prompt compute, ms added to a decode step) for a worker whose other role is busy on the
        same cores; nothing for workers on their own hardware, or a colocated worker alone."""
        if not self.deployment.one_host or self.colocated:
            return 1.0, 0.0
        others = self.decode if loop.kind == "prefill" else self.prefill
        if not any(worker.busy for worker in others):
            return 1.0, 0.0
        return 1.0 + self.calibration.contention["prefill_slowdown"], self.calibration.contention["decode_step_ms"]

    # ---- the event loop
    def at(self, time_s: float, action, *args) -> None:
        self._order += 1
        heapq.heappush(self._queue, (time_s, self._order, action, args))

    def run(self) -> "Simulation":
        if self.workload.clients:
            for _ in range(min(self.workload.clients, len(self.sessions))):
                self._start_next_session()
        else:
            for state in self.sessions:
                self.at(state.session.start_s or 0.0, self._start_session, state)
        while self._queue:
            self.now, _, action, args = heapq.heappop(self._queue)
            self.events += 1
            action(*args)
        return self

    # ---- sessions and turns
    def _start_next_session(self) -> None:
        if self._pending_sessions:
            self._start_session(self._pending_sessions.pop())

    def _start_session(self, state: SessionState) -> None:
        state.start_s = self.now
        self._start_turn(state, self.now)

    def _start_turn(self, state: SessionState, arrival_s: float) -> None:
        """The turn arrives at `arrival_s` and reaches the router's path choice after the leg's fixed overhead."""
        turn = state.session.turns[state.next_turn]
        result = TurnResult(state.index, state.next_turn, turn.prompt_tokens, turn.shared_tokens, arrival_s)
        self.results.append(result)
        self.at(arrival_s + self.other_s, self._dispatch, state, turn, result)

    def _turn_done(self, state: SessionState, decode: int, turn: TurnDemand, result: TurnResult) -> None:
        conversation = state.session.conversation_id
        retained = self._blocks(turn.prompt_tokens + turn.output_tokens - 1)
        self.decode_cache[decode].store(conversation, retained)
        if self.leg.bidirectional:
            self._retain(conversation, decode, retained)
        result.finished_s = self.now
        state.next_turn += 1
        if state.next_turn < len(state.session.turns):
            self._start_turn(state, self.now + state.session.turns[state.next_turn].think_s)
            return
        state.finished_s = self.now
        if self.workload.clients:
            self._start_next_session()

    # ---- one turn's path
    def _dispatch(self, state: SessionState, turn: TurnDemand, result: TurnResult) -> None:
        conversation = state.session.conversation_id
        if self.colocated:
            self._compute_on(state.index % len(self.decode), state, turn, result, lease_tokens=0)
            return
        entry = self.table.get(conversation)
        if entry is not None and self.now >= entry.forget_s:
            del self.table[conversation]  # the router forgot it
            entry = None
        holder = self.decode[entry.decode] if entry else None
        available = holder is not None and holder.in_flight < self.deployment.max_in_flight_per_decode
        prefill = min(self.prefill, key=LOAD)
        policy = self.leg.path_policy if self.leg.bidirectional else paths.RECOMPUTE
        if policy == "adaptive":
            view = paths.TurnView(turn.prompt_tokens, entry.lease.tokens if entry else 0,
                                  holder.in_flight if holder else 0, available, prefill.in_flight)
            result.path = paths.choose(self.costs, view, policy, self.deployment.stall_weight).path
        else:
            result.path = fixed_path(policy, entry is not None, available)
        live = entry is not None and entry.lease.alive and self.now + self.deployment.kv_expiry_margin_s < \
            entry.lease.expiry_s
        lease_tokens = entry.lease.tokens if live else 0
        if result.path == paths.COMPUTE_ON_DECODE:
            self._compute_on(entry.decode, state, turn, result, lease_tokens)
        else:
            self._prefill_on(prefill, state, turn, result, lease_tokens if result.path == paths.PULL else 0)

    def _reusable(self, turn: TurnDemand, cached: int) -> int:
        """Of `cached` tokens of history KV, the full blocks this prompt shares (its last token is always
        computed, for its logits)."""
        return min(cached, self._blocks(turn.shared_tokens), self._blocks(turn.prompt_tokens - 1))

    def _blocks(self, tokens: int) -> int:
        return max(tokens, 0) // self.deployment.block_size * self.deployment.block_size

    def _compute_on(self, decode: int, state: SessionState, turn: TurnDemand, result: TurnResult,
                    lease_tokens: int) -> None:
        """The turn's prompt is computed where it is decoded (colocated, or compute on decode)."""
        conversation = state.session.conversation_id
        cached = self._reusable(turn, max(self.decode_cache[decode].hit(conversation), lease_tokens))
        result.reused_tokens = self._reusable(turn, lease_tokens)
        job = Job(turn.prompt_tokens - cached, cached, turn.output_tokens,
                  on_first_token=lambda now: self._first_token(result, now),
                  on_finished=lambda now: self._turn_done(state, decode, turn, result))
        self.decode[decode].submit_prefill(job)

    def _prefill_on(self, prefill: StepLoop, state: SessionState, turn: TurnDemand, result: TurnResult,
                    lease_tokens: int) -> None:
        """Prefill on P (reading D's retained history first when that saves at least the threshold), then the
        decode worker reads the prompt's KV it lacks and decodes."""
        conversation = state.session.conversation_id
        index = prefill.index
        local = self._reusable(turn, self.prefill_cache[index].hit(conversation)) if self.prefill_cache else 0
        remote = self._reusable(turn, lease_tokens) - local
        if remote < max(self.deployment.kv_recompute_threshold_tokens, 1):
            remote = 0
        result.reused_tokens = remote
        context = local + remote
        job = Job(turn.prompt_tokens - context, context, 1,
                  on_finished=lambda now: self._prefilled(index, state, turn, result, now))
        if remote:  # the read runs beside the worker's steps, as the sequence waits in LOADING_KV
            self.at(self.now + self.calibration.read_ms(remote, "d_to_p") / 1e3, prefill.submit_prefill, job)
        else:
            prefill.submit_prefill(job)

    def _prefilled(self, index: int, state: SessionState, turn: TurnDemand, result: TurnResult, now: float) -> None:
        conversation = state.session.conversation_id
        if self.prefill_cache:
            self.prefill_cache[index].store(conversation, self._blocks(turn.prompt_tokens))
        entry = self.table.get(conversation)
        holder = entry.decode if entry else None
        if holder is None or self.decode[holder].in_flight >= self.deployment.max_in_flight_per_decode:
            holder = min(self.decode, key=LOAD).index
        cached = self._reusable(turn, self.decode_cache[holder].hit(conversation))
        first_token_s = now + self.calibration.read_ms(turn.prompt_tokens - cached, "p_to_d") / 1e3
        self.costs.prefill_request_ms.add((now - result.arrival_s) * 1e3)
        self.at(first_token_s, self._decode_on, holder, state, turn, result)

    def _decode_on(self, decode: int, state: SessionState, turn: TurnDemand, result: TurnResult) -> None:
        self._first_token(result, self.now)
        job = Job(0, turn.prompt_tokens, turn.output_tokens - 1,
                  on_finished=lambda now: self._turn_done(state, decode, turn, result))
        self.decode[decode].submit_decode(job)

    def _first_token(self, result: TurnResult, now: float) -> None:
        result.ttft_ms = (now - result.arrival_s) * 1e3

    # ---- retention
    def _retain(self, conversation: str, decode: int, tokens: int) -> None:
        previous = self.table.get(conversation)
        if previous is not None and previous.decode != decode:
            self.leases[previous.decode].drop(conversation, "superseded")
        leases = self.leases[decode]
        lease = leases.retain(conversation, tokens, self.now, self.deployment.decoder_kv_blocks_ttl_s)
        while leases.retained_tokens + self.decode[decode].context > self.pool_tokens and leases.reclaim_oldest():
            pass  # the pool needs room: leases go before any running request is preempted
        self.peak_retained_tokens = max(self.peak_retained_tokens, self.retained_tokens)  # after any reclaim
        if lease is None or not lease.alive:
            self.table.pop(conversation, None)
            return
        self.table[conversation] = Entry(decode, lease, self.now + self.deployment.conversation_ttl_s)

    def _retained_changed(self, tokens: int) -> None:
        self.retained_tokens += tokens
