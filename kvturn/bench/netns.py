"""Separate hosts on one machine for `kvturn bench --hosts netns`: every worker, and the router with the client, in
a network namespace of its own, each joined by a veth pair into one bridge, UCX over TCP only (no shared memory,
no CMA), each link shaped with tc to a rate (tbf) and a delay (netem, where the kernel has it).

Names carry a tag unique to the run, so two runs never collide; everything made is removed when the network
closes (the `with` block ends, Ctrl-C, SIGTERM), and a run's leftovers whose process is dead are removed by the
next run (a marker file per run under MARKER_DIR). Traffic goes only to addresses of the namespaces made here.
"""
import contextlib
import ipaddress
import json
import os
import random
import re
import secrets
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from kvturn.launch import LocalStack, enter_netns

MARKER_DIR = Path("/run/kvturn-netns")
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}  # the namespace's own link, never shm, CMA or loopback
MTU = 9000  # jumbo frames, as cluster networks run
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class NetnsUnavailable(RuntimeError):
    """Namespaces, veths or bridges cannot be made here (not root, no `ip`, a kernel without them)."""


@dataclass(frozen=True, slots=True)
class Link:
    rate_bits_per_s: float
    delay_s: float = 0.0
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> "Link":
        """'25gbit:50us' (rate, then one-way delay), or '10gbit' alone."""
        rate, _, delay = (text or "").strip().lower().partition(":")
        rate_match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|tbit)", rate)
        delay_match = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay) if delay else None
        if not rate_match or (delay and not delay_match):
            raise ValueError(f"a link is RATE[:DELAY], e.g. 25gbit:50us or 10gbit, got {text!r}")
        bits = float(rate_match[1]) * RATE_UNITS[rate_match[2]]
        delay_s = float(delay_match[1]) * DELAY_UNITS[delay_match[2]] if delay_match else 0.0
        if not 1e6 <= bits <= 1e13 or delay_s > 1.0:
            raise ValueError(f"a link's rate is 1mbit to 10tbit and its delay at most 1 s, got {text!r}")
        return cls(bits, delay_s, text.strip().lower())

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bits_per_s / 8


def run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> None:
    """Remove what runs whose process is gone left behind (killed with SIGKILL, the machine's power)."""
    for marker in MARKER_DIR.glob("*.json") if MARKER_DIR.is_dir() else []:
        try:
            record = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if not _alive(int(record.get("pid", 0))):
            _remove(record.get("namespaces", []), record.get("bridge"))
            marker.unlink(missing_ok=True)


def _remove(namespaces: list[str], bridge: str | None) -> None:
    for name in namespaces:
        run("ip", "netns", "del", name, check=False)  # its veth ends go with it, and their peers with them
    if bridge:
        run("ip", "link", "del", bridge, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    taken = [ipaddress.ip_network(line.split()[3], strict=False)
             for line in run("ip", "-o", "-4", "addr", "show").stdout.splitlines() if len(line.split()) > 3]
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{random.randrange(100, 200)}.{random.randrange(0, 256)}.0/24")
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet for the namespaces")


class Network:
    """Namespaces named after `hosts` (router, prefill, decode0, ...) joined through one bridge, each link shaped."""

    def __init__(self, hosts: list[str], link: Link | None = None):
        self.hosts, self.link = list(hosts), link
        self.tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(1)}"
        self.bridge = f"kvb{self.tag}"
        self.subnet = _free_subnet() if os.geteuid() == 0 else None
        self.namespaces = {host: f"kvturn-{self.tag}-{host}" for host in self.hosts}
        self.addresses = {host: str(self.subnet[i + 2]) for i, host in enumerate(self.hosts)} if self.subnet else {}
        self.host_ends = {host: f"kvh{self.tag}{i:02d}" for i, host in enumerate(self.hosts)}
        self.delay_applied = False
        self.marker = MARKER_DIR / f"{self.tag}.json"
        self._previous_sigterm = None

    def open(self) -> "Network":
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root")
        try:
            run("ip", "netns", "list")
        except (OSError, subprocess.CalledProcessError) as exc:
            raise NetnsUnavailable(f"`ip netns` does not run here: {exc}") from None
        sweep_leftovers()
        MARKER_DIR.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(json.dumps({"pid": os.getpid(), "namespaces": list(self.namespaces.values()),
                                           "bridge": self.bridge}))
        if threading.current_thread() is threading.main_thread():  # SIGTERM cleans up as Ctrl-C does
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        try:
            run("ip", "link", "add", self.bridge, "type", "bridge")
            run("ip", "link", "set", self.bridge, "mtu", str(MTU), "up")
            for i, host in enumerate(self.hosts):
                ns, host_end, inside = self.namespaces[host], self.host_ends[host], f"kvn{self.tag}{i:02d}"
                run("ip", "netns", "add", ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
                run("ip", "link", "add", host_end, "mtu", str(MTU), "type", "veth", "peer", "name", inside,
                    "mtu", str(MTU))
                run("ip", "link", "set", inside, "netns", ns)
                run("ip", "-n", ns, "link", "set", inside, "name", "eth0")
                run("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/{self.subnet.prefixlen}", "dev", "eth0")
                run("ip", "-n", ns, "link", "set", "eth0", "up")
                run("ip", "link", "set", host_end, "master", self.bridge, "up")
                if self.link:
                    self._shape([], host_end)  # traffic into the namespace
                    self._shape(["ip", "netns", "exec", ns], "eth0")  # traffic out of it
        except subprocess.CalledProcessError as exc:
            raise NetnsUnavailable(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from None

    def _shape(self, prefix: list[str], device: str) -> None:
        """tbf at the link's rate; netem before it for the delay where the kernel has netem."""
        rate = f"{int(self.link.rate_bits_per_s)}bit"
        burst = max(int(self.link.bytes_per_s / 1000), 256 * 1024)  # a millisecond's worth, at least a TSO burst
        parent = ["root"]
        if self.link.delay_s:
            delay = run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", "delay",
                        f"{self.link.delay_s * 1e6:.0f}us", "limit", "100000", check=False)
            self.delay_applied = delay.returncode == 0
            parent = ["parent", "1:1"] if self.delay_applied else parent
        run(*prefix, "tc", "qdisc", "add", "dev", device, *parent, "tbf", "rate", rate, "burst", str(burst),
            "latency", "100ms")

    def close(self) -> None:
        _remove(list(self.namespaces.values()), self.bridge)
        self.marker.unlink(missing_ok=True)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def __enter__(self) -> "Network":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def bytes_into(self, host: str) -> int:
        """Bytes the bridge sent into `host`'s namespace over its link so far (its host end's transmit counter)."""
        return int(Path(f"/sys/class/net/{self.host_ends[host]}/statistics/tx_bytes").read_text())

    def bytes_out_of(self, host: str) -> int:
        return int(Path(f"/sys/class/net/{self.host_ends[host]}/statistics/rx_bytes").read_text())

    @contextlib.contextmanager
    def inside(self, host: str):
        """Run the calling thread in `host`'s namespace for the block (the bench's client beside its router)."""
        with open(f"/proc/self/task/{threading.get_native_id()}/ns/net") as own:
            enter_netns(self.namespaces[host])
            try:
                yield
            finally:
                enter_netns(f"/proc/self/fd/{own.fileno()}")

    def describe(self) -> dict:
        return {"hosts": self.addresses, "link": self.link.text if self.link else None,
                "link_rate_bits_per_s": self.link.rate_bits_per_s if self.link else None,
                "link_delay_s": self.link.delay_s if self.link else None,
                "delay_applied": self.delay_applied if self.link and self.link.delay_s else None,
                "ucx": UCX_ENV, "mtu": MTU}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


class NetnsStack(LocalStack):
    """A LocalStack whose every process runs in its own namespace of `network`; the thread using it (its client)
    runs in the router's namespace between start and stop. A colocated worker takes decode0's namespace."""

    def __init__(self, network: Network, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.network = network
        self.env.update(UCX_ENV)
        self._inside = None

    def host_of(self, name: str) -> str:
        return "decode0" if name == "worker" else name

    def netns_of(self, name: str) -> str | None:
        return self.network.namespaces[self.host_of(name)]

    def address(self, name: str) -> str:
        return self.network.addresses[self.host_of(name)]

    def __enter__(self) -> "NetnsStack":
        self._inside = self.network.inside("router")
        self._inside.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._inside.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._inside.__exit__(None, None, None)


def hosts_for(num_prefill: int, num_decode: int) -> list[str]:
    """The namespaces a stack of this shape needs, named as its processes are (launch.replica_name)."""
    from kvturn.launch import replica_name
    return ["router", *(replica_name("prefill", i) for i in range(num_prefill)),
            *(replica_name("decode", i) for i in range(num_decode))]
