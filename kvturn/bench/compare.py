"""`kvturn bench --compare`: the same workload against each deployment leg, launched locally in turn.

Legs: colocated worker (prefix caching on); P/D without bidirectional transfer; P/D with it;
each P/D leg with prefix caching on P on (production baseline) and off (cache-miss emulation,
as in vLLM's published run). Scenarios add the cases where reuse cannot or should not help.
"""
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from kvturn.bench import client, workload
from kvturn.bench.report import longest_request, ttft_at
from kvturn.kv_transfer import side_channel
from kvturn.launch import LocalStack


@dataclass(frozen=True, slots=True)
class Leg:
    name: str
    mode: str
    bidirectional: bool
    prefix_caching_on_prefill: bool
    path_policy: str = "pull"  # what the router does with a live lease (see `kvturn router --path-policy`)


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
}
PATH_LEGS = ("pull", "compute-on-D", "adaptive")


@dataclass(slots=True)
class Scenario:
    """A named workload plus the deployment settings it needs."""
    name: str
    description: str
    sessions: int = 1
    decode_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)


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
}


def build_workload(scenario: str, source: workload.TextSource, seed: int, max_prompt_tokens: int,
                   turns: int) -> list[workload.Conversation]:
    if scenario == "sweep":
        lengths = [n for n in (1024, 2048, 4096, 8192, 16384, 24576) if n <= max_prompt_tokens] or [max_prompt_tokens]
        return workload.sweep(source, seed, lengths, turns=turns, new_tokens=150, answer_tokens=32)
    if scenario == "no-reuse":
        spec = workload.SyntheticSpec(num_sessions=8, system_tokens={"distribution": "uniform", "min": 500, "max": 2000},
                                      num_turns=1, new_tokens=150, answer_tokens=32)
        return workload.synthetic(spec, source, seed, "single")
    if scenario == "resume-after-ttl":
        spec = workload.SyntheticSpec(num_sessions=2, system_tokens=2048, num_turns=3, new_tokens=150,
                                      answer_tokens=32, gap_s=6.0)
        return workload.synthetic(spec, source, seed, "resume")
    if scenario == "edited-history":
        conversations = workload.synthetic(workload.SyntheticSpec(num_sessions=2, system_tokens=2048, num_turns=turns,
                                                                  new_tokens=150, answer_tokens=32), source, seed, "edit")
        for conv in conversations:
            for turn in conv.turns[2:3]:
                turn.edit_history = True
        return conversations
    if scenario == "short-turns":
        spec = workload.SyntheticSpec(num_sessions=2, system_tokens=24, num_turns=turns, new_tokens=12, answer_tokens=8)
        return workload.synthetic(spec, source, seed, "short")
    if scenario == "concurrent":
        spec = workload.SyntheticSpec(num_sessions=8, system_tokens={"distribution": "uniform", "min": 500, "max": 2500},
                                      num_turns=turns, new_tokens=150, answer_tokens=32)
        return workload.synthetic(spec, source, seed, "concurrent")
    if scenario == "agent-loop":
        spec = workload.SyntheticSpec(num_sessions=8, system_tokens={"distribution": "uniform", "min": 2000, "max": 5000},
                                      num_turns=turns + 4,
                                      new_tokens={"distribution": "uniform", "min": 50, "max": 400},
                                      answer_tokens={"distribution": "uniform", "min": 16, "max": 64})
        return workload.synthetic(spec, source, seed, "agent")
    raise ValueError(f"unknown scenario {scenario!r}; one of {sorted(SCENARIOS)}")


def warm_up(url: str, source: workload.TextSource) -> None:
    """First requests pay one-time costs (NIXL handshake, allocator growth); keep them out of the numbers."""
    spec = workload.SyntheticSpec(num_sessions=1, system_tokens=600, num_turns=2, new_tokens=64, answer_tokens=8)
    asyncio.run(client.run(url, workload.synthetic(spec, source, 999_999, "warmup"), sessions=1, show_progress=False))


def worker_replies(stack: LocalStack, path: str, **request) -> dict[str, dict | None]:
    """Each worker's JSON object at GET `path` (router left out), by name; None where it did not answer with one."""
    replies = {}
    for name, url in stack.urls.items():
        if name != "router":
            try:
                reply = httpx.get(f"{url}{path}", **request).json()
            except (httpx.HTTPError, ValueError):
                reply = None
            replies[name] = reply if isinstance(reply, dict) else None
    return replies


def worker_calibration(stack: LocalStack) -> dict[str, list]:
    """Each worker's start-up prefill steps (GET /kv/calibration), by role: `kvturn plan` fits them beside the
    requests, as prompts timed alone."""
    steps = {}
    for name, reply in worker_replies(stack, "/kv/calibration", timeout=10).items():
        if reply is not None and isinstance(reply.get("prefill_steps"), list):
            steps.setdefault(reply.get("role") or name, reply["prefill_steps"])
    return steps


def worker_steps(stack: LocalStack, since_s: float) -> tuple[dict[str, list], list[str]]:
    """Each worker's forward steps since `since_s` (GET /kv/steps), by role, for `kvturn plan` to fit its step costs
    to; and the workers left out, which did not answer or dropped steps of the span (raise --step-history-steps)."""
    steps, missing = {}, []
    replies = worker_replies(stack, "/kv/steps", params={"since": since_s}, timeout=30,
                             headers={side_channel.SECRET_HEADER: stack.cluster_secret})
    for name, reply in replies.items():
        if reply is not None and isinstance(reply.get("steps"), list) and reply.get("dropped") is False:
            steps.setdefault(reply.get("role") or name, reply["steps"])
        else:
            missing.append(name)
    return steps, missing


def leg_stack(model_dir: str, name: str, log_dir: Path, kv_cache_mb: int, scenario: Scenario | None = None,
              pin_workers: bool = False) -> LocalStack:
    """The local stack (not yet started) that serves leg `name` of a bench comparison."""
    leg = LEGS[name]
    worker_args, decode_args = (scenario.worker_args, scenario.decode_args) if scenario else ([], [])
    return LocalStack(model_dir, mode=leg.mode, bidirectional=leg.bidirectional,
                      prefix_caching_on_prefill=leg.prefix_caching_on_prefill, kv_cache_mb=kv_cache_mb,
                      worker_args=worker_args, decode_args=decode_args,
                      router_args=["--path-policy", leg.path_policy], log_dir=log_dir, pin_workers=pin_workers)


def run_legs(model_dir: str, legs: list[str], scenario: Scenario, conversations, seed: int, kv_cache_mb: int,
             log_dir: Path, console: Console, source: workload.TextSource, sessions: int | None = None,
             pin_workers: bool = False) -> dict:
    results = {}
    for name in legs:
        leg = LEGS[name]
        console.print(f"[bold]{name}[/bold]: starting {leg.mode} stack")
        stack = leg_stack(model_dir, name, log_dir / name.replace("/", "_"), kv_cache_mb, scenario, pin_workers)
        with stack:
            warm_up(stack.url, source)
            started_s = time.time()
            results[name] = asyncio.run(client.run(stack.url, conversations, sessions=sessions or scenario.sessions,
                                                   seed=seed, count_tokens=source.tokenizer.count))
            results[name].worker_calibration = worker_calibration(stack)
            results[name].worker_steps, missing = worker_steps(stack, started_s)
            if missing:
                console.print(f"  [yellow]no steps kept from {', '.join(missing)}: kvturn plan calibrates from "
                              f"this run's requests instead[/yellow]")
        failed = sum(1 for r in results[name].requests if r.error)
        console.print(f"  {len(results[name].requests)} requests, {failed} failed, {results[name].runtime_s:.1f} s")
    return results


def ideal_speedup(results: dict, model_dir: str) -> dict | None:
    """Full prefill of the longest prompt / (suffix-only prefill + raw NIXL read of its KV), measured in this run,
    and how close the measured TTFT(OFF) / TTFT(ON) came to it (prefix caching off on P in both)."""
    off, on = results.get("pd/P-cache-off"), results.get("bidir/P-cache-off")
    if off is None or on is None:
        return None
    longest = longest_request(off)
    if longest is None:
        return None
    on_row = ttft_at(on, longest.conversation_id, longest.turn)
    if on_row is None or not on_row["bytes_d_to_p"]:
        return {"note": "the ON leg did not reuse KV at the longest prompt", "on": on_row}
    from kvturn.bench.nixl_read import ReadBench
    nbytes = on_row["bytes_d_to_p"]
    with ReadBench(model_dir, nbytes // 2**20 + 2) as bench:
        raw_read_ms = bench.raw_read_s(nbytes, repeats=7) * 1e3
    full_ms, suffix_ms = longest.prefill_compute_ms, on_row["prefill_compute_ms"]
    ideal = full_ms / (suffix_ms + raw_read_ms)
    measured = longest.ttft_ms / on_row["ttft_ms"]
    return {"prompt_tokens": longest.input_num_tokens, "conversation_id": longest.conversation_id,
            "turn": longest.turn, "full_prefill_ms": full_ms, "suffix_prefill_ms": suffix_ms,
            "kv_bytes": nbytes, "raw_nixl_read_ms": raw_read_ms, "ideal_speedup": ideal,
            "ttft_off_ms": longest.ttft_ms, "ttft_on_ms": on_row["ttft_ms"], "measured_speedup": measured,
            "other_ms": on_row["other_ms"],
            "fraction_of_ideal": measured / ideal}


def path_verdict(summaries: list[dict]) -> dict | None:
    """The three-path targets, from one run: adaptive TTFT p50 against the better fixed path, its TPOT p90
    against pull only, and how often the router's predicted TTFT was within 20% of the measured one."""
    legs = {s["leg"]: s for s in summaries}
    if not all(name in legs for name in PATH_LEGS):
        return None
    pull, on_decode, adaptive = (legs[name] for name in PATH_LEGS)
    better = min(pull["ttft_ms"]["p50"], on_decode["ttft_ms"]["p50"])
    return {"adaptive_ttft_p50_ms": adaptive["ttft_ms"]["p50"], "better_fixed_ttft_p50_ms": better,
            "ttft_ratio": adaptive["ttft_ms"]["p50"] / better,
            "adaptive_tpot_p90_ms": adaptive["tpot_ms"].get("p90"), "pull_tpot_p90_ms": pull["tpot_ms"].get("p90"),
            "tpot_ratio": adaptive["tpot_ms"]["p90"] / pull["tpot_ms"]["p90"],
            "adaptive_paths": adaptive.get("paths"),
            "predicted_within_20pct": {name: legs[name].get("predicted_within_20pct") for name in PATH_LEGS}}
