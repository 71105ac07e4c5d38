"""The host tier: a second, larger region of blocks for retained KV, outside the engine's pool.

Its blocks have the pool's layout (a `KVCache` of the pool's layout, resized) and their own epochs, bumped when a
block is handed out and when it is let go, exactly as the pool's are: a reader holding an old (block id, epoch) pair
of this tier can tell the blocks were recycled. Both arrays are registered with NIXL (nixl_agent.py), so a peer
reads a lease here as it would in the pool. On a GPU build this region would be pinned host memory; here the pool is
in DRAM too, and the tier is plain DRAM. Used on the engine thread only.
"""
from collections import deque

import numpy as np

from kvturn.engine.kv_cache import KVCache
from kvturn.kv_transfer.params import HOST, POOL, TIERS  # noqa: F401 (the tiers, named where the wire names them)


class HostTier:
    def __init__(self, pool: KVCache, num_blocks: int):
        self.cache = pool.resized(num_blocks)
        self.epochs = np.zeros(num_blocks, dtype=np.int64)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self.cache.layout.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` free blocks, in id order (a run of consecutive ids moves as one NIXL descriptor); None if fewer
        are free."""
        if count > len(self._free):
            return None
        block_ids = sorted(self._free.popleft() for _ in range(count))
        self.epochs[block_ids] += 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        self.epochs[block_ids] += 1
        self._free.extend(block_ids)
