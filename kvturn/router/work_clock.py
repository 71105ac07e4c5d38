"""The router's own work in one turn: the stretches of code between its waits on workers and the client, from the
moment the request's body is in (parsing it, the history's digests) until the answer (streamed: its [DONE]) goes to
the HTTP server. Calls to a Redis conversation table are not paused: their round trips count as work.

On one event loop nothing else runs between two awaits, so these stretches are this turn's alone, whatever else
is in flight. Thread CPU time is kept beside wall time: on a shared machine the wall clock also counts the time
the router's process waited for a core. What the clock leaves out is the HTTP machinery on both sides (the server
reading the request and writing the answer, the client writing to and reading from workers): it runs inside the
waits. benchmarks/router_overhead.py measures the whole process's CPU beside it."""
import time


class WorkClock:
    def __init__(self):
        self.wall_s = self.cpu_s = 0.0
        self._running = False
        self.resume()

    def resume(self) -> None:
        if not self._running:
            self._running = True
            self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def pause(self) -> None:
        if self._running:
            self._running = False
            self.wall_s += time.perf_counter() - self._wall
            self.cpu_s += time.thread_time() - self._cpu

    def totals_ms(self) -> tuple[float, float]:
        """(wall, CPU) so far, the running stretch included."""
        wall, cpu = self.wall_s, self.cpu_s
        if self._running:
            wall += time.perf_counter() - self._wall
            cpu += time.thread_time() - self._cpu
        return wall * 1e3, cpu * 1e3


class IdleClock(WorkClock):
    """The clock of a turn whose own work nobody reads (kvturn's workers): pausing costs nothing per streamed token."""

    def __init__(self):
        self.wall_s = self.cpu_s = 0.0
        self._running = False

    def resume(self) -> None:
        pass

    def pause(self) -> None:
        pass
