"""The shared store relays, it cannot steer; tenants share compute, not knowledge. Against a real redis-server, real
workers that register there (signed), a router that finds them there and keeps its conversations there, with two
tenants' API keys and an admin key, and a fake peer that logs every request it gets (tests/fake_peer.py).

Each test writes Redis as an attacker who can would, or sends what a tenant probing another would, and checks that
no request (and so no cluster secret, no prompt) went to an address only the store named, and that nothing in an
answer tells one tenant of another's traffic."""
import json
import shutil
import time

import httpx
import pytest
import redis

from chat import SYSTEM, user_message
from fake_peer import FakePeer
from kvturn.launch import LocalStack, RedisServer, free_port, start, stop, wait_healthy
from kvturn.registry import signature
from kvturn.router.keys import scope_of, scoped

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")
KA, KB, ADMIN = "tenant-a-key-0123456789", "tenant-b-key-9876543210", "admin-key-of-the-operators-42"


class Cluster:
    def __init__(self, stack: LocalStack, router: str, redis_url: str, fake: FakePeer):
        self.stack, self.router, self.fake = stack, router, fake
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)

    def workers(self, role: str) -> list[str]:
        return httpx.get(f"{self.router}/health", headers=auth(ADMIN), timeout=10).json()[role]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """P (prefix cache on, the production baseline) + D, both registered in Redis with the stack's secret, and a
    router that knows them only from there."""
    logs = tmp_path_factory.mktemp("store-trust")
    with RedisServer() as server:
        stack = LocalStack(tiny_model_dir, kv_cache_mb=48, log_dir=logs,
                           worker_args=["--register", server.url, "--register-ttl-s", "3", "--no-calibrate"])
        fake = FakePeer(free_port(), logs)
        port = free_port()
        router = None
        try:
            stack.start_worker_processes()
            for name, url in stack.urls.items():
                wait_healthy(url, stack.processes[name])
            router = start(["router", "--port", str(port), "--discover", server.url, "--state", server.url,
                            "--health-interval-s", "0.5", "--api-key", KA, "--api-key", KB, "--admin-key", ADMIN],
                           logs / "router.log", stack.env)
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, router)
            fake.wait_listening()
            yield Cluster(stack, url, server.url, fake)
        finally:
            if router is not None:
                stop(router)
            stack.stop()
            fake.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def turn(cluster: Cluster, key: str, messages: list[dict], stream: bool = False, **extra) -> dict:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if not stream:
        response = httpx.post(f"{cluster.router}/v1/chat/completions", json=body, headers=auth(key), timeout=120)
        assert response.status_code == 200, response.text
        return response.json()
    chunks = []
    with httpx.stream("POST", f"{cluster.router}/v1/chat/completions", json=body, headers=auth(key),
                      timeout=120) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return {**chunks[-1], "kvturn": next(c["kvturn"] for c in chunks if "kvturn" in c),
            "kv_transfer_params": next((c["kv_transfer_params"] for c in chunks if "kv_transfer_params" in c), None)}


def wait_for(condition, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.1)
    return value


def all_keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in all_keys(v)}
    return set()


def test_the_router_serves_the_workers_whose_signed_registrations_it_found(cluster):
    assert cluster.workers("prefill") == [cluster.stack.urls["prefill"]]
    assert cluster.workers("decode") == [cluster.stack.urls["decode0"]]


def test_a_lease_record_rewritten_in_redis_sends_nothing_to_the_address_it_names(cluster):
    """The attack: move a stored conversation's lease record to the attacker's port (binding untouched). Its next
    turn used to make P call that address with the cluster secret. Now the entry's MAC fails: the turn recomputes,
    nothing is sent there, and the rejection is counted."""
    messages = [{"role": "system", "content": SYSTEM}, user_message(0)]
    first = turn(cluster, KA, messages, conversation_id="rewritten")
    name = "kvturn:conv:" + scoped(scope_of(KA), "rewritten")
    entry = json.loads(cluster.redis.hget(name, "entry"))
    entry["kv_params"]["remote_host"], entry["kv_params"]["remote_port"] = "127.0.0.1", cluster.fake.port
    cluster.redis.hset(name, "entry", json.dumps(entry))
    cluster.fake.configure({"agent": {"upstream": cluster.stack.urls["decode0"],
                                      "secret": cluster.stack.cluster_secret}})
    cluster.fake.clear()
    rejected = metric_as_admin(cluster, "kvturn_router_store_rejected_total", '{record="conversation"}')
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}, user_message(1)]
    second = turn(cluster, KA, messages, conversation_id="rewritten")
    assert second["kvturn"]["reuse"] != "reused"
    assert cluster.fake.requests() == []
    assert metric_as_admin(cluster, "kvturn_router_store_rejected_total", '{record="conversation"}') == rejected + 1


def metric_as_admin(cluster: Cluster, name: str, labels: str = "") -> float:
    for line in httpx.get(f"{cluster.router}/metrics", headers=auth(ADMIN), timeout=10).text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_worker_registration_written_by_hand_is_never_probed_nor_sent_a_turn(cluster):
    """The attack: SET a registration for the attacker's URL. The router used to probe it with the secret and send
    it real turns. Now: neither an empty value, nor a well-formed unsigned one, nor a signed one copied to another
    URL's key is taken; the fake hears nothing and each refusal is counted."""
    fake_url = f"http://{cluster.fake.address}"
    cluster.fake.configure({"health": {"status": 200, "json": {"status": "ok", "backend": "kvturn"}}})
    cluster.fake.clear()
    before = sum(metric_as_admin(cluster, "kvturn_router_registrations_refused_total", f'{{reason="{r}"}}')
                 for r in ("unsigned", "malformed"))
    genuine = cluster.redis.get(f"kvturn:worker:decode:{cluster.stack.urls['decode0']}")
    cluster.redis.set(f"kvturn:worker:decode:{fake_url}", "{}", px=60_000)
    cluster.redis.set(f"kvturn:worker:prefill:{fake_url}", json.dumps(
        {"role": "prefill", "url": fake_url, "announced_at": time.time(), "ttl_s": 60}), px=60_000)
    cluster.redis.set(f"kvturn:worker:decode:{fake_url}/", genuine, px=60_000)
    wait_for(lambda: sum(metric_as_admin(cluster, "kvturn_router_registrations_refused_total", f'{{reason="{r}"}}')
                         for r in ("unsigned", "malformed")) >= before + 3, "three refusals")
    for i in range(3):
        turn(cluster, KA, [{"role": "user", "content": f"who answers me? {i}"}])
    assert cluster.fake.requests() == []
    assert fake_url not in cluster.workers("decode") + cluster.workers("prefill")
    for key in cluster.redis.scan_iter(f"kvturn:worker:*{cluster.fake.address}*"):
        cluster.redis.delete(key)


def test_a_registration_that_stops_renewing_leaves_the_rotation_though_its_url_answers(cluster):
    """A signed registration (as a real worker makes) is taken, for its own time to live: when it is not renewed the
    worker leaves the rotation even though it still answers its health probe."""
    fake_url = f"http://{cluster.fake.address}"
    cluster.fake.configure({"health": {"status": 200, "json": {"status": "ok", "backend": "kvturn"}},
                            "agent": {"upstream": cluster.stack.urls["decode0"],
                                      "secret": cluster.stack.cluster_secret}})
    announced = time.time()
    value = {"role": "prefill", "url": fake_url, "announced_at": announced, "ttl_s": 2.0,
             "signature": signature(cluster.stack.cluster_secret, "prefill", fake_url, announced, 2.0)}
    cluster.redis.set(f"kvturn:worker:prefill:{fake_url}", json.dumps(value))  # no expiry in Redis: it stays there
    wait_for(lambda: fake_url in cluster.workers("prefill"), "the signed registration taken")
    assert any(e["path"] == "/health" for e in cluster.fake.requests())
    wait_for(lambda: fake_url not in cluster.workers("prefill"), "the stale registration dropped")
    cluster.redis.delete(f"kvturn:worker:prefill:{fake_url}")
    assert any(e["path"] == "/health" for e in cluster.fake.requests()[-3:])  # it kept answering


def test_a_tenant_sending_anothers_exact_prompt_gets_no_prefix_cache_hit(cluster):
    """Per 16-token block a tenant could test guesses of another's prompt through P's prefix cache (11.6 vs 66.5 ms,
    400 tokens 'cached'). Block hashes are salted per tenant, and per cache_salt within one."""
    secret_prompt = [{"role": "user", "content": "Tenant A's merger memo: the target is Northwind, offer 41 per "
                                                 "share, announce on the ninth. " * 6}]
    turn(cluster, KA, secret_prompt)
    again = turn(cluster, KA, secret_prompt)  # control: the same tenant hits its own cache
    assert again["kvturn"]["prompt_tokens_cached_prefill"] > 0
    probe = turn(cluster, KB, secret_prompt)
    assert probe["kvturn"]["prompt_tokens_cached_prefill"] == 0
    salted = turn(cluster, KA, secret_prompt, cache_salt="another-project")
    assert salted["kvturn"]["prompt_tokens_cached_prefill"] == 0
    bad = httpx.post(f"{cluster.router}/v1/chat/completions", headers=auth(KA), timeout=30,
                     json={"messages": secret_prompt, "max_tokens": 2, "cache_salt": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_sees_no_worker_url_engine_id_or_lease_handle(cluster, stream):
    messages = [{"role": "system", "content": SYSTEM}, user_message(3)]
    answer = turn(cluster, KA, messages, stream=stream, conversation_id=f"curious-{stream}",
                  return_kv_transfer_params=True)
    assert not all_keys(answer["kvturn"]) & {"prefill_worker", "decode_worker", "engine_id"}
    assert answer.get("kv_transfer_params") is None
    text = json.dumps(answer)
    for internal in (cluster.stack.urls["prefill"], cluster.stack.urls["decode0"], "127.0.0.1"):
        assert internal not in text


def test_metrics_and_the_worker_list_of_health_need_the_admin_key(cluster):
    for headers in ({}, auth(KA), auth("wrong")):
        reply = httpx.get(f"{cluster.router}/metrics", headers=headers, timeout=10)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == 401
        health = httpx.get(f"{cluster.router}/health", headers=headers, timeout=10).json()
        assert health["status"] == "ok" and "decode" not in health and "prefill" not in health
    assert httpx.get(f"{cluster.router}/metrics", headers=auth(ADMIN), timeout=10).status_code == 200
