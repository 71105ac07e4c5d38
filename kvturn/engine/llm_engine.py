"""The engine: admits requests, runs scheduled batches, emits tokens.

Everything here runs on one thread (see async_engine.py); other threads talk to it through
`call_soon`. KV that comes from or goes to other workers is the business of a KV connector
(kvturn.kv_transfer), which the engine calls through four hooks: `on_admit`, `poll`, `on_finish`
and `on_abort`. The engine imports nothing of it.
"""
import logging
import queue
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from kvturn.config import EngineConfig
from kvturn.engine.block_manager import BlockManager
from kvturn.engine.kv_cache import KVCache, KVLayout
from kvturn.engine.model_runner import ModelRunner
from kvturn.engine.prefix_host import PrefixHostTier
from kvturn.engine.sampling import TokenLogprob
from kvturn.engine.scheduler import Scheduler
from kvturn.engine.sequence import Sequence
from kvturn.engine.stats import EngineStats
from kvturn.engine.step_history import StepHistory, step_record
from kvturn.model.transformer import CausalLM

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them


class Connector(Protocol):
    """What the engine asks of a KV connector; every call comes on the engine thread. `reclaim_for` frees retained
    blocks for a sequence short of them, before it waits or anyone is preempted."""

    def reclaim_for(self, seq: Sequence) -> bool: ...
    def on_admit(self, seq: Sequence, full_hashes: list[int]) -> None: ...
    def poll(self) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...
    def on_abort(self, seq: Sequence) -> None: ...
    def on_preempt(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...
    def layer_waiter(self, batch: list[tuple[Sequence, int]]) -> Callable[[int], None] | None: ...
    def step_done(self, batch: list[tuple[Sequence, int]]) -> set[Sequence]: ...

    @property
    def waiting_on_reads(self) -> bool: ...


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig, emit: Callable[[RequestOutput], None],
                 detokenize: Callable[[list[int]], str], eos_token_ids: set[int]):
        self.config = config
        model_cfg = model.config
        self.max_model_len = config.max_model_len or model_cfg.max_position_embeddings
        block_bytes = KVLayout.for_model(model_cfg, 1, config.block_size, config.dtype).block_bytes
        num_blocks = config.num_kv_blocks or max(config.kv_cache_mb * 2**20 // block_bytes, 1)
        self.kv_cache = KVCache(KVLayout.for_model(model_cfg, num_blocks, config.block_size, config.dtype))
        if self.max_model_len > num_blocks * config.block_size:
            # One sequence must always fit the pool, or preempting it for its own growth would never end.
            log.warning("max_model_len %d exceeds the KV pool (%d tokens); capping it", self.max_model_len,
                        num_blocks * config.block_size)
            self.max_model_len = num_blocks * config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        host_slots = config.prefix_host_mb * 2**20 // block_bytes if config.enable_prefix_caching else 0
        self.prefix_host = PrefixHostTier(self.kv_cache, host_slots) if host_slots else None
        if self.prefix_host is not None:
            self.block_manager.on_evict = self.prefix_host.keep
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self._reclaim_retained, config.prefill_pack_tokens, self.prefix_host,
                                   self._on_preempt)
        self.runner = ModelRunner(model, self.kv_cache)
        self.connector: Connector | None = None
        self.emit = emit
        self.detokenize = detokenize
        self.eos_token_ids = eos_token_ids
        self.stats = EngineStats()
        self.step_seconds = 0.0  # forward passes so far: what a read that spans some waited for (connector)
        self.steps = StepHistory(config.step_history_steps)
        self.sequences: dict[str, Sequence] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()

    def attach_connector(self, connector: Connector) -> None:
        self.connector = connector

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
        if self.connector:
            self.connector.on_abort(seq)
        self.scheduler.remove(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.connector and self.connector.has_work())

    @property
    def waiting_on_reads(self) -> bool:
        """Sequences wait for a peer's blocks: the engine loop should poll soon even with nothing to compute."""
        return bool(self.connector and self.connector.waiting_on_reads)

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

    def tick(self) -> None:
        """Housekeeping while no step runs: the connector's leases and pins still expire on time."""
        if self.connector:
            self.connector.poll()

    def step(self) -> bool:
        """One scheduling round and forward pass; False when nothing could run."""
        if self.connector:
            self.connector.poll()
        batch = self.scheduler.schedule(self._on_admit, self.connector.poll if self.connector else None)
        if not batch:
            return False
        started, started_wall, started_cpu = time.perf_counter(), time.time(), time.thread_time()
        for seq, _ in batch:
            if seq.timing.first_scheduled is None:
                seq.timing.first_scheduled = started
        # A connector reading some of the batch's history layer by layer has the forward wait for each layer, and
        # then says whose read failed: nothing of this step counts for those.
        wait = self.connector.layer_waiter(batch) if self.connector else None
        sampled = self.runner.run(batch, wait)
        rejected = self.connector.step_done(batch) if wait else set()
        elapsed = time.perf_counter() - started
        self.step_seconds += elapsed
        compute = elapsed - (wait.waited_s if wait else 0.0)  # the time the step waited for layers is the read's
        self.steps.record(step_record(batch, started_wall, compute, time.thread_time() - started_cpu))
        batch = [(seq, num_new) for seq, num_new in batch if seq not in rejected]
        prompt_tokens = sum(num_new for seq, num_new in batch if seq.num_output_tokens == 0)
        for seq, num_new in batch:
            if seq.num_output_tokens == 0:
                seq.timing.prefill_compute_s += compute
                seq.timing.prefill_shared_tokens += prompt_tokens - num_new
            seq.num_computed_tokens += num_new
            self.publish_full_blocks(seq)
        for seq, (token_id, logprob) in sampled.items():
            if seq in rejected:
                continue
            if seq.first_token_id is not None and seq.num_output_tokens == 0:
                token_id = seq.first_token_id  # the client may hold it already (see Sequence.first_token_id)
            self.append_token(seq, token_id, logprob)
        return True

    def finish_loading(self, seq: Sequence) -> None:
        """A connector filled `seq`'s blocks from a peer: name them, and let the sequence run."""
        self.publish_full_blocks(seq)
        self.scheduler.finish_loading(seq)

    def append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None = None) -> None:
        seq.token_ids.append(token_id)
        self.stats.generation_tokens += 1
        if seq.timing.first_token is None:
            seq.timing.first_token = time.perf_counter()
        logprobs = None if logprob is None else [logprob]
        reason = self._stop_reason(seq, token_id)
        if reason is None:
            self.emit(RequestOutput(seq.request_id, [token_id], logprobs=logprobs))
            return
        self._finish(seq, reason)
        self.emit(RequestOutput(seq.request_id, [token_id], True, reason, logprobs))

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
        if self.connector:
            self.connector.on_finish(seq)
        self.scheduler.remove(seq)
        self.sequences.pop(seq.request_id, None)
        stats = self.stats
        stats.requests_finished += 1
        stats.prompt_tokens += seq.num_prompt_tokens
        stats.prompt_tokens_cached += seq.num_cached_tokens
        stats.prompt_tokens_cached_host += seq.num_host_cached_tokens
        stats.prompt_tokens_remote += seq.num_remote_tokens
        stats.prompt_tokens_computed += seq.num_prompt_tokens - seq.num_cached_tokens - seq.num_remote_tokens

    def _reclaim_retained(self, seq: Sequence) -> bool:
        return bool(self.connector) and self.connector.reclaim_for(seq)

    def publish_full_blocks(self, seq: Sequence) -> None:
        """Give each newly completed block its chained hash so the prefix cache and leases can name it."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if seq.num_published_blocks >= full:
            return
        hashes = seq.full_block_hashes(self.block_size)
        for i in range(seq.num_published_blocks, full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            self.block_manager.publish(seq.block_table[i], hashes[i], tokens)
        seq.num_published_blocks = max(seq.num_published_blocks, full)

    def _on_preempt(self, seq: Sequence) -> None:
        if self.connector:
            self.connector.on_preempt(seq)

    def _on_admit(self, seq: Sequence, full_hashes: list[int]) -> None:
        if self.connector:
            self.connector.on_admit(seq, full_hashes)
