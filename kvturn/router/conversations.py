"""The router's conversation table: which decode worker retains a conversation's KV, and its lease; and the
history index that names a conversation by the digest of a history it returned.

Kept in memory, bounded (`max_entries`, oldest dropped first; expired entries swept), and with a state path
written through to SQLite so a restarted router keeps reusing. The methods are coroutines so that a shared
store (Redis, for many routers) can stand in for this one.

A history digest names the conversation by its scoped key and by the id its client knows it by (the `derived-...`
id of its first turn, or the id the client sent): a later turn found by its history reports that id, which
`DELETE /v1/conversations/{id}` takes, never the scoped key.
"""
import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvturn.router.lease_time import lease_end, with_time_left


@dataclass(slots=True)
class Conversation:
    key: str
    decode_url: str
    kv_params: dict  # the decode worker's retention params, passed to prefill next turn
    expires_at: float  # wall clock
    order: int = 0  # how far the conversation had come (messages in the history); a store keeps the newest
    prompt_token_ids: str | None = None  # for a vLLM backend: the ids whose KV the decode worker retained, "1,2,3"
    # Bytes of the history's messages up to the answer, whose KV the lease holds: the next turn's prompt estimate
    # counts only the bytes added since (costmodel.tokens.TokenEstimator.prompt_tokens).
    history_bytes: int = 0
    stored_at: float = 0.0  # wall clock of the router that stored it: how long the lease has gone unused since

    @classmethod
    def from_fields(cls, fields: dict) -> "Conversation":
        """An entry as a shared store kept it. Fields this version does not know are left out: a newer router
        replica may have written them (replicas are upgraded one at a time)."""
        return cls(**{name: fields[name] for name in cls.__dataclass_fields__ if name in fields})


def legacy_client_id(key: str) -> str:
    """The client id of a history digest an older router stored without one: what it reported then."""
    return key.partition(":")[2]


class ConversationTable:
    def __init__(self, ttl_s: float, max_entries: int, state_path: str | Path | None = None,
                 clock: Callable[[], float] = time.time):
        self.ttl_s = ttl_s
        self.clock = clock  # wall clock: the state file outlives the process
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Conversation] = OrderedDict()  # oldest write first
        self._history: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # digest -> (key, client id, expires)
        self._db = None
        if state_path:
            self._db = sqlite3.connect(str(state_path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS conversations (key TEXT PRIMARY KEY, decode_url TEXT, "
                             "kv_params TEXT, expires_at REAL, extra TEXT)")
            self._db.execute("CREATE TABLE IF NOT EXISTS history (hash TEXT PRIMARY KEY, key TEXT, expires_at REAL, "
                             "client_id TEXT)")
            if "client_id" not in {row[1] for row in self._db.execute("PRAGMA table_info(history)")}:
                self._db.execute("ALTER TABLE history ADD COLUMN client_id TEXT")  # a file of an older router
            self._load()

    def _load(self) -> None:
        now = self.clock()
        self._db.execute("DELETE FROM conversations WHERE expires_at <= ?", (now,))
        self._db.execute("DELETE FROM history WHERE expires_at <= ?", (now,))
        rows = self._db.execute("SELECT key, decode_url, kv_params, expires_at, extra FROM conversations "
                                "ORDER BY expires_at")
        for key, url, params, expires, extra in rows:
            extra = json.loads(extra or "{}")
            self._entries[key] = Conversation(key, url, json.loads(params), expires, extra.get("order", 0),
                                              extra.get("prompt_token_ids"), extra.get("history_bytes", 0),
                                              extra.get("stored_at", 0.0))
        for digest, key, expires, client_id in self._db.execute("SELECT hash, key, expires_at, client_id FROM history "
                                                                "ORDER BY expires_at"):
            self._history[digest] = (key, client_id or legacy_client_id(key), expires)

    async def lookup(self, key: str) -> tuple[Conversation | None, str | None]:
        """The live entry, its lease's time left counted down, or None and why: "expired" when the lease ran out
        (the turn came too late)."""
        entry = self._entries.get(key)
        now = self.clock()
        if entry is not None and entry.expires_at <= now:
            self._drop(key)
            return None, "expired"
        if entry is None:
            return None, None
        kv_params = with_time_left(entry.kv_params, entry.expires_at - now)
        return Conversation(**{**{f: getattr(entry, f) for f in Conversation.__dataclass_fields__},
                               "kv_params": kv_params}), None

    async def put(self, entry: Conversation) -> bool:
        """Store `entry` unless the table holds a newer turn of the conversation; whether it was stored."""
        current = self._entries.get(entry.key)
        if current is not None and current.order > entry.order and current.expires_at > self.clock():
            return False
        now = self.clock()
        entry.expires_at = min(now + self.ttl_s, lease_end(entry.kv_params, now))
        entry.stored_at = now
        self._entries.pop(entry.key, None)
        self._entries[entry.key] = entry
        if self._db:
            extra = json.dumps({"order": entry.order, "prompt_token_ids": entry.prompt_token_ids,
                                "history_bytes": entry.history_bytes, "stored_at": entry.stored_at})
            self._db.execute("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?, ?)",
                             (entry.key, entry.decode_url, json.dumps(entry.kv_params), entry.expires_at, extra))
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
        return True

    async def drop(self, key: str) -> None:
        self._drop(key)

    def _drop(self, key: str) -> None:
        self._entries.pop(key, None)
        if self._db:
            self._db.execute("DELETE FROM conversations WHERE key = ?", (key,))

    async def remember_history(self, digest: str, key: str, client_id: str) -> None:
        """A later turn whose history has this digest as a prefix continues `key`, which its client calls
        `client_id`."""
        expires = self.clock() + self.ttl_s
        self._history.pop(digest, None)
        self._history[digest] = (key, client_id, expires)
        while len(self._history) > self.max_entries:
            oldest = next(iter(self._history))
            self._forget_history(oldest)
        if self._db:
            self._db.execute("INSERT OR REPLACE INTO history (hash, key, expires_at, client_id) VALUES (?, ?, ?, ?)",
                             (digest, key, expires, client_id))

    def _forget_history(self, digest: str) -> None:
        del self._history[digest]
        if self._db:
            self._db.execute("DELETE FROM history WHERE hash = ?", (digest,))

    async def find_history(self, digests: list[str]) -> tuple[str, str] | None:
        """(key, client id) of the conversation of the longest remembered prefix among `digests` (shortest first)."""
        now = self.clock()
        for digest in reversed(digests):
            found = self._history.get(digest)
            if found is not None and found[2] > now:
                return found[0], found[1]
        return None

    async def sweep(self) -> None:
        """Drop what has expired, so memory follows the live conversations."""
        now = self.clock()
        for key in [k for k, e in self._entries.items() if e.expires_at <= now]:
            self._drop(key)
        for digest in [d for d, (_, _, expires) in self._history.items() if expires <= now]:
            self._forget_history(digest)

    async def size(self) -> tuple[int, int]:
        """(conversations, history digests) held."""
        return len(self._entries), len(self._history)

    def health(self) -> dict:
        return {"backend": "sqlite" if self._db else "memory", "healthy": True}

    async def close(self) -> None:
        if self._db:
            self._db.close()
