"""Retention leases: blocks kept alive after a request finishes so a peer can read them.

D retains a finished turn's prompt + answer blocks for the next turn's prefill (readable many
times until expiry or until a newer turn of the same conversation supersedes it); P pins a
prompt's blocks until D has read them (released after the read). Leases hold block references,
so retained blocks are never recycled while leased; under memory pressure the oldest lease is
reclaimed first. Mutations happen on the engine thread; lookups come from HTTP handlers.
"""
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvturn.engine.block_manager import BlockManager


def conversation_digest(conversation_key: str) -> str:
    return hashlib.sha256(conversation_key.encode()).hexdigest()


@dataclass(slots=True)
class Lease:
    handle: str
    conversation: str  # digest of the conversation key the lease is bound to
    block_ids: list[int]
    block_hashes: list[int]
    block_epochs: list[int]
    num_tokens: int
    expiry_time: float  # wall clock, epoch seconds
    release_after_read: bool
    first_token_id: int | None = None  # P's pin: the token P sampled after the prompt

    def to_public(self) -> dict:
        return {"handle": self.handle, "block_ids": self.block_ids, "block_hashes": self.block_hashes,
                "block_epochs": self.block_epochs, "num_tokens": self.num_tokens, "expiry_time": self.expiry_time,
                "first_token_id": self.first_token_id}


class LeaseTable:
    def __init__(self, block_manager: BlockManager, max_retained_blocks: int | None = None):
        self.block_manager = block_manager
        self.max_retained_blocks = max_retained_blocks
        self._leases: OrderedDict[str, Lease] = OrderedDict()  # oldest first
        self._by_conversation: dict[str, str] = {}
        self._lock = threading.Lock()
        self.counts = {"created": 0, "expired": 0, "reclaimed": 0, "released": 0, "superseded": 0}

    def retain(self, block_ids: list[int], block_hashes: list[int], num_tokens: int, conversation_key: str,
               ttl_s: float, release_after_read: bool, first_token_id: int | None = None) -> Lease | None:
        if not block_ids:
            return None
        conversation = conversation_digest(conversation_key)
        for block_id in block_ids:
            self.block_manager.take(block_id)
        lease = Lease(handle=secrets.token_urlsafe(24), conversation=conversation, block_ids=list(block_ids),
                      block_hashes=list(block_hashes), block_epochs=[int(self.block_manager.epochs[b]) for b in block_ids],
                      num_tokens=num_tokens, expiry_time=time.time() + ttl_s, release_after_read=release_after_read,
                      first_token_id=first_token_id)
        with self._lock:
            previous = self._by_conversation.get(conversation)
            self._leases[lease.handle] = lease
            self._by_conversation[conversation] = lease.handle
            self.counts["created"] += 1
        if previous is not None and not release_after_read:
            self._drop(previous, "superseded")
        if self.max_retained_blocks is not None:
            while self.retained_blocks > self.max_retained_blocks and self.reclaim_oldest():
                pass
        return lease

    def lookup(self, handle: str, conversation_key: str) -> Lease | None:
        """The live lease named by `handle`, only if it is bound to `conversation_key`."""
        with self._lock:
            lease = self._leases.get(handle)
            if lease is None or lease.expiry_time <= time.time():
                return None
            if not secrets.compare_digest(lease.conversation, conversation_digest(conversation_key)):
                return None
            return lease

    def release(self, handle: str, binding_key: str) -> bool:
        """Release a lease early, only for a caller who knows what it is bound to."""
        with self._lock:
            lease = self._leases.get(handle)
            bound = lease is not None and secrets.compare_digest(lease.conversation, conversation_digest(binding_key))
        return bound and self._drop(handle, "released")

    def expire(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        with self._lock:
            stale = [h for h, lease in self._leases.items() if lease.expiry_time <= now]
        for handle in stale:
            self._drop(handle, "expired")
        return len(stale)

    def reclaim_oldest(self) -> bool:
        with self._lock:
            oldest = next(iter(self._leases), None)
        return oldest is not None and self._drop(oldest, "reclaimed")

    def release_all(self) -> None:
        for handle in list(self._leases):
            self._drop(handle, "released")

    def _drop(self, handle: str, why: str) -> bool:
        with self._lock:
            lease = self._leases.pop(handle, None)
            if lease is None:
                return False
            if self._by_conversation.get(lease.conversation) == handle:
                del self._by_conversation[lease.conversation]
            self.counts[why] += 1
        self.block_manager.release_all(lease.block_ids)
        return True

    @property
    def active(self) -> int:
        return len(self._leases)

    @property
    def retained_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())
