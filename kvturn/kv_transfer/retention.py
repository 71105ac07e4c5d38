"""Which lease gives its pool blocks up first when the pool needs room: plain inputs, plain output, no I/O.

A lease is worth keeping only if its conversation comes back before it ends and P would not have the history
anyway. So, of the leases in the pool (least recently used first):
1. tenants' shares first: a tenant's leases beyond its share of retained KV go before anyone else's; then the
   requesting tenant's own; another tenant's leases within its share go only when nothing else is left (the pool
   still comes before retention: a running request never waits for a lease);
2. within that, a lease whose conversation looks ended (unused for more than `ENDED_AFTER_GAPS` of its own gaps
   between turns so far) goes first, then one whose history P's own prefix cache held mostly at its turn (P is
   likely to hold it again: reading it back would save little), then the least recently used of those whose next
   turn has not been announced; a lease whose next turn is on its way (the router or P asked for it since it was
   made: P is about to read it) goes last, the most recently announced first (its read comes last).
The tenant is the part of a conversation key before its last ':' (the router scopes every key by its caller's API
key, router/keys.py); a key without one is the shared tenant ''.
"""
from dataclasses import dataclass

ENDED_AFTER_GAPS = 4.0  # unused for this many of its own gaps between turns: the conversation is likely over
COVERED_FRACTION = 0.5  # P's cache held at least this much of the history at its turn: P likely holds it again
# Why a lease was chosen, counted in /metrics (kvturn_kv_retention_choices_total{reason})
OVER_SHARE, ENDED, COVERED, LEAST_RECENT, ANNOUNCED, OTHER_TENANT = (
    "over_share", "ended", "covered", "least_recent", "announced", "other_tenant")
REASONS = (OVER_SHARE, ENDED, COVERED, LEAST_RECENT, ANNOUNCED, OTHER_TENANT)


@dataclass(frozen=True, slots=True)
class Candidate:
    tenant: str
    blocks: int
    idle_s: float  # since it was made or last used
    gap_s: float | None  # mean time between its conversation's turns so far; None after one turn
    covered: float  # fraction of its tokens P's prefix cache held at the turn that made it (0 unknown)
    announced_s: float | None = None  # since its next turn was announced (acquired); None: not yet


def tenant_of(conversation_key: str) -> str:
    return conversation_key.rpartition(":")[0]


def looks_ended(candidate: Candidate) -> bool:
    return candidate.gap_s is not None and candidate.idle_s > ENDED_AFTER_GAPS * max(candidate.gap_s, 1.0)


def shares(candidates: list[Candidate], requester: str | None, capacity_blocks: int) -> dict[str, float]:
    """Each tenant's share of `capacity_blocks`: equal among the tenants holding leases and the requester."""
    tenants = {c.tenant for c in candidates} | ({requester} if requester is not None else set())
    return {tenant: capacity_blocks / len(tenants) for tenant in tenants}


def choose(candidates: list[Candidate], requester: str | None, capacity_blocks: int,
           others_within_share: bool = True) -> tuple[int, str] | None:
    """(index into `candidates`, why) of the lease to give up, or None if none may go. `candidates` are in least
    recently used order; `requester`: the tenant whose request or lease needs the room (None: no tenant, as for a
    prompt P computes). `others_within_share`: whether another tenant's leases within its share may go when nothing
    else is left (yes for a request that needs blocks to run; no for room under the retained budget)."""
    if not candidates:
        return None
    share = shares(candidates, requester, capacity_blocks)
    held: dict[str, int] = {}
    for c in candidates:
        held[c.tenant] = held.get(c.tenant, 0) + c.blocks
    over = [i for i, c in enumerate(candidates) if held[c.tenant] > share[c.tenant]]
    own = [i for i, c in enumerate(candidates) if requester is None or c.tenant == requester]
    if over and len(share) > 1:
        return _least_worth(candidates, over, OVER_SHARE)
    if own:
        return _least_worth(candidates, own, None)
    if others_within_share:
        return _least_worth(candidates, list(range(len(candidates))), OTHER_TENANT)
    return None


def _least_worth(candidates: list[Candidate], indices: list[int], reason: str | None) -> tuple[int, str]:
    """The first ended lease among `indices`, else the first mostly covered by P's cache, else the first (least
    recently used) not announced, else the most recently announced; `reason` (if given) names the choice instead."""
    for test, why in ((looks_ended, ENDED), (lambda c: c.covered >= COVERED_FRACTION, COVERED),
                      (lambda c: c.announced_s is None, LEAST_RECENT)):
        found = next((i for i in indices if test(candidates[i])), None)
        if found is not None:
            return found, reason or why
    return min(indices, key=lambda i: candidates[i].announced_s), reason or ANNOUNCED
