"""What operators see: OpenTelemetry traces of a turn (router and workers exporting to a real OTLP receiver started
here) and the metrics a Grafana dashboard queries, on one running stack (router + P with its cache off + D)."""
import time

import httpx
import pytest

from chat import SYSTEM, send, user_message
from kvturn.launch import LocalStack
from otlp_receiver import OTLPReceiver

TRACE_GUARD_S = 60  # a hang guard: the exporters send a batch every OTEL_BSP_SCHEDULE_DELAY


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory, receiver):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with LocalStack(tiny_model_dir, kv_cache_mb=64, prefix_caching_on_prefill=False, worker_args=["--no-calibrate"],
                    log_dir=tmp_path_factory.mktemp("observability"), env=env) as started:
        yield started


def spans_of(receiver: OTLPReceiver, trace_id: str, count: int) -> list[dict]:
    deadline = time.monotonic() + TRACE_GUARD_S
    while True:
        spans = [s for s in receiver.received() if s["trace_id"] == trace_id]
        if len(spans) >= count:
            return spans
        assert time.monotonic() < deadline, f"trace {trace_id}: {len(spans)} of {count} spans came"
        time.sleep(0.1)


CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def test_a_reused_turn_is_one_trace_the_router_span_with_prefill_and_decode_spans_as_children(stack, receiver):
    messages = [{"role": "system", "content": SYSTEM}, user_message(0)]
    first = send(stack.url, messages, "traced", stream=False)
    messages += [{"role": "assistant", "content": first["text"]}, user_message(1)]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "conversation_id": "traced"}
    # a client of its own trace: the router's span becomes a child of the client's
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=120,
                       headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}).json()
    report = reply["kvturn"]
    assert report["reuse"] == "reused"
    spans = spans_of(receiver, CLIENT_TRACE, 3)
    turn = next(s for s in spans if s["name"] == "kvturn.turn")
    assert turn["parent_span_id"] == CLIENT_SPAN and turn["service"] == "kvturn-router"
    children = {s["service"]: s for s in spans if s["parent_span_id"] == turn["span_id"]}
    assert set(children) == {"kvturn-prefill", "kvturn-decode"}
    prefill, decode = children["kvturn-prefill"], children["kvturn-decode"]
    assert prefill["name"] == decode["name"] == "llm_request"

    a = turn["attributes"]
    assert a["kvturn.lookup"] == "hit" and a["kvturn.path"] == "pull" and a["kvturn.reuse"] == "reused"
    assert a["kvturn.path.predicted_ttft_ms.pull"] > 0 and a["kvturn.path.predicted_ttft_ms.recompute"] > 0
    assert a["kvturn.retries"] == 0 and a["kvturn.conversation.derived"] is False
    assert a["kvturn.kv_read.d_to_p.tokens"] == report["prompt_tokens_from_decode"] > 0
    assert a["kvturn.kv_read.d_to_p.bytes"] == report["bytes_d_to_p"] > 0
    assert a["kvturn.kv_read.p_to_d.bytes"] == report["bytes_p_to_d"] > 0
    assert a["kvturn.kv_tier"] == "pool"
    assert a["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.cached_tokens"] == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == reply["usage"]["completion_tokens"] == 8
    assert 0 < a["gen_ai.latency.kv_cache_transfer_time"] <= a["gen_ai.latency.e2e"]

    p = prefill["attributes"]
    assert p["kvturn.role"] == "prefill" and p["kvturn.reuse"] == "reused"
    assert p["kvturn.kv_read.source"] == "decode_lease" and p["kvturn.kv_tier"] == "pool"
    assert p["kvturn.kv_read.tokens"] == report["prompt_tokens_from_decode"]
    assert p["kvturn.kv_read.bytes"] == report["bytes_d_to_p"] and p["kvturn.kv_read.seconds"] > 0
    assert p["gen_ai.latency.kv_cache_transfer_time"] == p["kvturn.kv_read.seconds"]
    assert p["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"] and p["gen_ai.usage.completion_tokens"] == 1
    for name in ("gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_queue",
                 "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.e2e", "gen_ai.request.id"):
        assert name in p and name in decode["attributes"], name

    d = decode["attributes"]
    assert d["kvturn.role"] == "decode" and d["kvturn.kv_read.source"] == "prefill_pin"
    assert d["kvturn.kv_read.bytes"] == report["bytes_p_to_d"]
    assert d["gen_ai.usage.completion_tokens"] == 8
    assert turn["start_ns"] <= prefill["start_ns"] <= decode["start_ns"] <= decode["end_ns"] <= turn["end_ns"]


def test_without_a_client_trace_each_turn_starts_its_own(stack, receiver):
    result = send(stack.url, [{"role": "user", "content": "A turn of its own."}], "own-trace", stream=True)
    assert result["text"]
    deadline = time.monotonic() + TRACE_GUARD_S
    while not (roots := [s for s in receiver.received() if s["name"] == "kvturn.turn" and s["parent_span_id"] is None
                         and s["attributes"].get("kvturn.stream") is True]):
        assert time.monotonic() < deadline, "the streamed turn's span never came"
        time.sleep(0.1)
    spans = spans_of(receiver, roots[-1]["trace_id"], 3)
    assert {s["service"] for s in spans} == {"kvturn-router", "kvturn-prefill", "kvturn-decode"}
    assert roots[-1]["attributes"]["gen_ai.latency.time_to_first_token"] > 0
