"""Runs the engine loop on its own thread and streams outputs to asyncio callers."""
import asyncio
import threading
import time
from collections import deque
from typing import AsyncIterator

from kvturn.engine.llm_engine import LLMEngine, RequestOutput
from kvturn.engine.sequence import Sequence

IDLE_TICK_S = 1.0  # an idle engine still runs its housekeeping (leases and pins that expire) this often


class NotRead(Exception):
    """The caller took none of a request's outputs for longer than it allowed: the request was aborted."""


class Outbox:
    """One request's outputs on their way to its caller, each with the time it came, so that a caller that stopped
    taking them (a stream whose client does not read) is noticed by how long the oldest has waited."""

    def __init__(self, on_not_read=None):
        self.items: deque = deque()
        self.ready = asyncio.Event()
        self.closed = False
        self.on_not_read = on_not_read

    def put(self, item, now: float) -> None:
        self.items.append((now, item))
        self.ready.set()

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()[1]

    def waited(self, now: float) -> float:
        return now - self.items[0][0] if self.items else 0.0


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.emit = self._emit
        self._outboxes: dict[str, tuple[Outbox, float | None]] = {}  # request id -> its outbox, its unread bound
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvturn-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn) -> asyncio.Future:
        """Run `fn` on the engine thread and await its result."""
        future = self._loop.create_future()

        def run():
            try:
                result = fn()
            except Exception as exc:  # bound as a default: `exc` is unset once the except block ends
                self._loop.call_soon_threadsafe(lambda error=exc: future.done() or future.set_exception(error))
            else:
                self._loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))
        self.engine.call_soon(run)
        return future

    async def generate(self, seq: Sequence, max_unread_s: float | None = None,
                       on_not_read=None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the engine produces them; leaving early aborts the request and frees its blocks. With
        `max_unread_s`, a caller that leaves an output untaken longer than that (a stream whose client stopped
        reading) has the request aborted then (`on_not_read()` is called), its outputs dropped, and gets NotRead
        if it ever asks again."""
        if not self.alive:
            raise RuntimeError("engine is not running")
        outbox = Outbox(on_not_read)
        self._outboxes[seq.request_id] = (outbox, max_unread_s)
        seq.timing.submitted = time.perf_counter()
        self.engine.call_soon(lambda: self.engine.add_request(seq))
        finished = False
        try:
            while not finished:
                out = await outbox.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._outboxes.pop(seq.request_id, None)
            if not finished:
                self.engine.call_soon(lambda: self.engine.abort(seq.request_id))

    def _emit(self, out: RequestOutput) -> None:
        if out.request_id in self._outboxes:
            self._loop.call_soon_threadsafe(self._deliver, out)

    def _deliver(self, out: RequestOutput) -> None:
        """On the event loop: hand `out` over, unless its caller has left outputs untaken past its bound."""
        outbox, max_unread_s = self._outboxes.get(out.request_id, (None, None))
        if outbox is None or outbox.closed:
            return
        now = time.monotonic()
        if max_unread_s is not None and outbox.waited(now) > max_unread_s:
            outbox.closed = True
            outbox.items.clear()
            self.engine.call_soon(lambda: self.engine.abort(out.request_id))
            outbox.put(NotRead(f"no output was taken for {max_unread_s:g} s"), now)
            if outbox.on_not_read is not None:
                outbox.on_not_read()
            return
        outbox.put(out, now)

    def _run(self) -> None:
        engine = self.engine
        idle_polls = 0
        ticked = time.monotonic()
        try:
            while not self._stop.is_set():
                busy = engine.has_work()
                if not busy and time.monotonic() - ticked >= IDLE_TICK_S:
                    engine.tick()
                    ticked = time.monotonic()
                engine.run_commands(0 if busy else 0.05)
                if busy and not engine.step():
                    # Nothing could run: poll pending reads often (a read is mostly done when its post returns:
                    # 0.1 ms, backing off to 1 ms for a slow one), otherwise (abandoned reads of a hung peer,
                    # requests waiting for blocks) just wait for the next command.
                    if engine.waiting_on_reads:
                        engine.run_commands(min(0.0001 * 2 ** min(idle_polls, 4), 0.001))
                        idle_polls += 1
                    else:
                        engine.run_commands(0.05)
                else:
                    idle_polls = 0
        except BaseException as exc:  # a dead engine must fail requests, not hang them
            self.error = exc
            for outbox, _ in list(self._outboxes.values()):
                self._loop.call_soon_threadsafe(outbox.put, RuntimeError(f"engine failed: {exc!r}"), time.monotonic())
            raise
