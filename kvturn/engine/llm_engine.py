"""The engine: admits requests, runs scheduled batches, loads remote KV, retains finished KV.

Everything here runs on one thread (see async_engine.py); other threads talk to it through
`call_soon`. Reading a peer's blocks is asynchronous: the sequence waits in LOADING_KV while
other sequences keep running, then its blocks' epochs are read back to prove they were not
recycled during the read.
"""
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

from kvturn.config import EngineConfig
from kvturn.engine.block_manager import BlockManager, chain_hash
from kvturn.engine.kv_cache import KVCache
from kvturn.engine.model_runner import ModelRunner
from kvturn.engine.scheduler import Scheduler, reusable_blocks
from kvturn.engine.sequence import Sequence, Status
from kvturn.engine.stats import EngineStats
from kvturn.model.transformer import CausalLM
from kvturn.transfer import reuse_policy
from kvturn.transfer.leases import LeaseTable
from kvturn.transfer.nixl_agent import DONE, IN_PROGRESS, KVTransferAgent

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    seq: Sequence | None = None  # set when finished: counts, timing, retention


@dataclass(slots=True)
class PendingLoad:
    seq: Sequence
    handle: object
    local_ids: list[int]
    remote_ids: list[int]
    started: float
    reading_epochs: bool = False
    block_range: tuple[int, int] = (0, 0)
    whole_prompt: bool = False  # the prompt's every block, then P's first token


@dataclass(slots=True)
class AbandonedRead:
    """A read we gave up on: its target blocks stay held until NIXL is done with them."""
    handle: object
    block_ids: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig, emit: Callable[[RequestOutput], None],
                 detokenize: Callable[[list[int]], str], eos_token_ids: set[int], with_transfer: bool = False):
        self.config = config
        model_cfg = model.config
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        bytes_per_block = (model_cfg.num_hidden_layers * 2 * config.block_size * model_cfg.num_key_value_heads
                           * model_cfg.head_dim * 4)
        num_blocks = config.num_kv_blocks or max(config.kv_cache_mb * 2**20 // bytes_per_block, 1)
        self.kv_cache = KVCache(model_cfg, num_blocks, config.block_size, config.dtype)
        if self.max_model_len > num_blocks * config.block_size:
            # One sequence must always fit the pool, or preempting it for its own growth would never end.
            log.warning("max_model_len %d exceeds the KV pool (%d tokens); capping it", self.max_model_len,
                        num_blocks * config.block_size)
            self.max_model_len = num_blocks * config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        budget_blocks = (config.retained_kv_budget_mb * 2**20 // self.kv_cache.layout.block_bytes
                         if config.retained_kv_budget_mb is not None else None)
        self.leases = LeaseTable(self.block_manager, budget_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.leases.reclaim_oldest)
        self.runner = ModelRunner(model, self.kv_cache)
        self.transfer = KVTransferAgent(self.kv_cache, self.block_manager.epochs) if with_transfer else None
        self.emit = emit
        self.detokenize = detokenize
        self.eos_token_ids = eos_token_ids
        self.stats = EngineStats()
        self.sequences: dict[str, Sequence] = {}
        self.loads: list[PendingLoad] = []
        self.abandoned: list[AbandonedRead] = []
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._last_expiry_check = 0.0

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def max_prompt_blocks(self) -> int:
        return self.block_manager.num_blocks

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before the next step (thread-safe)."""
        self._commands.put(fn)

    def add_request(self, seq: Sequence) -> None:
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return
        seq.aborted = True
        self._abandon_load(seq)
        self.scheduler.remove(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.abandoned)

    def run_commands(self, timeout_s: float) -> None:
        """Run queued commands, waiting up to `timeout_s` for the first one."""
        try:
            fn = self._commands.get(timeout=timeout_s) if timeout_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                fn()
            except Exception:
                log.exception("engine command failed")
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return

    def step(self) -> bool:
        """One scheduling round and forward pass; False when nothing could run."""
        now = time.time()
        if now - self._last_expiry_check > 1.0:
            self.leases.expire(now)
            self._last_expiry_check = now
        self._poll_loads()
        if self.abandoned:
            self.reap_abandoned()
        batch = self.scheduler.schedule(self._on_admit)
        if not batch:
            return False
        started = time.perf_counter()
        for seq, _ in batch:
            if seq.timing.first_scheduled is None:
                seq.timing.first_scheduled = started
        sampled = self.runner.run(batch)
        elapsed = time.perf_counter() - started
        for seq, num_new in batch:
            if seq.num_output_tokens == 0:
                seq.timing.prefill_compute_s += elapsed
            seq.num_computed_tokens += num_new
            self._publish_full_blocks(seq)
        for seq, token_id in sampled.items():
            self._append_token(seq, token_id)
        return True

    def _append_token(self, seq: Sequence, token_id: int) -> None:
        seq.token_ids.append(token_id)
        self.stats.generation_tokens += 1
        if seq.timing.first_token is None:
            seq.timing.first_token = time.perf_counter()
        reason = self._stop_reason(seq, token_id)
        if reason is None:
            self.emit(RequestOutput(seq.request_id, [token_id]))
            return
        self._finish(seq, reason)
        self.emit(RequestOutput(seq.request_id, [token_id], True, reason, seq))

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            return "stop"
        if params.stop and any(s in self.detokenize(seq.output_token_ids) for s in params.stop):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.retain is not None:
            self._retain(seq)
        self.scheduler.remove(seq)
        self.sequences.pop(seq.request_id, None)
        stats = self.stats
        stats.requests_finished += 1
        stats.prompt_tokens += seq.num_prompt_tokens
        stats.prompt_tokens_cached += seq.num_cached_tokens
        stats.prompt_tokens_remote += seq.num_remote_tokens
        stats.prompt_tokens_computed += seq.num_prompt_tokens - seq.num_cached_tokens - seq.num_remote_tokens

    def _retain(self, seq: Sequence) -> None:
        """Lease the finished sequence's blocks. D keeps its full blocks for the next turn's prefill; P pins
        every prompt block, the partial last one included (hashed over its tokens), with its sampled token,
        so D can start decoding without recomputing the prompt's tail."""
        full = seq.num_computed_tokens // self.block_size
        blocks, hashes, tokens = seq.block_table[:full], seq.block_hashes[:full], full * self.block_size
        first_token = None
        if seq.retain.release_after_read:
            first_token = seq.output_token_ids[0] if seq.num_output_tokens else None
            tail = seq.token_ids[full * self.block_size:seq.num_computed_tokens]
            if tail:
                blocks = seq.block_table[:full + 1]
                hashes = hashes + [chain_hash(hashes[-1] if hashes else 0, tail)]
                tokens = seq.num_computed_tokens
        lease = self.leases.retain(blocks, hashes, tokens, seq.retain.conversation_key, seq.retain.ttl_s,
                                   seq.retain.release_after_read, first_token)
        if lease is not None:
            seq.retained = lease.to_public()

    def _publish_full_blocks(self, seq: Sequence) -> None:
        """Give each newly completed block its chained hash so the prefix cache and leases can name it."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[i - 1] if i else 0
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(chain_hash(parent, tokens))
        for i in range(seq.num_published_blocks, full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            self.block_manager.publish(seq.block_table[i], seq.block_hashes[i], tokens)
        seq.num_published_blocks = max(seq.num_published_blocks, full)

    def _on_admit(self, seq: Sequence, full_hashes: list[int]) -> None:
        seq.block_hashes = list(full_hashes[:seq.num_published_blocks])
        if seq.remote is None:
            return
        remote, local_hit = seq.remote, seq.num_published_blocks
        if remote.first_token_id is not None and self._start_whole_prompt_load(seq, local_hit, full_hashes):
            return
        threshold = self.config.kv_recompute_threshold_tokens if remote.min_reuse_tokens is None \
            else remote.min_reuse_tokens
        reusable = full_hashes[:reusable_blocks(len(seq), self.block_size)]
        decision = reuse_policy.decide_reuse(reusable, remote.block_hashes, local_hit, self.block_size,
                                             threshold, remote.expiry_time,
                                             time.time(), self.config.kv_expiry_margin_s)
        if not decision.loads:
            self._decline(seq, decision.reason)
        elif self.transfer is None or remote.peer_engine_id not in self.transfer.peers:
            self._decline(seq, reuse_policy.PEER_UNREACHABLE)
        elif not self._start_read(seq, decision.load_from_block, decision.load_to_block, whole_prompt=False):
            self._decline(seq, reuse_policy.READ_FAILED)

    def _start_whole_prompt_load(self, seq: Sequence, local_hit: int, full_hashes: list[int]) -> bool:
        """P->D with P's first token: read every prompt block D lacks, the partial last one included, and skip
        computing the prompt's tail. Only when all block hashes match and sampling does not depend on a seeded
        generator that P and D would advance differently."""
        remote, params = seq.remote, seq.params
        if remote.num_tokens != len(seq) or (params.seed is not None and not params.greedy):
            return False
        if remote.expiry_time - time.time() < self.config.kv_expiry_margin_s or self.transfer is None \
                or remote.peer_engine_id not in self.transfer.peers:
            return False
        hashes = list(full_hashes)
        tail = seq.token_ids[len(hashes) * self.block_size:]
        if tail:
            hashes.append(chain_hash(hashes[-1] if hashes else 0, tail))
        if remote.block_hashes != hashes or len(seq.block_table) != len(hashes):
            return False
        return self._start_read(seq, local_hit, len(hashes), whole_prompt=True)

    def _start_read(self, seq: Sequence, first: int, last: int, whole_prompt: bool) -> bool:
        """Start reading the peer's blocks [first, last) into ours; the sequence waits in LOADING_KV."""
        remote = seq.remote
        local_ids, remote_ids = seq.block_table[first:last], remote.block_ids[first:last]
        try:
            handle = self.transfer.start_block_read(remote.peer_engine_id, remote_ids, local_ids)
        except Exception:
            log.warning("starting a KV read from %s failed", remote.peer_engine_id, exc_info=True)
            return False
        seq.status = Status.LOADING_KV
        self.loads.append(PendingLoad(seq, handle, local_ids, remote_ids, time.perf_counter(),
                                      block_range=(first, last), whole_prompt=whole_prompt))
        return True

    def _decline(self, seq: Sequence, reason: str) -> None:
        seq.reuse_outcome = reason
        self.stats.reuse_declines[reason] += 1

    def _poll_loads(self) -> None:
        for load in list(self.loads):
            state = self.transfer.poll(load.handle)
            if state == IN_PROGRESS:
                if time.perf_counter() - load.started > self.config.kv_read_timeout_s:
                    self._fallback(load, reuse_policy.PEER_UNREACHABLE, in_flight=True)
                continue
            self.transfer.release(load.handle)
            if state != DONE:
                self._fallback(load, reuse_policy.READ_FAILED, in_flight=False)
            elif not load.reading_epochs:
                self._start_epoch_check(load)
            elif self.transfer.scratch_epochs(load.local_ids) != load.seq.remote.block_epochs[slice(*load.block_range)]:
                self._fallback(load, reuse_policy.EPOCH_MISMATCH, in_flight=False)
            else:
                self._complete_load(load)

    def _start_epoch_check(self, load: PendingLoad) -> None:
        """The blocks arrived; read their epochs again to prove the peer did not recycle them meanwhile."""
        try:
            load.handle = self.transfer.start_epoch_read(load.seq.remote.peer_engine_id, load.remote_ids,
                                                         load.local_ids)
            load.reading_epochs = True
        except Exception:
            log.warning("epoch read-back failed to start", exc_info=True)
            self._fallback(load, reuse_policy.READ_FAILED, in_flight=False)

    def _complete_load(self, load: PendingLoad) -> None:
        self.loads.remove(load)
        seq = load.seq
        first, last = load.block_range
        elapsed = time.perf_counter() - load.started
        full = min(last, len(seq) // self.block_size)
        seq.block_hashes = seq.block_hashes[:first] + seq.remote.block_hashes[first:full]
        seq.num_computed_tokens = len(seq) if load.whole_prompt else last * self.block_size
        seq.num_remote_tokens = seq.num_computed_tokens - first * self.block_size
        seq.timing.kv_read_s += elapsed
        seq.timing.kv_read_bytes += len(load.local_ids) * self.kv_cache.layout.block_bytes
        self._publish_full_blocks(seq)
        seq.reuse_outcome = reuse_policy.REUSED
        self.stats.kv_reads += 1
        self.stats.kv_read_seconds += elapsed
        self.stats.kv_read_bytes += len(load.local_ids) * self.kv_cache.layout.block_bytes
        self.scheduler.finish_loading(seq)
        if load.whole_prompt:
            self._append_token(seq, seq.remote.first_token_id)

    def _fallback(self, load: PendingLoad, reason: str, in_flight: bool) -> None:
        """Reuse failed: recompute from the local prefix-cache hit. A read still in flight keeps its target
        blocks (they pass to an AbandonedRead) and the sequence gets fresh ones, so a late write lands nowhere."""
        self.loads.remove(load)
        seq = load.seq
        self._decline(seq, reason)
        if in_flight:
            self.abandoned.append(AbandonedRead(load.handle, list(load.local_ids)))
            first, last = load.block_range
            if self.block_manager.num_free_blocks < last - first:
                seq.block_table = seq.block_table[:first] + seq.block_table[last:]
                self.scheduler.finish_loading(seq)
                self.scheduler.preempt(seq)
                return
            seq.block_table[first:last] = [self.block_manager.allocate_new() for _ in range(last - first)]
        self.scheduler.finish_loading(seq)

    def _abandon_load(self, seq: Sequence) -> None:
        for load in list(self.loads):
            if load.seq is seq:
                self.loads.remove(load)
                self.abandoned.append(AbandonedRead(load.handle, list(load.local_ids)))
                for block_id in load.local_ids:
                    self.block_manager.take(block_id)

    def reap_abandoned(self) -> None:
        for read in list(self.abandoned):
            if self.transfer.poll(read.handle) == IN_PROGRESS:
                continue
            self.transfer.release(read.handle)
            self.block_manager.release_all(read.block_ids)
            self.abandoned.remove(read)
