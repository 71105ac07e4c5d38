"""How `kvturn bench --compare` lays out every leg's stack: how many prefill and decode workers (`--topology
2P2D`), how the router picks a turn's prefill worker (`--prefill-choice`), and where the processes run: all on
this host, or each in a network namespace of its own behind a shaped link (`--hosts netns --link RATE:DELAY`,
bench/netns.py)."""
import re
from dataclasses import dataclass, field

MAX_WORKERS_PER_ROLE = 16
HOSTS = ("one", "netns")
LONGEST_PROMPT_ROOM = 1.1  # a prefill worker's pool fits its longest prompt this many times, whatever the share


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
    prefill_kv_cache_mb: int | None = None  # P's pool under pressure (--p-pool-share), None: --kv-cache-mb

    def describe(self) -> str:
        where = "one host" if self.hosts == "one" else f"a network namespace each, link {self.link or 'unshaped'}"
        pool = f", P pools {self.prefill_kv_cache_mb} MiB" if self.prefill_kv_cache_mb else ""
        return f"{self.topology}, prefill choice {self.prefill_choice}, {where}{pool}"


def live_history_tokens(conversations, count_tokens) -> tuple[int, int]:
    """(the histories live at once, in tokens: each conversation's mean prompt over its turns, summed; the longest
    prompt of any turn), counting answers at their planned length."""
    live, longest = 0, 0
    for conv in conversations:
        context, prompts = count_tokens(conv.system) if conv.system else 0, []
        for turn in conv.turns:
            context += count_tokens(turn.user)
            prompts.append(context)
            context += turn.answer_tokens
        if prompts:
            live += sum(prompts) // len(prompts)
            longest = max(longest, max(prompts))
    return live, longest


def prefill_pool_mb(conversations, count_tokens, model_dir: str, share: float, num_prefill: int) -> int:
    """Each prefill worker's KV pool, MiB, so that all of them together hold `share` of the live histories (P's
    prefix cache under pressure), yet each one fits the longest prompt with room to spare (it must compute it)."""
    from kvturn.engine.kv_cache import KVLayout
    from kvturn.model.config import ModelConfig
    layout = KVLayout.for_model(ModelConfig.from_dir(model_dir), 1, 16)
    per_token = layout.block_bytes / 16
    live, longest = live_history_tokens(conversations, count_tokens)
    wanted = share * live * per_token / num_prefill
    return max(int(wanted / 2**20) + 1, int(LONGEST_PROMPT_ROOM * longest * per_token / 2**20) + 1)
