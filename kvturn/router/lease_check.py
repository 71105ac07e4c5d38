"""Before a turn hands its conversation's lease to P: ask the decode worker that holds it whether it still does.

A decode worker lets a lease go whenever its pool needs the blocks (retention is the pool's lowest-priority tenant),
so the entry the router stored after the last turn may name blocks that are already reused: P would read them, find
their epochs changed, and recompute, having spent the read. One side-channel call to D (`POST /kv/lease/acquire`
with the cluster secret, as P would make it) answers before P plans anything: 404, the lease is gone and the router
withdraws it (the turn counts `lease_ended`, the entry is dropped); 200, D has renewed it and made it the most
recently used, so D's next reclaim takes another. D not answering in time changes nothing: the relayed record goes
to P as before, whose epoch check still catches a dead lease.
"""
import logging

import orjson

from kvturn.kv_transfer.policy import LEASE_ENDED  # noqa: F401 (the turn's reuse outcome when D let the lease go)
from kvturn.router.upstream import Unreachable

log = logging.getLogger("kvturn.router")
ACQUIRE_PATH = "/kv/lease/acquire"
CHECK_TIMEOUT_S = 1.0  # far above a loopback or in-rack round trip; a D this slow is busy, and P checks anyway


async def still_held(router, decode_url: str, handle: str | None, key: str) -> bool | None:
    """Whether the decode worker at `decode_url` still holds lease `handle` of conversation `key` (renewing it if
    so); None when it could not say (no handle, unreachable, slow, or an answer that is neither yes nor no)."""
    if not handle:
        return None
    try:
        reply = await router.http.post(decode_url + ACQUIRE_PATH, orjson.dumps({"handle": handle, "binding_key": key}),
                                       timeout_s=CHECK_TIMEOUT_S)
    except Unreachable:
        log.info("could not check a lease at %s; handing it to prefill unchecked", decode_url)
        return None
    if reply.status == 404:
        return False
    if reply.status == 200:
        try:
            return reply.json().get("handle") == handle
        except (ValueError, AttributeError):
            return None
    return None
