"""Hostile input against a real worker and router: every answer is JSON (a 4xx/5xx error or a valid
response), no process dies, and /health stays OK afterwards."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvturn.launch import LocalStack

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "kv_transfer_params",
          "conversation_id", "logprobs", "unknown_field"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", 3]),
                                           "content": st.one_of(st.text(max_size=60), st.integers(), st.none())}),
                    max_size=3)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6).flatmap(
    lambda body: st.fixed_dictionaries({"messages": messages, "prompt": st.one_of(st.text(max_size=60), values)})
    .map(lambda extra: {**extra, **body}))


@pytest.fixture(scope="module")
def targets(tiny_model_dir, tmp_path_factory):
    """A worker and a router, both with a short max_model_len so any valid request is quick."""
    stack = LocalStack(tiny_model_dir, kv_cache_mb=32, worker_args=["--max-model-len", "256"],
                       log_dir=tmp_path_factory.mktemp("fuzz-logs"))
    with stack:
        yield {"worker": stack.urls["decode0"], "router": stack.url}, stack


def check(response: httpx.Response) -> None:
    assert response.status_code < 600
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        return
    payload = response.json()  # never HTML or a dropped connection
    if response.status_code != 200:
        assert {"message", "type", "code"} <= set(payload["error"])


@pytest.mark.parametrize("target", ["worker", "router"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans())
def test_random_bodies_get_json_answers(targets, target, body, chat):
    urls, _ = targets
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {k: v for k, v in body.items() if k != "max_tokens"} | {"max_tokens": body.get("max_tokens", 4)}
    raw = json.dumps(body, allow_nan=True).encode()
    check(httpx.post(urls[target] + path, content=raw, headers={"content-type": "application/json"}, timeout=60))


@pytest.mark.parametrize("target", ["worker", "router"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_random_bytes_get_json_answers(targets, target, raw):
    urls, _ = targets
    check(httpx.post(urls[target] + "/v1/chat/completions", content=raw + b"\xff\xfe",
                     headers={"content-type": "application/json"}, timeout=30))


def test_everything_is_still_healthy(targets):
    urls, stack = targets
    for name, process in stack.processes.items():
        assert process.poll() is None, f"{name} died"
    for url in urls.values():
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    reply = httpx.post(urls["router"] + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4})
    assert reply.status_code == 200
