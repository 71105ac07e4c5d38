"""P's reads of a peer's history posted layer by layer, so that the step computing the new prompt tokens waits for
each layer only when it reaches it: over a slow link the read and the compute overlap, and the turn costs about
max(read, compute) plus one layer's share of the smaller, instead of their sum (vLLM's NIXL connector loads layer by
layer for the same reason).

A sequence whose history is read so runs at once instead of waiting in LOADING_KV. Before layer l the step's forward
pass calls the `LayerWait` of its batch, which waits (polling, bounded by the read's timeout) until layer l of every
such read in the batch has arrived. As soon as every layer is in, the blocks' epochs are read back; when the step
ends they are checked before anything of the step counts for the sequence. A read that failed, timed out or whose
blocks the peer recycled makes the sequence recompute, as a whole read's failure does, and its sampled token (if
the step reached its last prompt token) is dropped with its generator put back as it was.
"""
import time
from dataclasses import dataclass, field

from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer import policy
from kvturn.kv_transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent

POLL_INTERVAL_S = 0.0002  # between polls of a layer not yet in: a spinning poll takes the core UCX's thread needs


@dataclass(slots=True)
class LayeredRead:
    seq: Sequence
    handles: list  # one per layer; None once the layer is in and its handle released
    local_ids: list[int]
    remote_ids: list[int]
    decision: policy.ReuseDecision
    started: float  # perf_counter when the first layer was posted
    gives_up_at: float  # on the connector's clock
    steps_before: float  # the engine's step_seconds when the read began
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
        return [h for h in self.handles if h is not None] + ([self.epoch_handle] if self.epoch_handle else [])

    @property
    def exposed_s(self) -> float:
        """What of the read its sequence waited for: steps before its own, then its own step's waits on layers."""
        return self.steps_before_first + self.waited_s

    def read_s(self) -> float:
        return (self.arrived_at or time.perf_counter()) - self.started


def advance(read: LayeredRead, nixl: KVTransferAgent, now: float) -> None:
    """Take every layer as far as it has got; once all are in, post the epoch read-back. Gives up past the read's
    time (the transfers still in flight are then abandoned by the connector)."""
    if read.failed:
        return
    for layer, handle in enumerate(read.handles):
        if handle is None:
            continue
        state = nixl.poll(handle)
        if state == IN_PROGRESS:
            continue
        nixl.release(handle)
        read.handles[layer] = None
        if state != DONE:
            read.failed = policy.READ_FAILED
            return
    if any(h is not None for h in read.handles):
        if now > read.gives_up_at:
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
    """Called by the forward pass before each layer: waits until that layer of each read in the step is in."""
    reads: list[LayeredRead]
    nixl: KVTransferAgent
    clock: object
    waited_s: float = 0.0
    _started: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        for read in self.reads:
            if read.first_step_at is None:
                read.first_step_at = self._started
            if read.seq.generator is not None:
                read.generator_state = read.seq.generator.get_state()

    def __call__(self, layer: int) -> None:
        began = time.perf_counter()
        for read in self.reads:
            waited = time.perf_counter()
            advance(read, self.nixl, self.clock())
            while not read.failed and read.handles[layer] is not None:
                time.sleep(POLL_INTERVAL_S)
                advance(read, self.nixl, self.clock())
            read.waited_s += time.perf_counter() - waited
        self.waited_s += time.perf_counter() - began
