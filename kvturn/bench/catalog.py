"""The catalog of what `kvturn bench --compare` runs and `kvturn plan` simulates: the deployment legs (colocated;
P/D without bidirectional transfer; P/D with it; each P/D leg with P's prefix cache on, the production baseline,
and off, the cache-miss emulation of vLLM's published run; the three paths of a turn with a live lease) and the
scenarios, each a workload plus the deployment settings it needs, including the cases where reuse cannot or
should not help."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the workloads (numpy) are imported when one is built: the command line's help reads this file
    from kvturn.bench import workload


@dataclass(frozen=True, slots=True)
class Leg:
    name: str
    mode: str
    bidirectional: bool
    prefix_caching_on_prefill: bool
    path_policy: str = "pull"  # what the router does with a live lease (see `kvturn router --path-policy`)
    decode_args: tuple[str, ...] = ()  # the decode workers' own settings (the retention legs)
    prefill_args: tuple[str, ...] = ()  # the prefill workers' own settings (P's prefix cache with a host tier)

    def prefill_setting(self, flag: str) -> str | None:
        """What the leg's prefill workers are given for `flag` (a flag alone: itself); None where not given."""
        args = self.prefill_args
        if flag not in args:
            return None
        at = args.index(flag) + 1
        return args[at] if at < len(args) and not args[at].startswith("--") else flag


LEGS = {
    "colocated": Leg("colocated", "colocated", False, True),
    "pd/P-cache-on": Leg("pd/P-cache-on", "pd", False, True),
    "pd/P-cache-off": Leg("pd/P-cache-off", "pd", False, False),
    "bidir/P-cache-on": Leg("bidir/P-cache-on", "pd", True, True),
    "bidir/P-cache-off": Leg("bidir/P-cache-off", "pd", True, False),
    # The three paths of a turn with a live lease, P's cache off so that every path is real.
    "pull": Leg("pull", "pd", True, False, "pull"),
    "compute-on-D": Leg("compute-on-D", "pd", True, False, "compute_on_decode"),
    "adaptive": Leg("adaptive", "pd", True, False, "adaptive"),
    # production's: P's prefix cache on, the router pricing each turn's path by the link and load it measured
    "adaptive/P-cache-on": Leg("adaptive/P-cache-on", "pd", True, True, "adaptive"),
}
PATH_LEGS = ("pull", "compute-on-D", "adaptive")
# Retention under memory pressure (scenario memory-pressure): a retained budget that holds a fifth of its live
# conversations, leases past it dropped oldest first (as without a host tier) or moved to a host tier; and a pool
# that holds them all, the ceiling.
RETAINED_BUDGET_MB, RETAINED_HOST_MB = "48", "512"
LEGS |= {
    "retain/drop-oldest": Leg("retain/drop-oldest", "pd", True, False, "pull",
                              ("--retained-kv-budget-mb", RETAINED_BUDGET_MB)),
    "retain/host-tier": Leg("retain/host-tier", "pd", True, False, "pull",
                            ("--retained-kv-budget-mb", RETAINED_BUDGET_MB, "--retained-host-mb", RETAINED_HOST_MB)),
    "retain/unbounded": Leg("retain/unbounded", "pd", True, False, "pull"),
}
RETENTION_LEGS = ("retain/drop-oldest", "retain/host-tier", "retain/unbounded")
# The same host memory given to D's retention (a host tier for its leases) or to P's prefix cache (a host tier for
# the blocks its pool evicts): the two ways an operator may spend it, compared at equal total memory.
TIER_HOST_MB = "64"
LEGS |= {
    "pd/P-cache-host": Leg("pd/P-cache-host", "pd", False, True, prefill_args=("--prefix-host-mb", TIER_HOST_MB)),
    "bidir/D-host": Leg("bidir/D-host", "pd", True, True, decode_args=("--retained-host-mb", TIER_HOST_MB)),
}

# P's read of the history as one transfer before its compute, against the default (layer by layer beside it): what
# hiding the read behind the compute is worth over a slow link (--hosts netns --link ...)
LEGS["bidir/P-cache-off/whole-read"] = Leg("bidir/P-cache-off/whole-read", "pd", True, False,
                                           prefill_args=("--no-kv-read-overlap",))
ON_LEGS = ("bidir/P-cache-off", "bidir/P-cache-off/whole-read")  # held to the ideal against pd/P-cache-off


# The production scenario's legs: P's prefix cache on in each, and P's cache with a host tier at equal memory where
# this build has that leg (pd/P-cache-host)
PRODUCTION_LEGS = ("pd/P-cache-on", "bidir/P-cache-on", "adaptive/P-cache-on", "pd/P-cache-host")

DEFAULT_LEGS = ("colocated", "pd/P-cache-on", "pd/P-cache-off", "bidir/P-cache-on", "bidir/P-cache-off")


def baseline_of(name: str) -> str | None:
    """The P/D leg without bidirectional transfer that leg `name` is measured against: the one with the same
    prefix cache on P and no host tier on it (None for a leg that is neither a bidirectional P/D leg nor one whose
    P has a host tier)."""
    leg = LEGS[name]
    if leg.mode != "pd" or not (leg.bidirectional or leg.prefill_args):
        return None
    return next(other.name for other in LEGS.values()
                if other.mode == "pd" and not other.bidirectional and not other.prefill_args
                and other.prefix_caching_on_prefill == leg.prefix_caching_on_prefill)


@dataclass(slots=True)
class Scenario:
    """A named workload plus the deployment settings it needs."""
    name: str
    description: str
    sessions: int = 1
    decode_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    legs: tuple[str, ...] | None = None  # what `--compare` runs when no --legs is given (None: DEFAULT_LEGS)
    topology: str | None = None  # the stacks' shape without --topology (None: 1P1D)
    ignore_eos: bool = True  # False: answers end where a real model ends its turn
    show_conversation: bool = False  # the report shows one conversation's questions and answers, turn by turn


SCENARIOS = {
    "sweep": Scenario("sweep", "one session per first-turn length, fixed new and answer tokens per turn"),
    "no-reuse": Scenario("no-reuse", "independent single-turn requests: nothing to reuse, retention is pure cost",
                         sessions=2),
    # a worker refuses a lease shorter than the margin at which reads of it are declined (5 s by default)
    "resume-after-ttl": Scenario("resume-after-ttl", "the gap between turns outlasts the 4 s decode lease",
                                 decode_args=["--decoder-kv-blocks-ttl-s", "4"],
                                 worker_args=["--kv-expiry-margin-s", "1"]),
    "edited-history": Scenario("edited-history", "from turn 3 the agent rewrites its first user message: only "
                                                 "the prefix before the edit is reusable"),
    "short-turns": Scenario("short-turns", "short prompts and answers: reusable tokens stay below the threshold"),
    "concurrent": Scenario("concurrent", "eight sessions at once", sessions=8),
    "agent-loop": Scenario("agent-loop", "a tool-calling agent: 2k-8k-token histories, 50-400 new tokens and "
                                         "16-64 answer tokens a turn, eight sessions at once", sessions=8),
    # P's cache off: with it on, P already holds each history and nothing needs to move
    "coding-agent": Scenario("coding-agent", "coding agents shaped like public traces: ~20 turns, the context growing "
                                             "8x to --max-prompt-tokens by tool results, heavy-tailed think times "
                                             "(--gap-scale shortens them), three sessions at once", sessions=3,
                             legs=("pd/P-cache-off", "bidir/P-cache-off", "adaptive")),
    "production": Scenario("production", "what an operator runs: coding-agent sessions (tool results, 50-400-token "
                                         "answers, heavy-tailed think times; --gap-scale shortens them), twelve at "
                                         "once, on 2P2D with P's prefix cache on (--p-pool-share sizes P's pool to a "
                                         "share of the live histories)", sessions=12, topology="2P2D",
                           legs=tuple(leg for leg in PRODUCTION_LEGS if leg in LEGS)),
    "memory-pressure": Scenario("memory-pressure", "32 live sessions of 1-2.5k tokens with 5-15 s think times: "
                                                   "five times what the retention legs' pool budget holds",
                                sessions=32, legs=RETENTION_LEGS),
    "real-chat": Scenario("real-chat", "for a real model (kvturn models pull smollm2): one readable agent session, "
                                       "each turn pasting Python standard-library source as a tool result and "
                                       "asking about it; answers end at the model's end of turn",
                          ignore_eos=False, show_conversation=True,
                          legs=("pd/P-cache-off", "bidir/P-cache-off")),
}


def default_legs(scenario: str) -> tuple[str, ...]:
    """What `kvturn bench --compare --scenario NAME` runs without --legs."""
    return SCENARIOS[scenario].legs or DEFAULT_LEGS


def scenarios_help() -> str:
    """Every scenario with what it is, for `kvturn bench --help`."""
    return "; ".join(f"{name}: {spec.description}" for name, spec in SCENARIOS.items())


def legs_help() -> str:
    """Every leg, and each scenario's default legs, for `kvturn bench --help`."""
    defaults: dict[tuple[str, ...], list[str]] = {}
    for name in SCENARIOS:
        defaults.setdefault(default_legs(name), []).append(name)
    by_scenario = "; ".join(f"{', '.join(names)}: {','.join(legs)}" for legs, names in defaults.items())
    return f"legs to run with --compare, comma-separated, from {', '.join(LEGS)} (default, by scenario: {by_scenario})"


def build_workload(scenario: str, source: "workload.TextSource", seed: int, max_prompt_tokens: int,
                   turns: int, sessions: int | None = None) -> "list[workload.Conversation]":
    """The scenario's conversations; `sessions` (kvturn bench --sessions) is how many, in every scenario (default:
    the scenario's own count)."""
    from kvturn.bench import workload
    count = sessions if sessions is not None else None
    if count is not None and count < 1:
        raise ValueError(f"--sessions must be at least 1, got {count}")

    def many(default: int) -> int:
        return count if count is not None else default
    if scenario == "sweep":
        lengths = [n for n in (1024, 2048, 4096, 8192, 16384, 24576) if n <= max_prompt_tokens] or [max_prompt_tokens]
        if count is None:
            return workload.sweep(source, seed, lengths, turns=turns, new_tokens=150, answer_tokens=32)
        # N sessions cycle through the lengths, shortest first, each with its own text
        return [conv for i in range(count)
                for conv in workload.sweep(source, seed + i * 7919, [lengths[i % len(lengths)]], turns=turns,
                                           new_tokens=150, answer_tokens=32, id_suffix=f"-{i}")]
    if scenario == "no-reuse":
        spec = workload.SyntheticSpec(num_sessions=many(8),
                                      system_tokens={"distribution": "uniform", "min": 500, "max": 2000},
                                      num_turns=1, new_tokens=150, answer_tokens=32)
        return workload.synthetic(spec, source, seed, "single")
    if scenario == "resume-after-ttl":
        spec = workload.SyntheticSpec(num_sessions=many(2), system_tokens=2048, num_turns=3, new_tokens=150,
                                      answer_tokens=32, gap_s=6.0)
        return workload.synthetic(spec, source, seed, "resume")
    if scenario == "edited-history":
        conversations = workload.synthetic(workload.SyntheticSpec(num_sessions=many(2), system_tokens=2048,
                                                                  num_turns=turns, new_tokens=150, answer_tokens=32),
                                           source, seed, "edit")
        for conv in conversations:
            for turn in conv.turns[2:3]:
                turn.edit_history = True
        return conversations
    if scenario == "short-turns":
        spec = workload.SyntheticSpec(num_sessions=many(2), system_tokens=24, num_turns=turns, new_tokens=12,
                                      answer_tokens=8)
        return workload.synthetic(spec, source, seed, "short")
    if scenario == "concurrent":
        spec = workload.SyntheticSpec(num_sessions=many(8),
                                      system_tokens={"distribution": "uniform", "min": 500, "max": 2500},
                                      num_turns=turns, new_tokens=150, answer_tokens=32)
        return workload.synthetic(spec, source, seed, "concurrent")
    if scenario == "agent-loop":
        spec = workload.SyntheticSpec(num_sessions=many(8),
                                      system_tokens={"distribution": "uniform", "min": 2000, "max": 5000},
                                      num_turns=turns + 4,
                                      new_tokens={"distribution": "uniform", "min": 50, "max": 400},
                                      answer_tokens={"distribution": "uniform", "min": 16, "max": 64})
        return workload.synthetic(spec, source, seed, "agent")
    if scenario in ("coding-agent", "production"):
        from kvturn.bench.coding_agent import coding_agent
        return coding_agent(source, seed, max_prompt_tokens, many(SCENARIOS[scenario].sessions))
    if scenario == "memory-pressure":
        spec = workload.SyntheticSpec(num_sessions=many(32), system_tokens={"distribution": "uniform", "min": 1000,
                                                                            "max": 1500},
                                      num_turns=turns, new_tokens={"distribution": "uniform", "min": 100, "max": 200},
                                      answer_tokens=32, gap_s={"distribution": "uniform", "min": 5, "max": 15})
        return workload.synthetic(spec, source, seed, "pressure")
    if scenario == "real-chat":
        from kvturn.bench import real_chat
        return real_chat.conversations(sessions=many(1))
    raise ValueError(f"unknown scenario {scenario!r}; one of {sorted(SCENARIOS)}")
