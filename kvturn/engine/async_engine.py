"""Runs the engine loop on its own thread and streams outputs to asyncio callers."""
import asyncio
import threading
import time
from typing import AsyncIterator

from kvturn.engine.llm_engine import LLMEngine, RequestOutput
from kvturn.engine.sequence import Sequence


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.emit = self._emit
        self._queues: dict[str, asyncio.Queue] = {}
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

    async def generate(self, seq: Sequence) -> AsyncIterator[RequestOutput]:
        """Yield outputs as the engine produces them; leaving early aborts the request and frees its blocks."""
        if not self.alive:
            raise RuntimeError("engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[seq.request_id] = queue
        seq.timing.submitted = time.perf_counter()
        self.engine.call_soon(lambda: self.engine.add_request(seq))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(seq.request_id, None)
            if not finished:
                self.engine.call_soon(lambda: self.engine.abort(seq.request_id))

    def _emit(self, out: RequestOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, out)

    def _run(self) -> None:
        engine = self.engine
        idle_polls = 0
        try:
            while not self._stop.is_set():
                busy = engine.has_work()
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
            for queue in list(self._queues.values()):
                self._loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine failed: {exc!r}"))
            raise
