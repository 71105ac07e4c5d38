"""vLLM's `kv_transfer_params` as the router keeps and hands them on. For vLLM the router passes a decode worker's
params to prefill exactly as it returned them (vLLM adds fields over time: dcp_size, pp_size, ...) but for the two
flags and the verified `remote_num_tokens`."""
PREFILL_STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
# D computes locally and pins the result as a prefill worker pins for a decode: the one request shape that vLLM 0.32
# both retains and frees once read (with both flags false it retains and never frees). Pinned for D's
# kv_lease_duration, and the params carry no expiry: the router bounds the entry itself.
RETAIN_AS_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}
EXPIRY = "remote_blocks_expiry_time"
STORED_EXPIRY = "vllm_" + EXPIRY  # the table reads EXPIRY as wall clock; vLLM's is D's monotonic clock


def stored_params(params: dict, lease_end: float | None = None) -> dict:
    """D's params as the conversation table keeps them: `lease_end` (wall clock) or the table's TTL, below D's,
    bounds the entry."""
    stored = dict(params)
    stored[STORED_EXPIRY] = stored.pop(EXPIRY, None)
    stored[EXPIRY] = lease_end
    return stored


def params_for_prefill(stored: dict, remote_num_tokens: int) -> dict:
    """D's params exactly as D returned them, but for the flags and the verified token count."""
    params = {k: v for k, v in stored.items() if k != STORED_EXPIRY}
    params[EXPIRY] = stored.get(STORED_EXPIRY)
    return params | {"do_remote_decode": True, "do_remote_prefill": False, "remote_num_tokens": remote_num_tokens}
