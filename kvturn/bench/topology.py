"""How `kvturn bench --compare` lays out every leg's stack: how many prefill and decode workers (`--topology
2P2D`), how the router picks a turn's prefill worker (`--prefill-choice`), and where the processes run: all on
this host, or each in a network namespace of its own behind a shaped link (`--hosts netns --link RATE:DELAY`,
bench/netns.py)."""
import re
from dataclasses import dataclass, field

MAX_WORKERS_PER_ROLE = 16
HOSTS = ("one", "netns")


@dataclass(frozen=True, slots=True)
class Topology:
    prefill: int = 1
    decode: int = 1

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """'2P2D' (or '2p2d'): two prefill and two decode workers."""
        match = re.fullmatch(r"\s*(\d+)\s*P\s*(\d+)\s*D\s*", text or "", re.IGNORECASE)
        if not match:
            raise ValueError(f"a topology is NPMD, e.g. 2P2D, got {text!r}")
        prefill, decode = int(match[1]), int(match[2])
        if not (1 <= prefill <= MAX_WORKERS_PER_ROLE and 1 <= decode <= MAX_WORKERS_PER_ROLE):
            raise ValueError(f"a topology has 1 to {MAX_WORKERS_PER_ROLE} workers of each role, got {text!r}")
        return cls(prefill, decode)

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class Layout:
    """Every leg's stack has this shape; a colocated leg runs `topology.decode` colocated workers' worth of one."""
    topology: Topology = Topology()
    prefill_choice: str = "least-loaded"
    hosts: str = "one"
    link: str | None = None  # RATE:DELAY of each namespace's link (netns.Link.parse), None: unshaped
    network: object = field(default=None, compare=False)  # the open netns.Network while the legs run

    def describe(self) -> str:
        where = "one host" if self.hosts == "one" else f"a network namespace each, link {self.link or 'unshaped'}"
        return f"{self.topology}, prefill choice {self.prefill_choice}, {where}"
