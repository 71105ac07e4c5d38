"""What benchmarks/chaos_soak.py watches while it runs: every process's resident memory, the KV each decode worker
retains under leases, and the keys in Redis; and the verdict on memory over the last half of the run."""
import asyncio
import time
from pathlib import Path

import httpx
import redis

from kvturn.config import EngineConfig, default_of
from kvturn.launch import LocalStack, RedisServer

SAMPLE_EVERY_S = 2.0
SETTLE_S = 30.0  # a process's memory is judged from this long after it started (model load, first requests)
GROWTH_MIB, GROWTH_SHARE = 16.0, 0.10  # growth past both of these is growth, not noise


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Watch:
    def __init__(self, stack: LocalStack, redis_server: RedisServer, started: float):
        self.stack, self.redis, self.started = stack, redis_server, started
        self.rss: list[tuple[float, str, int, float]] = []  # (seconds into the run, name, pid, MiB)
        self.retained_bytes: dict[str, list[float]] = {}  # decode worker -> its samples
        self.redis_keys: list[tuple[float, int]] = []
        self.block_bytes = 0.0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        decoders = [name for name in self.stack.processes if name.startswith("decode")]
        async with httpx.AsyncClient(timeout=2) as client:
            self.block_bytes = await self.kv_block_bytes(client, decoders[0])
            while not self.stop.is_set():
                now = time.monotonic() - self.started
                for name, process in [*self.stack.processes.items(), ("redis", self.redis.process)]:
                    if (mib := rss_mib(process.pid)) is not None:
                        self.rss.append((now, name, process.pid, mib))
                for name in decoders:
                    if (retained := await self.retained(client, name)) is not None:
                        self.retained_bytes.setdefault(name, []).append(retained)
                if (keys := await asyncio.to_thread(self.count_keys)) is not None:
                    self.redis_keys.append((now, keys))
                try:
                    await asyncio.wait_for(self.stop.wait(), SAMPLE_EVERY_S)
                except asyncio.TimeoutError:
                    pass

    async def kv_block_bytes(self, client: httpx.AsyncClient, name: str) -> float:
        calibration = (await client.get(f"{self.stack.urls[name]}/kv/calibration")).json()
        return calibration["kv_bytes_per_token"] * default_of(EngineConfig, "block_size")

    async def retained(self, client: httpx.AsyncClient, name: str) -> float | None:
        try:
            for line in (await client.get(f"{self.stack.urls[name]}/metrics")).text.splitlines():
                if line.startswith("kvturn_kv_retained_bytes "):
                    return float(line.split()[1])
        except httpx.HTTPError:
            pass  # stopped or restarting
        return None

    def count_keys(self) -> int | None:
        try:
            with redis.Redis.from_url(self.redis.url, socket_timeout=1, socket_connect_timeout=1) as connection:
                return connection.dbsize()
        except redis.RedisError:
            return None  # down (the restart)


def rss_verdicts(samples: list[tuple[float, str, int, float]], duration_s: float) -> dict[str, dict]:
    """Per process: its memory over the last half of the run, from the process alive at the end (from SETTLE_S
    after it started, when a restart made it younger). The window's later half must not peak above its earlier
    half: a leak raises the peak again and again, where a step in load (a worker taking over its peer's sessions
    while the peer restarts) raises it once."""
    verdicts = {}
    for name in sorted({sample[1] for sample in samples}):
        mine = [s for s in samples if s[1] == name]
        pid = mine[-1][2]
        born_s = min(t for t, _, p, _ in mine if p == pid)
        since_s = max(duration_s / 2, born_s + SETTLE_S if born_s > 0 else 0.0)
        window = [mib for t, _, p, mib in mine if p == pid and t >= since_s]
        if len(window) < 10:
            verdicts[name] = {"verdict": "not judged", "pid": pid, "started_at_s": round(born_s, 1),
                              "why": "restarted too late in the run to judge"}
            continue
        earlier, later = max(window[:len(window) // 2]), max(window[len(window) // 2:])
        grew = later - earlier > max(GROWTH_MIB, GROWTH_SHARE * earlier)
        verdicts[name] = {"verdict": "grew" if grew else "flat", "pid": pid, "since_s": round(since_s, 1),
                          "first_mib": round(window[0], 1), "peak_earlier_mib": round(earlier, 1),
                          "peak_later_mib": round(later, 1), "last_mib": round(window[-1], 1),
                          "samples": len(window)}
    return verdicts
