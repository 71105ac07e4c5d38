"""`kvturn bench --compare`: the same workload against each deployment leg of the catalog (catalog.py), each
launched locally in turn."""
import asyncio
import contextlib
import dataclasses
import os
import time
from pathlib import Path

import httpx
from rich.console import Console

from kvturn.bench import client, workload
from kvturn.bench.catalog import LEGS, PATH_LEGS, Scenario
from kvturn.bench.report import longest_request, ttft_at
from kvturn.bench.topology import Layout
from kvturn.kv_transfer import side_channel
from kvturn.launch import LocalStack


# How long the legs' routers wait for a worker's answer: a 25k-token prompt computed from scratch takes ~20 s on a
# quiet CPU core and minutes on a busy one, past the router's default, which would fail the turn.
PREFILL_WAIT_S = 900


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
    """Each worker's start-up prefill steps (GET /kv/calibration), by role, kept in results.json as prompts timed
    alone (`kvturn plan` fits the steps in service instead)."""
    steps = {}
    for name, reply in worker_replies(stack, "/kv/calibration", timeout=10).items():
        if reply is not None and isinstance(reply.get("prefill_steps"), list):
            steps.setdefault(reply.get("role") or name, reply["prefill_steps"])
    return steps


# What a worker's /metrics says of retention under pressure, kept per leg (report.retention_words)
COUNTERS = ("kvturn_kv_leases_total", "kvturn_kv_retention_choices_total", "kvturn_preemptions_total",
            "kvturn_prompt_tokens_computed_total", "kvturn_kv_reuse_declines_total", "kvturn_kv_tier_moves_total")


def worker_counters(stack: LocalStack) -> dict[str, dict[str, float]]:
    """The retention counters (COUNTERS, by `name{labels}`) of each role's workers, summed; the routers' reuse
    outcomes too."""
    counters: dict[str, dict[str, float]] = {}
    for name, url in stack.urls.items():
        try:
            text = httpx.get(f"{url}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        role = name.rstrip("0123456789")
        wanted = COUNTERS + (("kvturn_router_prefill_reuse_total",) if role == "router" else ())
        into = counters.setdefault(role, {})
        for line in text.splitlines():
            metric, _, value = line.rpartition(" ")
            if metric.split("{")[0] in wanted:
                try:
                    into[metric] = into.get(metric, 0.0) + float(value)
                except ValueError:
                    pass
    return counters


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
              pin_workers: bool = False, layout: Layout = Layout()) -> LocalStack:
    """The local stack (not yet started) that serves leg `name` of a bench comparison, laid out as `layout` says."""
    leg = LEGS[name]
    worker_args, decode_args = (scenario.worker_args, scenario.decode_args) if scenario else ([], [])
    pool = ["--kv-cache-mb", str(layout.prefill_kv_cache_mb)] if layout.prefill_kv_cache_mb else []
    prefill_args = [*pool, *(scenario.prefill_args if scenario else []), *leg.prefill_args]
    router_args = ["--path-policy", leg.path_policy, "--upstream-timeout-s", str(PREFILL_WAIT_S),
                   "--prefill-choice", layout.prefill_choice]
    if layout.network is not None:
        from kvturn.bench.netns import NetnsStack
        return NetnsStack(layout.network, model_dir, mode=leg.mode, bidirectional=leg.bidirectional,
                          prefix_caching_on_prefill=leg.prefix_caching_on_prefill, kv_cache_mb=kv_cache_mb,
                          worker_args=worker_args, prefill_args=prefill_args,
                          decode_args=[*decode_args, *leg.decode_args], router_args=router_args, log_dir=log_dir,
                          num_prefill=layout.topology.prefill, num_decode=layout.topology.decode)
    return LocalStack(model_dir, mode=leg.mode, bidirectional=leg.bidirectional,
                      prefix_caching_on_prefill=leg.prefix_caching_on_prefill, kv_cache_mb=kv_cache_mb,
                      worker_args=worker_args, prefill_args=prefill_args,
                      decode_args=[*decode_args, *leg.decode_args], router_args=router_args,
                      log_dir=log_dir, pin_workers=pin_workers, num_prefill=layout.topology.prefill,
                      num_decode=layout.topology.decode)


def run_leg(model_dir: str, name: str, scenario: Scenario, conversations, seed: int, kv_cache_mb: int,
            log_dir: Path, console: Console, source: workload.TextSource, sessions: int | None = None,
            pin_workers: bool = False, layout: Layout = Layout()) -> client.RunResult:
    """Leg `name` on a stack of its own, started for this run and stopped after it."""
    leg = LEGS[name]
    console.print(f"[bold]{name}[/bold]: starting {leg.mode} stack"
                  + (f" ({layout.describe()})" if leg.mode == "pd" else ""))
    stack = leg_stack(model_dir, name, log_dir / name.replace("/", "_"), kv_cache_mb, scenario, pin_workers, layout)
    with stack:
        warm_up(stack.url, source)
        started_s = time.time()
        network = layout.network if leg.mode == "pd" else None
        before = link_counters(network)
        result = asyncio.run(client.run(stack.url, conversations, sessions=sessions or scenario.sessions,
                                        seed=seed, count_tokens=source.tokenizer.count,
                                        ignore_eos=scenario.ignore_eos))
        after = link_counters(network)
        result.link_bytes = {host: {way: after[host][way] - before[host][way] for way in ("in", "out")}
                             for host in after}
        result.worker_calibration = worker_calibration(stack)
        result.worker_steps, missing = worker_steps(stack, started_s)
        result.worker_counters = worker_counters(stack)
        if missing:
            console.print(f"  [yellow]no steps kept from {', '.join(missing)}: kvturn plan cannot calibrate "
                          f"from this leg[/yellow]")
    failed = sum(1 for r in result.requests if r.error)
    console.print(f"  {len(result.requests)} requests, {failed} failed, {result.runtime_s:.1f} s")
    return result


def link_counters(network) -> dict[str, dict[str, int]]:
    """Bytes each host's link has carried so far, into and out of its namespace ({} on one host)."""
    if network is None:
        return {}
    return {host: {"in": network.bytes_into(host), "out": network.bytes_out_of(host)} for host in network.hosts}


def run_legs(model_dir: str, legs: list[str], scenario: Scenario, conversations, seed: int, kv_cache_mb: int,
             log_dir: Path, console: Console, source: workload.TextSource, sessions: int | None = None,
             pin_workers: bool = False, layout: Layout = Layout()) -> dict:
    return {name: run_leg(model_dir, name, scenario, conversations, seed, kv_cache_mb, log_dir, console, source,
                          sessions, pin_workers, layout) for name in legs}


def interleaved(legs: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, leg) in the order they run: every leg once per repeat (A, B, A, B, ...), so that a slow spell of
    the machine falls on each leg rather than on all the runs of one."""
    return [(repeat, leg) for repeat in range(repeats) for leg in legs]


def run_repeats(repeats: int, model_dir: str, legs: list[str], scenario: Scenario, conversations, seed: int,
                kv_cache_mb: int, log_dir: Path, console: Console, source: workload.TextSource,
                sessions: int | None = None, pin_workers: bool = False, layout: Layout = Layout()) -> list[dict]:
    """Each repeat's results by leg: the legs run interleaved, each on a fresh stack replaying the same workload
    with the same seed."""
    runs = [{} for _ in range(repeats)]
    for repeat, name in interleaved(legs, repeats):
        if repeats > 1 and name == legs[0]:
            console.print(f"[bold]repeat {repeat + 1} of {repeats}[/bold]")
        runs[repeat][name] = run_leg(model_dir, name, scenario, conversations, seed, kv_cache_mb,
                                     log_dir / f"repeat{repeat + 1}" if repeats > 1 else log_dir, console, source,
                                     sessions, pin_workers, layout)
    return runs


@contextlib.contextmanager
def hosts_of(layout: Layout):
    """`layout` with its hosts made: with --hosts netns, a network of namespaces that lives for the block."""
    if layout.hosts != "netns":
        yield layout
        return
    from kvturn.bench.netns import Link, Network, hosts_for
    with Network(hosts_for(layout.topology.prefill, layout.topology.decode),
                 Link.parse(layout.link) if layout.link else None) as network:
        yield dataclasses.replace(layout, network=network)


@contextlib.contextmanager
def read_bench(model_dir: str, pool_mib: int, layout: Layout = Layout()):
    """A raw NIXL reader: on this host, or with --hosts netns from prefill's namespace out of decode0's, over the
    same links and UCX transports as the legs."""
    from kvturn.bench.nixl_read import ReadBench
    network = layout.network
    if network is None:
        with ReadBench(model_dir, pool_mib) as bench:
            yield bench
        return
    from kvturn.bench.netns import UCX_ENV
    saved = {key: os.environ.get(key) for key in UCX_ENV}
    os.environ.update(UCX_ENV)
    try:
        with network.inside("prefill"), ReadBench(model_dir, pool_mib, network.namespaces["decode0"],
                                                  UCX_ENV) as bench:
            yield bench
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


LINK_PROBE_BYTES = (4 * 2**20, 32 * 2**20)


def link_ideal(model_dir: str, layout: Layout) -> dict | None:
    """With --hosts netns: what a raw NIXL READ gets over the legs' link, measured now (the ideal a pull is held
    to), beside the rate the link was shaped to."""
    network = layout.network
    if network is None:
        return None
    with read_bench(model_dir, max(LINK_PROBE_BYTES) // 2**20 + 2, layout) as bench:
        reads = {nbytes: bench.raw_read_s(nbytes, repeats=5) for nbytes in LINK_PROBE_BYTES}
    small, large = min(reads), max(reads)
    per_byte_s = max((reads[large] - reads[small]) / (large - small), 1e-12)
    return {**network.describe(),
            "raw_read_ms": {str(nbytes): seconds * 1e3 for nbytes, seconds in reads.items()},
            "measured_bytes_per_s": 1 / per_byte_s,
            "measured_fixed_ms": max(reads[small] - small * per_byte_s, 0.0) * 1e3}


def link_text(measure: dict) -> str:
    shaped = measure["link_rate_bits_per_s"]
    delay = measure.get("link_delay_s")
    return (f"link {measure['link'] or 'unshaped'}: raw NIXL READ over it {measure['measured_bytes_per_s'] * 8 / 1e9:.2f}"
            f" Gbit/s + {measure['measured_fixed_ms']:.2f} ms a read"
            + (f" (shaped to {shaped / 1e9:g} Gbit/s)" if shaped else "")
            + ("" if not delay else f"; delay {delay * 1e6:.0f} us "
               + ("applied (netem)" if measure.get("delay_applied") else "NOT applied: this kernel has no netem")))


def ideal_speedup(results: dict, model_dir: str, layout: Layout = Layout(),
                  on_leg: str = "bidir/P-cache-off") -> dict | None:
    """Full prefill / (suffix-only prefill + raw NIXL read of its KV), measured in this run, and how close the
    measured TTFT(OFF) / TTFT(ON) came to it (prefix caching off on P in both), at each conversation's longest prompt
    (`by_length`, shortest first); the headline fields are the longest prompt's. Beside it the overlapped ideal, where
    the read runs layer by layer beside the suffix's compute: full / (max(suffix, read) + min(suffix, read) / layers)."""
    off, on = results.get("pd/P-cache-off"), results.get(on_leg)
    if off is None or on is None:
        return None
    pairs = longest_turns(off, on)
    if not pairs:
        return None
    reused = [(off_row, on_row) for off_row, on_row in pairs if on_row is not None and on_row["bytes_d_to_p"]]
    if not reused or reused[-1][0] is not pairs[-1][0]:
        return {"note": "the ON leg did not reuse KV at the longest prompt", "on": pairs[-1][1]}
    from kvturn.model.config import ModelConfig
    layers = ModelConfig.from_dir(model_dir).num_hidden_layers
    with read_bench(model_dir, max(on_row["bytes_d_to_p"] for _, on_row in reused) // 2**20 + 2, layout) as bench:
        rows = [ideal_row(off_row, on_row, bench.raw_read_s(on_row["bytes_d_to_p"], repeats=7) * 1e3, layers)
                for off_row, on_row in reused]
    return {**rows[-1], "on_leg": on_leg, "by_length": rows}


def longest_turns(off, on) -> list[tuple]:
    """(OFF leg's request, ON leg's ttft_at row or None) at each conversation's longest prompt, shortest first."""
    pairs = []
    for conversation_id in dict.fromkeys(r.conversation_id for r in off.requests):
        longest = longest_request(off, conversation_id)
        if longest is not None:
            pairs.append((longest, ttft_at(on, longest.conversation_id, longest.turn)))
    return sorted(pairs, key=lambda pair: pair[0].input_num_tokens)


def ideal_row(off_row, on_row: dict, raw_read_ms: float, layers: int) -> dict:
    full_ms, suffix_ms = off_row.prefill_compute_ms, on_row["prefill_compute_ms"]
    ideal = full_ms / (suffix_ms + raw_read_ms)
    overlapped = full_ms / (max(suffix_ms, raw_read_ms) + min(suffix_ms, raw_read_ms) / layers)
    measured = off_row.ttft_ms / on_row["ttft_ms"]
    return {"prompt_tokens": off_row.input_num_tokens, "conversation_id": off_row.conversation_id,
            "turn": off_row.turn, "full_prefill_ms": full_ms, "suffix_prefill_ms": suffix_ms,
            "kv_bytes": on_row["bytes_d_to_p"], "raw_nixl_read_ms": raw_read_ms, "d_to_p_read_ms":
            on_row["d_to_p_read_ms"], "ideal_speedup": ideal, "ttft_off_ms": off_row.ttft_ms,
            "ttft_on_ms": on_row["ttft_ms"], "measured_speedup": measured, "other_ms": on_row["other_ms"],
            "fraction_of_ideal": measured / ideal, "overlapped_ideal_speedup": overlapped,
            "fraction_of_overlapped_ideal": measured / overlapped, "d_to_p_read_hidden_ms": on_row.get("d_to_p_read_hidden_ms"),
            "tpot_off_ms": off_row.tpot_ms, "tpot_on_ms": on_row["tpot_ms"]}


def answers_equal(results: dict) -> dict | None:
    """Each leg's answers against the first leg's, turn by turn (greedy decoding: reuse must change no token); None
    with one leg."""
    names = list(results)
    if len(names) < 2:
        return None
    reference = {(r.conversation_id, r.turn): r.answer_digest for r in results[names[0]].requests
                 if r.error is None and r.answer_digest}
    out = {"reference_leg": names[0]}
    for name in names[1:]:
        pairs = [(reference[key], r.answer_digest) for r in results[name].requests
                 if r.error is None and (key := (r.conversation_id, r.turn)) in reference]
        out[name] = {"compared": len(pairs), "equal": sum(a == b for a, b in pairs)}
    return out


def answers_text(equal: dict) -> str:
    return f"answers against {equal['reference_leg']}'s, turn by turn: " + ", ".join(
        f"{leg} {row['equal']} of {row['compared']} equal" for leg, row in equal.items() if leg != "reference_leg")


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
