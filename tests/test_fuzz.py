"""Hostile input against a real worker and router: every answer is a valid completion, a well-formed event
stream, or an OpenAI-shaped 400/404; no process dies, and /health stays OK afterwards.

`make test` runs a fixed, derandomized profile (the same examples every run); `make fuzz` runs a long random one."""
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
    """A request either succeeds in full or is refused as the client's fault; never a 5xx, never non-JSON."""
    assert response.status_code in (200, 400, 404), response.text[:300]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks and all("error" not in chunk for chunk in chunks)
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
        return
    payload = response.json()
    if response.status_code == 200:
        assert payload["choices"][0]["finish_reason"] in ("stop", "length")
        assert payload["usage"]["completion_tokens"] >= 1
    else:
        error = payload["error"]
        assert error["code"] == response.status_code and error["type"] and error["message"]


@pytest.mark.parametrize("target", ["worker", "router"])
@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, chat=st.booleans())
def test_random_bodies_get_json_answers(targets, target, body, chat):
    urls, _ = targets
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {k: v for k, v in body.items() if k != "max_tokens"} | {"max_tokens": body.get("max_tokens", 4)}
    raw = json.dumps(body, allow_nan=True).encode()
    check(httpx.post(urls[target] + path, content=raw, headers={"content-type": "application/json"}, timeout=60))


@pytest.mark.parametrize("target", ["worker", "router"])
@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_random_bytes_get_json_answers(targets, target, raw):
    urls, _ = targets
    response = httpx.post(urls[target] + "/v1/chat/completions", content=raw + b"\xff\xfe",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("target", ["worker", "router"])
@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": Infinity}',
    b'{"prompt": "x", "top_p": -Infinity}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": ' + b"[" * 200 + b"1" + b"]" * 200 + b"}",
    b'{"messages": [{"role": "user", "content": "x\\ud800y"}], "prompt": "x\\udfff"}',  # lone surrogates
    b'{"prompt": "x", "conversation_id": "c\\ud800"}',
])
def test_non_json_numbers_absurd_nesting_and_lone_surrogates_get_a_400(targets, target, raw):
    urls, _ = targets
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = httpx.post(urls[target] + path, content=raw, headers={"content-type": "application/json"},
                              timeout=30)
        assert response.status_code == 400
        assert "malformed JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize("target", ["worker", "router"])
def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(targets, target, tiny_model_dir):
    """More characters than the longest tokens of the vocabulary could fill the context with: a 400 at once, not
    a worker busy tokenizing (tens of seconds for tens of MB, /health unanswered meanwhile)."""
    from kvturn.model.tokenizer import ChatTokenizer
    urls, _ = targets
    context = json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]
    text = "x" * (context * ChatTokenizer(tiny_model_dir).max_token_chars + 1)
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        response = httpx.post(urls[target] + path, json={**body, "max_tokens": 1}, timeout=30)
        assert response.status_code == 400
        assert "characters, more than that many tokens can hold" in response.json()["error"]["message"]


@pytest.mark.parametrize("target", ["worker", "router"])
def test_unknown_routes_and_methods_get_openai_errors(targets, target):
    urls, _ = targets
    missing = httpx.get(urls[target] + "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    wrong = httpx.get(urls[target] + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405


def test_everything_is_still_healthy(targets):
    urls, stack = targets
    for name, process in stack.processes.items():
        assert process.poll() is None, f"{name} died"
    for url in urls.values():
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    reply = httpx.post(urls["router"] + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4})
    assert reply.status_code == 200
