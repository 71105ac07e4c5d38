"""After a streamed turn on vLLM <= 0.32, whose stream carries no `kv_transfer_params`: one 1-token call asks the
decode worker to compute prompt + answer (from its prefix cache: all but the last partial block) and pin it, and
its reply gives the params the stream could not carry. It runs after the client has its [DONE]; the conversation's
next turn waits for it (briefly) before looking the conversation up."""
import logging
import time


from kvturn.router.conversations import Conversation
from kvturn.router.fast_json import encode_with
from kvturn.router.upstream import Unreachable
from kvturn.router.vllm_params import RETAIN_AS_PREFILL, stored_params
from kvturn.router.vllm_reuse import retained_token_ids

log = logging.getLogger("kvturn.router")
MARGIN_S = 5.0  # the router forgets a pinned retention this long before decode frees it


async def retain_streamed_turn(router, key: str, decode_url: str, model: str | None, token_ids: str,
                               order: int) -> None:
    """`token_ids`: the streamed turn's prompt and answer, as their text "1,2,3" (vllm_reuse.py)."""
    body = {"model": model, "max_tokens": 1, "temperature": 0.0, "kv_transfer_params": dict(RETAIN_AS_PREFILL)}
    worker = router.decode.find(decode_url)
    kv = None
    try:
        if worker is None:
            raise Unreachable("the decode worker left the pool")
        with router.decode.claim(worker):
            response = await router.http.post(decode_url + "/v1/completions",
                                              encode_with(body, "prompt", f"[{token_ids}]".encode()))
        kv = response.json().get("kv_transfer_params") if response.status == 200 else None
    except (Unreachable, ValueError) as exc:
        log.warning("retention call to %s failed: %s", decode_url, exc)
    router.vllm.metrics.streams.labels("retention_call" if kv else "none").inc()
    retained = retained_token_ids(token_ids, None, kv.get("remote_num_tokens") if kv else None)
    if kv and retained and kv.get("remote_block_ids"):
        lease_end = time.time() + router.config.vllm_retention_lease_s - MARGIN_S
        await router.table.put(Conversation(key, decode_url, stored_params(kv, lease_end), 0.0, order, retained))
