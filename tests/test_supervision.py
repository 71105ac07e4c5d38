"""Logs and supervision: `kvturn serve` writes each process's log where it says, restarts a process that dies,
and leaves nothing behind on SIGTERM; an internal error names the log file and a request id found in it; a turn
caught by a worker's death is carried over once the worker is back."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from chat import SYSTEM, metric, send, user_message
from kvturn.config import INSTANCE_HEADER, SupervisorConfig
from kvturn.launch import free_port, stop, wait_healthy
from kvturn.supervisor import Supervisor, next_backoff_s

DEADLINE_S = 180  # generous: the machine may be loaded; nothing here asserts a duration


def until(condition, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> set[int]:
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        found |= {int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def role_of(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--role") + 1].decode() if b"--role" in args else args[3].decode()


def unread_bytes(port: int) -> int:
    """Bytes sent to the server on `port` that it has not read yet (its receive queues, /proc/net/tcp)."""
    total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            total += int(fields[4].split(":")[1], 16)
    return total


def test_processes_forked_alike_or_seeded_alike_draw_their_own_ports():
    # Two stacks started from forks of one process (the same state of `random`) must not pick the same ports.
    import random
    state = random.getstate()
    first = [free_port() for _ in range(4)]
    random.setstate(state)
    assert [free_port() for _ in range(4)] != first


def test_a_stack_waits_for_its_own_process_not_another_stacks_on_the_same_port():
    # Another stack's worker already answers on the port ours failed to bind: its /health says 200 but names another
    # instance, so the wait goes on until our process exits, and says so, instead of taking the stranger for ours.
    import http.server
    import socketserver

    class Stranger(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header(INSTANCE_HEADER, "another-stack")
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    with socketserver.TCPServer(("127.0.0.1", port), Stranger) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5); raise SystemExit(3)"])
        try:
            with pytest.raises(RuntimeError, match="exited with code 3"):
                wait_healthy(url, ours, timeout_s=30, instance="our-stack")
            wait_healthy(url, timeout_s=5, instance="another-stack")  # its own launcher would take it
            wait_healthy(url, timeout_s=5)  # and a wait that names no instance takes whoever answers
        finally:
            stop(ours)
            server.shutdown()


def test_backoff_doubles_while_a_process_keeps_exiting_and_starts_over_once_it_ran_long_enough():
    config = SupervisorConfig(restart_backoff_s=0.5, restart_backoff_max_s=3.0, restart_settled_s=60.0)
    waits, previous = [], None
    for _ in range(5):
        previous = next_backoff_s(previous, ran_s=2.0, config=config)
        waits.append(previous)
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert next_backoff_s(3.0, ran_s=60.0, config=config) == 0.5


class Crashing:
    """The part of LocalStack the supervisor drives, around a real process that exits at once with code 3."""

    def __init__(self, clock):
        self.clock, self.processes, self.launched_at, self.starts = clock, {}, {}, 0
        self.respawn("crasher", None)

    def respawn(self, name: str, exited) -> subprocess.Popen:
        self.starts += 1
        self.processes[name] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        self.launched_at[name] = self.clock()
        return self.processes[name]

    def log_path(self, name: str) -> Path:
        return Path(f"{name}.log")


def test_a_process_that_keeps_exiting_is_restarted_after_doubling_waits():
    now = [0.0]
    stack = Crashing(lambda: now[0])
    supervisor = Supervisor(stack, SupervisorConfig(restart_backoff_s=1.0, restart_backoff_max_s=4.0,
                                                    restart_settled_s=60.0), clock=lambda: now[0])
    for expected_wait_s in (1.0, 2.0, 4.0, 4.0):
        stack.processes["crasher"].wait(timeout=DEADLINE_S)
        supervisor.tick()  # notices the exit
        starts = stack.starts
        now[0] += expected_wait_s - 0.01
        supervisor.tick()
        assert stack.starts == starts, "restarted before its backoff was over"
        now[0] += 0.01
        supervisor.tick()
        assert stack.starts == starts + 1
    assert [(r.exit_code, r.backoff_s) for r in supervisor.restarts] == [(3, 1.0), (3, 2.0), (3, 4.0), (3, 4.0)]


class Serve:
    """`kvturn serve` as a user runs it, its output read as it comes."""

    def __init__(self, model_dir: Path, cache_dir: Path):
        self.port = free_port()
        env = {**os.environ, "KVTURN_CACHE_DIR": str(cache_dir)}  # its default log folder goes there
        self.process = subprocess.Popen([sys.executable, "-m", "kvturn.cli", "serve", "--port", str(self.port),
                                         "--model", str(model_dir), "--kv-cache-mb", "32",
                                         "--no-prefix-caching-on-prefill", "--no-worker-wait-s", str(DEADLINE_S),
                                         "--no-calibrate"],  # the path is pull: timing steps only slows (re)starts
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()
        serving = self.wait_for_line("kvturn serving on")
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefill_port = int(re.search(r"prefill http://127.0.0.1:(\d+)", serving).group(1))
        self.log_dir = Path(re.search(r"logs in (\S+)", "".join(self.output)).group(1))

    def wait_for_line(self, text: str) -> str:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.process.poll() is None, f"serve exited: {''.join(self.output)}"
                continue
            self.output.append(line)
            if text in line:
                return line
        raise AssertionError(f"serve never printed {text!r}: {''.join(self.output)}")

    def pid_of(self, role: str) -> int:
        return next(pid for pid in children(self.process.pid) if role_of(pid) == role)


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory):
    """One `kvturn serve` (P with no cache of its own: later turns read the history from D) for the module's
    tests, in their order; the last one stops it with SIGTERM."""
    cache = tmp_path_factory.mktemp("cache")
    served = Serve(tiny_model_dir, cache)
    served.cache = cache
    yield served
    if served.process.poll() is None:
        stop(served.process, timeout_s=60)


def test_serve_writes_each_process_log_in_the_folder_it_prints(serve):
    assert serve.log_dir.parent == serve.cache / "logs"  # the default: under the kvturn cache
    for name in ("router", "prefill", "decode0"):
        assert "started `kvturn" in (serve.log_dir / f"{name}.log").read_text()
    own_line = r"^[\d-]+ [\d:,]+ kvturn\.[\w.]+ (INFO|WARNING) "  # the process's own output, as its logging writes it
    assert re.search(own_line, (serve.log_dir / "prefill.log").read_text(), re.MULTILINE)
    instances = set()
    for pid in children(serve.process.pid):
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if item)
        assert Path(environ["KVTURN_LOG_FILE"]).parent == serve.log_dir  # so its internal errors can name it
        instances.add(environ["KVTURN_INSTANCE"])
    assert len(instances) == 1  # one name for the stack, which each /health answers
    for url in (serve.url, f"http://127.0.0.1:{serve.prefill_port}"):
        assert httpx.get(f"{url}/health").headers[INSTANCE_HEADER] in instances


def test_a_turn_in_flight_when_prefill_is_killed_completes_once_serve_restarted_it(serve):
    victim = serve.pid_of("prefill")
    os.kill(victim, signal.SIGSTOP)  # it takes the turn's request and never answers it...
    answers: queue.Queue = queue.Queue()
    body = {"messages": [{"role": "system", "content": SYSTEM * 3}, user_message(0)], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "conversation_id": "in-flight"}
    threading.Thread(target=lambda: answers.put(httpx.post(f"{serve.url}/v1/chat/completions", json=body,
                                                           timeout=DEADLINE_S)), daemon=True).start()
    until(lambda: unread_bytes(serve.prefill_port) > len(SYSTEM), "the turn's request to reach the prefill worker")
    os.kill(victim, signal.SIGKILL)  # ...and dies with it unread
    response = answers.get(timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert serve.pid_of("prefill") != victim
    assert (serve.log_dir / "prefill.log").read_text().count("started `kvturn worker`") == 2
    assert metric(serve.url, "kvturn_router_retries_total", '{reason="prefill_unreachable"}') >= 1
    assert metric(serve.url, "kvturn_router_retries_total", '{reason="worker_back"}') >= 1


def test_a_killed_decode_worker_is_restarted_and_the_turn_that_held_its_lease_recomputes(serve):
    messages = [{"role": "system", "content": SYSTEM}, user_message(0)]
    first = send(serve.url, messages, "decode-restart", stream=False)
    os.kill(serve.pid_of("decode"), signal.SIGKILL)
    serve.wait_for_line("decode0 started again")
    messages += [{"role": "assistant", "content": first["text"]}, user_message(1)]
    # Not streamed: a streamed turn's status goes out with P's first token, so a decode worker found dead after
    # that is an error event in the stream, which the router cannot take back (the client retries).
    result = send(serve.url, messages, "decode-restart", stream=False)
    assert result["usage"]["completion_tokens"] == 16
    assert result["kvturn"]["reuse"] != "reused"  # the lease died with the old engine: P computed the history
    assert result["kvturn"]["prompt_tokens_from_decode"] == 0


def carried_over(url: str) -> float:
    """Turns the router ran again once a worker came back."""
    try:
        return metric(url, "kvturn_router_retries_total", '{reason="worker_back"}')
    except KeyError:
        return 0.0


def test_a_streamed_turn_whose_first_token_went_out_completes_once_its_decode_worker_is_back(serve):
    messages = [{"role": "system", "content": SYSTEM * 2}, user_message(2)]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "conversation_id": "stream-carried"}
    prefill, decode = serve.pid_of("prefill"), serve.pid_of("decode")
    carried_before = carried_over(serve.url)
    os.kill(prefill, signal.SIGSTOP)  # hold the turn at P until D is stopped too
    events: queue.Queue = queue.Queue()

    def read():
        with httpx.stream("POST", f"{serve.url}/v1/chat/completions", json=body, timeout=DEADLINE_S) as response:
            events.put(response.status_code)
            for line in response.iter_lines():
                events.put(line)
        events.put(None)
    threading.Thread(target=read, daemon=True).start()
    until(lambda: unread_bytes(serve.prefill_port) > len(SYSTEM), "the turn's request to reach the prefill worker")
    os.kill(decode, signal.SIGSTOP)
    os.kill(prefill, signal.SIGCONT)
    assert events.get(timeout=DEADLINE_S) == 200
    assert events.get(timeout=DEADLINE_S).startswith("data: ")  # P's first token went out ahead of D
    os.kill(decode, signal.SIGKILL)  # the decode worker dies before it answers: serve starts it again
    lines = [line for line in iter(lambda: events.get(timeout=DEADLINE_S), None) if line]
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert not [chunk for chunk in chunks if "error" in chunk], lines
    assert lines[-1] == "data: [DONE]"
    assert next(chunk["usage"] for chunk in chunks if chunk.get("usage"))["completion_tokens"] == 8
    assert serve.pid_of("decode") != decode
    assert carried_over(serve.url) > carried_before


def test_sigterm_to_serve_stops_every_process_it_started(serve):
    started = children(serve.process.pid)
    assert len(started) == 3
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=DEADLINE_S) == 0
    until(lambda: not any(alive(pid) for pid in started), "serve's processes to exit")


def test_an_internal_error_names_the_log_file_and_a_request_id_that_is_in_it(tmp_path):
    port, log_path = free_port(), tmp_path / "router.log"
    with open(log_path, "ab") as log:
        server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "failing_app.py"), str(port)],
                                  stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                                                             "KVTURN_LOG_FILE": str(log_path)})
    try:
        def answer():
            try:
                return httpx.post(f"http://127.0.0.1:{port}/boom", timeout=10)
            except httpx.TransportError:
                assert server.poll() is None, log_path.read_text()
        response = until(answer, "the app to answer")
        error = response.json()["error"]
        assert response.status_code == 500 and error["type"] == "InternalServerError"
        request_id = re.search(r"request ([0-9a-f]{32})", error["message"]).group(1)
        assert str(log_path) in error["message"]
        logged = until(lambda: request_id in log_path.read_text() and log_path.read_text(), "the error in the log")
        line = next(line for line in logged.splitlines() if request_id in line)
        assert "ERROR" in line and "/boom" in line
        assert "RuntimeError: a bug" in logged  # its traceback follows
    finally:
        stop(server)
