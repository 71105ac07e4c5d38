"""The conversation table in Redis, shared by router replicas behind any balancer: a dead replica loses nothing.

Same interface as `ConversationTable`. A conversation is a hash `kvturn:conv:{key}` = {order, entry} that Redis
expires when its lease or the conversation TTL ends, whichever is first. A put is a compare-and-set on `order` in
one script, so a replica that finishes an older turn late never overwrites a newer lease. A history digest is a key
`kvturn:hist:{digest}` naming its conversation (a JSON pair: its key and the id its client knows it by), with the
conversation TTL; each conversation keeps only its latest few (a retried or regenerated turn still finds it), so the
keys follow the live conversations, not the turns.

Redis relays, it does not steer: with a cluster secret, each entry carries a MAC (under the secret) of its key and its
whole content, the decode worker's URL and lease record included, and an entry whose MAC does not hold (written by
whoever else can write Redis) is treated as absent and counted. (The lease record inside is also MAC'd by the decode
worker that made it, over its own address, which is what a prefill worker checks before it contacts anyone.)

Redis is an optimisation like every reuse path: when it cannot be reached, lookups miss, writes are dropped, turns
recompute, and `health()` says so; the next call after Redis is back uses it again.
"""
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from kvturn.redis_client import ERRORS, connect
from kvturn.router.conversations import Conversation, legacy_client_id
from kvturn.router.lease_time import lease_end, with_time_left

UNAVAILABLE = "state_unavailable"
TIMEOUT_S = 1.0  # a hung Redis costs one turn this long, then the others nothing (0.5 s misfired on busy 2 cores)
RETRY_AFTER_S = 2.0  # after a failure, turns skip Redis this long (the health round's ping ends it sooner)
SIZE_EVERY_S = 10.0  # counting the keys scans the namespace; a gauge need not be fresher
HISTORY_DIGESTS_KEPT = 4  # per conversation: a client resending one of its last few histories still finds it
MGET_CHUNK = 256
_FAILED = object()
log = logging.getLogger("kvturn.router")

# KEYS: conversation. ARGV: order, entry JSON, time to live ms, MAC. 1 if stored, 0 if a newer turn is there.
PUT_UNLESS_NEWER = """
local stored = redis.call('HGET', KEYS[1], 'order')
if stored and tonumber(stored) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'order', ARGV[1], 'entry', ARGV[2], 'mac', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS: digest, the conversation's recent digests. ARGV: the digest's value, digest, ms, how many kept, digest prefix,
# what names the conversation (the value's part before its MAC). A digest trimmed from the list is deleted unless
# another conversation has taken it over since.
REMEMBER_DIGEST = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('LREM', KEYS[2], 0, ARGV[2])
redis.call('LPUSH', KEYS[2], ARGV[2])
for _, old in ipairs(redis.call('LRANGE', KEYS[2], tonumber(ARGV[4]), -1)) do
  local value = redis.call('GET', ARGV[5] .. old)
  if value and (value == ARGV[6] or string.sub(value, 1, #ARGV[6] + 1) == ARGV[6] .. '\\n') then
    redis.call('DEL', ARGV[5] .. old)
  end
end
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[4]) - 1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""


def conversation_named(value: str) -> tuple[str, str]:
    """(key, client id) of a history digest's value (its MAC cut off); an older router's value is the key alone."""
    value = value.rpartition("\n")[0] or value
    try:
        key, client_id = json.loads(value)
        if isinstance(key, str) and isinstance(client_id, str):
            return key, client_id
    except (ValueError, TypeError):
        pass
    return value, legacy_client_id(value)


class RedisConversationTable:
    def __init__(self, url: str, ttl_s: float, namespace: str = "kvturn", on_error: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, secret: str | None = None,
                 on_rejected: Callable[[str], None] | None = None):
        """`secret`: the cluster's, under which entries are signed and checked (None: the store is trusted).
        `on_rejected(record)`: counts a conversation entry or history digest whose MAC did not hold."""
        self.ttl_s = ttl_s
        self.secret = secret.encode() if secret else None
        self._on_rejected = on_rejected
        self.clock = clock  # of the retry wait and the size gauge; entries expire by Redis's own clock
        self.redis = connect(url, TIMEOUT_S)
        self._put = self.redis.register_script(PUT_UNLESS_NEWER)
        self._remember = self.redis.register_script(REMEMBER_DIGEST)
        self._conversation_prefix = f"{namespace}:conv:"
        self._digest_prefix = f"{namespace}:hist:"
        self._recent_prefix = f"{namespace}:recent:"
        self._on_error = on_error
        self.healthy = True
        self.last_error: str | None = None
        self._skip_until = 0.0
        self._size, self._size_at = (0, 0), float("-inf")

    async def _call(self, operation: Callable[[], Awaitable], probe: bool = False):
        """The operation's result, or _FAILED when Redis cannot answer (remembered; turns carry on without it)."""
        if not probe and self.clock() < self._skip_until:
            return _FAILED
        try:
            result = await operation()
        except ERRORS as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
            if self.healthy:
                log.warning("conversation store unreachable, turns recompute until it is back: %s", error)
            self.healthy, self.last_error = False, error
            self._skip_until = self.clock() + RETRY_AFTER_S
            if self._on_error:
                self._on_error()
            return _FAILED
        if not self.healthy:
            log.info("conversation store is back")
        self.healthy, self._skip_until = True, 0.0
        return result

    async def lookup(self, key: str) -> tuple[Conversation | None, str | None]:
        """The live entry, or None and why: "expired" (the lease ran out) or "state_unavailable" (Redis is down)."""
        found = await self._call(lambda: self._entry_and_time_left(self._conversation_prefix + key))
        if found is _FAILED:
            return None, UNAVAILABLE
        raw, mac, left_ms = found
        if raw is None:
            return None, None
        if not self._signed(key, raw, mac):
            log.warning("conversation entry %s in the shared store has no valid MAC; ignoring it", key)
            if self._on_rejected:
                self._on_rejected("conversation")
            return None, None
        try:
            entry = Conversation.from_fields(json.loads(raw))
        except (TypeError, ValueError):  # not an entry any version of the router wrote: no reuse this turn
            log.warning("conversation entry %s in the shared store is malformed; ignoring it", key)
            return None, None
        if left_ms is not None:  # its time left by Redis's own clock, not the wall clock of the replica that wrote it
            if left_ms <= 0:
                return None, "expired"
            entry.expires_at = time.time() + left_ms / 1000
            entry.kv_params = with_time_left(entry.kv_params, left_ms / 1000)
        return entry, None

    async def _entry_and_time_left(self, name: str) -> tuple[str | None, str | None, int | None]:
        """The entry's JSON, its MAC and its ms left in Redis (None for a key without expiry, which kvturn never
        writes)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(name, "entry", "mac")
            pipe.pttl(name)
            (raw, mac), left_ms = await pipe.execute()
        return raw, mac, (left_ms if isinstance(left_ms, int) and left_ms != -1 else None)

    def _mac(self, key: str, raw: str) -> str:
        if self.secret is None:
            return ""
        message = len(key).to_bytes(4, "big") + key.encode("utf-8", "surrogatepass") + raw.encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def _signed(self, key: str, raw: str, mac: str | None) -> bool:
        """Whether a router of this cluster wrote the entry `raw` under `key` (always, in a cluster without a secret)."""
        return self.secret is None or isinstance(mac, str) and hmac.compare_digest(mac, self._mac(key, raw))

    async def put(self, entry: Conversation) -> bool:
        """Store `entry` unless Redis holds a newer turn of the conversation; whether it was stored."""
        now = time.time()
        entry.expires_at = min(now + self.ttl_s, lease_end(entry.kv_params, now))
        entry.stored_at = now
        ttl_ms = int((entry.expires_at - now) * 1000)
        if ttl_ms <= 0:
            return False
        raw = json.dumps(asdict(entry))
        stored = await self._call(lambda: self._put(keys=[self._conversation_prefix + entry.key],
                                                    args=[entry.order, raw, ttl_ms, self._mac(entry.key, raw)]))
        return stored == 1

    async def drop(self, key: str) -> None:
        await self._call(lambda: self.redis.delete(self._conversation_prefix + key))

    async def remember_history(self, digest: str, key: str, client_id: str) -> None:
        """A later turn whose history has this digest as a prefix continues `key`, which its client calls
        `client_id`."""
        ttl_ms = int(self.ttl_s * 1000)
        named = json.dumps([key, client_id])  # the same for every digest of the conversation (the script compares)
        value = f"{named}\n{self._mac('hist:' + digest, named)}" if self.secret else named
        await self._call(lambda: self._remember(keys=[self._digest_prefix + digest, self._recent_prefix + key],
                                                args=[value, digest, ttl_ms, HISTORY_DIGESTS_KEPT,
                                                      self._digest_prefix, named]))

    async def find_history(self, digests: list[str]) -> tuple[str, str] | None:
        """(key, client id) of the conversation of the longest remembered prefix among `digests` (shortest first);
        longest asked first."""
        for end in range(len(digests), 0, -MGET_CHUNK):
            chunk = digests[max(0, end - MGET_CHUNK):end]
            names = [self._digest_prefix + digest for digest in chunk]
            found = await self._call(lambda names=names: self.redis.mget(names))
            if found is _FAILED:
                return None
            for digest, value in zip(reversed(chunk), reversed(found)):
                if value is None:
                    continue
                named, _, mac = value.rpartition("\n")
                if self._signed("hist:" + digest, named, mac or None):
                    return conversation_named(value)
                log.warning("history digest %s in the shared store has no valid MAC; ignoring it", digest[:16])
                if self._on_rejected:
                    self._on_rejected("history")
        return None

    async def sweep(self) -> None:
        """Redis expires entries itself; this round only checks that it answers, so health follows it back."""
        await self._call(self.redis.ping, probe=True)

    async def size(self) -> tuple[int, int]:
        """(conversations, history digests) in Redis, counted at most every SIZE_EVERY_S."""
        if self.clock() - self._size_at < SIZE_EVERY_S:
            return self._size
        self._size_at = self.clock()
        conversations = await self._call(lambda: self._count(self._conversation_prefix))
        digests = await self._call(lambda: self._count(self._digest_prefix))
        if conversations is not _FAILED and digests is not _FAILED:
            self._size = conversations, digests
        return self._size

    async def _count(self, prefix: str) -> int:
        return sum([1 async for _ in self.redis.scan_iter(match=prefix + "*", count=1000)])

    def health(self) -> dict:
        return {"backend": "redis", "healthy": self.healthy, "last_error": None if self.healthy else self.last_error}

    async def close(self) -> None:
        await self.redis.aclose()
