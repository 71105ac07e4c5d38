"""The router's conversation table: which decode worker retains a conversation's KV, and its lease.

Kept in memory and, with a state path, written through to SQLite so a restarted router keeps
reusing. Clients without a conversation id are tracked by hashes of their message history: a
turn's history plus the answer we returned names the conversation on its next turn.
"""
import hashlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Conversation:
    key: str
    decode_url: str
    kv_params: dict  # the decode worker's retention params, passed to prefill next turn
    expires_at: float  # wall clock


def history_hash(messages: list[dict]) -> str:
    canonical = json.dumps([[m.get("role"), m.get("content")] for m in messages], separators=(",", ":"),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class ConversationTable:
    def __init__(self, ttl_s: float, state_path: str | Path | None = None, max_entries: int = 100_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, Conversation] = {}
        self._history: dict[str, tuple[str, float]] = {}  # history hash -> (key, expires_at)
        self._lock = threading.Lock()
        self._db = None
        if state_path:
            self._db = sqlite3.connect(str(state_path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS conversations (key TEXT PRIMARY KEY, decode_url TEXT, "
                             "kv_params TEXT, expires_at REAL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS history (hash TEXT PRIMARY KEY, key TEXT, expires_at REAL)")
            self._load()

    def _load(self) -> None:
        now = time.time()
        self._db.execute("DELETE FROM conversations WHERE expires_at <= ?", (now,))
        self._db.execute("DELETE FROM history WHERE expires_at <= ?", (now,))
        for key, url, params, expires in self._db.execute("SELECT key, decode_url, kv_params, expires_at "
                                                          "FROM conversations"):
            self._entries[key] = Conversation(key, url, json.loads(params), expires)
        for digest, key, expires in self._db.execute("SELECT hash, key, expires_at FROM history"):
            self._history[digest] = (key, expires)

    def get(self, key: str) -> Conversation | None:
        return self.lookup(key)[0]

    def lookup(self, key: str) -> tuple[Conversation | None, str | None]:
        """The live entry, or None and why: "expired" when the lease ran out (the turn came too late)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.expires_at <= time.time():
                self._drop_locked(key)
                return None, "expired"
            return entry, None

    def put(self, key: str, decode_url: str, kv_params: dict) -> Conversation:
        lease_end = float(kv_params.get("remote_blocks_expiry_time") or float("inf"))
        entry = Conversation(key, decode_url, kv_params, min(time.time() + self.ttl_s, lease_end))
        with self._lock:
            self._entries[key] = entry
            if len(self._entries) > self.max_entries:
                self._evict_locked()
            if self._db:
                self._db.execute("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?)",
                                 (key, decode_url, json.dumps(kv_params), entry.expires_at))
        return entry

    def drop(self, key: str) -> None:
        with self._lock:
            self._drop_locked(key)

    def _drop_locked(self, key: str) -> None:
        self._entries.pop(key, None)
        if self._db:
            self._db.execute("DELETE FROM conversations WHERE key = ?", (key,))

    def _evict_locked(self) -> None:
        oldest = sorted(self._entries.values(), key=lambda e: e.expires_at)[: len(self._entries) // 10 or 1]
        for entry in oldest:
            self._drop_locked(entry.key)

    def remember_history(self, messages: list[dict], key: str) -> None:
        """The next turn's history will start with `messages`: let it find `key`."""
        digest, expires = history_hash(messages), time.time() + self.ttl_s
        with self._lock:
            self._history[digest] = (key, expires)
            if len(self._history) > self.max_entries:
                for stale in [h for h, (_, e) in self._history.items() if e <= time.time()]:
                    del self._history[stale]
            if self._db:
                self._db.execute("INSERT OR REPLACE INTO history VALUES (?, ?, ?)", (digest, key, expires))

    def key_for_history(self, messages: list[dict]) -> str:
        """The conversation whose longest earlier turn this history extends, or a new derived key."""
        now = time.time()
        with self._lock:
            for end in range(len(messages) - 1, 0, -1):
                found = self._history.get(history_hash(messages[:end]))
                if found is not None and found[1] > now:
                    return found[0]
        return "derived-" + history_hash(messages)[:32]

    def __len__(self) -> int:
        return len(self._entries)
