"""A turn's span at the router (tracing.py): opened when the request comes, its `traceparent` handed to the prefill
and decode workers so that their spans are its children, ended once the answer is sent (a stream's last byte
included) with what the turn was: the conversation lookup, the path chosen and every path's predicted time to first
token, P's reuse outcome, what moved each way and how long each read took, the tier read, the retries (events, as
they happen), and vLLM's `gen_ai.*` names where they mean the same (usage, time to first token, end to end, KV
transfer time as TensorRT-LLM names it)."""
import time

from starlette.background import BackgroundTasks

from kvturn import tracing


class TurnSpan:
    def __init__(self, traces: tracing.Tracing, headers):
        self.span = traces.open_span("kvturn.turn", traces.parent(headers))
        self.headers = traces.headers_for(self.span)
        self.retries = 0  # across the request's attempts (a turn run again once a worker is back)

    def retried(self, reason: str) -> None:
        self.retries += 1
        self.span.add_event("retry", {"kvturn.retry.reason": reason})

    def end_after(self, response, turn) -> None:
        """End the span once `response` is sent, after what the response already does then."""
        tasks = BackgroundTasks()
        if response.background is not None:
            tasks.add_task(response.background)
        tasks.add_task(self.end, turn, response.status_code)
        response.background = tasks

    def end(self, turn, status: int) -> None:
        attributes = turn_attributes(turn)
        attributes["kvturn.retries"] = self.retries
        attributes["http.response.status_code"] = status
        tracing.end_span(self.span, attributes, failed=f"HTTP {status}" if status >= 400 else None)


def turn_attributes(turn) -> dict:
    """The span's attributes from the turn as it ended (turn.Turn), its `kvturn` report and P's own account."""
    body, report = turn.body, turn.reported or {}
    prefill = turn.prefill.get("kvturn") or {}
    decode = report.get("decode") or {}
    timing, path = report.get("timing") or {}, report.get("path") or {}
    d_to_p_s, p_to_d_s = tracing.seconds(timing.get("d_to_p_read_ms")), tracing.seconds(timing.get("p_to_d_read_ms"))
    usage_owner = decode or prefill  # whoever computed the prompt counted it
    prompt_tokens = sum(usage_owner.get(k) or 0 for k in ("prompt_tokens_computed", "prompt_tokens_cached",
                                                          "prompt_tokens_remote")) or report.get("prompt_tokens")
    cached = turn.backend.cached_tokens()
    attributes = {
        "gen_ai.request.model": body.get("model") if isinstance(body.get("model"), str) else None,
        "gen_ai.request.max_tokens": _number(body.get("max_completion_tokens") or body.get("max_tokens")),
        "gen_ai.request.temperature": _number(body.get("temperature")),
        "gen_ai.request.top_p": _number(body.get("top_p")),
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": decode.get("completion_tokens"),
        "gen_ai.usage.cached_tokens": cached if cached is not None else decode.get("prompt_tokens_cached"),
        "gen_ai.latency.e2e": time.perf_counter() - turn.started,
        "gen_ai.latency.time_to_first_token": turn.first_token_at - turn.started if turn.first_token_at else None,
        "gen_ai.latency.kv_cache_transfer_time": None if d_to_p_s is None and p_to_d_s is None else
        (d_to_p_s or 0.0) + (p_to_d_s or 0.0),
        "kvturn.conversation.derived": turn.conversation.derived if turn.conversation else None,
        "kvturn.stream": bool(body.get("stream")),
        "kvturn.lookup": turn.lookup,
        "kvturn.path": path.get("chosen"),
        "kvturn.path.policy": path.get("policy"),
        "kvturn.reuse": str(report.get("reuse", prefill.get("reuse"))),
        "kvturn.kv_tier": report.get("kv_tier"),
        "kvturn.first_token_from": report.get("first_token_from"),
        "kvturn.prefill_worker": report.get("prefill_worker") or None,
        "kvturn.decode_worker": report.get("decode_worker"),
        "kvturn.prompt_tokens.computed_prefill": report.get("prompt_tokens_computed_prefill"),
        "kvturn.kv_read.d_to_p.tokens": report.get("prompt_tokens_from_decode", report.get("tokens_passed")),
        "kvturn.kv_read.d_to_p.bytes": report.get("bytes_d_to_p"),
        "kvturn.kv_read.d_to_p.seconds": d_to_p_s,
        "kvturn.kv_read.p_to_d.tokens": decode.get("prompt_tokens_remote"),
        "kvturn.kv_read.p_to_d.bytes": report.get("bytes_p_to_d"),
        "kvturn.kv_read.p_to_d.seconds": p_to_d_s,
        "kvturn.backend": report.get("backend", "kvturn") if report else None,
    }
    for name, ms in (path.get("predicted_ttft_ms") or {}).items():
        attributes[f"kvturn.path.predicted_ttft_ms.{name}"] = ms
    return attributes


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
