"""The KV pool: one preallocated contiguous tensor per worker, registered with NIXL as one region.

Layout (layer-major):
    pool[num_layers, 2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]
One layer's keys (or values) of a run of consecutive blocks are one contiguous run of bytes: attention reads a
sequence's context in place, a view per run (model/attention.py), and a NIXL read moves a run of blocks as one
descriptor per layer and key/value (kv_transfer/nixl_agent.py), as vLLM registers its per-layer caches.
Whatever indexes blocks (a copy between two caches of one layout, a NIXL descriptor of a run of blocks) goes through
`block_index` and `run_regions`, so a change of layout changes them here only.
"""
from dataclasses import asdict, dataclass, replace

import torch

from kvturn.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYER_MAJOR = "layer-major"


@dataclass(frozen=True, slots=True)
class KVLayout:
    model_type: str
    dtype: str
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    order: str  # how the pool's dimensions are nested (LAYER_MAJOR); peers must agree

    @classmethod
    def for_model(cls, model_cfg: ModelConfig, num_blocks: int, block_size: int, dtype: str = "float32") -> "KVLayout":
        return cls(model_cfg.model_type, dtype, num_blocks, block_size, model_cfg.num_hidden_layers,
                   model_cfg.num_key_value_heads, model_cfg.head_dim, LAYER_MAJOR)

    @property
    def slot_bytes(self) -> int:
        """One block's keys (or values) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize

    @property
    def block_bytes(self) -> int:
        """One block's keys and values of all layers."""
        return self.num_layers * 2 * self.slot_bytes

    def extents(self, first_block: int, num_blocks: int) -> list[tuple[int, int]]:
        """(byte offset, length) of each contiguous piece of blocks [first_block, first_block + num_blocks) in the
        pool: one per layer and key/value."""
        plane = self.num_blocks * self.slot_bytes
        length = num_blocks * self.slot_bytes
        return [(plane * i + first_block * self.slot_bytes, length) for i in range(self.num_layers * 2)]

    def run_regions(self, base_address: int, first_block: int, count: int) -> list[tuple[int, int]]:
        """(address, bytes) of each contiguous piece of memory holding `count` blocks from `first_block` of a cache
        of this layout at `base_address` (ours, or a peer's)."""
        return [(base_address + offset, length) for offset, length in self.extents(first_block, count)]

    def compatible_with(self, other: "KVLayout") -> list[str]:
        """Fields that differ, other than the pool size (peers may have pools of different sizes)."""
        mine, theirs = asdict(self), asdict(other)
        return [k for k in mine if k != "num_blocks" and mine[k] != theirs[k]]


class KVCache:
    def __init__(self, layout: KVLayout):
        self.layout = layout
        self.pool = torch.zeros(layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads,
                                layout.head_dim, dtype=DTYPES[layout.dtype])

    def resized(self, num_blocks: int) -> "KVCache":
        """Another cache of this one's layout with `num_blocks` blocks (the host tier of retained blocks)."""
        return KVCache(replace(self.layout, num_blocks=num_blocks))

    @staticmethod
    def block_index(block_ids: list[int]) -> tuple:
        """The index of these blocks in `pool`, whole (every layer, key and value)."""
        return slice(None), slice(None), torch.tensor(block_ids, dtype=torch.int64)

    def copy_blocks(self, source: "KVCache", source_ids: list[int], target_ids: list[int]) -> None:
        """Copy whole blocks of `source` (a cache of the same layout, any size) into blocks of this one."""
        self.pool[self.block_index(target_ids)] = source.pool[source.block_index(source_ids)]

    def run_regions(self, first_block: int, count: int) -> list[tuple[int, int]]:
        return self.layout.run_regions(self.base_address, first_block, count)

    @property
    def base_address(self) -> int:
        return self.pool.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def block(self, block_id: int) -> torch.Tensor:
        """A copy of one block's keys and values, [num_layers, 2, block_size, kv_heads, head_dim] (for tests)."""
        return self.pool[:, :, block_id].clone()
