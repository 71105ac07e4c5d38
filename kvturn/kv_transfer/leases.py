"""Retention leases: blocks kept alive after a request finishes so a peer can read them.

D retains a finished turn's prompt + answer blocks for the next turn's prefill (readable many times until it
expires, is released, or a newer turn of the same conversation supersedes it); P pins a prompt's blocks until D has
read them (released after the read). Leases hold block references, so retained blocks are never recycled while
leased. Under memory pressure (the pool's retained budget, or the scheduler short of blocks) the lease retention.py
chooses (tenants' shares, then the least likely to be read) moves whole to the host tier when there is one
(host_tier.py): its blocks are copied there and its pool blocks freed, so their epochs bump and a read racing the
move is caught. Only when the host tier is full too is its least recently used lease dropped. P's pins are never
taken under pressure. A lease is renewed each time its conversation reads it (`acquire`, or D's own
use), never past its maximum age. Deadlines are on this machine's monotonic clock; the record a peer sees carries
the time left as a duration (`ttl_s`), from which the peer computes its own deadline. Mutations happen on the
engine thread; lookups and renewals come from HTTP handlers, under the lock.
"""
import hashlib
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvturn.engine.block_manager import BlockManager
from kvturn.engine.kv_cache import KVCache
from kvturn.kv_transfer import retention
from kvturn.kv_transfer.host_tier import HOST, POOL, HostTier

CONVERSATIONS_REMEMBERED = 4096  # conversations whose turn rhythm is kept (retention.Candidate.gap_s)


def conversation_digest(conversation_key: str) -> str:
    return hashlib.sha256(conversation_key.encode()).hexdigest()


@dataclass(slots=True)
class Lease:
    handle: str
    conversation: str  # digest of the conversation key the lease is bound to
    tier: str  # POOL or HOST: where block_ids and block_epochs point
    block_ids: list[int]
    block_hashes: list[int]
    block_epochs: list[int]
    num_tokens: int
    ttl_s: float  # what each renewal grants
    created: float  # monotonic seconds
    deadline: float  # monotonic seconds
    last_used: float  # monotonic seconds: made, or last renewed
    release_after_read: bool
    first_token_id: int | None = None  # P's pin: the token P sampled after the prompt
    renewals: int = 0
    tenant: str = ""  # retention.tenant_of(the conversation key)
    gap_s: float | None = None  # mean time between its conversation's turns so far
    covered: float = 0.0  # fraction of its tokens P's prefix cache held at the turn that made it
    announced_at: float | None = None  # monotonic seconds: last acquired (its next turn is on its way to P)

    def to_public(self, now: float) -> dict:
        """The lease as a peer sees it: its time left as a duration, and (for vLLM's field) as this machine's
        wall-clock time, which no other machine compares with its own."""
        ttl_s = max(self.deadline - now, 0.0)
        return {"handle": self.handle, "tier": self.tier, "block_ids": list(self.block_ids),
                "block_hashes": self.block_hashes, "block_epochs": list(self.block_epochs),
                "num_tokens": self.num_tokens, "ttl_s": ttl_s, "expiry_time": time.time() + ttl_s,
                "first_token_id": self.first_token_id}


class LeaseTable:
    def __init__(self, block_manager: BlockManager, max_retained_blocks: int | None = None,
                 host: HostTier | None = None, pool: KVCache | None = None, max_age_s: float = float("inf"),
                 clock: Callable[[], float] = time.monotonic):
        self.block_manager = block_manager
        self.max_retained_blocks = max_retained_blocks  # in the pool
        self.host, self.pool = host, pool
        self.max_age_s = max_age_s
        self.clock = clock
        self._leases: OrderedDict[str, Lease] = OrderedDict()  # least recently used first
        self._by_conversation: dict[str, str] = {}
        self._lock = threading.Lock()
        self.counts = {"created": 0, "expired": 0, "reclaimed": 0, "released": 0, "superseded": 0, "renewed": 0}
        self.moves: Counter = Counter()  # (from tier, to tier) -> leases moved or copied back for D's own use
        self.reads: Counter = Counter()  # tier -> reads of a lease its holder saw (acquire, D's own use)
        self.last_moved_at: float | None = None  # when a lease last left the pool for the host tier
        self.choices: Counter = Counter()  # retention reason -> leases given up for room (retention.py)
        self._turns: OrderedDict[str, tuple[float, int, float]] = OrderedDict()  # conversation -> (last, gaps, sum)

    def retain(self, block_ids: list[int], block_hashes: list[int], num_tokens: int, conversation_key: str,
               ttl_s: float, release_after_read: bool, first_token_id: int | None = None,
               covered: float = 0.0) -> Lease | None:
        if not block_ids:
            return None
        conversation = conversation_digest(conversation_key)
        tenant = retention.tenant_of(conversation_key)
        for block_id in block_ids:
            self.block_manager.take(block_id)
        now = self.clock()
        lease = Lease(handle=secrets.token_urlsafe(24), conversation=conversation, tier=POOL,
                      block_ids=list(block_ids), block_hashes=list(block_hashes),
                      block_epochs=[int(self.block_manager.epochs[b]) for b in block_ids], num_tokens=num_tokens,
                      ttl_s=ttl_s, created=now, deadline=now + min(ttl_s, self.max_age_s), last_used=now,
                      release_after_read=release_after_read, first_token_id=first_token_id, tenant=tenant,
                      gap_s=None if release_after_read else self._turn_gap(conversation, now), covered=covered)
        with self._lock:
            previous = self._by_conversation.get(conversation)
        if previous is not None and not release_after_read:
            self._drop(previous, "superseded")
        budget = self.max_retained_blocks
        # Room first, so that the pool never holds more than the budget, not even while the oldest lease is copied.
        while (budget is not None and self.retained_blocks + len(block_ids) > budget
               and self.reclaim_oldest(tenant, others_within_share=False)):
            pass
        with self._lock:
            self._leases[lease.handle] = lease
            self._by_conversation[conversation] = lease.handle
            self.counts["created"] += 1
        while budget is not None and self.retained_blocks > budget and self.reclaim_oldest(tenant):
            pass  # the lease alone is over the budget (or its tenant's share of it): it moves itself
        return lease

    def _turn_gap(self, conversation: str, now: float) -> float | None:
        """Note a turn of `conversation` at `now`; the mean time between its turns so far (None after one)."""
        last, gaps, total = self._turns.pop(conversation, (None, 0, 0.0))
        if last is not None:
            gaps, total = gaps + 1, total + now - last
        self._turns[conversation] = (now, gaps, total)
        if len(self._turns) > CONVERSATIONS_REMEMBERED:
            self._turns.popitem(last=False)
        return total / gaps if gaps else None

    def lookup(self, handle: str, conversation_key: str) -> Lease | None:
        """The live lease named by `handle`, only if it is bound to `conversation_key`."""
        with self._lock:
            return self._live(handle, conversation_key)

    def acquire(self, handle: str, conversation_key: str) -> dict | None:
        """A peer reads the lease: its public record, the lease renewed; None unless it is live and bound to
        `conversation_key`."""
        with self._lock:
            lease = self._live(handle, conversation_key)
            if lease is None:
                return None
            if not lease.release_after_read:
                self._renew(lease)
                lease.announced_at = lease.last_used
            self.reads[lease.tier] += 1
            return lease.to_public(self.clock())

    def for_conversation(self, conversation_key: str) -> Lease | None:
        """The live lease of a conversation (D's own use of its retained history)."""
        with self._lock:
            handle = self._by_conversation.get(conversation_digest(conversation_key))
            return None if handle is None else self._live(handle, conversation_key)

    def renew(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.get(lease.handle) is lease:
                self._renew(lease)

    def _live(self, handle: str, conversation_key: str) -> Lease | None:
        lease = self._leases.get(handle)
        if lease is None or lease.deadline <= self.clock():
            return None
        if not secrets.compare_digest(lease.conversation, conversation_digest(conversation_key)):
            return None
        return lease

    def _renew(self, lease: Lease) -> None:
        now = self.clock()
        lease.deadline = max(lease.deadline, min(now + lease.ttl_s, lease.created + self.max_age_s))
        lease.last_used = now
        lease.renewals += 1
        self._leases.move_to_end(lease.handle)
        self.counts["renewed"] += 1

    def release(self, handle: str, binding_key: str) -> bool:
        """Release a lease early, only for a caller who knows what it is bound to."""
        with self._lock:
            lease = self._leases.get(handle)
            bound = lease is not None and secrets.compare_digest(lease.conversation, conversation_digest(binding_key))
        return bound and self._drop(handle, "released")

    def release_conversation(self, conversation_key: str) -> bool:
        """Release whatever this worker retains for a conversation (its session ended)."""
        with self._lock:
            handle = self._by_conversation.get(conversation_digest(conversation_key))
        return handle is not None and self._drop(handle, "released")

    def expire(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        with self._lock:
            stale = [h for h, lease in self._leases.items() if lease.deadline <= now]
        for handle in stale:
            self._drop(handle, "expired")
        return len(stale)

    def reclaim_oldest(self, requester: str | None = None, others_within_share: bool = True) -> bool:
        """Free the pool blocks of the lease retention.choose gives up (for tenant `requester`, None: no tenant):
        move it to the host tier if it fits there (dropping the host tier's least recently used leases to make
        room), else drop it. False if no lease may go. P's pins are never taken: a decode worker is about to read
        each one, and a pin let go makes it recompute the whole prompt in its decoding steps; they end when read,
        released, or at their short TTL."""
        passed: set[str] = set()  # leases a peer acquired while they were being copied: moved last
        while True:
            now = self.clock()
            with self._lock:
                in_pool = [lease for lease in self._leases.values()
                           if lease.tier == POOL and not lease.release_after_read]
            fresh = [lease for lease in in_pool if lease.handle not in passed] or in_pool
            chosen = retention.choose([retention.Candidate(lease.tenant, len(lease.block_ids), now - lease.last_used,
                                                           lease.gap_s, lease.covered,
                                                           None if lease.announced_at is None
                                                           else now - lease.announced_at) for lease in fresh],
                                      requester, self.max_retained_blocks or self.block_manager.num_blocks,
                                      others_within_share)
            if chosen is None:
                return False
            oldest, why = fresh[chosen[0]], chosen[1]
            if self.host is None or len(oldest.block_ids) > self.host.num_blocks:
                return self._gave_up(why, self._drop(oldest.handle, "reclaimed"))
            while self.host.num_free_blocks < len(oldest.block_ids):
                with self._lock:
                    victim = next((lease for lease in self._leases.values() if lease.tier == HOST), None)
                if victim is None or not self._drop(victim.handle, "reclaimed"):
                    return self._gave_up(why, self._drop(oldest.handle, "reclaimed"))
            if self._move_to_host(oldest, force=oldest.handle in passed):
                return self._gave_up(why, True)
            passed.add(oldest.handle)

    def _gave_up(self, why: str, done: bool) -> bool:
        """Count why a lease left the pool (retention.REASONS)."""
        if done:
            with self._lock:
                self.choices[why] += 1
        return done

    def _move_to_host(self, lease: Lease, force: bool = False) -> bool:
        """Copy the lease's blocks to the host tier, point the lease there, then free its pool blocks (their epochs
        bump: a peer that read them meanwhile sees it and recomputes). The least recently used lease is the one
        whose conversation is the likeliest to come back now: when a peer acquired it during the copy, and so is
        about to read the pool blocks its answer named, the move is given up (unless `force`) and False returned."""
        renewals = lease.renewals
        host_ids = self.host.allocate(len(lease.block_ids))
        self.host.cache.copy_blocks(self.pool, lease.block_ids, host_ids)
        pool_ids = lease.block_ids
        with self._lock:
            moved = force or lease.renewals == renewals
            if moved:
                lease.tier, lease.block_ids = HOST, host_ids
                lease.block_epochs = [int(self.host.epochs[b]) for b in host_ids]
                self.moves[(POOL, HOST)] += 1
                self.last_moved_at = self.clock()
        if moved:
            self.block_manager.release_all(pool_ids)
        else:
            self.host.free(host_ids)
        return moved

    def copy_back(self, lease: Lease, first: int, last: int, target_ids: list[int]) -> None:
        """Copy blocks first..last of a host-tier lease into pool blocks of D's own (compute on decode)."""
        self.pool.copy_blocks(self.host.cache, lease.block_ids[first:last], target_ids)
        with self._lock:
            self.moves[(HOST, POOL)] += 1
            self.reads[HOST] += 1

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
        if lease.tier == HOST:
            self.host.free(lease.block_ids)
        else:
            self.block_manager.release_all(lease.block_ids)
        return True

    @property
    def active(self) -> int:
        return len(self._leases)

    def blocks_in(self, tier: str) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values() if lease.tier == tier)

    @property
    def retained_blocks(self) -> int:
        """Blocks leases hold in the pool (what the retained budget bounds)."""
        return self.blocks_in(POOL)

    def pool_horizon_s(self) -> float | None:
        """How long the least recently used lease still in the pool has gone unused, once leases have had to move
        to the host tier (None before): a lease unused for longer is in the host tier, or gone."""
        if self.last_moved_at is None:
            return None
        with self._lock:
            oldest = next((lease for lease in self._leases.values() if lease.tier == POOL), None)
        if oldest is None:
            return 0.0
        return max(self.clock() - oldest.last_used, 0.0)
