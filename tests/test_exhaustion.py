"""Resource exhaustion and liveness (issue 47), with real processes: no input stalls other clients, a slow answer is
not a dead worker, a client that leaves or stops reading costs nothing after a bound, leases expire on time, and
what clients send cannot forge a log line.

One stack (router + P + D; P with the default 512 MiB pool, whose context is long enough that a 10 MB prompt passes
the characters-per-token guard, and pins that expire after 2 s; D with a short unread-stream bound and a small
default answer), a second router over the same workers that gives up on a worker after 1 s of silence, and a third
that keeps its conversations in a real redis-server. Durations here are hang guards only.
"""
import socket
import threading
import time

import httpx
import pytest

from chat import metric
from kvturn import launch
from kvturn.launch import LocalStack, RedisServer

GUARD_S = 30  # a hang guard: a busy 2-core machine answers well within it; the stalls these tests catch did not
HEALTH_GUARD_S = 10  # /health while a 10 MB prompt is in: before, P's answered after the whole tokenizing (25-35 s)
DEFAULT_ANSWER_TOKENS = 24
UNREAD_S = 1.0
TOP_LOGPROBS = 400  # a streamed token's event is then ~25 KB: an unread stream fills the socket buffers in ~200 tokens


class Deployment:
    def __init__(self, stack: LocalStack, impatient: str, shared: str, logs):
        self.stack, self.impatient, self.shared, self.logs = stack, impatient, shared, logs
        self.router, self.prefill, self.decode = stack.url, stack.urls["prefill"], stack.urls["decode0"]


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("exhaustion-logs")
    stack = LocalStack(tiny_model_dir, kv_cache_mb=64, log_dir=logs, worker_args=["--no-calibrate"],
                       prefill_args=["--kv-cache-mb", "512", "--kv-pin-timeout-s", "2"],
                       decode_args=["--unread-stream-timeout-s", str(UNREAD_S), "--max-logprobs", str(TOP_LOGPROBS),
                                    "--default-max-output-tokens", str(DEFAULT_ANSWER_TOKENS)])
    redis_server = RedisServer().start()
    processes = []
    try:
        stack.start_worker_processes()
        for name, url in stack.urls.items():
            launch.wait_healthy(url, stack.processes[name])
        routers = {}
        for name, extra in (("impatient", ["--upstream-timeout-s", "1", "--health-interval-s", "600"]),
                            ("shared", ["--state", redis_server.url])):  # /health lists workers: --expose-internals
            port = launch.free_port()
            routers[name] = f"http://127.0.0.1:{port}"
            processes.append(launch.start(["router", "--port", str(port), "--prefill", stack.urls["prefill"],
                                           "--decode", stack.urls["decode0"], "--tokenizer", str(tiny_model_dir),
                                           "--expose-internals", *extra], logs / f"router-{name}.log", stack.env))
        stack.wait_and_start_router()
        for url, process in zip(routers.values(), processes):
            launch.wait_healthy(url, process)
        yield Deployment(stack, routers["impatient"], routers["shared"], logs)
    finally:
        for process in processes:
            launch.stop(process)
        stack.stop()
        redis_server.stop()


def completion(url: str, prompt: str, timeout: float = GUARD_S, **extra) -> httpx.Response:
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and "param" in error
    return error


def count(url: str, name: str, labels: str = "") -> float:
    """A metric's value; 0 for a labelled counter never counted (it has no line yet)."""
    try:
        return metric(url, name, "{%s}" % labels if labels else "")
    except KeyError:
        return 0.0


def poll(condition, what: str, guard_s: float = GUARD_S):
    deadline = time.monotonic() + guard_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"not within {guard_s} s: {what}"
        time.sleep(0.1)
    return found


def raw_request(url: str, head: str, body: bytes = b"", receive_buffer: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting: the window the server may fill is this small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    sock.sendall(head.encode() + body)
    return sock


def json_head(path: str, length: int | None, chunked: bool = False) -> str:
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}\r\n\r\n"


def status_of(sock: socket.socket, guard_s: float = GUARD_S) -> int:
    sock.settimeout(guard_s)
    head = sock.recv(4096)
    return int(head.split(b" ", 2)[1])


# ---- no input stalls the others

def test_a_10_mb_prompt_leaves_health_and_another_tenants_turns_answering(deployment):
    """Before, P tokenized it on its event loop: its /health and another client's 4-token turn waited 25-35 s and
    the router dropped P from its rotation. Now it is counted off the loop and refused after its first pieces."""
    d = deployment
    huge = "alpha beta gamma delta " * 435_000  # 10 MB, under 131072 tokens x the longest token's 80 characters
    outcome = {}
    sender = threading.Thread(target=lambda: outcome.update(response=completion(d.router, huge, max_tokens=4,
                                                                                   timeout=120)))
    sender.start()
    try:
        while sender.is_alive():
            assert httpx.get(f"{d.prefill}/health", timeout=HEALTH_GUARD_S).status_code == 200
            small = completion(d.router, "Another tenant's small turn.", max_tokens=4, timeout=HEALTH_GUARD_S)
            assert small.status_code == 200, small.text
            assert d.prefill in httpx.get(f"{d.router}/health", timeout=HEALTH_GUARD_S).json()["prefill"]
    finally:
        sender.join()
    assert "maximum context length is 131072 tokens" in assert_openai_error(outcome["response"], 400)["message"]


def test_tokenize_refuses_a_text_longer_than_the_context_and_detokenize_a_list_longer_than_it(deployment):
    """Before, /tokenize took any text (30 MB held the worker 68 s) and /detokenize any list."""
    d = deployment
    for prompt in ("x" * 30_000_000, "alpha beta gamma delta " * 435_000):
        refused = httpx.post(f"{d.prefill}/tokenize", json={"prompt": prompt}, timeout=GUARD_S)
        assert "maximum context length" in assert_openai_error(refused, 400)["message"]
    assert httpx.post(f"{d.prefill}/tokenize", json={"prompt": "fits"}, timeout=GUARD_S).json()["count"] > 0
    too_many = httpx.post(f"{d.prefill}/detokenize", json={"tokens": [1] * 200_000}, timeout=GUARD_S)
    assert assert_openai_error(too_many, 400)["param"] == "tokens"


def test_the_router_refuses_a_body_declared_over_its_cap_before_it_comes(deployment):
    """Only the head is sent: a router that waits for the body (and holds it) never answers."""
    sock = raw_request(deployment.router, json_head("/v1/completions", 33 * 2**20))
    with sock:
        assert status_of(sock) == 413


def test_the_router_stops_reading_a_chunked_body_once_past_its_cap(deployment):
    """33 MiB in chunks, the last chunk never sent: the answer comes while the body is still open."""
    sock = raw_request(deployment.router, json_head("/v1/completions", None, chunked=True))
    with sock:
        piece = b"x" * 2**20
        for _ in range(33):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        assert status_of(sock) == 413


def test_a_worker_refuses_a_body_declared_over_its_cap_before_it_comes(deployment):
    sock = raw_request(deployment.prefill, json_head("/tokenize", 65 * 2**20))
    with sock:
        assert status_of(sock) == 413


def test_a_client_leaving_mid_body_is_logged_as_one_line_not_a_traceback(deployment):
    log = deployment.stack.log_path("router")
    before = log.read_text()
    raw_request(deployment.router, json_head("/v1/chat/completions", 1000), b'{"messages": [').close()
    added = poll(lambda: log.read_text()[len(before):] if "client left" in log.read_text()[len(before):] else None,
                 "the router logs the client that left")
    assert added.count("client left during its request body") == 1
    assert "Traceback" not in added and "unhandled error" not in added, added


# ---- a slow answer is not a dead worker; a client that leaves or stops reading costs nothing after a bound

def decode_running(d: Deployment) -> float:
    return count(d.decode, "kvturn_requests_running")


def test_a_non_streamed_turn_is_cancelled_end_to_end_when_its_client_leaves(deployment):
    """Before, the router went on waiting for D's whole answer, and D generated all of it for nobody."""
    d = deployment
    generated = count(d.decode, "kvturn_generation_tokens_total")
    body = b'{"prompt": "Write at length.", "max_tokens": 12000, "ignore_eos": true, "temperature": 0}'
    sock = raw_request(d.router, json_head("/v1/completions", len(body)), body)
    poll(lambda: decode_running(d) >= 1, "D runs the turn")
    sock.close()
    poll(lambda: decode_running(d) == 0, "D ends the turn once its client left")
    assert count(d.decode, "kvturn_generation_tokens_total") - generated < 12000
    assert count(d.router, "kvturn_router_requests_total", 'outcome="client_left"') >= 1


def test_a_turn_the_worker_is_slow_to_answer_fails_with_a_504_and_the_worker_stays(deployment):
    """A router that gives up after 1 s of silence: a 2000-token answer takes D longer. Before, the router took D
    for dead, dropped it and ran the turn again (then waited for a worker, and answered 503)."""
    d = deployment
    slow = completion(d.impatient, "Answer at length.", max_tokens=2000)
    assert "sent nothing for 1 s" in assert_openai_error(slow, 504)["message"]
    listed = httpx.get(f"{d.impatient}/health", timeout=GUARD_S).json()  # no probe since start: its own verdict
    assert listed["prefill"] == [d.prefill] and listed["decode"] == [d.decode]
    for reason in ("prefill_unreachable", "decode_unreachable", "worker_back"):
        assert count(d.impatient, "kvturn_router_retries_total", f'reason="{reason}"') == 0
    poll(lambda: decode_running(d) == 0, "D ends the turn the router gave up on")


def test_a_prompt_the_prefill_worker_is_slow_to_compute_fails_with_a_504_and_it_stays(deployment):
    d = deployment
    slow = completion(d.impatient, "alpha beta gamma delta " * 12_000, max_tokens=4)  # ~50k tokens for P
    assert "prefill worker sent nothing for 1 s" in assert_openai_error(slow, 504)["message"]
    assert httpx.get(f"{d.impatient}/health", timeout=GUARD_S).json()["prefill"] == [d.prefill]
    assert count(d.impatient, "kvturn_router_retries_total", 'reason="prefill_unreachable"') == 0


def test_a_stream_its_client_does_not_read_is_ended_after_the_bound_and_counted(deployment):
    """Straight to D, with TOP_LOGPROBS logprobs a token so that the socket buffers fill in a few hundred tokens;
    then D's output waits, and after UNREAD_S D ends the sequence. Before, it generated on (12000 tokens) and its
    output piled up in memory."""
    d = deployment
    body = (b'{"messages": [{"role": "user", "content": "Talk."}], "max_tokens": 12000, "ignore_eos": true, '
            b'"stream": true, "logprobs": true, "top_logprobs": %d}' % TOP_LOGPROBS)
    sock = raw_request(d.decode, json_head("/v1/chat/completions", len(body)), body, receive_buffer=4096)
    with sock:
        poll(lambda: count(d.decode, "kvturn_streams_not_read_total") >= 1, "D ends the unread stream", 60)
        poll(lambda: decode_running(d) == 0, "nothing runs for the unread stream")


def test_a_request_without_max_tokens_gets_the_workers_default_cap(deployment):
    """Before, it generated until the context ended (16k tokens here)."""
    answer = completion(deployment.router, "Go on and on.", timeout=GUARD_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == DEFAULT_ANSWER_TOKENS


# ---- leases on a timer, conversation ids, log lines

def test_an_idle_prefill_workers_pins_expire_on_time(deployment):
    """P pins a prompt's blocks for a decode worker that never comes; with nothing else to do, P still lets them go
    at their 2 s timeout. Before, they stayed held (and shown in /metrics) until the engine next stepped."""
    d = deployment
    body = {"prompt": "A prompt pinned for nobody. " * 8, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False}}
    pinned = httpx.post(f"{d.prefill}/v1/completions", json=body, timeout=GUARD_S)
    assert pinned.status_code == 200 and pinned.json()["kv_transfer_params"]["remote_block_ids"], pinned.text
    assert count(d.prefill, "kvturn_kv_leases_active") >= 1
    poll(lambda: count(d.prefill, "kvturn_kv_leases_active") == 0, "P's idle engine lets the pin expire")
    assert count(d.prefill, "kvturn_kv_leases_total", 'event="expired"') >= 1


@pytest.mark.parametrize("table", ["memory", "redis"])
def test_a_conversation_named_by_its_history_reports_on_later_turns_the_id_delete_takes(deployment, table):
    """Before, turn 2 on reported the router's internal 48-hex key, which DELETE answered 404."""
    url = deployment.router if table == "memory" else deployment.shared
    messages = [{"role": "user", "content": f"A conversation with no id, its table in {table}."}]
    ids = []
    for turn in range(3):
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=GUARD_S)
        assert answer.status_code == 200, answer.text
        ids.append(answer.json()["kvturn"]["conversation_id"])
        messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": f"Turn {turn + 2}."}]
    assert ids[0].startswith("derived-") and ids == [ids[0]] * 3
    deleted = httpx.delete(f"{url}/v1/conversations/{ids[-1]}", timeout=GUARD_S)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text


def test_a_newline_in_a_client_named_peer_cannot_forge_a_log_line(deployment):
    """A worker port, no secret: the peer is not contacted, and its name is logged escaped, on the warning's line."""
    d = deployment
    forged = "2026-01-01 00:00:00,000 kvturn.worker ERROR forged by a client"
    body = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_host": f"10.0.0.1\n{forged}\r\n", "remote_port": 9,
        "remote_engine_id": "e", "handle": "h", "remote_request_id": "r", "remote_block_ids": [1]}}
    answer = httpx.post(f"{d.decode}/v1/completions", json=body, timeout=GUARD_S)
    assert answer.status_code == 200 and answer.json()["kvturn"]["reuse"] == "untrusted_peer", answer.text
    log = d.stack.log_path("decode0")
    warned = poll(lambda: [line for line in log.read_text().splitlines() if "may not contact" in line],
                  "D logs the untrusted peer")
    assert forged in warned[-1]  # written on the warning's own line, escaped
    assert not any(line.startswith(forged) for line in log.read_text().splitlines())
