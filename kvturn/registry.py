"""Workers announce themselves in Redis, so routers find prefill and decode workers that come and go.

A worker (`kvturn worker --register redis://...`) sets `kvturn:worker:{role}:{url}` with a time to live and renews it
on a heartbeat; one that dies stops renewing and its key expires, one that stops cleanly deletes it. A router
(`kvturn router --discover redis://...`) lists the keys on each health round.

Whoever can write Redis must not be able to add a worker: a router sends a registered worker the cluster secret and
its clients' prompts. So a registration is signed under the cluster secret (role, URL, when it was announced and for
how long), and a router takes only registrations it can verify, each for as long as it says from when the router
first saw it: a replayed old registration extends nothing, one announced long ago is stale, and a worker whose
registration stops renewing leaves the rotation even if its URL still answers. Refusals are counted by reason.
Redis down: workers keep serving and register again on the next beat; routers keep the workers they knew.
"""
import asyncio
import hashlib
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

from kvturn.redis_client import ERRORS, connect

log = logging.getLogger("kvturn.registry")
KEY_PREFIX = "kvturn:worker:"
TIMEOUT_S = 1.0  # the most a beat or a router's health round waits on Redis
BEATS_PER_TTL = 3  # a registration survives two missed beats
MAX_TTL_S = 300.0  # the longest a router believes one registration, whatever it says
CLOCK_SKEW_S = 60.0  # how far a worker's wall clock may run behind a router's before its registrations look stale
# Why a router ignored a registration (kvturn_router_registrations_refused_total{reason})
UNSIGNED, BAD_SIGNATURE, STALE, MALFORMED = "unsigned", "bad_signature", "stale", "malformed"


def signature(secret: str, role: str, url: str, announced_at: float, ttl_s: float) -> str:
    message = json.dumps(["registration", role, url, announced_at, ttl_s], separators=(",", ":")).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Registration:
    url: str
    announced_at: float  # the worker's wall clock: orders one worker's registrations
    ttl_s: float


def verified(key: str, raw: str | None, secret: str | None, now: float) -> Registration | str:
    """The registration stored under `key`, or why it is not taken. Without a secret (an open cluster) the
    signature cannot be checked and every well-formed registration is taken, as before."""
    role, _, url = key[len(KEY_PREFIX):].partition(":")
    try:
        value = json.loads(raw) if raw is not None else None
        announced_at, ttl_s = value["announced_at"], value["ttl_s"]
        if value["role"] != role or value["url"] != url or not url.startswith(("http://", "https://")):
            return MALFORMED
        if type(announced_at) not in (int, float) or type(ttl_s) not in (int, float) or not 0 < ttl_s <= MAX_TTL_S:
            return MALFORMED
    except (ValueError, KeyError, TypeError):
        return MALFORMED
    if secret is not None:
        sent = value.get("signature")
        if not isinstance(sent, str):
            return UNSIGNED
        if not hmac.compare_digest(sent, signature(secret, role, url, announced_at, ttl_s)):
            return BAD_SIGNATURE
        if announced_at < now - ttl_s - CLOCK_SKEW_S:
            return STALE
    return Registration(url, float(announced_at), float(ttl_s))


class WorkerRegistry:
    def __init__(self, url: str, secret: str | None = None, on_refused=None):
        """`secret`: the cluster's, which signs (worker) and verifies (router) registrations. `on_refused(reason)`:
        counts a registration a router ignored."""
        self.redis = connect(url, TIMEOUT_S)
        self.secret = secret
        self.on_refused = on_refused or (lambda reason: None)
        self.reachable = True
        self._refused_logged: set[tuple[str, str]] = set()

    async def announce(self, role: str, worker_url: str, ttl_s: float) -> None:
        value = {"role": role, "url": worker_url, "announced_at": time.time(), "ttl_s": ttl_s}
        if self.secret is not None:
            value["signature"] = signature(self.secret, role, worker_url, value["announced_at"], ttl_s)
        await self.redis.set(KEY_PREFIX + f"{role}:{worker_url}", json.dumps(value), px=int(ttl_s * 1000))

    async def withdraw(self, role: str, worker_url: str) -> None:
        await self.redis.delete(KEY_PREFIX + f"{role}:{worker_url}")

    async def members(self) -> dict[str, dict[str, Registration]] | None:
        """Verified registrations by role and URL, or None when Redis cannot be reached (then nothing is known to
        be gone)."""
        found: dict[str, dict[str, Registration]] = {}
        try:
            keys = [key async for key in self.redis.scan_iter(match=KEY_PREFIX + "*", count=1000)]
            values = await self.redis.mget(keys) if keys else []
        except ERRORS as exc:
            if self.reachable:
                log.warning("worker registry unreachable, keeping the workers known: %s", exc)
            self.reachable = False
            return None
        if not self.reachable:
            log.info("worker registry is back")
        self.reachable = True
        now = time.time()
        for key, raw in zip(keys, values):
            registration = verified(key, raw, self.secret, now)
            if isinstance(registration, str):
                self._refuse(key, registration)
                continue
            role = key[len(KEY_PREFIX):].partition(":")[0]
            found.setdefault(role, {})[registration.url] = registration
        return found

    def _refuse(self, key: str, reason: str) -> None:
        self.on_refused(reason)
        if (key, reason) not in self._refused_logged and len(self._refused_logged) < 1000:
            self._refused_logged.add((key, reason))
            log.warning("ignoring worker registration %r in Redis: %s", key, reason)

    async def close(self) -> None:
        await self.redis.aclose()


async def heartbeat(registry: WorkerRegistry, role: str, worker_url: str, ttl_s: float) -> None:
    reachable = True
    while True:
        try:
            await registry.announce(role, worker_url, ttl_s)
            if not reachable:
                log.info("registered again as %s worker %s", role, worker_url)
            reachable = True
        except ERRORS as exc:
            if reachable:
                log.warning("cannot register as %s worker %s (retrying every beat): %s", role, worker_url, exc)
            reachable = False
        await asyncio.sleep(ttl_s / BEATS_PER_TTL)


@asynccontextmanager
async def run_registration(config):
    """While the worker runs, keep it registered at `config.register_url` (a WorkerConfig), signed with the cluster
    secret; nothing without one."""
    if not config.register_url:
        yield
        return
    secret = config.connector.cluster_secret
    if secret is None:
        log.warning("registering without a cluster secret: routers that have one will ignore this worker")
    registry = WorkerRegistry(config.register_url, secret)
    worker_url = f"http://{config.advertise_host or config.host}:{config.port}"
    beating = asyncio.create_task(heartbeat(registry, config.role, worker_url, config.register_ttl_s))
    try:
        yield
    finally:
        beating.cancel()
        with suppress(asyncio.CancelledError):
            await beating
        try:
            await registry.withdraw(config.role, worker_url)
        except ERRORS:
            pass  # the registration expires by itself
        await registry.close()
