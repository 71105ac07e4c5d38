"""A decode worker's lease, in time: when it ends on this router's clock, and the time it has left as the next
prefill worker is told it. No wall clock is compared between machines: a kvturn worker says how long its lease has
left (`remote_blocks_ttl_s`, a duration), the router sets its own deadline from that, and hands on the time left
at the moment it hands the lease on; each receiver sets its deadline on its own clock in turn."""
import math

TTL_FIELD = "remote_blocks_ttl_s"
EXPIRY_FIELD = "remote_blocks_expiry_time"  # vLLM's: the holder's wall clock (the router's own, for vLLM leases)


def lease_end(kv_params: dict, now: float) -> float:
    """When the lease these params describe ends, in this router's `now` terms: from the time it had left when its
    holder answered (its holder's clock never read here), else from vLLM's expiry time, which for a vLLM lease the
    router set itself (vllm_retention.py); without either, never."""
    ttl_s = kv_params.get(TTL_FIELD)
    if type(ttl_s) in (int, float) and math.isfinite(ttl_s):
        return now + max(ttl_s, 0.0)
    expiry = kv_params.get(EXPIRY_FIELD)
    return float(expiry) if type(expiry) in (int, float) and math.isfinite(expiry) else math.inf


def with_time_left(kv_params: dict, seconds_left: float) -> dict:
    """The params as they are handed on: the time their lease has left, counted down on this router's clock (vLLM's
    params, which carry none, are left as they are)."""
    if TTL_FIELD not in kv_params:
        return kv_params
    return {**kv_params, TTL_FIELD: max(round(seconds_left, 3), 0.0)}
