"""Tunable settings, each with its unit in its name."""
from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_mb: int = 512
    num_kv_blocks: int | None = None  # overrides kv_cache_mb when set
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    kv_recompute_threshold_tokens: int = 64
    kv_read_timeout_s: float = 5.0
    kv_expiry_margin_s: float = 5.0  # decline a remote read whose lease ends within this margin
    decoder_kv_blocks_ttl_s: float = 480.0
    kv_pin_timeout_s: float = 30.0
    retained_kv_budget_mb: int | None = None
    dtype: str = "float32"
