"""The prefix cache's host tier: full blocks the pool evicts are kept in a host-memory region, keyed by their chained
hash, and a later prompt whose pool hits end where this region's hits begin gets them copied back into its blocks.

The region is a `KVCache` of the pool's layout with its own slots (`KVCache.resized`, as D's host tier of leases),
and each slot carries an epoch bumped when it is handed out and when it is let go, as the pool's blocks do: a
restore checks that the slot it looked up still holds that epoch (the pool blocks a prompt is given may evict
others into this region, recycling the oldest slots) and the chained hash at its position, else the prompt
computes the rest. Hashes are the pool's, salted per tenant. The slots are least recently used first out; a slot
stays after a restore (inclusive), so a block evicted again costs no copy. The region's memory is registered
with NIXL by the connector, as D's host tier is. Used on the engine thread only.
"""
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvturn.engine.kv_cache import KVCache

HASH_MISMATCH, EPOCH_MISMATCH = "hash_mismatch", "epoch_mismatch"


@dataclass(frozen=True, slots=True)
class HostHit:
    """A block of a prompt found in the region: its slot and the slot's epoch when it was found."""
    slot: int
    epoch: int
    block_hash: int


@dataclass(slots=True)
class PrefixHostStats:
    blocks_stored: int = 0  # evicted pool blocks copied into the region
    blocks_restored: int = 0  # copied back into the pool for a prompt
    blocks_dropped: int = 0  # let go to make room (least recently used)
    hit_lookups: int = 0  # prompts that found blocks here
    restore_failures: dict = field(default_factory=lambda: {HASH_MISMATCH: 0, EPOCH_MISMATCH: 0})  # reason -> count


class PrefixHostTier:
    def __init__(self, pool: KVCache, num_slots: int):
        self.pool = pool
        self.cache = pool.resized(num_slots)
        self.epochs = np.zeros(num_slots, dtype=np.int64)
        self.slot_hash = [None] * num_slots
        self.slot_tokens: list[tuple[int, ...]] = [()] * num_slots
        self.hash_to_slot: OrderedDict[int, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest ids first
        self.stats = PrefixHostStats()

    @property
    def num_slots(self) -> int:
        return self.cache.layout.num_blocks

    @property
    def num_held(self) -> int:
        return len(self.hash_to_slot)

    @property
    def bytes_held(self) -> int:
        return self.num_held * self.cache.layout.block_bytes

    def keep(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """The pool is about to give `block_id`, a cached full block, new contents: copy its KV (all layers) here."""
        if block_hash in self.hash_to_slot:
            self.hash_to_slot.move_to_end(block_hash)
            return
        slot = self._take_slot()
        self.cache.copy_blocks(self.pool, [block_id], [slot])
        self.slot_hash[slot], self.slot_tokens[slot] = block_hash, token_ids
        self.hash_to_slot[block_hash] = slot
        self.stats.blocks_stored += 1

    def lookup(self, token_ids: list[int], hashes: list[int], start: int, block_size: int) -> list[HostHit]:
        """The consecutive blocks of a prompt held here from block `start` on (hash and tokens both match), marked
        most recently used so that the pool blocks given to the prompt evict others into the region first."""
        hits = []
        for i in range(start, len(hashes)):
            slot = self.hash_to_slot.get(hashes[i])
            if slot is None or self.slot_tokens[slot] != tuple(token_ids[i * block_size:(i + 1) * block_size]):
                break
            self.hash_to_slot.move_to_end(hashes[i])
            hits.append(HostHit(slot, int(self.epochs[slot]), hashes[i]))
        self.stats.hit_lookups += bool(hits)
        return hits

    def restore(self, hits: list[HostHit], block_ids: list[int]) -> int:
        """Copy the leading hits still valid (slot epoch as found, and still holding the hash the prompt expects at
        that position) into pool blocks `block_ids`; returns how many were copied."""
        valid = 0
        for hit in hits:
            if int(self.epochs[hit.slot]) != hit.epoch:
                self.stats.restore_failures[EPOCH_MISMATCH] += 1
                break
            if self.slot_hash[hit.slot] != hit.block_hash:
                self.stats.restore_failures[HASH_MISMATCH] += 1
                break
            valid += 1
        if valid:
            self.pool.copy_blocks(self.cache, [hit.slot for hit in hits[:valid]], block_ids[:valid])
            self.stats.blocks_restored += valid
        return valid

    def _take_slot(self) -> int:
        """A free slot, or the least recently used one, let go (its epoch bumped for anyone holding it)."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.hash_to_slot.popitem(last=False)
            self.slot_hash[slot], self.slot_tokens[slot] = None, ()
            self.epochs[slot] += 1
            self.stats.blocks_dropped += 1
        self.epochs[slot] += 1
        return slot
