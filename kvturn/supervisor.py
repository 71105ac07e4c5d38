"""Keep a local stack's workers and routers running, as `kvturn serve` does.

A process that exits is started again on its port with its arguments, after a backoff that doubles while it keeps
exiting soon after a start (a crash loop) and is back to the first once it ran `restart_settled_s`. The router
probes a worker that left its rotation and takes it back once it answers; a restarted worker is a new engine, so
the leases of the old one are gone and the next turns that held one recompute (the engine-id check on the lease).
"""
import logging
import subprocess
import threading
import time
from dataclasses import dataclass

from kvturn.config import SupervisorConfig

log = logging.getLogger("kvturn.supervisor")
POLL_S = 0.2  # how soon an exit is noticed


def next_backoff_s(previous_s: float | None, ran_s: float, config: SupervisorConfig) -> float:
    """The wait before restarting a process that exited after running `ran_s` seconds; `previous_s`: the wait
    before its last restart (None: it never was restarted)."""
    if previous_s is None or ran_s >= config.restart_settled_s:
        return config.restart_backoff_s
    return min(previous_s * 2, config.restart_backoff_max_s)


@dataclass(slots=True)
class Restart:
    """One restart of a process: when it exited and how, when it was started again (None: not yet)."""
    name: str
    exited_at: float
    exit_code: int
    backoff_s: float
    started_at: float | None = None
    pid: int | None = None


class Supervisor:
    def __init__(self, stack, config: SupervisorConfig, clock=time.monotonic):
        """`clock`: the clock of the stack's `launched_at`."""
        self.stack, self.config, self.clock = stack, config, clock
        self.backoff_s: dict[str, float] = {}  # name -> the wait before its last restart
        self.pending: dict[str, Restart] = {}  # name -> its restart, while it waits out its backoff
        self.restarts: list[Restart] = []  # every restart so far, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        """Notice the processes that exited and start those whose backoff is over."""
        now = self.clock()
        for name, process in list(self.stack.processes.items()):
            code = process.poll()
            if code is None:
                self.pending.pop(name, None)  # someone started it again meanwhile (LocalStack.restart)
            elif name not in self.pending:
                self.exited(name, process, code, now)
            elif now >= self.pending[name].exited_at + self.pending[name].backoff_s:
                self.restart(name, process, now)

    def exited(self, name: str, process: subprocess.Popen, code: int, now: float) -> None:
        ran_s = now - self.stack.launched_at.get(name, now)
        backoff_s = self.backoff_s[name] = next_backoff_s(self.backoff_s.get(name), ran_s, self.config)
        self.pending[name] = Restart(name, now, code, backoff_s)
        log.warning("%s (pid %d) exited with code %s after %.1f s; restarting it in %.1f s (its log: %s)", name,
                    process.pid, code, ran_s, backoff_s, self.stack.log_path(name))

    def restart(self, name: str, exited: subprocess.Popen, now: float) -> None:
        try:
            process = self.stack.respawn(name, exited)
        except OSError:
            log.exception("could not start %s again; trying after the next backoff", name)
            self.pending[name].exited_at = now
            return
        restart = self.pending.pop(name)
        restart.started_at, restart.pid = now, process.pid
        self.restarts.append(restart)
        log.warning("%s started again as pid %d", name, process.pid)

    def start(self) -> "Supervisor":
        # The thread that starts a process must outlive it: the kernel ends the process when that thread ends
        # (launch._end_with_parent), which it does only in stop().
        self._thread = threading.Thread(target=self._run, name="kvturn-supervisor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.tick()
            except Exception:  # the supervisor must outlive whatever went wrong with one process
                log.exception("supervisor tick failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
