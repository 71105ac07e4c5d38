"""Which tier of its decode worker a conversation's lease is likely in, before the turn: the router prices a pull
from the host tier by that tier's own read speed, and compute on decode with the copy back (costmodel/paths.py).

A decode worker moves its least recently used leases to its host tier first, and says in its /health how long the
least recently used lease still in its pool has gone unused (`pool_horizon_s`). A lease the router has not seen
used for longer than that has moved (or is gone, which the turn finds out)."""
import time

from kvturn.kv_transfer.params import HOST, POOL


def guess(entry, holder, now: float | None = None) -> str:
    """POOL or HOST for the lease of `entry` (a router Conversation) held by decode worker `holder`."""
    if entry is None or holder is None or holder.pool_horizon_s is None:
        return POOL
    idle_s = (time.time() if now is None else now) - entry.stored_at
    return HOST if idle_s > holder.pool_horizon_s else POOL
