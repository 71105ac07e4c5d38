"""A discrete-event simulation of one deployment leg serving a workload: the router's own code for each turn (its
cost model's path choice and learning, its load accounting on the simulated clock), workers as step loops
(steps.py), leases and prefix caches (retention.py), think time, and closed-loop clients or a trace's own start
times. The router streams P's first token ahead of the decode worker, as for the bench's streamed requests."""
import heapq
import random
from collections import deque
from dataclasses import dataclass

from kvturn import costmodel
from kvturn.bench.catalog import Leg
from kvturn.config import ConnectorConfig, EngineConfig, RouterConfig, default_of
from kvturn.kv_transfer.params import HOST, POOL
from kvturn.plan import link
from kvturn.plan.calibration import WORKER_KINDS, Calibration
from kvturn.plan.retention import Lease, Leases, PrefixCache
from kvturn.plan.steps import Job, StepLoop
from kvturn.plan.trace import Session, TurnDemand, Workload, reusable
from kvturn.router.prefix_memory import PrefixMemory
from kvturn.router.workers import Claim, WorkerPool


@dataclass(frozen=True, slots=True)
class Deployment:
    """The cluster to plan; each default is the one kvturn itself runs with."""
    num_prefill: int = 1
    num_decode: int = 1  # also the number of workers of a colocated leg
    kv_cache_mb: int = default_of(EngineConfig, "kv_cache_mb")
    decoder_kv_blocks_ttl_s: float = default_of(ConnectorConfig, "decoder_kv_blocks_ttl_s")
    retained_kv_budget_mb: int | None = default_of(ConnectorConfig, "retained_kv_budget_mb")
    retained_host_mb: int | None = default_of(ConnectorConfig, "retained_host_mb")
    kv_recompute_threshold_tokens: int = default_of(ConnectorConfig, "kv_recompute_threshold_tokens")
    kv_expiry_margin_s: float = default_of(ConnectorConfig, "kv_expiry_margin_s")
    conversation_ttl_s: float = default_of(RouterConfig, "conversation_ttl_s")
    max_in_flight_per_decode: int = default_of(RouterConfig, "max_in_flight_per_decode")
    stall_weight: float = default_of(RouterConfig, "stall_weight")
    max_num_seqs: int = default_of(EngineConfig, "max_num_seqs")
    max_num_batched_tokens: int = default_of(EngineConfig, "max_num_batched_tokens")
    prefill_pack_tokens: int = default_of(EngineConfig, "prefill_pack_tokens")
    block_size: int = default_of(EngineConfig, "block_size")
    one_host: bool = False  # every worker on one machine's cores, as `kvturn bench --compare` runs them
    prefill_kv_cache_mb: int | None = None  # P's pool when it differs from kv_cache_mb (its prefix cache's size)
    prefill_choice: str = default_of(RouterConfig, "prefill_choice")
    prefill_spill_ms: float = default_of(RouterConfig, "prefill_spill_ms")
    link_bits_per_s: float | None = None  # between hosts (plan/link.py); None: the calibration's own reads
    link_delay_s: float = 0.0
    link_read_fixed_ms: float = 0.0  # what one read over the link costs besides its bytes
    # P reads D's history layer by layer beside its compute over this many layers (the model's; 0: read, then
    # compute); a leg's --no-kv-read-overlap reads whole
    read_overlap_layers: int = 0


@dataclass(slots=True)
class Flight:
    """One turn on its way through the router and the workers, and, once answered, what it took."""
    state: "SessionState"
    turn: TurnDemand
    number: int  # of the turn in its session, from 0
    arrival_s: float
    shareable_tokens: int = 0  # full blocks of history KV the prompt may reuse
    dispatched_s: float = 0.0
    choice: costmodel.PathChoice | None = None
    claim: Claim | None = None  # the router's load on the worker serving the turn now
    prefill: int = 0
    decode: int = 0
    read_ms: float = 0.0  # P's read of D's retained history
    leased_tokens: int = 0  # the lease the router's table held for the conversation when the turn came
    path: str = ""
    reused_tokens: int = 0  # history KV that came from a decode worker's retention (read, or computed beside)
    cached_tokens: int = 0  # of the prompt, what P's own prefix cache held
    ttft_ms: float = 0.0


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


def router_cost_model(calibration: Calibration, deployment: Deployment | None = None) -> costmodel.CostModel:
    """The router's cost model as it stands once calibrated (on the deployment's link, where it has one)."""
    other = {costmodel.RECOMPUTE: "pd/P-cache-off", costmodel.PULL: "bidir/P-cache-off",
             costmodel.COMPUTE_ON_DECODE: "compute-on-D"}
    rates = link.read_ms_per_mib(calibration, deployment) if deployment else calibration.read_ms_per_mib
    return costmodel.CostModel.calibrated({role: calibration.fit_for(role) for role in ("prefill", "decode")},
                                          rates, calibration.kv_bytes_per_token,
                                          {path: calibration.other(leg) for path, leg in other.items()})


class Simulation:
    def __init__(self, workload: Workload, leg: Leg, deployment: Deployment, calibration: Calibration, seed: int = 0):
        self.workload, self.leg, self.deployment, self.calibration = workload, leg, deployment, calibration
        self._draw = random.Random(seed).choice  # a prompt step's factor from its kind's scatter
        self._scatter = {kind: calibration.scatter(kind) for kind in WORKER_KINDS}
        self.now, self.events, self._queue, self._order = 0.0, 0, [], 0
        d = deployment
        self.colocated = leg.mode == "colocated"
        self.shared_cores = d.one_host and not self.colocated  # P and D contend for the same cores
        self.prefill = [] if self.colocated else [StepLoop(self, "prefill") for _ in range(d.num_prefill)]
        self.decode = [StepLoop(self, "colocated" if self.colocated else "decode") for _ in range(d.num_decode)]
        # the router's own view of each role's workers: its load accounting, on the simulated clock
        self.router_prefill = WorkerPool([str(i) for i in range(len(self.prefill))], "prefill", lambda: self.now)
        self.router_decode = WorkerPool([str(i) for i in range(len(self.decode))], "decode", lambda: self.now)
        for worker, view in zip(self.decode, self.router_decode.workers):
            worker.token_gaps_ms = view.token_gaps_ms  # the router's decode step time
        self.pool_tokens = self._tokens_in(d.kv_cache_mb)
        prefill_pool = self._tokens_in(d.prefill_kv_cache_mb) if d.prefill_kv_cache_mb else self.pool_tokens
        prefill_host = self._tokens_in(int(leg.prefill_setting("--prefix-host-mb") or 0))
        self.prefill_cache = [PrefixCache(prefill_pool, prefill_host) for _ in self.prefill] \
            if leg.prefix_caching_on_prefill else []
        self.decode_cache = [PrefixCache(self.pool_tokens) for _ in self.decode]
        budget = None if d.retained_kv_budget_mb is None else self._tokens_in(d.retained_kv_budget_mb)
        self.leases = [Leases(budget, self._tokens_in(d.retained_host_mb or 0), self._retained_changed)
                       for _ in self.decode]
        self.lease_ends: deque[tuple[Lease, int]] = deque()  # one TTL for all: they end in the order they began
        self.table: dict[str, Entry] = {}
        self.costs = router_cost_model(calibration, deployment)
        self.costs.observe_read_overlap(0 if leg.prefill_setting("--no-kv-read-overlap") else d.read_overlap_layers)
        self.prefix_memory = PrefixMemory(max(len(workload.sessions), 1))  # the router's guess of P's caches
        self.policy = leg.path_policy if leg.bidirectional else costmodel.RECOMPUTE
        self.turns_in_flight = 0  # arrived, not yet answered in full
        self.retained_tokens = {POOL: 0, HOST: 0}  # over all decode workers together
        self.retained_over_time: list[tuple[float, int, int]] = []  # (s, pool tokens, host tokens) at each change
        self.peak_worker_retained_tokens = 0  # in the pool of the decode worker that held the most
        self.results: list[Flight] = []
        self.sessions = [SessionState(i, s) for i, s in enumerate(workload.sessions)]
        self._pending_sessions = list(reversed(self.sessions))

    def contention_ms(self, loop: StepLoop) -> float:
        """What a step of `loop` gains while a worker of the other role is busy on the same cores (never on hardware
        of their own)."""
        others = self.decode if loop.kind == "prefill" else self.prefill
        return self.calibration.decode_contention_ms if self.shared_cores and any(w.busy for w in others) else 0.0

    def prompt_step_ms(self, loop: StepLoop, chunks: list[tuple[Job, int]]) -> float:
        """A step of `loop` computing the (job, new tokens) `chunks`, scattered as the calibration's steps of that
        kind were (steps of fixed times keep closed-loop sessions in a lockstep that a machine's scatter breaks)."""
        ms = self.calibration.step_prefill_ms([(n, job.context) for job, n in chunks], loop.kind)
        return ms * self._draw(self._scatter[loop.kind]) if self._scatter[loop.kind] else ms

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
        queue, pop = self._queue, heapq.heappop
        while queue:
            self.now, _, action, args = pop(queue)
            self.events += 1
            action(*args)
        return self

    def _start_next_session(self) -> None:
        if self._pending_sessions:
            self._start_session(self._pending_sessions.pop())

    def _start_session(self, state: SessionState) -> None:
        state.start_s = self.now
        self._start_turn(state, self.now)

    def _start_turn(self, state: SessionState, arrival_s: float) -> None:
        turn = state.session.turns[state.next_turn]
        previous = state.session.turns[state.next_turn - 1] if state.next_turn else None
        flight = Flight(state, turn, state.next_turn, arrival_s, self._blocks(reusable(previous, turn)))
        self.results.append(flight)
        if arrival_s <= self.now:
            self._arrive(flight)
        else:
            self.at(arrival_s, self._arrive, flight)

    def _arrive(self, flight: Flight) -> None:
        """The turn reaches the router's path choice after the leg's time outside compute, which grows with the
        requests in flight beside it."""
        load = self.turns_in_flight / (len(self.prefill) or len(self.decode))  # per prompt worker
        self.turns_in_flight += 1
        self.at(self.now + self.calibration.other(self.leg.name, load) / 1e3, self._dispatch, flight)

    def _turn_done(self, flight: Flight) -> None:
        state, turn = flight.state, flight.turn
        conversation = state.session.conversation_id
        retained = self._blocks(turn.prompt_tokens + turn.output_tokens - 1)
        self.decode_cache[flight.decode].store(conversation, retained)
        if self.leg.bidirectional:
            self._retain(conversation, flight.decode, retained)
        self.turns_in_flight -= 1
        flight.choice = flight.claim = None  # the results keep each turn's figures, not the router's objects
        state.next_turn += 1
        if state.next_turn < len(state.session.turns):
            self._start_turn(state, self.now + state.session.turns[state.next_turn].think_s)
            return
        state.finished_s = self.now
        if self.workload.clients:
            self._start_next_session()

    def _dispatch(self, flight: Flight) -> None:
        """The turn's path, as kvturn/router/turn.py takes it."""
        state, turn = flight.state, flight.turn
        flight.dispatched_s = now = self.now
        if self.colocated:
            self._compute_on(state.index % len(self.decode), flight, lease_tokens=0)
            return
        conversation = state.session.conversation_id
        entry = self.table.get(conversation)
        if entry is not None and now >= entry.forget_s:
            del self.table[conversation]  # the router forgot it
            entry = None
        holder = self.router_decode.workers[entry.decode] if entry else None
        flight.leased_tokens = entry.lease.tokens if entry else 0
        prefill = self.router_prefill.pick(conversation, self.deployment.prefill_choice,
                                           spill_ms=self.deployment.prefill_spill_ms)
        view = costmodel.TurnView(
            turn.prompt_tokens, flight.leased_tokens, holder.in_flight if holder else 0,
            holder is not None and holder.in_flight < self.deployment.max_in_flight_per_decode, prefill.in_flight,
            prefill.backlog_ms(now), holder.backlog_ms(now) if holder else 0.0, True, holder.step_ms if holder else 0.0,
            prefill_cached_tokens=self.prefix_memory.expected_cached(conversation, prefill.url))
        choice = flight.choice = costmodel.choose(self.costs, view, self.policy, self.deployment.stall_weight)
        self.costs.chosen(choice.path)
        flight.path = choice.path
        live = entry is not None and entry.lease.alive and now + self.deployment.kv_expiry_margin_s < \
            entry.lease.expiry_s
        lease_tokens = entry.lease.tokens if live else 0
        if choice.path == costmodel.COMPUTE_ON_DECODE:
            flight.claim = self.router_decode.claim(holder, choice.work_ms)
            self._compute_on(entry.decode, flight, lease_tokens)
        else:
            flight.claim = self.router_prefill.claim(prefill, choice.work_ms)
            self._prefill_on(self.router_prefill.workers.index(prefill), flight,
                             lease_tokens if choice.path == costmodel.PULL else 0)

    def _blocks(self, tokens: int) -> int:
        return max(tokens, 0) // self.deployment.block_size * self.deployment.block_size

    def _compute_on(self, decode: int, flight: Flight, lease_tokens: int) -> None:
        """The turn's prompt is computed where it is decoded (colocated, or compute on decode)."""
        shareable = flight.shareable_tokens
        cached = min(shareable, max(self.decode_cache[decode].hit(flight.state.session.conversation_id), lease_tokens))
        flight.reused_tokens = min(shareable, lease_tokens)
        flight.decode = decode
        if not self.colocated:  # the router learns how much of a lease the next prompt shares from D's cache hit
            self.costs.observe_reuse(flight.leased_tokens, cached)
        self.decode[decode].submit_prefill(Job(flight.turn.prompt_tokens - cached, cached, flight.turn.output_tokens,
                                               flight, self._computed_on_decode, self._decoded))

    def _computed_on_decode(self, job: Job, now: float) -> None:
        flight = job.flight
        if flight.claim is not None:  # a colocated worker has no router in front
            flight.claim.work_done()  # D's first text: its predicted work is done
        self._first_token(flight, now, job.compute_ms)

    def _prefill_on(self, prefill: int, flight: Flight, lease_tokens: int) -> None:
        """Prefill on P, reading D's retained history first when that saves at least the threshold."""
        conversation, shareable = flight.state.session.conversation_id, flight.shareable_tokens
        local = min(shareable, self.prefill_cache[prefill].hit(conversation)) if self.prefill_cache else 0
        remote = min(shareable, lease_tokens) - local
        if remote < max(self.deployment.kv_recompute_threshold_tokens, 1):
            remote = 0
        flight.reused_tokens, flight.prefill, flight.cached_tokens = remote, prefill, local
        job = Job(flight.turn.prompt_tokens - local - remote, local + remote, 1, flight, on_finished=self._prefilled)
        if remote:  # read as P's step that admits it is scheduled
            flight.read_ms = job.read_ms = link.read_ms(self.calibration, self.deployment, remote, "d_to_p")
        self.prefill[prefill].submit_prefill(job)

    def _prefilled(self, job: Job, now: float) -> None:
        """P has answered: the router streams its first token, learns from its report and sends the turn on to a
        decode worker, which reads the prompt's KV it lacks and decodes."""
        flight = job.flight
        turn, conversation = flight.turn, flight.state.session.conversation_id
        if self.prefill_cache:
            self.prefill_cache[flight.prefill].store(conversation, self._blocks(turn.prompt_tokens))
        self.prefix_memory.observe(conversation, str(flight.prefill), turn.prompt_tokens, flight.cached_tokens)
        flight.claim.release()
        self.costs.prefill_request_ms.add((now - flight.dispatched_s) * 1e3)
        entry = self.table.get(conversation)
        holder = entry.decode if entry else None
        if holder is None or self.router_decode.workers[holder].in_flight >= self.deployment.max_in_flight_per_decode:
            holder = self.router_decode.workers.index(self.router_decode.least_loaded())
        flight.decode = holder
        flight.claim = self.router_decode.claim(self.router_decode.workers[holder])
        on_decode = min(flight.shareable_tokens, self.decode_cache[holder].hit(conversation))
        self.costs.observe_reuse(flight.leased_tokens, on_decode)
        self._first_token(flight, now, job.compute_ms + flight.read_ms)
        decode = Job(0, turn.prompt_tokens, turn.output_tokens - 1, flight, on_finished=self._decoded)
        read_ms = link.read_ms(self.calibration, self.deployment, turn.prompt_tokens - on_decode, "p_to_d")
        self.at(now + read_ms / 1e3, self.decode[holder].submit_decode, decode)

    def _first_token(self, flight: Flight, now: float, explained_ms: float) -> None:
        ttft_ms = flight.ttft_ms = (now - flight.arrival_s) * 1e3
        if flight.choice is not None:
            self.costs.observe_turn(flight.choice, ttft_ms, explained_ms)

    def _decoded(self, job: Job, now: float) -> None:
        if job.flight.claim is not None:
            job.flight.claim.release()
        self._turn_done(job.flight)

    def _retain(self, conversation: str, decode: int, tokens: int) -> None:
        previous = self.table.get(conversation)
        if previous is not None and previous.decode != decode:
            self.leases[previous.decode].drop(conversation)  # superseded by the lease on another worker
        leases = self.leases[decode]
        lease = leases.retain(conversation, tokens, self.now, self.deployment.decoder_kv_blocks_ttl_s)
        while leases.tokens[POOL] + self.decode[decode].context > self.pool_tokens and leases.reclaim_oldest():
            pass  # the pool needs room: leases move or go before any running request is preempted
        if lease is not None:
            self.lease_ends.append((lease, decode))
        while self.lease_ends and self.lease_ends[0][0].expiry_s <= self.now:  # each worker ends its own
            ended, worker = self.lease_ends.popleft()
            if ended.alive:
                self.leases[worker].drop(ended.conversation)
        self.peak_worker_retained_tokens = max(self.peak_worker_retained_tokens, leases.tokens[POOL])
        if lease is None or not lease.alive:
            self.table.pop(conversation, None)
        else:
            self.table[conversation] = Entry(decode, lease, self.now + self.deployment.conversation_ttl_s)

    def _tokens_in(self, mib: int) -> int:
        return int(mib * 2**20 / self.calibration.kv_bytes_per_token)

    def _retained_changed(self, tier: str, tokens: int) -> None:
        """Each instant's retained KV once every change made then is in."""
        self.retained_tokens[tier] += tokens
        if self.retained_over_time and self.retained_over_time[-1][0] == self.now:
            self.retained_over_time.pop()
        self.retained_over_time.append((self.now, self.retained_tokens[POOL], self.retained_tokens[HOST]))
