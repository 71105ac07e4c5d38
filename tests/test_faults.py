"""Failure handling with real processes: killed, stopped and restarted workers, secrets, shutdown."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from chat import conversation, metric, send, user_message
from kvturn.config import ConnectorConfig, EngineConfig
from kvturn.engine.llm_engine import LLMEngine
from kvturn.engine.sampling import SamplingParams
from kvturn.engine.sequence import Sequence
from kvturn.kv_transfer.connector import KVConnector, RemoteBlocks
from kvturn.launch import LocalStack, free_port, start, stop
from kvturn.model.loader import load_model

SECRET = "test-cluster-secret"
NO_CALIBRATION = ["--no-calibrate"]  # the path is fixed (pull): start-up timing would only slow each (re)start


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """Router with SQLite state + 1 P + 2 D, all sharing a cluster secret."""
    logs = tmp_path_factory.mktemp("fault-logs")
    state = tmp_path_factory.mktemp("state") / "router.sqlite"
    built = LocalStack(tiny_model_dir, num_decode=2, kv_cache_mb=64, log_dir=logs, prefix_caching_on_prefill=False,
                       worker_args=["--side-channel-timeout-s", "2", *NO_CALIBRATION],
                       env={"KVTURN_CLUSTER_SECRET": SECRET},
                       router_args=["--state", str(state), "--upstream-timeout-s", "10", "--health-interval-s", "1",
                                    "--no-worker-wait-s", "300"])  # a restart outlasts the default on a busy machine
    with built:
        yield built


def holder(stack, result) -> str:
    return next(name for name, url in stack.urls.items() if url == result["kvturn"]["decode_worker"])


def test_side_channel_refuses_a_wrong_or_missing_secret_and_counts_it(stack):
    url = stack.urls["prefill"]
    before = metric(url, "kvturn_side_channel_refused_total")
    assert httpx.get(f"{url}/kv/agent").status_code == 403
    assert httpx.get(f"{url}/kv/agent", headers={"X-Kvturn-Cluster-Secret": "guess"}).status_code == 403
    assert httpx.post(f"{url}/kv/lease/acquire", json={"handle": "h", "binding_key": "k"}).status_code == 403
    assert metric(url, "kvturn_side_channel_refused_total") - before == 3
    assert httpx.get(f"{url}/kv/agent", headers={"X-Kvturn-Cluster-Secret": SECRET}).status_code == 200
    _, results = conversation(stack.url, 2, conversation_id="secret-ok")  # peers with the secret still reuse
    assert results[1]["kvturn"]["reuse"] == "reused"


def test_router_restart_keeps_the_conversation_table(stack):
    messages, results = conversation(stack.url, 2, conversation_id="restart")
    stack.restart("router")
    messages.append(user_message(2))
    result = send(stack.url, messages, "restart", stream=False)
    assert result["kvturn"]["reuse"] == "reused" and result["kvturn"]["prompt_tokens_from_decode"] > 0


def test_decode_killed_mid_stream_gives_a_clean_error_and_the_next_turn_recomputes(stack, tiny_model_dir):
    messages, results = conversation(stack.url, 1, conversation_id="midstream")
    victim = holder(stack, results[0])
    messages.append(user_message(1))
    body = {"messages": messages, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True,
            "conversation_id": "midstream"}
    events = []
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        content_lines = 0
        for line in lines:  # the first token comes from P (sent ahead by the router); the second from D
            content_lines += line.startswith("data: {") and '"content":"' in line and '"content":""' not in line
            if content_lines == 2:
                break
        stack.kill(victim, signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]
    errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
    assert errors and errors[0]["error"]["code"] == 503
    assert "data: [DONE]" not in events
    messages.append({"role": "assistant", "content": "(interrupted)"})
    messages.append(user_message(2))
    result = send(stack.url, messages, "midstream", stream=False)
    assert result["kvturn"]["reuse"] != "reused" and result["kvturn"]["decode_worker"] != stack.urls[victim]
    stack.restart(victim)


def test_stopped_decode_worker_makes_prefill_recompute(stack):
    messages, results = conversation(stack.url, 1, conversation_id="sigstop")
    victim = holder(stack, results[0])
    stack.kill(victim, signal.SIGSTOP)
    try:
        messages.append(user_message(1))
        result = send(stack.url, messages, "sigstop", stream=False)
        assert result["kvturn"]["reuse"] == "peer_unreachable"
        assert result["kvturn"]["decode_worker"] != stack.urls[victim]
    finally:
        stack.kill(victim, signal.SIGCONT)


def test_a_turn_waits_for_a_killed_prefill_worker_and_completes_once_it_is_back(stack):
    stack.kill("prefill", signal.SIGKILL)
    answers: queue.Queue = queue.Queue()
    body = {"messages": [user_message(0)], "max_tokens": 4}
    threading.Thread(target=lambda: answers.put(httpx.post(f"{stack.url}/v1/chat/completions", json=body,
                                                           timeout=300)), daemon=True).start()
    stack.restart("prefill")  # within the router's no_worker_wait_s
    response = answers.get(timeout=300)
    assert response.status_code == 200, response.text


def test_a_turn_that_finds_no_worker_within_the_wait_gets_an_openai_503(tmp_path):
    port = free_port()
    nowhere = "http://127.0.0.1:9"
    router = start(["router", "--port", str(port), "--prefill", nowhere, "--decode", nowhere,
                    "--no-worker-wait-s", "0.5"], tmp_path / "router.log")
    try:
        wait_healthy_or_503(f"http://127.0.0.1:{port}", router)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                              json={"messages": [user_message(0)], "max_tokens": 4}, timeout=60)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == 503 and "no prefill worker" in response.json()["error"]["message"]
    finally:
        stop(router)


def wait_healthy_or_503(url: str, process) -> None:
    """Until the router answers /health at all (503 there: it has no worker)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None
        try:
            httpx.get(f"{url}/health", timeout=2)
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def test_sigterm_drains_the_in_flight_stream(tiny_model_dir, tmp_path):
    with LocalStack(tiny_model_dir, mode="colocated", kv_cache_mb=32, worker_args=NO_CALIBRATION,
                    log_dir=tmp_path) as single:
        body = {"prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{single.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            single.processes["worker"].send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert single.processes["worker"].wait(timeout=30) in (0, -signal.SIGTERM)


def test_a_hung_kv_read_times_out_and_the_request_recomputes(tiny_model_dir):
    """NIXL READ from a SIGSTOPped peer: the engine gives up after kv_read_timeout_s, keeps the target blocks
    out of use until NIXL lets go of them, and computes the prompt itself, with the same output."""
    remote = subprocess.Popen([sys.executable, "-m", "kvturn.bench.nixl_read", "--serve", "64",
                               str(tiny_model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("HELLO "):
            line = remote.stdout.readline()
            assert line, "remote side exited"
        info = json.loads(line[6:])["info"]
        outputs = []
        engine = LLMEngine(load_model(tiny_model_dir), EngineConfig(kv_cache_mb=16),
                           emit=lambda out: outputs.extend(out.new_token_ids), detokenize=lambda ids: "",
                           eos_token_ids=set())
        now = [0.0]  # the connector's clock, moved by hand
        connector = KVConnector(engine, ConnectorConfig(kv_read_timeout_s=1.0), clock=lambda: now[0])
        connector.nixl.add_peer(info)
        os.kill(remote.pid, signal.SIGSTOP)
        prompt = torch.randint(3, 4000, (300,), generator=torch.Generator().manual_seed(5)).tolist()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        from kvturn.engine.block_manager import block_hashes
        hashes = block_hashes(prompt, 16)
        remote_blocks = RemoteBlocks(info["engine_id"], list(range(len(hashes))), hashes, [0] * len(hashes),
                                     now[0] + 60, "handle")
        engine.add_request(Sequence("hung", prompt, params, remote=remote_blocks))
        for _ in range(20):  # the read is posted and polled; no time passes on the connector's clock
            engine.step()
            time.sleep(0.01)
        in_flight = len(connector.loads) + len(connector.layered.reads)  # a whole read, or one layer by layer
        assert in_flight == 1 and not outputs and not connector.stats.reuse_declines["peer_unreachable"]
        now[0] += 1.01  # past kv_read_timeout_s
        hang_guard = time.monotonic() + 60
        while "hung" in engine.sequences:
            assert time.monotonic() < hang_guard, "the request neither read nor recomputed"
            if not engine.step():
                time.sleep(0.005)
        assert connector.stats.reuse_declines["peer_unreachable"] == 1 and len(outputs) == 8
        reference = []
        plain = LLMEngine(load_model(tiny_model_dir), EngineConfig(kv_cache_mb=16),
                          emit=lambda out: reference.extend(out.new_token_ids), detokenize=lambda ids: "",
                          eos_token_ids=set())
        plain.add_request(Sequence("plain", prompt, params))
        while plain.has_work():
            plain.step()
        assert outputs == reference
        assert connector.abandoned, "the in-flight read's blocks must stay held while NIXL may still write them"
    finally:
        os.kill(remote.pid, signal.SIGCONT)
        remote.stdin.close()
        remote.wait(timeout=30)


def test_decode_refuses_a_prefill_peer_with_another_layout_and_computes_itself(tiny_model_dir, tmp_path):
    with LocalStack(tiny_model_dir, kv_cache_mb=32, prefill_args=["--block-size", "32"], worker_args=NO_CALIBRATION,
                    log_dir=tmp_path) as pair:
        messages = [{"role": "system", "content": "layouts " * 80}, user_message(0)]
        result = send(pair.url, messages, "layout", stream=False)
        decode = result["kvturn"]["decode"]
        assert decode["reuse"] == "layout_mismatch" and decode["prompt_tokens_remote"] == 0
        assert decode["prompt_tokens_computed"] == result["usage"]["prompt_tokens"]
        assert metric(pair.urls["decode0"], "kvturn_kv_reuse_declines_total", '{reason="layout_mismatch"}') == 1
