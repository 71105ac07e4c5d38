"""One request's tokens, blocks and progress through the engine."""
import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from kvturn.engine.block_manager import block_hashes
from kvturn.engine.sampling import SamplingParams


class Status(Enum):
    WAITING = auto()
    LOADING_KV = auto()  # blocks allocated, remote KV being read into them
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class Timing:
    """Where a request's time went, in seconds (returned to clients so a benchmark can split TTFT)."""
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    tokenize_s: float = 0.0
    side_channel_s: float = 0.0  # handshake and lease lookup at the peer, before the engine sees the request
    submitted: float | None = None
    kv_read_s: float = 0.0
    kv_read_step_s: float = 0.0  # of kv_read_s, the engine's steps that ran meanwhile (a read is seen done between them)
    kv_read_hidden_s: float = 0.0  # of kv_read_s, what its own step's compute covered (a read posted layer by layer)
    prefill_compute_s: float = 0.0
    prefill_shared_tokens: int = 0  # other prompts' tokens computed in the steps of its prefill (they share the time)
    kv_read_bytes: int = 0
    host_restore_s: float = 0.0  # copying its history back from this worker's own host tier (compute on decode)
    host_restore_bytes: int = 0


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 remote=None, retain=None, hash_seed: int = 0):
        self.request_id = request_id
        self.hash_seed = hash_seed  # the parent of its first block's hash: its cache salt's (block_manager.salt_seed)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_published_blocks = 0
        self.block_hashes: list[int] = []  # chained hashes of its full blocks of tokens so far (full_block_hashes)
        self.num_cached_tokens = 0  # served from the local prefix cache
        self.num_host_cached_tokens = 0  # ...of them, copied back from its host tier (engine/prefix_host.py)
        self.num_remote_tokens = 0  # read from a peer
        self.remote = remote  # the KV connector's record of blocks to read from a peer
        self.first_token_id: int | None = None  # sampled already elsewhere (P): continue from it, do not sample
        self.reuse_outcome: str | None = None  # "reused" or a decline reason
        self.kv_tier: str | None = None  # where the history it reused lived: a peer's pool or host tier, or our own
        self.retain = retain  # the KV connector's instruction to keep the blocks after finishing
        self.retained: dict | None = None  # lease metadata, set at finish
        self.finish_reason: str | None = None
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.timing = Timing()
        self.aborted = False
        self.prompt_started = False  # some of its prompt has been in a step (the scheduler's pack limit reads it)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of its full blocks of tokens: each block is hashed once in the sequence's life (admitted
        again after a preemption, or grown by its answer, it hashes only its new blocks)."""
        if len(self.block_hashes) < len(self.token_ids) // block_size:
            self.block_hashes = block_hashes(self.token_ids, block_size, known=self.block_hashes, seed=self.hash_seed)
        return self.block_hashes

    def blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        tokens = len(self.token_ids) if num_tokens is None else num_tokens
        return (tokens + block_size - 1) // block_size
