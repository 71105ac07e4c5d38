"""The router's conversation table and conversation keys, without processes."""
import asyncio
import sqlite3
import time

import pytest

from kvturn.errors import BadRequest
from kvturn.router import keys
from kvturn.router.conversations import Conversation, ConversationTable


def run(coro):
    return asyncio.run(coro)


def entry(key, order=1, expiry=None):
    return Conversation(key, "http://d", {"handle": "h", "remote_blocks_expiry_time": expiry or time.time() + 60},
                        0.0, order)


def test_put_then_lookup_and_drop():
    table = ConversationTable(ttl_s=60, max_entries=10)
    assert run(table.put(entry("a")))
    found, why = run(table.lookup("a"))
    assert found.decode_url == "http://d" and why is None
    run(table.drop("a"))
    assert run(table.lookup("a")) == (None, None)


def test_an_entry_past_its_lease_is_reported_expired():
    now = [1_000.0]
    table = ConversationTable(ttl_s=60, max_entries=10, clock=lambda: now[0])
    run(table.put(entry("a", expiry=now[0] + 5)))
    now[0] += 4.9
    assert run(table.lookup("a"))[1] is None
    now[0] += 0.1
    assert run(table.lookup("a")) == (None, "expired")


def test_an_older_turn_never_overwrites_a_newer_one():
    table = ConversationTable(ttl_s=60, max_entries=10)
    run(table.put(entry("a", order=5)))
    assert not run(table.put(entry("a", order=3)))
    assert run(table.lookup("a"))[0].order == 5


def test_the_table_is_bounded_oldest_first():
    table = ConversationTable(ttl_s=60, max_entries=3)
    for name in "abcd":
        run(table.put(entry(name)))
        run(table.remember_history(f"digest-{name}", name, f"id-{name}"))
    assert run(table.size()) == (3, 3)
    assert run(table.lookup("a"))[0] is None and run(table.lookup("d"))[0] is not None


def test_sqlite_state_survives_a_restart(tmp_path):
    path = tmp_path / "state.sqlite"
    table = ConversationTable(ttl_s=60, max_entries=10, state_path=path)
    run(table.put(entry("a", order=4)))
    run(table.remember_history("digest", "a", "derived-a"))
    run(table.close())
    again = ConversationTable(ttl_s=60, max_entries=10, state_path=path)
    assert run(again.lookup("a"))[0].order == 4 and run(again.find_history(["x", "digest"])) == ("a", "derived-a")


def test_a_state_file_of_an_older_router_is_read_with_the_ids_it_reported_then(tmp_path):
    """An older router stored a digest's key alone (and reported its part after the scope as the id)."""
    path = tmp_path / "state.sqlite"
    old = sqlite3.connect(str(path))
    old.execute("CREATE TABLE history (hash TEXT PRIMARY KEY, key TEXT, expires_at REAL)")
    old.execute("INSERT INTO history VALUES ('digest', 'public:abc', ?)", (time.time() + 60,))
    old.commit()
    old.close()
    table = ConversationTable(ttl_s=60, max_entries=10, state_path=path)
    assert run(table.find_history(["digest"])) == ("public:abc", "abc")
    run(table.remember_history("next", "public:abc", "derived-x"))
    run(table.close())
    assert run(ConversationTable(60, 10, path).find_history(["next"])) == ("public:abc", "derived-x")


def test_a_history_continues_the_conversation_of_its_longest_remembered_prefix():
    table = ConversationTable(ttl_s=60, max_entries=10)
    turn1 = [{"role": "user", "content": "hi"}]
    answer = {"role": "assistant", "content": "hello"}
    run(table.remember_history(keys.History("scope", turn1).extended(answer), "scope:conv", "derived-1"))
    turn2 = keys.History("scope", [*turn1, answer, {"role": "user", "content": "more"}])
    assert run(table.find_history(turn2.digests[:-1])) == ("scope:conv", "derived-1")
    other_tenant = keys.History("other", [*turn1, answer, {"role": "user", "content": "more"}])
    assert run(table.find_history(other_tenant.digests[:-1])) is None


def test_history_digests_chain_so_each_prefix_has_its_own():
    messages = [{"role": "user", "content": str(i)} for i in range(5)]
    history = keys.History("s", messages)
    assert len(set(history.digests)) == 5
    assert history.digests[:3] == keys.History("s", messages[:3]).digests


@pytest.mark.parametrize("value", [5, ["a"], {"a": 1}, "", "x" * 257])
def test_conversation_ids_must_be_short_strings(value):
    with pytest.raises(BadRequest):
        keys.explicit_id({"conversation_id": value}, {})


def test_ids_are_taken_from_body_then_headers_never_truncated():
    assert keys.explicit_id({"conversation_id": "body"}, {"X-Session-ID": "session"}) == "body"
    assert keys.explicit_id({}, {"X-Conversation-Id": "conv", "X-Session-ID": "session"}) == "conv"
    assert keys.explicit_id({}, {"X-Session-ID": "session"}) == "session"
    assert keys.explicit_id({"conversation_id": "y" * 256}, {}) == "y" * 256


def test_a_routers_list_of_session_headers_says_which_are_read_and_in_what_order():
    sent = {"X-SMG-Routing-Key": "smg", "session-id": "codex"}
    assert keys.explicit_id({}, sent) == "smg"
    assert keys.explicit_id({}, sent, ["session-id", "X-SMG-Routing-Key"]) == "codex"
    assert keys.explicit_id({}, sent, ["X-Conversation-Id"]) is None
    with pytest.raises(BadRequest, match="X-Correlation-ID"):
        keys.explicit_id({}, {"X-Correlation-ID": "c" * 257})


@pytest.mark.parametrize("value, final", [("true", True), ("True", True), (" true ", True), ("false", False),
                                          ("1", False), (None, False)])
def test_dynamos_final_header_ends_the_session_only_when_true(value, final):
    assert keys.ends_session({} if value is None else {"X-Dynamo-Session-Final": value}) is final


@pytest.mark.parametrize("header", ["", "two words", "X-Id:", "X-Ïd"])
def test_a_session_header_must_be_an_http_header_name(header):
    from kvturn.config import ConfigError, RouterConfig
    with pytest.raises(ConfigError, match="session header"):
        RouterConfig(prefill_urls=["http://p"], decode_urls=["http://d"], session_headers=["X-Session-ID", header])
