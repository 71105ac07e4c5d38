"""kvturn's router in front of vLLM workers, with fake vLLM workers (tests/fake_vllm.py) that answer at once in
vLLM's shapes: what the router does around them, without vLLM's venv (`make test-vllm` runs the real thing)."""
import json
from contextlib import contextmanager

import httpx
import pytest

from chat import SYSTEM, metric, send, user_message
from fake_vllm import FakeVLLM
from kvturn import launch

SYSTEM_PROMPT = SYSTEM * 4  # ~1.2k tokens: several whole blocks of 128 to reuse


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fake-vllm")
    prefill, decode = FakeVLLM(launch.free_port(), workdir, tiny_model_dir), \
        FakeVLLM(launch.free_port(), workdir, tiny_model_dir)
    try:
        prefill.wait_listening()
        decode.wait_listening()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(autouse=True)
def fresh_scripts(workers):
    for worker in workers:
        worker.configure({"record": True})
        worker.clear()


@contextmanager
def router(workers, log_dir, *args: str):
    prefill, decode = workers
    port = launch.free_port()
    process = launch.start(["router", "--backend", "vllm", "--prefill", prefill.url, "--decode", decode.url,
                            "--port", str(port), *args], log_dir / f"router-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(url, process)
        yield url
    finally:
        launch.stop(process)


def test_prefill_failing_on_decode_params_is_retried_without_them_and_the_client_gets_its_answer(workers,
                                                                                                 tmp_path):
    prefill, _ = workers
    with router(workers, tmp_path) as url:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(0)]
        first = send(url, messages, "conv-fail", stream=False)
        messages += [{"role": "assistant", "content": first["text"]}, user_message(1)]
        prefill.configure({"record": True, "fail_reads": 500})  # as vLLM's P when D's handle has expired
        prefill.clear()
        second = send(url, messages, "conv-fail", stream=False)
        retries = metric(url, "kvturn_router_retries_total", '{reason="prefill_failed_with_reuse"}')
    assert second["text"] == first["text"]  # the fake decode worker answers every prompt alike
    assert second["kvturn"]["reuse"] == "failed_with_reuse" and second["kvturn"]["tokens_passed"] == 0
    with_reuse, without = (body["kv_transfer_params"] for body in prefill.posts("/v1/chat/completions"))
    assert with_reuse["remote_block_ids"] and with_reuse["remote_num_tokens"] == second["kvturn"]["tokens_verified"] \
        // 128 * 128
    assert without["remote_block_ids"] is None and "remote_num_tokens" not in without
    assert retries == 1


def test_a_decode_answer_that_is_not_json_is_a_502_in_openai_shape(workers, tmp_path):
    _, decode = workers
    decode.configure({"garbled_decode": True})
    with router(workers, tmp_path) as url:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(0)]
        response = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                              json={"model": "tiny", "messages": messages, "max_tokens": 4})
        errors = metric(url, "kvturn_router_requests_total", '{outcome="decode_error"}')
    assert response.status_code == 502
    assert response.json()["error"]["message"] == "the decode worker's answer is not a JSON object"
    assert errors == 1


def reuse_of_three_turns(url: str, conversation_id: str) -> list[tuple]:
    """An extended history, then one with an earlier user message edited: (outcome, claimed, verified, passed)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(0)]
    replies = [send(url, messages, conversation_id, stream=False)]
    messages += [{"role": "assistant", "content": replies[-1]["text"]}, user_message(1)]
    replies.append(send(url, messages, conversation_id, stream=False))
    messages += [{"role": "assistant", "content": replies[-1]["text"]}, user_message(2)]
    messages[3] = {"role": "user", "content": "an edited tool result"}
    replies.append(send(url, messages, conversation_id, stream=False))
    return [tuple(r["kvturn"][k] for k in ("reuse", "tokens_claimed", "tokens_verified", "tokens_passed"))
            for r in replies]


def test_usage_counts_as_cached_what_prefill_did_not_compute_not_what_decode_read_from_it(workers, tmp_path):
    """vLLM's decode counts the prompt it loaded from P as cached; the turn computed it on P. What P did not compute
    (its cache and what it loaded from D) is what P's params say."""
    with router(workers, tmp_path) as url:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(0)]
        first = send(url, messages, "conv-usage", stream=False)
        messages += [{"role": "assistant", "content": first["text"]}, user_message(1)]
        second = send(url, messages, "conv-usage", stream=True)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    passed = second["kvturn"]["tokens_passed"]
    assert second["kvturn"]["reuse"] == "passed" and 0 < passed < second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == passed


def test_a_local_tokenizer_caps_reuse_exactly_as_the_backends_tokenize(workers, tiny_model_dir, tmp_path):
    prefill, _ = workers
    with router(workers, tmp_path) as url:
        remote = reuse_of_three_turns(url, "conv-remote")
    assert [r[0] for r in remote] == ["no_params", "passed", "capped"]
    assert 0 < remote[2][3] < remote[2][2] < remote[2][1]
    prefill.clear()
    with router(workers, tmp_path, "--tokenizer", str(tiny_model_dir)) as url:
        local = reuse_of_three_turns(url, "conv-local")
    assert local == remote
    assert prefill.posts("/tokenize") == []
    assert all(body["kv_transfer_params"]["prompt_token_ids"] for body in prefill.posts("/v1/chat/completions"))


def test_a_streamed_turn_is_retained_for_the_next_and_the_router_reports_its_own_work(workers, tmp_path):
    _, decode = workers
    with router(workers, tmp_path) as url:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(0)]
        first = send(url, messages, "conv-stream", stream=True)
        messages += [{"role": "assistant", "content": first["text"]}, user_message(1)]
        second = send(url, messages, "conv-stream", stream=False)
        retention_calls = metric(url, "kvturn_router_vllm_streamed_turns_total", '{kv_params="retention_call"}')
        own_work_turns = metric(url, "kvturn_router_own_work_seconds_count")
    retention = decode.posts("/v1/completions")
    assert len(retention) == 1 and retention[0]["max_tokens"] == 1
    assert second["kvturn"]["reuse"] == "passed" and second["kvturn"]["tokens_passed"] > 0
    assert retention_calls == 1 and own_work_turns == 2
    assert 0 < second["kvturn"]["timing"]["router_cpu_ms"] and 0 < second["kvturn"]["timing"]["router_ms"]


def test_a_stream_whose_params_are_not_an_object_still_ends_cleanly_and_leaves_nothing_to_reuse(workers, tmp_path):
    _, decode = workers
    decode.configure({"record": True, "stream_kv_params": "not an object"})
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(0)]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True, "conversation_id": "conv-junk"}
    with router(workers, tmp_path) as url:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        answered = metric(url, "kvturn_router_requests_total", '{outcome="ok"}')
        messages += [{"role": "assistant", "content": "".join(
            (json.loads(e[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or "" for e in events[:-1])},
            user_message(1)]
        second = send(url, messages, "conv-junk", stream=False)
    assert events[-1] == "data: [DONE]" and answered == 1
    assert second["kvturn"]["reuse"] == "no_params"
