"""KV block allocation over one preallocated pool, with prefix caching by chained block hashes.

A block's hash chains on its parent's, so equal hashes mean equal whole prefixes; a cache hit
still compares the token ids to rule out a hash collision. Freed blocks keep their contents and
hash and are reused least-recently-freed first. Each block carries an epoch that is bumped
when the block loses its last reference and when it is handed out for new contents, so a reader
holding an old (block id, epoch) pair can tell that the block was let go (its lease ended) or
recycled, without asking its holder.
"""
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

NO_HASH = -1
HASH_MASK = 0x7FFF_FFFF_FFFF_FFFF  # non-negative, fits a signed 64-bit JSON integer


def salt_seed(cache_salt: str | None) -> int:
    """The parent of a prompt's first block hash: 0 without a salt; with one (vLLM's `cache_salt`; the router sets one
    per tenant), a seed of it, so that prompts under different salts share no cached block."""
    if not cache_salt:
        return 0
    return xxhash.xxh64_intdigest(cache_salt.encode("utf-8", "surrogatepass")) & HASH_MASK


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int | None = None,
                 known: list[int] = (), seed: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (the first `num_blocks` of them if given), the first chained
    on `seed` (salt_seed); `known` holds those of its first blocks already, which are not hashed again."""
    full = len(token_ids) // block_size if num_blocks is None else min(num_blocks, len(token_ids) // block_size)
    hashes = list(known[:full])
    first = len(hashes)
    data = np.asarray(token_ids[first * block_size:full * block_size], dtype=np.int64).tobytes()  # one conversion
    step = block_size * 8
    parent = hashes[-1] if hashes else seed
    append, digest = hashes.append, xxhash.xxh64_intdigest
    for start in range(0, (full - first) * step, step):
        parent = digest(data[start:start + step], parent) & HASH_MASK
        append(parent)
    return hashes


def chain_hash(parent: int, block_token_ids) -> int:
    return _chain(parent, np.asarray(block_token_ids, dtype=np.int64).tobytes())


def _chain(parent: int, block_bytes: bytes) -> int:
    """A block's hash chained on its parent's: xxh64 of its token ids (int64 bytes), seeded with the parent's."""
    return xxhash.xxh64_intdigest(block_bytes, parent) & HASH_MASK


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = field(default=())


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Free blocks that still hold a cached prefix, kept as a count: /metrics reads it from another thread, where
        # walking free_block_ids while the engine changes it raised "mutated during iteration"
        self.num_cached_free_blocks = 0
        self.epochs = np.zeros(num_blocks, dtype=np.int64)
        # told of each cached full block before it gets new contents (block id, hash, tokens): the prefix cache's
        # host tier (prefix_host.py) keeps a copy
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def cached_prefix(self, token_ids: list[int], hashes: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `token_ids` (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for i, h in enumerate(hashes):
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            if self.blocks[block_id].token_ids != chunk:
                break
            hit.append(block_id)
        return hit

    def take(self, block_id: int) -> None:
        """Add a reference to an existing (possibly free but cached) block."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
            self.num_cached_free_blocks -= block.hash != NO_HASH
        block.ref_count += 1

    def allocate_new(self, after: int | None = None) -> int:
        """Hand out a block for new contents: the one right after block `after` if it is free and holds no cached
        KV (a growing sequence's blocks then stay one run, which attention reads in place and NIXL moves as one
        piece; a cached one is left to the least-recently-freed order, or another conversation's history next to
        ours would go first), else the least recently freed."""
        following = None if after is None else after + 1
        if following in self.free_block_ids and self.blocks[following].hash == NO_HASH:
            block_id = following
            del self.free_block_ids[block_id]
        else:
            block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        self.num_cached_free_blocks -= block.hash != NO_HASH
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
            if self.on_evict is not None:
                self.on_evict(block_id, block.hash, block.token_ids)
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        self.epochs[block_id] += 1
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            self.epochs[block_id] += 1
            if not self.enable_prefix_caching and block.hash != NO_HASH:
                self.hash_to_block.pop(block.hash, None)
                block.hash, block.token_ids = NO_HASH, ()
            self.free_block_ids[block_id] = None
            self.num_cached_free_blocks += block.hash != NO_HASH

    def release_all(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # the tail of a sequence is the least likely to be reused
            self.release(block_id)

    def publish(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Record that `block_id` now holds the KV of `token_ids` (a full, computed block)."""
        block = self.blocks[block_id]
        if block.hash == block_hash:
            return
        if block.ref_count == 0:  # a free block named again
            self.num_cached_free_blocks += (block_hash != NO_HASH) - (block.hash != NO_HASH)
        block.hash, block.token_ids = block_hash, token_ids
        if self.enable_prefix_caching:
            self.hash_to_block.setdefault(block_hash, block_id)
