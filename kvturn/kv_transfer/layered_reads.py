"""P's reads of a peer's history posted layer by layer, so that the step computing the new prompt tokens waits for
each layer only when it reaches it: over a slow link the read and the compute overlap, and the turn costs about
max(read, compute) plus one layer's share of the smaller, instead of their sum (vLLM's NIXL connector loads layer by
layer for the same reason).

A sequence whose history is read so waits in LOADING_KV only until the first layer has arrived (the peer is alive and
the link moving), then runs. Before layer l the step's forward pass calls the `LayerWait` of its batch, which waits
(polling, at most `kv_read_layer_wait_s` a layer: the whole step waits with it) until layer l of every such read in
the batch has arrived. As soon as every layer is in, the blocks' epochs are read back; when the step
ends they are checked before anything of the step counts for the sequence. A read that failed, timed out or whose
blocks the peer recycled makes the sequence recompute, as a whole read's failure does, and its sampled token (if
the step reached its last prompt token) is dropped with its generator put back as it was.
"""
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from kvturn.engine.sequence import Sequence, Status
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.0002  # between polls of a layer not yet in: a spinning poll takes the core UCX's thread needs
LAYERS_IN_FLIGHT = 2  # one landing while the next is on the wire


@dataclass(slots=True)
class AbandonedRead:
    """A read we gave up on: its target blocks stay held until NIXL is done with every transfer of it."""
    handles: list
    block_ids: list[int]


@dataclass(slots=True)
class LayeredRead:
    seq: Sequence
    post_layer: Callable  # layer -> NIXL handle of that layer's read (KVTransferAgent.layer_reads)
    num_layers: int
    local_ids: list[int]
    remote_ids: list[int]
    decision: policy.ReuseDecision
    started: float  # perf_counter when the first layer was posted
    gives_up_at: float  # on the connector's clock
    steps_before: float  # the engine's step_seconds when the read began
    posting: dict = field(default_factory=dict)  # layer -> handle, posted and not yet seen in
    next_layer: int = 0  # the next layer to post
    arrived: set = field(default_factory=set)  # layers seen in
    arrived_at: float | None = None  # perf_counter when every layer was seen in
    epoch_handle: object = None
    failed: str | None = None  # a decline reason, once the read cannot be used
    waited_s: float = 0.0  # how long steps waited for its layers
    first_step_at: float | None = None  # perf_counter when the first step computing its tokens began
    steps_before_first: float = 0.0  # other steps' seconds between its post and its first step
    generator_state: object = None

    @property
    def in_flight(self) -> list:
        """Transfers NIXL may still be writing (a read given up on hands them and its blocks to AbandonedRead)."""
        return list(self.posting.values()) + ([self.epoch_handle] if self.epoch_handle else [])

    def read_s(self) -> float:
        return (self.arrived_at or time.perf_counter()) - self.started


def post_more(read: LayeredRead) -> None:
    """Keep LAYERS_IN_FLIGHT layers posted: posted all at once, the transfers of every layer share the link and all
    land near the end, so the compute of layer 0 would wait for nearly the whole read."""
    while read.next_layer < read.num_layers and len(read.posting) < LAYERS_IN_FLIGHT and not read.failed:
        try:
            read.posting[read.next_layer] = read.post_layer(read.next_layer)
        except Exception:
            log.warning("posting layer %d of a KV read failed", read.next_layer, exc_info=True)
            read.failed = policy.READ_FAILED
            return
        read.next_layer += 1


def advance(read: LayeredRead, nixl: KVTransferAgent, now: float) -> None:
    """Take the posted layers as far as they have got and post the next; once all are in, post the epoch read-back.
    Gives up past the read's time (the transfers still in flight are then abandoned by the connector)."""
    if read.failed:
        return
    for layer, handle in list(read.posting.items()):
        state = nixl.poll(handle)
        if state == IN_PROGRESS:
            continue
        nixl.release(handle)
        del read.posting[layer]
        if state != DONE:
            read.failed = policy.READ_FAILED
            return
        read.arrived.add(layer)
    post_more(read)
    if len(read.arrived) < read.num_layers:
        if now > read.gives_up_at and not read.failed:
            read.failed = policy.PEER_UNREACHABLE
        return
    if read.arrived_at is None:
        read.arrived_at = time.perf_counter()
        remote = read.seq.remote
        try:
            read.epoch_handle = nixl.start_epoch_read(remote.peer_engine_id, read.remote_ids, read.local_ids,
                                                      remote.tier)
        except Exception:
            read.failed = policy.READ_FAILED


def verify(read: LayeredRead, nixl: KVTransferAgent, clock) -> None:
    """Wait for the epoch read-back (a few bytes, posted when the last layer came in) and check it; sets `failed`
    unless the blocks are the ones the peer's record named."""
    while not read.failed and read.epoch_handle is not None:
        state = nixl.poll(read.epoch_handle)
        if state == IN_PROGRESS:
            if clock() > read.gives_up_at:
                read.failed = policy.PEER_UNREACHABLE
                return
            time.sleep(POLL_INTERVAL_S)
            continue
        nixl.release(read.epoch_handle)
        read.epoch_handle = None
        if state != DONE:
            read.failed = policy.READ_FAILED
            return
        first, last = read.decision.load_from_block, read.decision.load_to_block
        if nixl.scratch_epochs(read.local_ids) != read.seq.remote.block_epochs[first:last]:
            read.failed = policy.EPOCH_MISMATCH
        return
    if read.arrived_at is None and not read.failed:
        read.failed = policy.READ_FAILED  # the step ended without every layer in: it computed on missing history


@dataclass(slots=True)
class LayerWait:
    """Called by the forward pass before each layer: waits until that layer of each read in the step is in, or gives
    the read up after `layer_wait_s` (a peer that stopped mid-read must not hold every prompt of the step long)."""
    reads: list[LayeredRead]
    nixl: KVTransferAgent
    clock: object
    layer_wait_s: float
    waited_s: float = 0.0

    def __call__(self, layer: int) -> None:
        began = time.perf_counter()
        for read in self.reads:
            waited, gives_up_at = time.perf_counter(), self.clock() + self.layer_wait_s
            advance(read, self.nixl, self.clock())
            while not read.failed and layer not in read.arrived:
                if self.clock() > gives_up_at:
                    read.failed = policy.PEER_UNREACHABLE
                    break
                time.sleep(POLL_INTERVAL_S)
                advance(read, self.nixl, self.clock())
            read.waited_s += time.perf_counter() - waited
        self.waited_s += time.perf_counter() - began


class LayeredReads:
    """A connector's layered reads in flight: started at admission, waited for by the step's forward pass, verified
    or given up on when the step ends. The connector (connector.py) keeps the stats, declines and abandoned reads."""

    def __init__(self, connector):
        self.connector = connector
        self.reads: list[LayeredRead] = []

    def start(self, seq: Sequence, decision: policy.ReuseDecision) -> None:
        """Post the first layers of the read and let the sequence run: its step waits for each layer as it gets
        there, and counts nothing before step_done has verified the read."""
        connector = self.connector
        remote, first, last = seq.remote, decision.load_from_block, decision.load_to_block
        local_ids, remote_ids = seq.block_table[first:last], remote.block_ids[first:last]
        try:
            post_layer = connector.nixl.layer_reads(remote.peer_engine_id, remote_ids, local_ids, remote.tier)
            started = time.perf_counter()
            first_layer = post_layer(0)
        except Exception:
            log.warning("starting a KV read from %s failed", remote.peer_engine_id, exc_info=True)
            connector.decline(seq, policy.READ_FAILED)
            return
        read = LayeredRead(seq, post_layer, connector.engine.kv_cache.layout.num_layers, local_ids, remote_ids,
                           decision, started, connector.clock() + connector.config.kv_read_timeout_s,
                           connector.engine.step_seconds, posting={0: first_layer}, next_layer=1)
        post_more(read)  # a later layer failing to post: the read recomputes when its step ends
        self.reads.append(read)
        seq.num_computed_tokens = last * connector.block_size
        seq.status = Status.LOADING_KV  # until its first layer is in

    def advance_all(self) -> None:
        """Between steps: keep every read moving (the next layers posted as the earlier land), let a sequence whose
        first layer is in run, and give up a read that failed before its sequence ran."""
        now = self.connector.clock()
        for read in list(self.reads):
            advance(read, self.connector.nixl, now)
            if read.seq.status is not Status.LOADING_KV:
                continue  # it ran: step_done decides, after the step it is in
            if read.failed:
                self.reads.remove(read)
                self._fall_back(read)
            elif 0 in read.arrived:
                self.connector.engine.scheduler.finish_loading(read.seq)

    def waiter(self, batch: list[tuple[Sequence, int]]) -> LayerWait | None:
        """What the step's forward pass calls before each layer, when the step computes a layered read's tokens."""
        if not self.reads:
            return None
        in_step = {id(seq) for seq, _ in batch}
        reads = [read for read in self.reads if id(read.seq) in in_step]
        step_seconds, now = self.connector.engine.step_seconds, time.perf_counter()
        for read in reads:
            if read.first_step_at is None:
                read.first_step_at = now
                read.steps_before_first = min(step_seconds - read.steps_before, now - read.started)
            if read.seq.generator is not None:
                read.generator_state = read.seq.generator.get_state()  # put back if the read fails
        return LayerWait(reads, self.connector.nixl, self.connector.clock,
                         self.connector.config.kv_read_layer_wait_s) if reads else None

    def step_done(self, batch: list[tuple[Sequence, int]]) -> set[Sequence]:
        """After a step's forward pass: verify the layered reads it computed on. Returns the sequences whose read
        failed: nothing of this step counts for them, they recompute from their local prefix-cache hit."""
        if not self.reads:
            return set()
        nixl, clock = self.connector.nixl, self.connector.clock
        in_step, rejected = {id(seq) for seq, _ in batch}, set()
        for read in list(self.reads):
            if id(read.seq) in in_step:
                verify(read, nixl, clock)
            else:
                advance(read, nixl, clock())
                if not read.failed:
                    continue  # its sequence computes in a later step
            self.reads.remove(read)
            if read.failed:
                rejected.add(read.seq)
                self._fall_back(read)
            else:
                self._complete(read)
        return rejected

    def _complete(self, read: LayeredRead) -> None:
        seq, first, last = read.seq, read.decision.load_from_block, read.decision.load_to_block
        elapsed = read.read_s()
        seq.num_remote_tokens = (last - first) * self.connector.block_size
        seq.timing.kv_read_hidden_s += max(elapsed - (read.first_step_at - read.started) - read.waited_s, 0.0)
        self.connector.count_read(seq, elapsed, read.steps_before_first, len(read.local_ids))

    def _fall_back(self, read: LayeredRead) -> None:
        """Back to the local prefix-cache hit; blocks NIXL may still be writing are swapped for fresh ones (or, with
        none free, the sequence is preempted)."""
        connector = self.connector
        seq, first, last = read.seq, read.decision.load_from_block, read.decision.load_to_block
        connector.decline(seq, read.failed)
        if seq.status is Status.LOADING_KV:
            connector.engine.scheduler.finish_loading(seq)
        if read.generator_state is not None:
            seq.generator.set_state(read.generator_state)
        seq.num_computed_tokens = first * connector.block_size
        if not read.in_flight:
            return
        connector.abandoned.append(AbandonedRead(read.in_flight, list(read.local_ids)))
        blocks = connector.engine.block_manager
        if blocks.num_free_blocks < last - first:
            seq.block_table = seq.block_table[:first] + seq.block_table[last:]
            connector.engine.scheduler.preempt(seq)
            return
        seq.block_table[first:last] = [blocks.allocate_new() for _ in range(last - first)]

    def drop(self, seq: Sequence, reason: str | None = None) -> None:
        """`seq` is preempted or aborted: its read is given up (declined for `reason`); blocks NIXL may still write
        stay held until it is done."""
        for read in [read for read in self.reads if read.seq is seq]:
            self.reads.remove(read)
            if reason:
                self.connector.decline(seq, reason)
            self.connector.abandon_taken(read.in_flight, read.local_ids)
