"""What workers keep between turns: a decode worker's retention leases, as kvturn/kv_transfer/leases.py keeps them
(checked against it in tests/test_plan_engine_match.py), and a worker's prefix cache."""
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvturn.kv_transfer import retention
from kvturn.kv_transfer.params import HOST, POOL


@dataclass(slots=True)
class Lease:
    conversation: str
    tokens: int
    expiry_s: float
    made_s: float = 0.0
    gap_s: float | None = None  # mean time between its conversation's turns so far (retention.Candidate)
    alive: bool = True


class Leases:
    """One decode worker's leases in tokens of KV, oldest first, each in the pool or the host tier: a newer turn's
    supersedes the older, the TTL ends them, and over the pool's budget, or when the pool needs room, the oldest in
    the pool moves whole to the host tier (whose own oldest go to make room), or goes if the tier cannot hold it."""

    def __init__(self, budget_tokens: int | None, host_tokens: int, on_change: Callable[[str, int], None]):
        self.budget_tokens = budget_tokens  # in the pool
        self.host_tokens = host_tokens
        self.on_change = on_change  # told (tier, change in tokens), for the cluster's totals
        self.tiers: dict[str, OrderedDict[str, Lease]] = {POOL: OrderedDict(), HOST: OrderedDict()}
        self.tokens = {POOL: 0, HOST: 0}
        self.now = 0.0
        self.turns: dict[str, tuple[float, int, float]] = {}  # conversation -> (last retained, gaps, their sum)

    def retain(self, conversation: str, tokens: int, now: float, ttl_s: float) -> Lease | None:
        self.expire(now)
        self.drop(conversation)  # superseded
        last, gaps, total = self.turns.get(conversation, (None, 0, 0.0))
        if last is not None:
            gaps, total = gaps + 1, total + now - last
        self.turns[conversation] = (now, gaps, total)
        if tokens <= 0:
            return None
        lease = Lease(conversation, tokens, now + ttl_s, now, total / gaps if gaps else None)
        self.tiers[POOL][conversation] = lease
        self._add(POOL, tokens)
        while self.budget_tokens is not None and self.tokens[POOL] > self.budget_tokens and self.reclaim_oldest():
            pass  # the oldest move first, the new lease itself last (alone over the budget)
        return lease

    def drop(self, conversation: str) -> None:
        for tier, leases in self.tiers.items():
            lease = leases.pop(conversation, None)
            if lease is not None:
                lease.alive = False
                self._add(tier, -lease.tokens)

    def expire(self, now: float) -> None:
        """Drop the leases ended by `now`: all share one TTL, so in each tier they end in the order they began."""
        self.now = now
        for leases in self.tiers.values():
            while leases and next(iter(leases.values())).expiry_s <= now:
                self.drop(next(iter(leases)))

    def reclaim_oldest(self) -> bool:
        """Free the pool tokens of the lease the decode worker's own choice takes (kv_transfer/retention.py: one
        whose conversation looks ended, else the oldest): to the host tier if it fits there, else dropped. False
        with none in the pool."""
        pool, host = self.tiers[POOL], self.tiers[HOST]
        if not pool:
            return False
        in_pool = list(pool.values())
        index, _ = retention.choose([retention.Candidate("", lease.tokens, self.now - lease.made_s, lease.gap_s, 0.0)
                                     for lease in in_pool], None, 1)
        oldest = in_pool[index]
        if oldest.tokens > self.host_tokens:
            self.drop(oldest.conversation)
            return True
        while self.tokens[HOST] + oldest.tokens > self.host_tokens:
            self.drop(next(iter(host)))
        del pool[oldest.conversation]
        self._add(POOL, -oldest.tokens)
        host[oldest.conversation] = oldest
        self._add(HOST, oldest.tokens)
        return True

    def tier_of(self, conversation: str) -> str | None:
        return next((tier for tier, leases in self.tiers.items() if conversation in leases), None)

    def _add(self, tier: str, tokens: int) -> None:
        self.tokens[tier] += tokens
        self.on_change(tier, tokens)


class PrefixCache:
    """Tokens of each conversation's latest prompt (and answer, where the worker decoded it) still cached on a
    worker, within its pool; the least recently used conversation is evicted first, into the worker's host tier
    when it has one (`host_tokens`, P's --prefix-host-mb: its own least recent go to make room), from where a hit
    moves it back into the pool."""

    def __init__(self, capacity_tokens: int, host_tokens: int = 0):
        self.capacity_tokens = capacity_tokens
        self.tokens: OrderedDict[str, int] = OrderedDict()
        self.total = 0
        self.host = PrefixCache(host_tokens) if host_tokens > 0 else None

    def hit(self, conversation: str) -> int:
        cached = self.tokens.get(conversation, 0)
        if cached:
            self.tokens.move_to_end(conversation)
        elif self.host is not None and (cached := self.host.take(conversation)):
            self.store(conversation, cached)  # restored into the pool, as the engine copies a host hit back
        return cached

    def take(self, conversation: str) -> int:
        """The tokens held for `conversation`, no longer held here."""
        tokens = self.tokens.pop(conversation, 0)
        self.total -= tokens
        return tokens

    def store(self, conversation: str, tokens: int) -> None:
        if self.host is not None:
            self.host.take(conversation)  # the newer prompt supersedes an older one in the host tier
        self.total += tokens - self.tokens.pop(conversation, 0)
        self.tokens[conversation] = tokens
        while self.total > self.capacity_tokens and len(self.tokens) > 1:
            evicted_conversation, evicted = self.tokens.popitem(last=False)
            self.total -= evicted
            if self.host is not None and evicted <= self.host.capacity_tokens:
                self.host.store(evicted_conversation, evicted)
