"""What workers keep between turns, as kvturn keeps it: a decode worker's retention leases (one per conversation,
a newer turn's superseding the older, ended by the TTL, reclaimed oldest-first over the budget or when the pool
needs room; see kvturn/kv_transfer/leases.py) and a worker's prefix cache (least recently used evicted first)."""
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    conversation: str
    tokens: int
    expiry_s: float
    alive: bool = True


class Leases:
    """One decode worker's leases, oldest first; sizes in tokens of KV."""

    def __init__(self, budget_tokens: int | None, on_change):
        self.budget_tokens = budget_tokens
        self.on_change = on_change  # told the change in retained tokens, for the cluster-wide peak
        self.by_conversation: OrderedDict[str, Lease] = OrderedDict()
        self.retained_tokens = 0

    def retain(self, conversation: str, tokens: int, now: float, ttl_s: float) -> Lease | None:
        self.expire(now)
        self.drop(conversation)  # superseded
        if tokens <= 0:
            return None
        lease = Lease(conversation, tokens, now + ttl_s)
        self.by_conversation[conversation] = lease
        self._add(tokens)
        if self.budget_tokens is not None:
            while self.retained_tokens > self.budget_tokens and self.reclaim_oldest():
                pass
        return lease

    def drop(self, conversation: str) -> None:
        lease = self.by_conversation.pop(conversation, None)
        if lease is not None:
            lease.alive = False
            self._add(-lease.tokens)

    def expire(self, now: float) -> None:
        """Drop the leases ended by `now`: all share one TTL, so they end in the order they began (and, as only
        a new lease raises the total, dropping them just before one is made keeps the peak exact)."""
        while self.by_conversation:
            oldest = next(iter(self.by_conversation.values()))
            if oldest.expiry_s > now:
                break
            self.drop(oldest.conversation)

    def reclaim_oldest(self) -> bool:
        if not self.by_conversation:
            return False
        self.drop(next(iter(self.by_conversation)))
        return True

    def _add(self, tokens: int) -> None:
        self.retained_tokens += tokens
        self.on_change(tokens)


class PrefixCache:
    """Tokens of each conversation's latest prompt (and answer, where the worker decoded it) still cached on a
    worker, within its pool; the least recently used conversation is evicted first."""

    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.tokens: OrderedDict[str, int] = OrderedDict()
        self.total = 0

    def hit(self, conversation: str) -> int:
        cached = self.tokens.get(conversation, 0)
        if cached:
            self.tokens.move_to_end(conversation)
        return cached

    def store(self, conversation: str, tokens: int) -> None:
        self.total += tokens - self.tokens.pop(conversation, 0)
        self.tokens[conversation] = tokens
        while self.total > self.capacity_tokens and len(self.tokens) > 1:
            _, evicted = self.tokens.popitem(last=False)
            self.total -= evicted
