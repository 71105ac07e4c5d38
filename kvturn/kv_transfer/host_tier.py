"""The host tier: a second, larger region of blocks for retained KV, outside the engine's pool.

Its blocks have the pool's layout (a `KVCache` of the pool's layout, resized) and their own epochs, bumped when a
block is handed out and when it is let go, exactly as the pool's are: a reader holding an old (block id, epoch) pair
of this tier can tell the blocks were recycled. Both arrays are registered with NIXL (nixl_agent.py), so a peer
reads a lease here as it would in the pool. On a GPU build this region would be pinned host memory; here the pool is
in DRAM too, and the tier is plain DRAM. Used on the engine thread only.
"""
import numpy as np

from kvturn.engine.kv_cache import KVCache
from kvturn.kv_transfer.params import HOST, POOL, TIERS  # noqa: F401 (the tiers, named where the wire names them)


class HostTier:
    def __init__(self, pool: KVCache, num_blocks: int):
        self.cache = pool.resized(num_blocks)
        self.epochs = np.zeros(num_blocks, dtype=np.int64)
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks

    @property
    def num_blocks(self) -> int:
        return self.cache.layout.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def allocate(self, count: int) -> list[int] | None:
        """`count` free blocks: the first run of consecutive free ids long enough if there is one (a run moves as one
        NIXL descriptor per layer and key/value, where scattered blocks read at a quarter of the speed), else the
        lowest free ids; None if fewer are free."""
        if count > self._num_free:
            return None
        block_ids = self._first_run(count) or np.flatnonzero(self._is_free)[:count].tolist()
        self._is_free[block_ids] = False
        self._num_free -= count
        self.epochs[block_ids] += 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        self.epochs[block_ids] += 1
        self._is_free[block_ids] = True
        self._num_free += len(block_ids)

    def _first_run(self, count: int) -> list[int] | None:
        edges = np.flatnonzero(np.diff(np.concatenate(([0], self._is_free.view(np.int8), [0]))))
        starts, ends = edges[::2], edges[1::2]  # each run of free blocks: [start, end)
        long_enough = np.flatnonzero(ends - starts >= count)
        if not len(long_enough):
            return None
        start = int(starts[long_enough[0]])
        return list(range(start, start + count))
