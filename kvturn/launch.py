"""Start and stop kvturn processes (used by `kvturn serve`, the benchmark and the integration tests)."""
import ctypes
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvturn.config import INSTANCE_ENV, INSTANCE_HEADER, LOG_FILE_ENV, SupervisorConfig

PR_SET_PDEATHSIG = 1
# Ports drawn from the OS's entropy, not the module's generator: processes forked from one parent (or a generator
# seeded alike) would draw the same ports and start their stacks on each other's.
_PORTS = random.SystemRandom()
LOG_DIRS_KEPT_DAYS = 7


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel handed out for bind(0) may be given
    to an outgoing connection before our server binds it (seen as start-up failures under load)."""
    low, high = 20000, _ephemeral_start()
    for _ in range(200):
        port = _PORTS.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


def _ephemeral_start() -> int:
    try:
        return min(int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]), 32768)
    except (OSError, ValueError, IndexError):
        return 32768


def _end_with_parent() -> None:
    """In the child: have the kernel send SIGTERM when the process that started us dies (Linux), so a killed
    benchmark or test run leaves no servers behind. The kernel ties this to the thread that started the child,
    so a supervisor's thread must live as long as the processes it starts (kvturn/supervisor.py)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def default_log_dir(kind: str) -> Path:
    """A new folder for one stack's logs, under the kvturn cache (kvturn/model/make_model.cache_dir). Folders
    nothing was written to for LOG_DIRS_KEPT_DAYS are removed (never a live stack's, whose processes write)."""
    from kvturn.model.make_model import cache_dir
    root = cache_dir() / "logs"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        if time.time() - _last_written(old) > LOG_DIRS_KEPT_DAYS * 86_400:
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=root))


def _last_written(folder: Path) -> float:
    try:
        return max([folder.stat().st_mtime, *(path.stat().st_mtime for path in folder.rglob("*"))])
    except OSError:  # another run removed it meanwhile
        return time.time()


def start(args: list[str], log_path: Path | None = None, env: dict | None = None,
          cpus: set[int] | None = None, netns: str | None = None) -> subprocess.Popen:
    """Run `python -m kvturn.cli ARGS` in its own process group; it ends when the thread that started it does. Its
    output is appended to `log_path`, which it is told (KVTURN_LOG_FILE) so that its internal errors name it. With
    `cpus` it runs on those cores only, one compute thread on each; with `netns` in that named network namespace
    (kvturn/bench/netns.py)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    env = {**os.environ, **(env or {}), **({"OMP_NUM_THREADS": str(len(cpus))} if cpus else {}),
           **({LOG_FILE_ENV: str(log_path)} if log_path else {})}

    def in_child() -> None:
        _end_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
        if netns:
            enter_netns(netns)
    try:
        process = subprocess.Popen([sys.executable, "-m", "kvturn.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True, preexec_fn=in_child)
    finally:
        if log_path:
            out.close()  # the child has its own copy
    if log_path:
        with open(log_path, "a") as log:  # where each run of the process begins, for a reader of the file
            log.write(f"--- kvturn launch {time.strftime('%Y-%m-%d %H:%M:%S')}: started `kvturn {args[0]}` "
                      f"as pid {process.pid}\n")
    return process


CLONE_NEWNET = 0x40000000


def enter_netns(name_or_path: str) -> None:
    """Move the calling thread into a network namespace: one `ip netns add` named, or a /proc/.../ns/net path."""
    path = name_or_path if name_or_path.startswith("/") else f"/var/run/netns/{name_or_path}"
    fd = os.open(path, os.O_RDONLY)
    try:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name_or_path} failed")
    finally:
        os.close(fd)


def split_cores() -> dict[str, set[int]] | None:
    """This process's cores halved: the first half for prefill workers, the rest for decode workers (None with fewer
    than two), so that on one machine P and D compute side by side as on machines of their own."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return {"prefill": set(cores[:half]), "decode": set(cores[half:])}


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout_s: float = 120.0,
                 instance: str | None = None) -> None:
    """Until `url` answers /health (with `instance`'s name, where given: not another stack's process on the port)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with code {process.returncode} before it became healthy")
        try:
            reply = httpx.get(f"{url}/health", timeout=2)
            if reply.status_code == 200 and (instance is None or reply.headers.get(INSTANCE_HEADER) == instance):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not become healthy within {timeout_s:.0f} s")


def stop(process: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def replica_name(role: str, index: int) -> str:
    """prefill, prefill1, ...; router, router1, ...; decode0, decode1, ...: a process's name in a stack and its log."""
    return f"decode{index}" if role == "decode" else role if index == 0 else f"{role}{index}"


class LocalStack:
    """A kvturn deployment on this machine: one colocated worker, or routers + prefill + decode workers.

    `url` is what clients talk to (the first router, or the colocated worker). The stack is closed by default: its
    processes share a cluster secret made for it (or KVTURN_CLUSTER_SECRET from `env`), passed in their
    environment. Each process writes NAME.log in `log_dir` (default: a new folder, see default_log_dir). With
    `base_port` the first router listens there and the workers and other routers on the ports after it. With
    `pin_workers` prefill workers run on half of the machine's cores and decode workers on the other half. With
    `supervisor` a process that exits is started again on its port (kvturn/supervisor.py).
    """

    def __init__(self, model_dir: str, mode: str = "pd", bidirectional: bool = True,
                 prefix_caching_on_prefill: bool = True, num_decode: int = 1, kv_cache_mb: int = 512,
                 worker_args: list[str] = (), prefill_args: list[str] = (), decode_args: list[str] = (),
                 router_args: list[str] = (), log_dir: Path | None = None, env: dict | None = None,
                 base_port: int | None = None, pin_workers: bool = False, num_prefill: int = 1, num_routers: int = 1,
                 supervisor: SupervisorConfig | None = None, expose_internals: bool = True):
        self.model_dir, self.mode = str(model_dir), mode
        self.bidirectional, self.prefix_caching_on_prefill = bidirectional, prefix_caching_on_prefill
        self.num_prefill, self.num_decode, self.num_routers = num_prefill, num_decode, num_routers
        self.kv_cache_mb = kv_cache_mb
        self.worker_args, self.prefill_args = list(worker_args), list(prefill_args)
        self.decode_args, self.router_args = list(decode_args), list(router_args)
        if expose_internals:  # the stacks of benchmarks and tests report where each turn ran; `kvturn serve` does not
            self.router_args.append("--expose-internals")
        self.log_dir = Path(log_dir) if log_dir else default_log_dir("stack")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {"KVTURN_CLUSTER_SECRET": secrets.token_urlsafe(32), INSTANCE_ENV: secrets.token_hex(8),
                    **(env or {})}
        self.instance = self.env[INSTANCE_ENV]
        self.cluster_secret = self.env["KVTURN_CLUSTER_SECRET"]
        self.base_port = base_port
        self.cores = split_cores() if pin_workers else None  # role -> cores; a colocated worker and the router: all
        self._worker_ports = iter(range(base_port + 1, base_port + 64)) if base_port else None
        self.processes: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.args: dict[str, list[str]] = {}
        self.cpus: dict[str, set[int] | None] = {}
        self.launched_at: dict[str, float] = {}  # name -> when its current process started (time.monotonic)
        self.supervisor_config = supervisor
        self.supervisor = None
        self._lock = threading.Lock()  # one process per name: the supervisor's restarts and ours do not race

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _port(self) -> int:
        return next(self._worker_ports) if self._worker_ports else free_port()

    def launch(self, name: str, args: list[str], cpus: set[int] | None = None) -> None:
        self.args[name], self.cpus[name] = args, cpus
        self.processes[name] = start(args, self.log_path(name), self.env, cpus, self.netns_of(name))
        self.launched_at[name] = time.monotonic()

    def netns_of(self, name: str) -> str | None:
        """The network namespace process `name` runs in (None: this one; bench/netns.py's stack has one each)."""
        return None

    def address(self, name: str) -> str:
        """Where process `name` listens and its peers reach it."""
        return "127.0.0.1"

    def start_worker(self, name: str, role: str, extra: list[str]) -> None:
        port, host = self._port(), self.address(name)
        args = ["worker", "--role", role, "--port", str(port), "--model", self.model_dir,
                "--kv-cache-mb", str(self.kv_cache_mb), *self.worker_args, *extra]
        if host != "127.0.0.1":
            args += ["--host", host]
        if self.bidirectional and role != "both":
            args.append("--bidirectional")
        self.launch(name, args, (self.cores or {}).get(role))
        self.urls[name] = f"http://{host}:{port}"

    def start(self) -> "LocalStack":
        self.start_worker_processes()
        self.wait_and_start_router()
        if self.supervisor_config is not None and self.supervisor_config.restart:
            from kvturn.supervisor import Supervisor
            self.supervisor = Supervisor(self, self.supervisor_config).start()
        return self

    def start_worker_processes(self) -> None:
        if self.mode == "colocated":
            self.start_worker("worker", "both", [])
        else:
            prefill_extra = [] if self.prefix_caching_on_prefill else ["--no-prefix-caching"]
            for i in range(self.num_prefill):
                self.start_worker(replica_name("prefill", i), "prefill", prefill_extra + self.prefill_args)
            for i in range(self.num_decode):
                self.start_worker(replica_name("decode", i), "decode", self.decode_args)

    def wait_and_start_router(self) -> None:
        for name, url in list(self.urls.items()):
            wait_healthy(url, self.processes[name], instance=self.instance)
        if self.mode == "colocated":
            return
        workers = [arg for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode))
                   for i in range(count) for arg in (f"--{role}", self.urls[replica_name(role, i)])]
        if not any(arg.split("=")[0] == "--tokenizer" for arg in self.router_args):
            workers += ["--tokenizer", str(self.model_dir)]  # the router counts what each turn adds
        names = [replica_name("router", i) for i in range(self.num_routers)]
        for i, name in enumerate(names):
            port, host = self.base_port if i == 0 and self.base_port else self._port(), self.address(name)
            where = ["--host", host] if host != "127.0.0.1" else []
            self.launch(name, ["router", "--port", str(port), *where, *workers, *self.router_args])
            self.urls[name] = f"http://{host}:{port}"
        for name in names:
            wait_healthy(self.urls[name], self.processes[name], instance=self.instance)

    @property
    def url(self) -> str:
        return self.urls["worker" if self.mode == "colocated" else "router"]

    @property
    def router_urls(self) -> list[str]:
        return [self.urls[replica_name("router", i)] for i in range(self.num_routers)]

    def restart(self, name: str) -> None:
        """Start a stopped process again on the same port with the same arguments, and wait until it is healthy."""
        with self._lock:
            if self.processes[name].poll() is None:
                stop(self.processes[name])
            self.launch(name, self.args[name], self.cpus.get(name))
        wait_healthy(self.urls[name], self.processes[name], instance=self.instance)

    def respawn(self, name: str, exited: subprocess.Popen) -> subprocess.Popen:
        """Start `name` again in place of `exited`, unless someone did already; its process now."""
        with self._lock:
            if self.processes[name] is exited:
                self.launch(name, self.args[name], self.cpus.get(name))
            return self.processes[name]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.processes[name].send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.processes[name].wait(timeout=30)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        with self._lock:
            for process in reversed(list(self.processes.values())):
                if process.poll() is None:
                    try:
                        os.killpg(process.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                    except ProcessLookupError:
                        pass
                stop(process)

    def __enter__(self) -> "LocalStack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisServer:
    """A redis-server of its own on a free loopback port that keeps nothing on disk (tests, the soak benchmark);
    stop and start it again to see what routers do without their shared state."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        import redis
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (`make install` installs it)")
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no", "--dir", tempfile.gettempdir()],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        with redis.Redis(port=self.port, socket_connect_timeout=0.5) as client:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
