"""The KV pool: one preallocated contiguous tensor per worker, registered with NIXL as one region.

Layout (block-major, so one block is one contiguous run of bytes and moves as one NIXL descriptor):
    pool[num_blocks, num_layers, 2 (key, value), block_size, num_kv_heads, head_dim]
"""
from dataclasses import asdict, dataclass

import torch

from kvturn.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class KVLayout:
    model_type: str
    dtype: str
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def for_model(cls, model_cfg: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32") -> "KVLayout":
        return cls(model_cfg.model_type, dtype, num_blocks, block_size, model_cfg.num_hidden_layers,
                   model_cfg.num_key_value_heads, model_cfg.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    def compatible_with(self, other: "KVLayout") -> list[str]:
        """Fields that differ, other than the pool size (peers may have pools of different sizes)."""
        mine, theirs = asdict(self), asdict(other)
        return [k for k in mine if k != "num_blocks" and mine[k] != theirs[k]]


class KVCache:
    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.pool = torch.zeros(layout.num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                                layout.head_dim, dtype=DTYPES[layout.dtype])

    @property
    def base_address(self) -> int:
        return self.pool.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
