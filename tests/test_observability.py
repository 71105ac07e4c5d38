"""What operators see: OpenTelemetry traces of a turn (router and workers exporting to a real OTLP receiver started
here) and the metrics a Grafana dashboard queries, on one running stack (router + P with its cache off + D)."""
import json
import re
import time
from pathlib import Path

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


DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "kvturn.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def series_queried(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: not functions, keywords, labels, numbers or durations."""
    expr = re.sub(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,[^)]*\)", r"\1", expr)
    for pattern in (r'"(?:[^"\\]|\\.)*"', r"\{[^}]*\}", r"\[[^\]]*\]",
                    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"):
        expr = re.sub(pattern, " ", expr)
    names = re.findall(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", expr)
    return {name for name in names if name.lower() not in PROMQL_WORDS}


def test_series_queried_reads_names_only():
    assert series_queried('histogram_quantile(0.9, sum by (le, instance) (rate(vllm:x_bucket{model_name=~"$m"}'
                          '[$__rate_interval])))') == {"vllm:x_bucket"}
    assert series_queried("sum(rate(a_total[5m])) / sum(rate(b_total[5m]))") == {"a_total", "b_total"}
    assert series_queried("label_values(vllm:num_requests_running, model_name)") == {"vllm:num_requests_running"}


def exposed_series(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_series_the_grafana_dashboard_queries_exists_on_a_running_stack(stack):
    messages = [{"role": "system", "content": SYSTEM}, user_message(0)]
    first = send(stack.url, messages, "dashboard", stream=True)
    send(stack.url, messages + [{"role": "assistant", "content": first["text"]}, user_message(1)], "dashboard",
         stream=True)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    queried = set().union(*(series_queried(expr) for expr in queries))
    exposed = set().union(*(exposed_series(url) for url in stack.urls.values()))
    assert queried and queried <= exposed, sorted(queried - exposed)
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:prefix_cache_hits_total",
                 "vllm:nixl_xfer_time_seconds_bucket", "vllm:nixl_bytes_transferred_sum",
                 "kvturn_router_kv_transferred_bytes_total", "kvturn_kv_tier_retained_bytes"):
        assert name in queried, name


def test_the_vllm_named_metrics_count_what_vllms_do(stack):
    """Prompt tokens by source add up to vLLM's total; D's reads of P's blocks are its external hits."""
    send(stack.url, [{"role": "user", "content": "Counted by source."}], "by-source", stream=False)
    samples = {}
    for line in httpx.get(f"{stack.urls['decode0']}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            samples[(name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(value)

    def sample(name: str, **labels) -> float:
        wanted = {"engine": "0", "model_name": stack_model(stack), **labels}
        return samples[(name, frozenset(wanted.items()))]

    by_source = {s: sample("vllm:prompt_tokens_by_source_total", source=s)
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(by_source.values()) == sample("vllm:prompt_tokens_total") > 0
    assert by_source["external_kv_transfer"] == sample("vllm:external_prefix_cache_hits_total") > 0
    assert sample("vllm:nixl_bytes_transferred_count") > 0 and sample("vllm:nixl_xfer_time_seconds_count") > 0


def stack_model(stack) -> str:
    return httpx.get(f"{stack.url}/v1/models", timeout=10).json()["data"][0]["id"]
