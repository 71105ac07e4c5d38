"""The conversation table and the worker registry in Redis, against a real redis-server of the test's own."""
import asyncio
import json
import random
import shutil
import time

import pytest
import redis

from kvturn.launch import RedisServer
from kvturn.registry import Registration, WorkerRegistry, signature
from kvturn.router.conversations import Conversation
from kvturn.router.redis_state import (HISTORY_DIGESTS_KEPT, RETRY_AFTER_S, TIMEOUT_S, UNAVAILABLE,
                                       RedisConversationTable)
from kvturn.router.workers import WorkerPool

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make install installs it)")


@pytest.fixture(scope="module")
def server():
    with RedisServer() as started:
        yield started


@pytest.fixture
def url(server):
    if server.process.poll() is not None:
        server.start()
    redis.Redis.from_url(server.url).flushdb()
    return server.url


def entry(key, order=1, lease_s=60.0):
    return Conversation(key, "http://d", {"handle": "h", "remote_blocks_expiry_time": time.time() + lease_s}, 0.0,
                        order)


def with_table(url, scenario, ttl_s=60.0, **kwargs):
    async def run():
        table = RedisConversationTable(url, ttl_s, **kwargs)
        try:
            return await scenario(table)
        finally:
            await table.close()
    return asyncio.run(run())


def test_put_then_lookup_and_drop(url):
    async def scenario(table):
        assert await table.put(entry("public:a", order=3))
        found, why = await table.lookup("public:a")
        assert why is None and found.decode_url == "http://d" and found.order == 3 and found.kv_params["handle"] == "h"
        await table.drop("public:a")
        assert await table.lookup("public:a") == (None, None)
    with_table(url, scenario)


def test_entries_of_another_router_version_are_read_or_ignored_never_a_failure(url):
    """Replicas are upgraded one at a time: an entry with a field this version does not know is read without it,
    and one that is not an entry at all is a miss (the turn recomputes), not an error."""
    store = redis.Redis.from_url(url)

    async def scenario(table):
        await table.put(entry("public:newer", order=2))
        name = table._conversation_prefix + "public:newer"
        store.hset(name, "entry", json.dumps({**json.loads(store.hget(name, "entry")), "field_of_a_later_version": 1}))
        found, why = await table.lookup("public:newer")
        assert why is None and found.order == 2
        store.hset(table._conversation_prefix + "public:broken", "entry", json.dumps({"key": 1}))
        assert await table.lookup("public:broken") == (None, None)
    with_table(url, scenario)


def test_an_older_turn_never_overwrites_a_newer_one(url):
    async def scenario(table):
        assert await table.put(entry("public:a", order=5))
        assert not await table.put(entry("public:a", order=3))
        assert await table.put(entry("public:a", order=5))  # the same turn again (a retry) may
        assert (await table.lookup("public:a"))[0].order == 5
    with_table(url, scenario)


def test_replicas_racing_on_one_conversation_keep_the_newest_turn(url):
    orders = list(range(1, 41))
    random.Random(0).shuffle(orders)

    async def scenario(table):
        replicas = [RedisConversationTable(url, 60.0) for _ in range(3)]
        await asyncio.gather(*(replicas[i % 3].put(entry("public:race", order)) for i, order in enumerate(orders)))
        for replica in replicas:
            await replica.close()
        assert (await table.lookup("public:race"))[0].order == max(orders)
    with_table(url, scenario)


def test_redis_expires_an_entry_when_its_lease_or_the_conversation_ttl_ends(url):
    client = redis.Redis.from_url(url)

    async def scenario(table):
        await table.put(entry("public:long-lease", lease_s=600))
        await table.put(entry("public:short-lease", lease_s=0.3))
        assert 25_000 < client.pttl("kvturn:conv:public:long-lease") <= 30_000  # the conversation TTL
        assert 0 < client.pttl("kvturn:conv:public:short-lease") <= 300
        await asyncio.sleep(0.4)
        assert await table.lookup("public:short-lease") == (None, None)
        assert not client.exists("kvturn:conv:public:short-lease")
    with_table(url, scenario, ttl_s=30.0)


def test_history_finds_the_longest_remembered_prefix(url):
    async def scenario(table):
        await table.remember_history("d1", "public:a", "a")
        await table.remember_history("d3", "public:b", "derived-b")
        assert await table.find_history(["d0", "d1", "d2", "d3", "d4"]) == ("public:b", "derived-b")
        assert await table.find_history(["d0", "d1", "d2"]) == ("public:a", "a")
        assert await table.find_history(["x"]) is None
        assert await table.find_history([f"n{i}" for i in range(1000)] + ["d1"]) == ("public:a", "a")
    with_table(url, scenario)


def test_a_history_digest_an_older_router_stored_is_read_with_the_id_it_reported_then(url):
    """An older replica stored the key alone; during a rolling upgrade its digests still name their conversation."""
    redis.Redis.from_url(url).set("kvturn:hist:old", "public:0123abcd", px=30_000)

    async def scenario(table):
        assert await table.find_history(["old"]) == ("public:0123abcd", "0123abcd")
    with_table(url, scenario)


def test_a_conversation_keeps_only_its_latest_history_digests(url):
    client = redis.Redis.from_url(url)

    async def scenario(table):
        for turn in range(10):
            await table.remember_history(f"turn-{turn}", "public:a", "derived-a")
        kept = [f"turn-{turn}" for turn in range(10 - HISTORY_DIGESTS_KEPT, 10)]
        assert await table.find_history(["turn-0"]) is None
        assert all([await table.find_history([digest]) == ("public:a", "derived-a") for digest in kept])
        assert len(client.keys("kvturn:hist:*")) == HISTORY_DIGESTS_KEPT
        assert 0 < client.pttl("kvturn:hist:turn-9") <= 30_000 and 0 < client.pttl("kvturn:recent:public:a") <= 30_000
        assert await table.size() == (0, HISTORY_DIGESTS_KEPT)
    with_table(url, scenario, ttl_s=30.0)


def test_trimming_a_conversations_digests_spares_one_another_conversation_took_over(url):
    async def scenario(table):
        await table.remember_history("shared", "public:a", "a")
        await table.remember_history("shared", "public:b", "b")  # the same history, continued as b
        for turn in range(HISTORY_DIGESTS_KEPT):
            await table.remember_history(f"a-{turn}", "public:a", "a")
        assert await table.find_history(["shared"]) == ("public:b", "b")
    with_table(url, scenario)


def test_a_stopped_redis_costs_a_turn_nothing_and_is_used_again_once_back(server, url):
    """The call that finds Redis gone fails at once (the connection is refused); the calls after it do not try
    Redis again for RETRY_AFTER_S, or until the health round's ping finds it back."""
    errors, now = [], [0.0]

    async def scenario(table):
        await table.put(entry("public:a"))
        server.stop()
        # a hang guard only: a refused connection fails at once, a hung one after TIMEOUT_S
        assert await asyncio.wait_for(table.lookup("public:a"), 10 * TIMEOUT_S) == (None, UNAVAILABLE)
        assert errors == [1]
        assert not await table.put(entry("public:b"))
        await table.remember_history("d", "public:b", "b")
        assert await table.find_history(["d"]) is None
        assert errors == [1]  # none of them asked Redis
        assert table.health()["healthy"] is False and table.health()["last_error"]
        now[0] += RETRY_AFTER_S
        assert await table.lookup("public:a") == (None, UNAVAILABLE) and errors == [1, 1]  # asked again: still gone
        server.start()  # empty: Redis kept nothing
        await table.sweep()
        assert table.health() == {"backend": "redis", "healthy": True, "last_error": None}
        assert await table.lookup("public:a") == (None, None)
        assert await table.put(entry("public:a", order=2))
        assert (await table.lookup("public:a"))[0].order == 2
    with_table(url, scenario, on_error=lambda: errors.append(1), clock=lambda: now[0])


SECRET = "cluster-secret-of-the-registry-tests"


def urls(members: dict | None) -> dict:
    return {role: sorted(found) for role, found in (members or {}).items()}


def test_workers_registry_lists_live_registrations_and_forgets_expired_ones(url):
    async def scenario():
        registry = WorkerRegistry(url, SECRET)
        await registry.announce("prefill", "http://127.0.0.1:9001", ttl_s=60)
        await registry.announce("decode", "http://127.0.0.1:9002", ttl_s=0.2)
        assert urls(await registry.members()) == {"prefill": ["http://127.0.0.1:9001"],
                                                  "decode": ["http://127.0.0.1:9002"]}
        deadline = time.monotonic() + 10  # Redis expires the registration by its own clock
        while urls(await registry.members()) != {"prefill": ["http://127.0.0.1:9001"]}:
            assert time.monotonic() < deadline, await registry.members()
            await asyncio.sleep(0.05)
        await registry.withdraw("prefill", "http://127.0.0.1:9001")
        assert await registry.members() == {}
        await registry.close()
        unreachable = WorkerRegistry("redis://127.0.0.1:1/0")
        assert await unreachable.members() is None
        await unreachable.close()
    asyncio.run(scenario())


def test_a_router_takes_only_registrations_signed_under_its_cluster_secret(url):
    """Whoever can write Redis cannot add a worker: a key written by hand (unsigned), one signed under another
    secret, one whose value names another URL than its key, and a signed one announced long ago are all ignored,
    each counted by reason."""
    async def scenario():
        refused = []
        router = WorkerRegistry(url, SECRET, refused.append)
        await WorkerRegistry(url, SECRET).announce("decode", "http://127.0.0.1:9002", ttl_s=10)
        await WorkerRegistry(url, "another-clusters-secret-value").announce("decode", "http://127.0.0.1:9003", 10)
        raw = redis.Redis.from_url(url)
        raw.set("kvturn:worker:decode:http://127.0.0.1:9199", "{}")
        raw.set("kvturn:worker:decode:http://127.0.0.1:9198", json.dumps(
            {"role": "decode", "url": "http://127.0.0.1:9198", "announced_at": time.time(), "ttl_s": 10}))
        signed = json.loads(raw.get("kvturn:worker:decode:http://127.0.0.1:9002"))
        raw.set("kvturn:worker:decode:http://127.0.0.1:9197", json.dumps(signed))  # a copy under another key
        old = time.time() - 3600
        raw.set("kvturn:worker:prefill:http://127.0.0.1:9196", json.dumps(
            {"role": "prefill", "url": "http://127.0.0.1:9196", "announced_at": old, "ttl_s": 10,
             "signature": signature(SECRET, "prefill", "http://127.0.0.1:9196", old, 10)}))
        assert urls(await router.members()) == {"decode": ["http://127.0.0.1:9002"]}
        assert sorted(refused) == ["bad_signature", "malformed", "malformed", "stale", "unsigned"]
        await router.close()
    asyncio.run(scenario())


def test_a_pool_adds_registered_workers_and_drops_those_whose_registration_ran_out_even_if_they_answer():
    now = [100.0]
    pool = WorkerPool(["http://static:1"], "decode", clock=lambda: now[0])
    pool.follow_registry({"http://new:2/": Registration("http://new:2", 1.0, 10.0),
                          "http://other:3": Registration("http://other:3", 1.0, 10.0)})
    assert [w.url for w in pool.workers] == ["http://static:1", "http://new:2", "http://other:3"]
    assert not pool.find("http://new:2").healthy  # until a probe says otherwise
    pool.find("http://other:3").healthy = True
    pool.find("http://static:1").healthy = False
    now[0] = 105.0
    pool.follow_registry({"http://other:3": Registration("http://other:3", 1.0, 10.0)})  # replayed: extends nothing
    pool.follow_registry({})  # e.g. Redis restarted empty: each stays until its last registration runs out
    assert [w.url for w in pool.workers] == ["http://static:1", "http://new:2", "http://other:3"]
    pool.follow_registry({"http://new:2": Registration("http://new:2", 2.0, 10.0)})  # renewed: until 115
    now[0] = 111.0
    pool.follow_registry({})
    assert [w.url for w in pool.workers] == ["http://static:1", "http://new:2"]  # `other` answers, yet it is gone
    now[0] = 116.0
    pool.follow_registry({})
    assert [w.url for w in pool.workers] == ["http://static:1"]  # given on the command line: stays


def test_an_entry_rewritten_in_redis_is_treated_as_absent_and_counted(url):
    """With a cluster secret, an entry carries a MAC of its key and content: whoever rewrites the decode worker's
    address (or anything else) in Redis, or writes an entry of its own, is not believed."""
    rejected = []

    async def scenario(table):
        stored = entry("public:a")
        stored.kv_params = {**stored.kv_params, "remote_host": "127.0.0.1", "remote_port": 8200}
        assert await table.put(stored)
        assert (await table.lookup("public:a"))[0].kv_params["remote_port"] == 8200
        raw = redis.Redis.from_url(url)
        name = "kvturn:conv:public:a"
        fields = json.loads(raw.hget(name, "entry"))
        fields["kv_params"]["remote_port"] = 9199
        raw.hset(name, "entry", json.dumps(fields))
        assert await table.lookup("public:a") == (None, None) and len(rejected) == 1
        await RedisConversationTable(url, 60.0).put(entry("public:b"))  # a writer without the secret
        assert await table.lookup("public:b") == (None, None) and len(rejected) == 2
        raw.hset(name, "mac", raw.hget("kvturn:conv:public:b", "mac") or "x")  # a MAC of another entry
        assert await table.lookup("public:a") == (None, None) and len(rejected) == 3
    with_table(url, scenario, secret=SECRET, on_rejected=rejected.append)


def test_a_history_digest_pointed_elsewhere_in_redis_is_not_followed(url):
    """With a cluster secret a digest's value carries a MAC of the digest and the conversation it names: pointed at
    another conversation (or written unsigned), it is ignored and counted, and the turn starts afresh."""
    rejected = []

    async def scenario(table):
        await table.remember_history("d1", "scope-a:conv-1", "derived-1")
        await table.remember_history("d2", "scope-b:conv-2", "derived-2")
        assert await table.find_history(["d1"]) == ("scope-a:conv-1", "derived-1")
        raw = redis.Redis.from_url(url)
        raw.set("kvturn:hist:d1", raw.get("kvturn:hist:d2"))  # another conversation's value, MAC and all
        assert await table.find_history(["d1"]) is None and rejected == ["history"]
        raw.set("kvturn:hist:d1", json.dumps(["scope-b:conv-2", "derived-2"]))  # unsigned
        assert await table.find_history(["d1"]) is None and rejected == ["history"] * 2
        for i in range(HISTORY_DIGESTS_KEPT + 1):  # trimming still finds its own digests behind their MACs
            await table.remember_history(f"e{i}", "scope-a:conv-3", "derived-3")
        assert raw.get("kvturn:hist:e0") is None and await table.find_history([f"e{HISTORY_DIGESTS_KEPT}"])
    with_table(url, scenario, secret=SECRET, on_rejected=rejected.append)
