"""A worker's span of one request (tracing.py), vLLM's `llm_request` with its `gen_ai.*` attributes, written once the
request finished, from its arrival on: a child of the router's turn span when the router sent `traceparent`.
kvturn's own attributes say what vLLM's cannot: the reuse outcome, the KV read from a peer (D's lease read by P, or
P's prompt read by D), its tokens, bytes, time and tier."""
import time

from kvturn import tracing
from kvturn.engine.sequence import Sequence


def record_request(traces: tracing.Tracing, parent, seq: Sequence, fields: dict, usage: dict, model: str,
                   role: str) -> None:
    """`fields`: the worker's `kvturn` report of the request; `usage`: its OpenAI usage."""
    t, timing = seq.timing, fields.get("timing") or {}
    ttft_s = tracing.seconds(timing.get("ttft_ms"))
    e2e_s = time.perf_counter() - t.arrival
    from_prefill = seq.remote is not None and seq.remote.prefilled_for_us
    span = traces.open_span("llm_request", parent, start_time_ns=tracing.wall_ns(t.arrival))
    tracing.end_span(span, {
        "gen_ai.request.id": seq.request_id,
        "gen_ai.response.model": model,
        "gen_ai.request.max_tokens": seq.params.max_tokens,
        "gen_ai.request.temperature": seq.params.temperature,
        "gen_ai.request.top_p": seq.params.top_p,
        "gen_ai.response.finish_reasons": [seq.finish_reason] if seq.finish_reason else None,
        "gen_ai.usage.prompt_tokens": usage["prompt_tokens"],
        "gen_ai.usage.completion_tokens": usage["completion_tokens"],
        "gen_ai.usage.cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "gen_ai.latency.time_to_first_token": ttft_s,
        "gen_ai.latency.time_in_queue": tracing.seconds(timing.get("engine_wait_ms")),
        "gen_ai.latency.time_in_model_prefill": tracing.seconds(timing.get("prefill_compute_ms")),
        "gen_ai.latency.time_in_model_decode": e2e_s - ttft_s if ttft_s else None,
        "gen_ai.latency.e2e": e2e_s,
        "gen_ai.latency.kv_cache_transfer_time": tracing.seconds(timing.get("kv_read_ms")),
        "kvturn.role": role,
        "kvturn.engine_id": fields.get("engine_id"),
        "kvturn.reuse": str(fields.get("reuse")),
        "kvturn.prompt_tokens.computed": fields.get("prompt_tokens_computed"),
        "kvturn.prompt_tokens.cached": fields.get("prompt_tokens_cached"),
        "kvturn.kv_read.source": None if seq.remote is None else "prefill_pin" if from_prefill else "decode_lease",
        "kvturn.kv_read.tokens": fields.get("prompt_tokens_remote"),
        "kvturn.kv_read.bytes": fields.get("kv_read_bytes"),
        "kvturn.kv_read.seconds": tracing.seconds(timing.get("kv_read_ms")),
        "kvturn.kv_read.hidden_seconds": tracing.seconds(timing.get("kv_read_hidden_ms")),
        "kvturn.kv_tier": fields.get("kv_tier"),
        "kvturn.host_restore.bytes": fields.get("host_restore_bytes") or None,
        "kvturn.side_channel.seconds": tracing.seconds(timing.get("side_channel_ms")),
    })
