"""The engine side of the KV connector: loads a peer's blocks into a sequence, retains finished KV for a peer.

The engine calls four hooks on its own thread: `on_admit` (may start a read; the sequence then waits in
LOADING_KV while others run), `poll` (each step: finish, verify or abandon reads), `on_finish` (retain) and
`on_abort`. A read is verified twice before its blocks count: the block hashes come from the trusted peer's
own lease record and must match the prompt's, and after the bytes arrive the peer's block epochs are read
again to prove it did not recycle the blocks meanwhile. Any failure recomputes.

A decode worker with a host tier (leases.py, host_tier.py) also brings a conversation's history back from it
itself, when the next turn is sent straight to it (compute on decode): the blocks are copied into the new
sequence's own pool blocks at admission, past what its prefix cache already holds.
"""
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from kvturn.config import ConnectorConfig
from kvturn.engine.block_manager import chain_hash
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.scheduler import reusable_blocks
from kvturn.engine.sequence import Sequence, Status
from kvturn.kv_transfer import policy, retention
from kvturn.kv_transfer.histogram import READ_BYTES_BOUNDS, READ_SECONDS_BOUNDS, Buckets
from kvturn.kv_transfer.host_tier import HostTier
from kvturn.kv_transfer.layered_reads import AbandonedRead, LayeredReads, LayerWait
from kvturn.kv_transfer.leases import LeaseTable
from kvturn.kv_transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent
from kvturn.kv_transfer.params import HOST, POOL

log = logging.getLogger(__name__)
PROBE_WAIT_S = 0.01  # the engine thread waits this long at most for a lease's epochs before reading it


@dataclass(slots=True)
class RemoteBlocks:
    """Blocks a peer retains for this prompt, as that peer's side channel described its own lease."""
    peer_engine_id: str
    block_ids: list[int]
    block_hashes: list[int]
    block_epochs: list[int]
    deadline: float  # when the lease ends, on this worker's own clock (KVConnector.clock)
    handle: str
    num_tokens: int = 0  # tokens whose KV the blocks hold (the last block may be partial)
    first_token_id: int | None = None  # P->D: P's sampled first token, taken when every prompt block matches
    prefilled_for_us: bool = False  # P->D: P computed these for this request, so any block we lack is worth it
    tier: str = POOL  # where the peer holds them: its engine pool, or its host tier


@dataclass(slots=True)
class RetainSpec:
    """Keep this request's blocks after it finishes, under a lease."""
    ttl_s: float
    conversation_key: str
    release_after_read: bool  # P's pin for one decode; D's lease stays readable until it expires
    covered: float = 0.0  # fraction of the prompt P's prefix cache held (retention.py weighs the lease by it)


@dataclass(slots=True)
class ConnectorStats:
    kv_reads: int = 0
    kv_read_seconds: float = 0.0
    kv_read_step_seconds: float = 0.0  # of kv_read_seconds, the engine's steps that ran before a read was seen done
    kv_read_bytes: int = 0
    reuse_declines: Counter = field(default_factory=Counter)
    reads_by_tier: Counter = field(default_factory=Counter)  # tier of the peer's blocks -> reads completed
    read_bytes_by_tier: Counter = field(default_factory=Counter)
    read_seconds_by_tier: Counter = field(default_factory=Counter)
    host_restores: int = 0  # turns whose history this worker copied back from its own host tier
    host_restore_bytes: int = 0
    host_restore_seconds: float = 0.0
    read_seconds: Buckets = field(default_factory=lambda: Buckets(READ_SECONDS_BOUNDS))  # each read's, for vLLM's names
    read_bytes: Buckets = field(default_factory=lambda: Buckets(READ_BYTES_BOUNDS))


@dataclass(slots=True)
class PendingLoad:
    seq: Sequence
    handle: object
    local_ids: list[int]
    remote_ids: list[int]
    started: float
    decision: policy.ReuseDecision
    gives_up_at: float  # on the connector's clock: a read still in flight past it is abandoned
    steps_before: float = 0.0  # the engine's step_seconds when the read began
    reading_epochs: bool = False


class KVConnector:
    def __init__(self, engine: LLMEngine, config: ConnectorConfig, clock=time.monotonic):
        """`clock`: this worker's own (monotonic) seconds, on which every lease deadline here is set."""
        self.engine = engine
        self.config = config
        self.clock = clock
        self.block_size = engine.block_size
        block_bytes = engine.kv_cache.layout.block_bytes
        budget_blocks = (config.retained_kv_budget_mb * 2**20 // block_bytes
                         if config.retained_kv_budget_mb is not None else None)
        host_blocks = (config.retained_host_mb or 0) * 2**20 // block_bytes
        self.host = HostTier(engine.kv_cache, host_blocks) if host_blocks else None
        self.leases = LeaseTable(engine.block_manager, budget_blocks, self.host, engine.kv_cache,
                                 config.kv_lease_max_age_s, clock)
        self.nixl = KVTransferAgent(engine.kv_cache, engine.block_manager.epochs, host=self.host,
                                    prefix_host=engine.prefix_host)
        self.stats = ConnectorStats()
        self.loads: list[PendingLoad] = []
        self.layered = LayeredReads(self)  # reads posted layer by layer, their sequences running
        self.abandoned: list[AbandonedRead] = []
        self._last_expiry_check = 0.0
        engine.attach_connector(self)

    @property
    def engine_id(self) -> str:
        return self.nixl.engine_id

    def has_work(self) -> bool:
        return bool(self.abandoned)

    @property
    def waiting_on_reads(self) -> bool:
        return bool(self.loads or self.layered.reads)  # a layered read's next layers are posted as the earlier land

    def reclaim_for(self, seq: Sequence) -> bool:
        """The pool is short of blocks for `seq`: give up a retained lease (retention.py chooses which, for the
        tenant of `seq`'s conversation); False if none may go."""
        spec = seq.retain
        tenant = retention.tenant_of(spec.conversation_key) if spec and not spec.release_after_read else None
        return self.leases.reclaim_oldest(tenant)

    def decline(self, seq: Sequence, reason: str) -> None:
        seq.reuse_outcome = reason
        self.stats.reuse_declines[reason] += 1

    # ---- admission: decide, start the read
    def on_admit(self, seq: Sequence, full_hashes: list[int]) -> None:
        remote = seq.remote
        if remote is None and not self._own_history(seq):
            return
        whole = list(full_hashes)
        tail = seq.token_ids[len(whole) * self.block_size:]
        if tail:
            whole.append(chain_hash(whole[-1] if whole else seq.hash_seed, tail))
        prompt = policy.PromptView(len(seq), full_hashes[:reusable_blocks(len(seq), self.block_size)], whole,
                                   seq.num_published_blocks, seq.params.must_sample_here)
        if remote is None:
            self._restore_from_host(seq, prompt)
            return
        view = policy.RemoteView(remote.block_hashes, remote.num_tokens, remote.deadline - self.clock(),
                                 remote.first_token_id is not None, remote.peer_engine_id in self.nixl.peers)
        threshold = 1 if remote.prefilled_for_us else self.config.kv_recompute_threshold_tokens
        decision = policy.decide(prompt, view, self.block_size, threshold, self.config.kv_expiry_margin_s)
        if not decision.loads:
            self.decline(seq, decision.reason)
        elif not remote.prefilled_for_us and self._lease_let_go(seq, decision):
            self.decline(seq, policy.LEASE_ENDED)
        elif self._overlaps(seq, decision):
            self.layered.start(seq, decision)
        elif not self._start_read(seq, decision):
            self.decline(seq, policy.READ_FAILED)

    def _own_history(self, seq: Sequence) -> bool:
        """Whether a turn sent to this worker itself may find its history in our host tier."""
        return self.host is not None and seq.retain is not None and not seq.retain.release_after_read

    def _restore_from_host(self, seq: Sequence, prompt: policy.PromptView) -> None:
        """Compute on decode: copy the conversation's history from our host tier into the sequence's own blocks,
        past its prefix-cache hit, when that saves at least the recompute threshold (a lease still in the pool is
        found by the prefix cache itself)."""
        lease = self.leases.for_conversation(seq.retain.conversation_key)
        if lease is None:
            return
        if lease.block_hashes[:1] == prompt.reusable_hashes[:1]:
            self.leases.renew(lease)  # the conversation's next turn reads it
        if lease.tier != HOST:
            return
        view = policy.RemoteView(lease.block_hashes, lease.num_tokens, lease.deadline - self.clock(), False, True)
        decision = policy.decide(prompt, view, self.block_size, self.config.kv_recompute_threshold_tokens, 0.0)
        if not decision.loads:
            return
        first, last = decision.load_from_block, decision.load_to_block
        started = time.perf_counter()
        self.leases.copy_back(lease, first, last, seq.block_table[first:last])
        elapsed = time.perf_counter() - started
        nbytes = (last - first) * self.engine.kv_cache.layout.block_bytes
        seq.block_hashes = seq.block_hashes[:first] + lease.block_hashes[first:last]
        seq.num_computed_tokens = seq.num_cached_tokens = last * self.block_size
        seq.kv_tier = HOST
        seq.timing.host_restore_s += elapsed
        seq.timing.host_restore_bytes += nbytes
        self.stats.host_restores += 1
        self.stats.host_restore_bytes += nbytes
        self.stats.host_restore_seconds += elapsed
        self.engine.publish_full_blocks(seq)

    def _lease_let_go(self, seq: Sequence, decision: policy.ReuseDecision) -> bool:
        """Before reading a peer's lease (not P's pin, which is never let go under pressure): read back the epochs of
        the blocks wanted, a few bytes, and skip the read if the holder has let them go since its record was made
        (under pressure, while this prompt waited in our queue). False when that cannot be told within
        PROBE_WAIT_S: the read then goes ahead and its own epoch check decides."""
        remote, first, last = seq.remote, decision.load_from_block, decision.load_to_block
        local_ids = seq.block_table[first:last]
        try:
            handle = self.nixl.start_epoch_read(remote.peer_engine_id, remote.block_ids[first:last], local_ids,
                                                remote.tier, probe=True)
        except Exception:
            return False
        waited_until = time.perf_counter() + PROBE_WAIT_S
        while (state := self.nixl.poll(handle)) == IN_PROGRESS and time.perf_counter() < waited_until:
            time.sleep(PROBE_WAIT_S / 50)  # the GIL goes to NIXL's progress thread meanwhile
        if state == IN_PROGRESS:
            self.abandoned.append(AbandonedRead([handle], []))  # lands in the probe's own scratch only; reaped later
            return False
        self.nixl.release(handle)
        return state == DONE and self.nixl.scratch_epochs(local_ids, probe=True) != remote.block_epochs[first:last]

    def _start_read(self, seq: Sequence, decision: policy.ReuseDecision) -> bool:
        remote, first, last = seq.remote, decision.load_from_block, decision.load_to_block
        local_ids, remote_ids = seq.block_table[first:last], remote.block_ids[first:last]
        started = time.perf_counter()  # before posting: over shared memory, UCX copies inside the post itself
        gives_up_at = self.clock() + self.config.kv_read_timeout_s
        try:
            handle = self.nixl.start_block_read(remote.peer_engine_id, remote_ids, local_ids, remote.tier)
        except Exception:
            log.warning("starting a KV read from %s failed", remote.peer_engine_id, exc_info=True)
            return False
        seq.status = Status.LOADING_KV
        self.loads.append(PendingLoad(seq, handle, local_ids, remote_ids, started, decision,
                                      gives_up_at, self.engine.step_seconds))
        return True

    def _overlaps(self, seq: Sequence, decision: policy.ReuseDecision) -> bool:
        """P's read of a history, layer by layer beside its compute; not D's read of what P prefilled for it."""
        remote = seq.remote
        return (self.config.kv_read_overlap and not decision.whole_prompt and not remote.prefilled_for_us
                and remote.first_token_id is None)

    def layer_waiter(self, batch: list[tuple[Sequence, int]]) -> LayerWait | None:
        return self.layered.waiter(batch)

    def step_done(self, batch: list[tuple[Sequence, int]]) -> set[Sequence]:
        return self.layered.step_done(batch)

    def on_preempt(self, seq: Sequence) -> None:
        self.layered.drop(seq, policy.PREEMPTED)

    def abandon_taken(self, handles: list, block_ids: list[int]) -> None:
        """Hold `block_ids` (the sequence's table is about to be released) until `handles` are done with them."""
        if not handles:
            return
        self.abandoned.append(AbandonedRead(handles, list(block_ids)))
        for block_id in block_ids:
            self.engine.block_manager.take(block_id)

    # ---- each step: progress of reads, leases past their time
    def poll(self) -> None:
        now = self.clock()
        if now - self._last_expiry_check > 1.0:
            self.leases.expire(now)
            self._last_expiry_check = now
        for load in list(self.loads):
            self._advance(load)
        self.layered.advance_all()
        if self.abandoned:
            self._reap_abandoned()

    def _advance(self, load: PendingLoad) -> None:
        """Take a read as far as it can go now. Over shared memory UCX copies inside the post, so the bytes
        are usually there at the first poll, and the epoch read-back (a few bytes) right after its post."""
        while True:
            state = self.nixl.poll(load.handle)
            if state == IN_PROGRESS:
                if self.clock() > load.gives_up_at:
                    self._fallback(load, policy.PEER_UNREACHABLE, in_flight=True)
                return
            self.nixl.release(load.handle)
            if state != DONE:
                self._fallback(load, policy.READ_FAILED, in_flight=False)
            elif not load.reading_epochs:
                if self._start_epoch_check(load):
                    continue
            elif self.nixl.scratch_epochs(load.local_ids) != self._expected_epochs(load):
                self._fallback(load, policy.EPOCH_MISMATCH, in_flight=False)
            else:
                self._complete(load)
            return

    @staticmethod
    def _expected_epochs(load: PendingLoad) -> list[int]:
        return load.seq.remote.block_epochs[load.decision.load_from_block:load.decision.load_to_block]

    def _start_epoch_check(self, load: PendingLoad) -> bool:
        """The blocks arrived; read their epochs again to prove the peer did not let them go meanwhile."""
        try:
            remote = load.seq.remote
            load.handle = self.nixl.start_epoch_read(remote.peer_engine_id, load.remote_ids, load.local_ids,
                                                     remote.tier)
        except Exception:
            log.warning("epoch read-back failed to start", exc_info=True)
            self._fallback(load, policy.READ_FAILED, in_flight=False)
            return False
        load.reading_epochs = True
        return True

    def _complete(self, load: PendingLoad) -> None:
        self.loads.remove(load)
        seq, decision = load.seq, load.decision
        first, last = decision.load_from_block, decision.load_to_block
        elapsed = time.perf_counter() - load.started
        seq.num_computed_tokens = len(seq) if decision.whole_prompt else last * self.block_size
        seq.num_remote_tokens = seq.num_computed_tokens - first * self.block_size
        self.count_read(seq, elapsed, min(self.engine.step_seconds - load.steps_before, elapsed),
                         len(load.local_ids))
        self.engine.finish_loading(seq)
        if decision.whole_prompt:
            self.engine.append_token(seq, seq.remote.first_token_id)

    def count_read(self, seq: Sequence, elapsed: float, steps: float, num_blocks: int) -> None:
        """A read verified and taken: its time, bytes and tier, on the sequence and in the connector's stats."""
        nbytes = num_blocks * self.engine.kv_cache.layout.block_bytes
        seq.timing.kv_read_s += elapsed
        seq.timing.kv_read_step_s += steps
        seq.timing.kv_read_bytes += nbytes
        seq.reuse_outcome = policy.REUSED
        seq.kv_tier = seq.remote.tier
        stats = self.stats
        stats.kv_reads += 1
        stats.kv_read_seconds += elapsed
        stats.kv_read_step_seconds += steps
        stats.kv_read_bytes += nbytes
        stats.reads_by_tier[seq.kv_tier] += 1
        stats.read_bytes_by_tier[seq.kv_tier] += nbytes
        stats.read_seconds_by_tier[seq.kv_tier] += elapsed
        stats.read_seconds.observe(elapsed)
        stats.read_bytes.observe(nbytes)

    def _fallback(self, load: PendingLoad, reason: str, in_flight: bool) -> None:
        """Reuse failed: recompute from the local prefix-cache hit. A read still in flight keeps its target
        blocks (they pass to an AbandonedRead) and the sequence gets fresh ones, so a late write lands nowhere."""
        self.loads.remove(load)
        seq = load.seq
        self.decline(seq, reason)
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        if in_flight:
            self.abandoned.append(AbandonedRead([load.handle], list(load.local_ids)))
            first, last = load.decision.load_from_block, load.decision.load_to_block
            if blocks.num_free_blocks < last - first:
                seq.block_table = seq.block_table[:first] + seq.block_table[last:]
                scheduler.finish_loading(seq)
                scheduler.preempt(seq)
                return
            seq.block_table[first:last] = [blocks.allocate_new() for _ in range(last - first)]
        scheduler.finish_loading(seq)

    def on_abort(self, seq: Sequence) -> None:
        for load in [load for load in self.loads if load.seq is seq]:
            self.loads.remove(load)
            self.abandon_taken([load.handle], load.local_ids)
        self.layered.drop(seq)

    def _reap_abandoned(self) -> None:
        for read in list(self.abandoned):
            if any(self.nixl.poll(handle) == IN_PROGRESS for handle in read.handles):
                continue
            for handle in read.handles:
                self.nixl.release(handle)
            self.engine.block_manager.release_all(read.block_ids)
            self.abandoned.remove(read)

    # ---- finish: retention
    def on_finish(self, seq: Sequence) -> None:
        """Lease the finished sequence's blocks. D keeps its full blocks for the next turn's prefill; P pins
        every prompt block, the partial last one included (hashed over its tokens), with its sampled token,
        so D can start decoding without recomputing the prompt's tail."""
        spec = seq.retain
        if spec is None:
            return
        full = seq.num_computed_tokens // self.block_size
        blocks, hashes = seq.block_table[:full], seq.full_block_hashes(self.block_size)[:full]
        tokens = full * self.block_size
        first_token = None
        if spec.release_after_read:
            first_token = seq.output_token_ids[0] if seq.num_output_tokens else None
            tail = seq.token_ids[full * self.block_size:seq.num_computed_tokens]
            if tail:
                blocks = seq.block_table[:full + 1]
                hashes = hashes + [chain_hash(hashes[-1] if hashes else seq.hash_seed, tail)]
                tokens = seq.num_computed_tokens
        lease = self.leases.retain(blocks, hashes, tokens, spec.conversation_key, spec.ttl_s,
                                   spec.release_after_read, first_token, spec.covered)
        if lease is not None:
            seq.retained = lease.to_public(self.clock())
