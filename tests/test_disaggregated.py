"""P/D disaggregation and bidirectional KV transfer: real worker processes, real NIXL reads on loopback."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from chat import SYSTEM, conversation, metric, send, user_message
from kvturn.config import SERVER_KEEP_ALIVE_S
from kvturn.launch import LocalStack
from kvturn.plan import trace
from kvturn.router.upstream import IDLE_CONNECTION_S

BLOCK_BYTES = 4 * 2 * 16 * 2 * 64 * 4  # tiny model: layers * (k, v) * block_size * kv_heads * head_dim * fp32
TURNS = 5
NO_CALIBRATION = ["--no-calibrate"]  # the path is fixed (pull): start-up timing would only queue workers on its lock


@pytest.fixture(scope="module")
def stacks(tiny_model_dir, tmp_path_factory):
    """Five deployments started together (their start-up overlaps)."""
    logs = tmp_path_factory.mktemp("stack-logs")
    specs = {
        "colocated": {"mode": "colocated"},
        "pd": {"bidirectional": False, "pin_workers": True},  # P and D on cores of their own (with two or more)
        "bidir": {"prefix_caching_on_prefill": False},
        # prefix cache on P, two decode workers, a short lease: for threshold, expiry and failover
        "bidir2": {"num_decode": 2, "decode_args": ["--decoder-kv-blocks-ttl-s", "8"]},
        # one test's alone: its P starts knowing no peer
        "fresh": {"prefix_caching_on_prefill": False},
    }
    built = {name: LocalStack(tiny_model_dir, kv_cache_mb=64, log_dir=logs / name, worker_args=NO_CALIBRATION,
                              **spec) for name, spec in specs.items()}
    try:
        for stack in built.values():  # launch all processes first, then wait for each
            stack.start_worker_processes()
        for stack in built.values():
            stack.wait_and_start_router()
        yield built
    finally:
        with ThreadPoolExecutor(len(built)) as stopping:  # each stack stops its processes one at a time
            list(stopping.map(LocalStack.stop, built.values()))


@pytest.fixture(scope="module")
def reference(stacks):
    return conversation(stacks["colocated"].url, TURNS)


def test_greedy_outputs_identical_colocated_pd_and_bidirectional(stacks, reference):
    _, expected = reference
    for name in ("pd", "bidir"):
        _, results = conversation(stacks[name].url, TURNS)
        assert [r["text"] for r in results] == [r["text"] for r in expected], name


def test_bidirectional_turns_read_history_from_decode(stacks, reference):
    stack = stacks["bidir"]
    computed_before = metric(stack.urls["prefill"], "kvturn_prompt_tokens_computed_total")
    bytes_before = metric(stack.urls["prefill"], "kvturn_kv_read_bytes_total")
    _, results = conversation(stack.url, TURNS, conversation_id="conv-reads")
    assert results[0]["kvturn"]["reuse"] is None
    computed_total = results[0]["kvturn"]["prompt_tokens_computed_prefill"]
    for previous, current in zip(results, results[1:]):
        kv = current["kvturn"]
        assert kv["reuse"] == "reused"
        new_tokens = current["usage"]["prompt_tokens"] - previous["usage"]["prompt_tokens"] - 16
        assert kv["prompt_tokens_computed_prefill"] <= new_tokens + 2 * 16  # the new turn plus a partial block
        assert kv["prompt_tokens_computed_prefill"] + kv["prompt_tokens_from_decode"] == current["usage"]["prompt_tokens"]
        assert kv["bytes_d_to_p"] == kv["prompt_tokens_from_decode"] // 16 * BLOCK_BYTES
        assert kv["timing"]["d_to_p_read_ms"] > 0
        assert 0 <= kv["prefill_timing"]["kv_read_step_ms"] <= kv["timing"]["d_to_p_read_ms"]
        assert kv["decode"]["prompt_tokens_computed"] == 0  # D read every prompt block and took P's first token
        computed_total += kv["prompt_tokens_computed_prefill"]
    read_bytes = sum(r["kvturn"]["bytes_d_to_p"] for r in results)
    assert metric(stack.urls["prefill"], "kvturn_kv_read_bytes_total") - bytes_before == read_bytes
    assert metric(stack.urls["prefill"], "kvturn_prompt_tokens_computed_total") - computed_before == computed_total


def test_edited_history_reuses_only_the_matching_prefix(stacks, reference):
    stack = stacks["bidir"]
    messages, _ = conversation(stack.url, 3, conversation_id="conv-edit")
    edited = [dict(m) for m in messages] + [user_message(3)]
    edited[1]["content"] = edited[1]["content"].replace("Tool result 0", "Tool result 0 (edited)")
    result = send(stack.url, edited, "conv-edit", stream=False)
    expected = send(stacks["colocated"].url, edited, None, stream=False)
    assert result["text"] == expected["text"]
    system_tokens = send(stacks["colocated"].url, edited[:1], None, stream=False, max_tokens=1)["usage"]["prompt_tokens"]
    reused = result["kvturn"]["prompt_tokens_from_decode"]
    assert result["kvturn"]["reuse"] == "reused" and 0 < reused <= system_tokens + 16


def as_router(stack) -> dict:
    """Headers of a caller inside the cluster: only such a caller may name a peer for a worker to read from."""
    return {"X-Kvturn-Cluster-Secret": stack.cluster_secret}


def test_a_retained_handle_can_be_read_twice(stacks):
    """A retried turn presents the same lease again and still gets the history."""
    stack = stacks["bidir"]
    messages, results = conversation(stack.url, 1, conversation_id="conv-retry")
    lease = send(stack.urls["decode0"], messages[:-1], "conv-retry-direct", stream=False)["kv_transfer_params"]
    next_turn = messages[:-1] + [{"role": "assistant", "content": results[0]["text"]}, user_message(1)]
    attempts = []
    for _ in range(2):
        kv = {**lease, "do_remote_decode": True, "do_remote_prefill": False}
        body = {"messages": next_turn, "max_tokens": 1, "temperature": 0, "kv_transfer_params": kv,
                "conversation_id": "conv-retry-direct"}
        attempts.append(httpx.post(f"{stack.urls['prefill']}/v1/chat/completions", json=body, timeout=60,
                                   headers=as_router(stack)).json())
    assert [a["kvturn"]["reuse"] for a in attempts] == ["reused", "reused"]
    assert attempts[0]["kvturn"]["prompt_tokens_remote"] == attempts[1]["kvturn"]["prompt_tokens_remote"] > 0


def test_a_handle_is_bound_to_its_conversation(stacks):
    stack = stacks["bidir"]
    messages, _ = conversation(stack.url, 1, conversation_id="conv-owner")
    lease = send(stack.urls["decode0"], messages[:-1], "conv-owner", stream=False)["kv_transfer_params"]
    kv = {**lease, "do_remote_decode": True, "do_remote_prefill": False}
    body = {"messages": messages + [user_message(1)], "max_tokens": 1, "kv_transfer_params": kv,
            "conversation_id": "conv-intruder"}
    result = httpx.post(f"{stack.urls['prefill']}/v1/chat/completions", json=body, timeout=60,
                        headers=as_router(stack)).json()
    # The lease's MAC binds it to its conversation: another's is refused before D is even asked.
    assert result["kvturn"]["reuse"] == "unsigned_record" and result["kvturn"]["prompt_tokens_remote"] == 0


def test_reusable_tokens_below_threshold_are_recomputed(stacks):
    stack = stacks["bidir2"]  # P keeps its own prefix cache: D's lease adds only the 16-token answer
    _, results = conversation(stack.url, 2, conversation_id="conv-threshold")
    assert results[1]["kvturn"]["reuse"] == "below_threshold"
    assert results[1]["kvturn"]["prompt_tokens_cached_prefill"] > 0
    assert metric(stack.urls["prefill"], "kvturn_kv_reuse_declines_total", '{reason="below_threshold"}') >= 1


def test_lease_about_to_expire_is_declined(stacks, reference):
    stack = stacks["bidir2"]  # 8 s lease, P declines reads within 5 s of the end
    messages, _ = conversation(stack.url, 1, conversation_id="conv-expiry", start=[{"role": "system",
                                                                                   "content": "x " * 400}])
    time.sleep(3.5)
    result = send(stack.url, messages + [user_message(1)], "conv-expiry", stream=False)
    assert result["kvturn"]["reuse"] == "expired"
    assert result["kvturn"]["prompt_tokens_from_decode"] == 0


def test_decode_killed_between_turns_falls_back_to_recompute(stacks, reference):
    stack = stacks["bidir2"]
    messages, results = conversation(stack.url, 2, conversation_id="conv-kill",
                                     start=[{"role": "system", "content": "y " * 400}])
    holder = next(name for name, url in stack.urls.items() if url == results[-1]["kvturn"]["decode_worker"])
    stack.kill(holder, signal.SIGKILL)
    messages.append(user_message(2))
    result = send(stack.url, messages, "conv-kill", stream=False)
    # P does not ask the dead D before reading (the router relays D's lease record): its own prefix cache
    # covers the history here, or the read from the dead worker fails; never is KV of it used.
    assert result["kvturn"]["reuse"] in ("covered_locally", "read_failed", "peer_unreachable")
    assert result["kvturn"]["prompt_tokens_from_decode"] == 0
    assert result["kvturn"]["decode_worker"] != stack.urls[holder]
    expected = send(stacks["colocated"].url, messages, None, stream=False)
    assert result["text"] == expected["text"]


def test_bench_cli_measures_reuse_against_the_router(stacks, tiny_model_dir, tmp_path):
    """`kvturn bench --url` against a live stack: vLLM-named stats, kvturn split, report files."""
    workload_file = tmp_path / "agent.json"
    workload_file.write_text(json.dumps({"filetype": "kvturn_synthetic", "num_sessions": 2, "system_tokens": 300,
                                         "num_turns": 3, "new_tokens": 40, "answer_tokens": 8}))
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, "-m", "kvturn.cli", "bench", "--url", stacks["bidir"].url, "--workload",
                          str(workload_file), "--sessions", "2", "--model", str(tiny_model_dir), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    [leg] = results["legs"].values()
    requests = leg["requests"]
    assert len(requests) == 6 and not any(r["error"] for r in requests)
    for r in requests:
        assert r["ttft_ms"] > 0 and r["latency_ms"] >= r["ttft_ms"] and r["output_num_tokens"] == 8
        assert r["input_num_tokens"] > 300 and r["conversation_id"].startswith("session-")
        # P's engine's own wait (its queue, and a read from D) is recorded apart from its tokenizing and handling
        assert 0 <= r["engine_wait_ms"] <= r["queue_ms"] + r["d_to_p_read_ms"] + 1e-6
        assert r["decode_engine_wait_ms"] >= 0
    later = [r for r in requests if r["turn"] > 0]
    assert all(r["reuse"] == "reused" and r["bytes_d_to_p"] > 0 for r in later)
    # Each answer goes back as its text, which the bench counts: the next prompt grows by the tokens that text
    # came to and the user's new words (as `kvturn plan` counts them from the same workload and seed), within the
    # one token where the answer meets the next message.
    planned = trace.load(workload_file, lambda: str(tiny_model_dir), 0, 2)
    sent = {(r["conversation_id"], r["turn"]): r for r in requests}
    for session in planned.sessions:
        for turn, (before, after) in enumerate(zip(session.turns, session.turns[1:])):
            answered, next_prompt = sent[session.conversation_id, turn], sent[session.conversation_id, turn + 1]
            assert type(answered["answer_text_tokens"]) is int and answered["answer_text_tokens"] >= 0
            user_tokens = after.prompt_tokens - before.prompt_tokens - before.output_tokens
            grew = next_prompt["input_num_tokens"] - answered["input_num_tokens"]
            assert abs(grew - answered["answer_text_tokens"] - user_tokens) <= 1, (grew, answered, user_tokens)
    assert max(b for _, b in leg["retained_kv"]) > 0
    for name in ("report.html", "ttft_vs_prompt.png", "prefill_split.png", "session_time.png", "retained_kv.png"):
        assert (out / name).stat().st_size > 1000, name


def connect(url: str) -> socket.socket:
    """A raw TCP connection to the server at `url`, for requests no HTTP client would send."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def health(sock: socket.socket) -> bytes:
    """The status line of one GET /health on `sock`, its whole answer read; b"" if the server closed it."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: kvturn\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n")[0]


IDLE_S = 6  # past uvicorn's default keep-alive


@pytest.fixture(scope="module", autouse=True)
def idle_connections(stacks):
    """Connections to the pd stack's router and workers, each asked for /health before the module's first test and
    then left idle while the tests run: the keep-alive test waits only for what is left of IDLE_S."""
    connections = [connect(stacks["pd"].urls[name]) for name in ("router", "prefill", "decode0")]
    first_answers = [health(sock) for sock in connections]
    idle_from = time.monotonic()
    yield connections, first_answers, idle_from
    for sock in connections:
        sock.close()


def test_servers_keep_an_idle_connection_longer_than_their_clients_do(idle_connections):
    """A server that closes an idle connection first races a client sending on it at that moment: the request
    fails as a disconnect and the router takes the worker for dead (a bench run lost a turn so). kvturn's servers
    outlast uvicorn's default 5 s; the router reuses a connection for less than that, for servers it does not run."""
    assert IDLE_CONNECTION_S < 5 < SERVER_KEEP_ALIVE_S
    connections, first_answers, idle_from = idle_connections
    assert first_answers == [b"HTTP/1.1 200 OK"] * len(connections)
    time.sleep(max(0.0, idle_from + IDLE_S - time.monotonic()))
    for sock in connections:
        assert health(sock) == b"HTTP/1.1 200 OK"


def raw_answer(url: str, request: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """(status line, headers, body) of the one answer a server sends to `request` before it closes."""
    with connect(url) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    status, *lines = head.split(b"\r\n")
    headers = dict(line.split(b":", 1) for line in lines)
    return status, {name.strip().lower(): value.strip() for name, value in headers.items()}, body


@pytest.mark.parametrize("request_bytes", [b"GET /he\x01alth HTTP/1.1\r\nHost: kvturn\r\n\r\n",
                                           b"POST /v1/completions HTTP/1.1\r\nHost kvturn\r\n\r\n",
                                           b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not HTTP\r\n\r\n"])
def test_a_request_the_http_parser_refuses_gets_a_json_error(stacks, request_bytes):
    """A control character in the request line, a header line without a colon, a TLS hello: refused by the HTTP
    parser before any app sees them, and still answered with an OpenAI-shaped JSON error, by router and workers."""
    for name in ("router", "prefill", "decode0"):
        status, headers, body = raw_answer(stacks["pd"].urls[name], request_bytes)
        assert status.startswith(b"HTTP/1.1 400"), (name, status)
        assert headers[b"content-type"] == b"application/json" and headers[b"connection"] == b"close"
        error = json.loads(body)["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError"
        assert error["message"].startswith("malformed HTTP request")
    assert httpx.get(f"{stacks['pd'].urls['router']}/health").status_code == 200  # and it serves on


def test_kv_params_replayed_through_the_router_are_ignored(stacks):
    """A client cannot make the router hand another conversation's lease to a worker."""
    stack = stacks["bidir"]
    messages, _ = conversation(stack.url, 1, conversation_id="victim")
    stolen = send(stack.url, messages + [user_message(1)], "victim", stream=False,
                  extra={"return_kv_transfer_params": True})["kv_transfer_params"]
    assert stolen and stolen["handle"]
    replay = {**stolen, "do_remote_decode": True, "do_remote_prefill": False}
    result = send(stack.url, messages + [user_message(1)], "attacker", stream=False,
                  extra={"kv_transfer_params": replay})
    assert result["kvturn"]["reuse"] is None and result["kvturn"]["prompt_tokens_from_decode"] == 0
    assert "kv_transfer_params" not in result or result["kv_transfer_params"] is None


def stream_chunks(url: str, messages: list[dict], conversation_id: str, **extra) -> list[dict]:
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "conversation_id": conversation_id, **extra}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def streamed_text(chunks: list[dict]) -> str:
    return "".join((c["delta"].get("content") or "") for chunk in chunks for c in chunk.get("choices") or [])


def test_the_router_streams_prefills_first_token_ahead_and_the_answer_is_unchanged(stacks):
    """P's first token goes to the client before D is called; D continues from it and the router drops it from
    D's stream: one role, one id, the same text as a colocated worker's."""
    stack = stacks["bidir"]
    messages = [{"role": "system", "content": SYSTEM_FOR_FIRST_TOKEN}, user_message(0)]
    expected = send(stacks["colocated"].url, messages, None, stream=False, max_tokens=12)["text"]
    chunks = stream_chunks(stack.url, messages, "conv-first-token")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"]["content"]  # the first token, from P
    assert sum("role" in c["delta"] for chunk in chunks for c in chunk["choices"]) == 1
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert streamed_text(chunks) == expected
    final = next(chunk for chunk in chunks if "kvturn" in chunk)
    assert final["kvturn"]["first_token_from"] == "prefill"
    assert final["choices"][0]["finish_reason"] == "length"
    # With a stop string the first token's text is not final: D sends everything.
    chunks = stream_chunks(stack.url, messages, "conv-first-token-stop", stop=["\u2603"])
    assert streamed_text(chunks) == expected
    assert next(chunk for chunk in chunks if "kvturn" in chunk)["kvturn"]["first_token_from"] == "decode"


SYSTEM_FOR_FIRST_TOKEN = "You answer in one short line. " * 20


def test_a_prefill_worker_connects_back_to_a_decode_worker_that_read_from_it(stacks):
    """D's first read from P introduces D to P, so the first turn that reuses D's KV does no NIXL handshake."""
    stack = stacks["fresh"]
    assert metric(stack.urls["prefill"], "kvturn_nixl_peers") == 0
    _, results = conversation(stack.url, 1, conversation_id="introduced")
    assert results[0]["kvturn"]["bytes_p_to_d"] > 0  # D read from P
    deadline = time.monotonic() + 10
    while metric(stack.urls["prefill"], "kvturn_nixl_peers") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(stack.urls["prefill"], "kvturn_nixl_peers") == 1
    _, results = conversation(stack.url, 2, conversation_id="introduced")
    assert results[1]["kvturn"]["reuse"] == "reused"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_pinned_workers_run_on_their_own_cores_and_answer_the_same(stacks, reference):
    """`kvturn bench --pin-workers`: P on the first half of the cores, D on the rest, one compute thread a core."""
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    stack = stacks["pd"]
    assert os.sched_getaffinity(stack.processes["prefill"].pid) == set(cores[:half])
    assert os.sched_getaffinity(stack.processes["decode0"].pid) == set(cores[half:])
    assert os.sched_getaffinity(stack.processes["router"].pid) == set(cores)
    _, results = conversation(stack.url, 2, conversation_id="pinned")
    assert [r["text"] for r in results] == [r["text"] for r in reference[1][:2]]


# The usage tests come last, after the keep-alive test's idle wait; each opens with a system prompt of its own, so
# that no earlier turn left its prefix in a worker's cache (nor theirs in another test's).

def cached(result: dict) -> int:
    return result["usage"]["prompt_tokens_details"]["cached_tokens"]


def own_start(name: str) -> list[dict]:
    return [{"role": "system", "content": f"Usage test {name}. " + SYSTEM}]


def test_usage_counts_as_cached_only_what_the_turn_did_not_compute_when_it_pulls_the_history(stacks):
    """P's cache off: the history read back from D is what was not computed; the prompt D read from P was (by P).
    The first turn, P/D with nothing to reuse, computed all of its prompt."""
    _, results = conversation(stacks["bidir"].url, 3, "usage-pull", own_start("pull"))
    assert cached(results[0]) == 0 and results[0]["kvturn"]["decode"]["prompt_tokens_remote"] > 0
    for result in results[1:]:  # one whole answer, one streamed
        kv = result["kvturn"]
        assert kv["reuse"] == "reused" and kv["prompt_tokens_cached_prefill"] == 0
        assert cached(result) == kv["prompt_tokens_from_decode"] > 0
        assert cached(result) == result["usage"]["prompt_tokens"] - kv["prompt_tokens_computed_prefill"]


def test_usage_counts_prefills_cache_hits_and_the_history_read_from_decode_as_cached(stacks):
    """P's cache on holds the first prompt; a long answer (past the reuse threshold) is read back from D."""
    url, messages = stacks["bidir2"].url, own_start("pull-cache-on") + [user_message(0)]
    first = send(url, messages, "usage-pull-cache-on", stream=False, max_tokens=96)
    messages += [{"role": "assistant", "content": first["text"]}, user_message(1)]
    second = send(url, messages, "usage-pull-cache-on", stream=False)
    kv = second["kvturn"]
    assert kv["reuse"] == "reused" and kv["prompt_tokens_cached_prefill"] > 0 and kv["prompt_tokens_from_decode"] > 0
    assert cached(second) == kv["prompt_tokens_cached_prefill"] + kv["prompt_tokens_from_decode"]
    assert cached(second) == second["usage"]["prompt_tokens"] - kv["prompt_tokens_computed_prefill"]


def test_usage_counts_prefills_cache_hits_alone_as_cached_when_prefill_recomputes(stacks):
    """P/D without bidirectional transfer: D read the whole prompt from P or its own cache, but P computed what its
    cache did not hold."""
    _, results = conversation(stacks["pd"].url, 3, "usage-recompute", own_start("recompute"))
    assert cached(results[0]) == 0
    for result in results[1:]:
        kv = result["kvturn"]
        assert kv["prompt_tokens_from_decode"] == 0 and kv["decode"]["prompt_tokens_computed"] == 0
        assert cached(result) == kv["prompt_tokens_cached_prefill"] > 0


def test_a_colocated_workers_usage_counts_its_prefix_cache_hits_as_cached(stacks):
    _, results = conversation(stacks["colocated"].url, 3, "usage-colocated", own_start("colocated"))
    assert cached(results[0]) == 0
    for result in results[1:]:
        assert cached(result) == result["kvturn"]["prompt_tokens_cached"] > 0
