"""Router replicas sharing the conversation table in Redis: real routers, real workers, a real redis-server of the
module's own (stopped and restarted for the fault tests), and a client that sends each turn to another replica."""
import shutil
import signal
import subprocess
import time

import httpx
import pytest
import redis

from chat import SYSTEM, metric, send, user_message
from kvturn.launch import LocalStack, RedisServer, free_port, start, stop, wait_healthy

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
REGISTRATION_TTL_S = 2.0


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def workers(tiny_model_dir, redis_server, tmp_path_factory):
    """1 P (prefix cache off, so every reuse is a read from D) + 1 D, both registered in Redis."""
    stack = LocalStack(tiny_model_dir, prefix_caching_on_prefill=False, kv_cache_mb=48,
                       log_dir=tmp_path_factory.mktemp("many-routers"),
                       worker_args=["--register", redis_server.url, "--register-ttl-s", str(REGISTRATION_TTL_S),
                                    "--no-calibrate"])
    try:
        stack.start_worker_processes()
        for name, url in stack.urls.items():
            wait_healthy(url, stack.processes[name])
        yield stack
    finally:
        stack.stop()


class Routers:
    """Router replicas on loopback with the workers' cluster secret; `stop` stops every one started."""

    def __init__(self, stack: LocalStack):
        self.stack = stack
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, count: int, *args: str) -> list[str]:
        started = {}
        for _ in range(count):
            port = free_port()
            log = self.stack.log_dir / f"router-{port}.log"
            started[f"http://127.0.0.1:{port}"] = start(["router", "--port", str(port), "--health-interval-s", "0.5",
                                                         "--expose-internals", *args], log, self.stack.env)
        self.processes.update(started)
        for url, process in started.items():
            wait_healthy(url, process, timeout_s=90)
        return list(started)

    def start_shared(self, count: int, redis_url: str) -> list[str]:
        """`count` replicas in front of the stack's P and D, sharing the conversation table in `redis_url`."""
        return self.start(count, "--prefill", self.stack.urls["prefill"], "--decode", self.stack.urls["decode0"],
                          "--state", redis_url)

    def kill(self, url: str) -> None:
        self.processes[url].send_signal(signal.SIGKILL)
        self.processes[url].wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            stop(process)


@pytest.fixture(scope="module")
def routers(workers):
    replicas = Routers(workers)
    yield replicas
    replicas.stop()


@pytest.fixture(scope="module")
def replicas(routers, redis_server) -> list[str]:
    """Three replicas that live through the module (the tests that kill one start one of their own)."""
    return routers.start_shared(3, redis_server.url)


@pytest.fixture(scope="module")
def discovering(routers, redis_server) -> str:
    """A router given no worker URLs: it finds them in the registry."""
    (url,) = routers.start(1, "--discover", redis_server.url, "--state", redis_server.url)
    return url


def turns(urls: list[str], count: int, conversation_id: str | None, messages: list[dict] | None = None):
    """`count` turns, the i-th sent to urls[i % len(urls)], alternately whole and streamed; (messages, results)."""
    messages = messages if messages is not None else [{"role": "system", "content": SYSTEM}]
    results = []
    for turn in range(count):
        messages.append(user_message(len(messages)))
        result = send(urls[turn % len(urls)], messages, conversation_id, stream=turn % 2 == 1, max_tokens=8)
        results.append(result)
        messages.append({"role": "assistant", "content": result["text"]})
    return messages, results


def wait_for(condition, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout_s} s")


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=5).json()


def test_turns_sent_round_robin_to_three_replicas_reuse_as_with_one(replicas):
    _, named = turns(replicas, 4, "rr-named")
    assert [r["kvturn"]["reuse"] for r in named[1:]] == ["reused"] * 3
    assert all(r["kvturn"]["prompt_tokens_from_decode"] > 0 for r in named[1:])
    _, derived = turns(replicas[1:] + replicas[:1], 4, conversation_id=None)  # named by its history
    assert [r["kvturn"]["reuse"] for r in derived[1:]] == ["reused"] * 3
    assert health(replicas[0])["state"] == {"backend": "redis", "healthy": True, "last_error": None}


def test_a_replica_killed_mid_session_loses_nothing(routers, replicas, redis_server):
    (doomed,) = routers.start_shared(1, redis_server.url)
    messages, results = turns([replicas[0], doomed], 2, "kill-replica")
    routers.kill(doomed)
    _, later = turns([replicas[1], replicas[2]], 2, "kill-replica", messages)
    assert [r["kvturn"]["reuse"] for r in results[1:] + later] == ["reused"] * 3


def test_a_replica_killed_during_a_stream_leaves_the_retry_to_another(routers, replicas, redis_server):
    (doomed,) = routers.start_shared(1, redis_server.url)
    messages, _ = turns([replicas[0]], 1, "kill-streaming")
    messages.append(user_message(7))
    body = {"messages": messages, "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0,
            "conversation_id": "kill-streaming"}
    with pytest.raises(httpx.HTTPError), httpx.stream("POST", f"{doomed}/v1/chat/completions", json=body,
                                                      timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                routers.kill(doomed)
    retried = send(replicas[1], messages, "kill-streaming", stream=False, max_tokens=8)
    assert retried["kvturn"]["reuse"] == "reused"  # the first turn's lease, which nobody superseded


def test_redis_stopped_then_restarted_empty_costs_reuse_but_no_request(replicas, discovering, redis_server):
    first, second, third = replicas
    messages, _ = turns([first], 1, "redis-down")
    redis_server.stop()
    try:
        messages, down = turns([second, third], 2, "redis-down", messages)
        assert [r["kvturn"]["reuse"] for r in down] == ["state_unavailable"] * 2  # recomputed, answered
        state = health(second)
        assert state["status"] == "degraded" and state["state"]["healthy"] is False
        assert metric(second, "kvturn_router_state_errors_total") > 0
        wait_for(lambda: metric(first, "kvturn_router_state_healthy") == 0, what="the gauge to fall")
        _, via_registry = turns([discovering], 1, "redis-down-discovering")
        assert via_registry[0]["kvturn"]["reuse"] == "state_unavailable"
    finally:
        redis_server.start()  # with nothing in it, worker registrations included
    turns([discovering], 1, "redis-down-discovering")  # the workers it knew still serve until they register again
    for url in replicas:
        wait_for(lambda url=url: health(url)["state"]["healthy"], what=f"{url} to see Redis again")
    _, back = turns([third, first, second], 3, "redis-down", messages)
    assert [r["kvturn"]["reuse"] for r in back] == [None, "reused", "reused"]
    assert metric(first, "kvturn_router_state_healthy") == 1


def test_a_router_discovers_workers_that_register_and_drops_one_killed(discovering, workers, redis_server):
    url = discovering
    assert sorted(health(url)["prefill"] + health(url)["decode"]) == sorted(
        [workers.urls["prefill"], workers.urls["decode0"]])
    _, results = turns([url], 2, "discovered")
    assert results[1]["kvturn"]["reuse"] == "reused"
    workers.start_worker("decode-late", "decode", ["--register-ttl-s", "1"])
    late = workers.urls["decode-late"]
    wait_for(lambda: late in health(url)["decode"], timeout_s=90, what="the late decode worker to join")
    workers.kill("decode-late", signal.SIGKILL)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    wait_for(lambda: not client.keys(f"kvturn:worker:decode:{late}"), timeout_s=5, what="the registration to expire")
    assert late not in health(url)["decode"]
    _, after = turns([url], 1, "after-late-worker")
    assert after[0]["kvturn"]["decode_worker"] == workers.urls["decode0"]
