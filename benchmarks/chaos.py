"""The faults of benchmarks/chaos_soak.py: a schedule made up front from a seed, and a driver that applies each
event at its time, on a process chosen then among those up, and logs it with its time.

    kill   kill -9 a worker or router; the stack's supervisor starts it again on its port
    stop   SIGSTOP a worker or router for a few seconds, then SIGCONT
    redis  kill -9 the routers' redis-server and start it again on its port (once per run)
"""
import asyncio
import os
import random
import signal
import time
from dataclasses import asdict, dataclass

import httpx

from kvturn.launch import LocalStack, RedisServer

REDIS_DOWN_S = 2.0  # how long Redis stays down before it is started again


@dataclass(slots=True)
class Event:
    at_s: float  # seconds after the run began
    action: str  # kill, stop or redis
    stop_s: float = 0.0  # stop: how long the process stays stopped
    target: str | None = None  # the process it hit, chosen when it fired
    pid: int | None = None
    fired_at_s: float | None = None
    back_after_s: float | None = None  # from the fault until the process answered its /health again


def schedule(duration_s: float, seed: int, gap_s: tuple[float, float] = (20.0, 30.0),
             stop_s: tuple[float, float] = (3.0, 6.0)) -> list[Event]:
    """An event every gap_s until 15 s before the end: Redis restarted at the middle one, every third of the
    others a stop, the rest kills."""
    rng = random.Random(seed)
    times, at = [], rng.uniform(*gap_s)
    while at < duration_s - 15:
        times.append(round(at, 1))
        at += rng.uniform(*gap_s)
    middle = len(times) // 2
    events = []
    for i, at in enumerate(times):
        if i == middle:
            events.append(Event(at, "redis"))
        elif i % 3 == 1:
            events.append(Event(at, "stop", stop_s=round(rng.uniform(*stop_s), 1)))
        else:
            events.append(Event(at, "kill"))
    return events


class Chaos:
    def __init__(self, stack: LocalStack, redis_server: RedisServer, events: list[Event], seed: int):
        self.stack, self.redis, self.events = stack, redis_server, events
        self.rng = random.Random(seed + 1)
        self.started = time.monotonic()
        self.recoveries: set[asyncio.Task] = set()

    def now_s(self) -> float:
        return time.monotonic() - self.started

    def say(self, text: str) -> None:
        print(f"[chaos {self.now_s():6.1f} s] {text}", flush=True)

    async def up(self, client: httpx.AsyncClient, name: str) -> bool:
        """Running and answering: a worker with 200 on /health, a router with any answer (503 while it lacks a
        worker)."""
        if self.stack.processes[name].poll() is not None:
            return False
        try:
            status = (await client.get(f"{self.stack.urls[name]}/health", timeout=2)).status_code
        except httpx.HTTPError:
            return False
        return status == 200 or name.startswith("router")

    async def pick(self, client: httpx.AsyncClient) -> str | None:
        names = sorted(self.stack.processes)
        answering = await asyncio.gather(*(self.up(client, name) for name in names))
        candidates = [name for name, ok in zip(names, answering) if ok]
        return self.rng.choice(candidates) if candidates else None

    async def run(self, until_s: float) -> None:
        async with httpx.AsyncClient() as client:
            for event in self.events:
                if event.at_s >= until_s:
                    break
                await asyncio.sleep(max(event.at_s - self.now_s(), 0.0))
                await self.fire(client, event)
            await asyncio.gather(*self.recoveries)

    async def fire(self, client: httpx.AsyncClient, event: Event) -> None:
        event.fired_at_s = round(self.now_s(), 1)
        if event.action == "redis":
            event.target, event.pid = "redis", self.redis.process.pid
            self.redis.process.kill()
            self.redis.process.wait()
            self.say(f"kill -9 redis-server (pid {event.pid}); starting it again in {REDIS_DOWN_S:.0f} s")
            await asyncio.sleep(REDIS_DOWN_S)
            await asyncio.to_thread(self.redis.start)
            event.back_after_s = round(self.now_s() - event.fired_at_s, 1)
            self.say(f"redis-server is back (pid {self.redis.process.pid})")
            return
        event.target = await self.pick(client)
        if event.target is None:
            self.say(f"{event.action}: no process is up to hit")
            return
        process = self.stack.processes[event.target]
        event.pid = process.pid
        if event.action == "kill":
            os.kill(process.pid, signal.SIGKILL)
            self.say(f"kill -9 {event.target} (pid {process.pid})")
        else:
            os.kill(process.pid, signal.SIGSTOP)
            self.say(f"SIGSTOP {event.target} (pid {process.pid}) for {event.stop_s:.1f} s")
            await asyncio.sleep(event.stop_s)
            os.kill(process.pid, signal.SIGCONT)
            self.say(f"SIGCONT {event.target} (pid {process.pid})")
        task = asyncio.create_task(self.watch_recovery(client, event))
        self.recoveries.add(task)

    async def watch_recovery(self, client: httpx.AsyncClient, event: Event, timeout_s: float = 180.0) -> None:
        while self.now_s() - event.fired_at_s < timeout_s:
            if await self.up(client, event.target):
                event.back_after_s = round(self.now_s() - event.fired_at_s, 1)
                self.say(f"{event.target} answers again ({event.back_after_s:.1f} s after the {event.action}, pid "
                         f"{self.stack.processes[event.target].pid})")
                return
            await asyncio.sleep(0.25)
        self.say(f"{event.target} did not answer within {timeout_s:.0f} s of the {event.action}")

    def log(self) -> list[dict]:
        return [asdict(event) for event in self.events if event.fired_at_s is not None]
