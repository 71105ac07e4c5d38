"""Workers announce themselves in Redis, so routers find prefill and decode workers that come and go.

A worker (`kvturn worker --register redis://...`) sets `kvturn:worker:{role}:{url}` with a time to live and renews it
on a heartbeat; one that dies stops renewing and its key expires, one that stops cleanly deletes it. A router
(`kvturn router --discover redis://...`) lists the keys on each health round and drops a worker only once it is
neither registered nor answering. Redis down or wiped: workers keep serving and register again on the next beat;
routers keep the workers they knew.
"""
import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager, suppress

from kvturn.redis_client import ERRORS, connect

log = logging.getLogger("kvturn.registry")
KEY_PREFIX = "kvturn:worker:"
TIMEOUT_S = 1.0  # the most a beat or a router's health round waits on Redis
BEATS_PER_TTL = 3  # a registration survives two missed beats


class WorkerRegistry:
    def __init__(self, url: str):
        self.redis = connect(url, TIMEOUT_S)
        self.reachable = True

    async def announce(self, role: str, worker_url: str, ttl_s: float) -> None:
        value = json.dumps({"role": role, "url": worker_url, "announced_at": time.time()})
        await self.redis.set(KEY_PREFIX + f"{role}:{worker_url}", value, px=int(ttl_s * 1000))

    async def withdraw(self, role: str, worker_url: str) -> None:
        await self.redis.delete(KEY_PREFIX + f"{role}:{worker_url}")

    async def members(self) -> dict[str, list[str]] | None:
        """Registered worker URLs by role, or None when Redis cannot be reached (then nothing is known to be gone)."""
        found: dict[str, list[str]] = {}
        try:
            async for key in self.redis.scan_iter(match=KEY_PREFIX + "*", count=1000):
                role, _, worker_url = key[len(KEY_PREFIX):].partition(":")
                found.setdefault(role, []).append(worker_url)
        except ERRORS as exc:
            if self.reachable:
                log.warning("worker registry unreachable, keeping the workers known: %s", exc)
            self.reachable = False
            return None
        if not self.reachable:
            log.info("worker registry is back")
        self.reachable = True
        return found

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
    """While the worker runs, keep it registered at `config.register_url` (a WorkerConfig); nothing without one."""
    if not config.register_url:
        yield
        return
    registry = WorkerRegistry(config.register_url)
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
