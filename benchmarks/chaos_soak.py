"""Chaos soak: agent sessions against a supervised stack while processes die, stop and Redis restarts.

    python benchmarks/chaos_soak.py [--duration-s 300] [--sessions 32] [--seed 0]

3 routers sharing a redis-server of the soak's own, 2 prefill workers with no prefix cache of their own (so a
later turn reuses only by reading its history back from a decode worker) and 2 decode workers, all restarted by
the stack's supervisor when they exit (as `kvturn serve` does). benchmarks/chaos.py kills one worker or router
every 20-30 s, SIGSTOPs one now and then, and restarts Redis once. Each session retries a failed turn once, on
the next router, as an agent behind a balancer would. Afterwards a colocated worker with no prefix cache answers
a sample of the turns from the same messages, as a full recompute.

Targets, printed and written to results/chaos-soak.json: no turn lost; every failure the client saw an HTTP error
or an SSE error event (or the connection of a router that was killed), never a hang past the client's timeout;
the sampled answers equal the recompute's; no process's RSS grows over the last half; retained KV within the
budget; Redis keys bounded by the conversations started.
"""
import argparse
import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from chaos import Chaos, schedule
from kvturn.bench.client import RequestRecord, model_name, one_turn
from kvturn.bench.machine import machine, write_json
from kvturn.config import SupervisorConfig
from kvturn.launch import LocalStack, RedisServer
from kvturn.model.make_model import default_model_dir
from soak import KEYS_PER_CONVERSATION, redis_keys, soak_conversations
from watch import Watch, rss_verdicts

RETRY_PAUSE_S = 1.0  # an agent's pause before it sends a failed turn again


@dataclass(slots=True)
class TurnOutcome:
    conversation_id: str
    turn: int
    at_s: float
    attempts: list[str] = field(default_factory=list)  # "ok" or the kind of each failure, in order
    attempt_at_s: list[float] = field(default_factory=list)  # when each attempt began, seconds into the run
    errors: list[str] = field(default_factory=list)
    reuse: str | None = None
    max_tokens: int = 0
    messages: list[dict] | None = None  # what was sent, for the recompute check
    answer: str | None = None

    @property
    def answered(self) -> bool:
        return self.attempts[-1:] == ["ok"]


def failure_kind(exc: Exception) -> str:
    """How a turn failed, as the client saw it (kvturn.bench.client.one_turn raises these)."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"  # a hang past the client's timeout
    if isinstance(exc, httpx.TransportError):
        return "connection"  # the router it talked to went away (killed) or was not there yet
    if isinstance(exc, RuntimeError):
        return "http_status" if str(exc).startswith("HTTP ") else "sse_error"
    return "other"


async def attempt(client, url: str, model: str, outcome: TurnOutcome, messages: list[dict],
                  started: float) -> str | None:
    record = RequestRecord(outcome.conversation_id, 0, outcome.turn, len(messages), 0.0, warmup=False)
    outcome.attempt_at_s.append(time.monotonic() - started)
    try:
        answer = await one_turn(client, url, model, messages, record, outcome.max_tokens, ignore_eos=True)
    except Exception as exc:
        outcome.attempts.append(failure_kind(exc))
        outcome.errors.append(f"{type(exc).__name__}: {exc}"[:200])
        return None
    outcome.attempts.append("ok")
    outcome.reuse = record.reuse
    return answer


async def sessions(urls: list[str], conversations: list, count: int, duration_s: float, timeout_s: float,
                   started: float) -> list[TurnOutcome]:
    """`count` sessions replaying the conversations until `duration_s`; each turn goes to the next router, and a
    failed one once more to the one after. A turn lost twice ends its session, as it would end an agent's task."""
    outcomes: list[TurnOutcome] = []
    pending = list(conversations)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10)) as client:
        model = await model_name(client, urls[0])

        async def session(index: int) -> None:
            while pending and time.monotonic() - started < duration_s:
                conv = pending.pop(0)
                messages = [{"role": "system", "content": conv.system}]
                for number, turn in enumerate(conv.turns):
                    if time.monotonic() - started >= duration_s:
                        return
                    if number:
                        await asyncio.sleep(turn.gap_s)
                    messages.append({"role": "user", "content": turn.user})
                    outcome = TurnOutcome(conv.conversation_id, number, time.monotonic() - started,
                                          max_tokens=turn.answer_tokens, messages=list(messages))
                    outcomes.append(outcome)
                    answer = await attempt(client, urls[(index + number) % len(urls)], model, outcome, messages,
                                           started)
                    if answer is None:
                        await asyncio.sleep(RETRY_PAUSE_S)
                        answer = await attempt(client, urls[(index + number + 1) % len(urls)], model, outcome,
                                               messages, started)
                    if answer is None:
                        break
                    outcome.answer = answer
                    messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(session(i) for i in range(count)))
    return outcomes


async def recompute_check(url: str, sample: list[TurnOutcome], timeout_s: float) -> list[dict]:
    """Each sampled turn sent again, alone, to a worker that computes it all: the answers that differ."""
    differ = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10)) as client:
        model = await model_name(client, url)
        for outcome in sample:
            record = RequestRecord(outcome.conversation_id, 0, outcome.turn, len(outcome.messages), 0.0, False)
            expected = await one_turn(client, url, model, outcome.messages, record, outcome.max_tokens, True)
            if expected != outcome.answer:
                differ.append({"conversation_id": outcome.conversation_id, "turn": outcome.turn,
                               "reuse": outcome.reuse, "got": outcome.answer[:120], "recompute": expected[:120]})
    return differ


async def soak(stack: LocalStack, redis_server: RedisServer, args, conversations) -> tuple:
    started = time.monotonic()
    chaos = Chaos(stack, redis_server, schedule(args.duration_s, args.seed), args.seed)
    chaos.started = started
    watch = Watch(stack, redis_server, started)
    watching = asyncio.create_task(watch.run())
    faults = asyncio.create_task(chaos.run(args.duration_s))
    outcomes = await sessions(stack.router_urls, conversations, args.sessions, args.duration_s, args.client_timeout_s,
                              started)
    await faults
    watch.stop.set()
    await watching
    return outcomes, chaos, watch


def unexplained_connection_failures(outcomes: list[TurnOutcome], chaos: Chaos, timeout_s: float) -> int:
    """Connection failures that no router's death explains: neither in flight when a router was killed nor sent
    to it before it answered again (plus a few seconds: a balancer would have routed around it)."""
    down = [(e.fired_at_s, (e.back_after_s or 60.0) + e.fired_at_s + 5.0) for e in chaos.events
            if e.fired_at_s is not None and e.action == "kill" and (e.target or "").startswith("router")]
    return sum(kind == "connection" and not any(begin - timeout_s <= at <= end for begin, end in down)
               for o in outcomes for kind, at in zip(o.attempts, o.attempt_at_s))


def figures(outcomes: list[TurnOutcome], differ: list[dict], sample_size: int, chaos: Chaos, watch: Watch,
            stack: LocalStack, args, keys: dict) -> dict:
    failures = [kind for o in outcomes for kind in o.attempts if kind != "ok"]
    started = {o.conversation_id for o in outcomes}
    peak_keys = max((n for _, n in watch.redis_keys), default=0)
    retained = {name: max(values, default=0.0) / 2**20 for name, values in watch.retained_bytes.items()}
    budget_slack_mib = watch.block_bytes / 2**20  # a lease is reclaimed once the budget is passed by a block
    rss = rss_verdicts(watch.rss, args.duration_s)
    restarts = stack.supervisor.restarts if stack.supervisor else []
    return {
        "duration_s": args.duration_s, "sessions": args.sessions, "seed": args.seed,
        "turns": len(outcomes), "answered_first_try": sum(o.attempts == ["ok"] for o in outcomes),
        "answered_on_retry": sum(o.answered and len(o.attempts) == 2 for o in outcomes),
        "lost": sum(not o.answered for o in outcomes),
        "failures_by_kind": {kind: failures.count(kind) for kind in sorted(set(failures))},
        "hangs": failures.count("timeout"), "client_timeout_s": args.client_timeout_s,
        "connection_failures_no_router_kill_explains": unexplained_connection_failures(outcomes, chaos,
                                                                                        args.client_timeout_s),
        "failure_examples": sorted({e for o in outcomes for e in o.errors})[:8],
        "reuse_outcomes": {k: sum(o.reuse == k for o in outcomes if o.answered)
                           for k in sorted({str(o.reuse) for o in outcomes if o.answered}) if k != "None"},
        "recompute_sample": sample_size, "recompute_equal": sample_size - len(differ), "recompute_differ": differ[:5],
        "rss": rss, "rss_no_growth": all(v["verdict"] != "grew" for v in rss.values()),
        "retained_kv_peak_mib": retained, "retained_kv_budget_mib": args.retained_kv_budget_mb,
        "retained_within_budget": all(mib <= args.retained_kv_budget_mb + budget_slack_mib
                                      for mib in retained.values()),
        "conversations_started": len(started), "redis_keys_at_end": keys, "redis_keys_peak": peak_keys,
        "redis_keys_bound": KEYS_PER_CONVERSATION * len(started),
        "redis_keys_bounded": peak_keys <= KEYS_PER_CONVERSATION * len(started),
        "chaos": chaos.log(),
        "restarts": [{"name": r.name, "exit_code": r.exit_code, "exited_at_s": round(r.exited_at - chaos.started, 1),
                      "backoff_s": r.backoff_s} for r in restarts],
        "rss_samples": {name: [[round(t, 1), pid, round(mib, 1)] for t, n, pid, mib in watch.rss if n == name]
                        for name in sorted({sample[1] for sample in watch.rss})},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--routers", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--retained-kv-budget-mb", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--retained-host-mb", type=int, default=256,
                        help="each decode worker's host tier, so that kills land while leases move there (0: none)")
    parser.add_argument("--upstream-timeout-s", type=float, default=30.0, help="the routers' --upstream-timeout-s")
    parser.add_argument("--no-worker-wait-s", type=float, default=60.0, help="the routers' --no-worker-wait-s")
    parser.add_argument("--sample", type=int, default=64, help="turns checked against a full recompute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, help="each process's log (default: a new folder in the kvturn cache)")
    parser.add_argument("--out", default="results/chaos-soak.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")  # the supervisor's restarts
    # The longest a turn may take without hanging: the wait for a worker, then prefill's and decode's silence.
    args.client_timeout_s = args.no_worker_wait_s + 2 * args.upstream_timeout_s + 30
    model_dir = default_model_dir("tiny")
    conversations = soak_conversations(model_dir, args.sessions, args.seed, "chaos")
    with RedisServer() as redis_server:
        stack = LocalStack(model_dir, kv_cache_mb=args.kv_cache_mb, prefix_caching_on_prefill=False,
                           num_prefill=args.prefill, num_decode=args.decode, num_routers=args.routers,
                           decode_args=["--retained-kv-budget-mb", str(args.retained_kv_budget_mb),
                                        "--retained-host-mb", str(args.retained_host_mb)],
                           router_args=["--state", redis_server.url,
                                        "--upstream-timeout-s", str(args.upstream_timeout_s),
                                        "--no-worker-wait-s", str(args.no_worker_wait_s)],
                           log_dir=args.log_dir, supervisor=SupervisorConfig())
        print(f"chaos soak: {args.sessions} sessions for {args.duration_s:.0f} s; logs in {stack.log_dir}", flush=True)
        with stack:
            outcomes, chaos, watch = asyncio.run(soak(stack, redis_server, args, conversations))
            keys = redis_keys(redis_server.url)
    answered = [o for o in outcomes if o.answered]
    sample = random.Random(args.seed).sample(answered, min(args.sample, len(answered)))
    with LocalStack(model_dir, mode="colocated", kv_cache_mb=args.kv_cache_mb, worker_args=["--no-prefix-caching"],
                    log_dir=stack.log_dir / "recompute") as reference:
        differ = asyncio.run(recompute_check(reference.url, sample, args.client_timeout_s))
    summary = figures(outcomes, differ, len(sample), chaos, watch, stack, args, keys)
    print_summary(summary)
    info = machine()
    print(f"machine: {info} (shared with other work: timings are noisy)")
    print(f"wrote {write_json(args.out, {'machine': info, 'summary': summary})}")


def print_summary(summary: dict) -> None:
    lines = [("turns", summary["turns"]), ("answered first try", summary["answered_first_try"]),
             ("answered on retry", summary["answered_on_retry"]), ("lost (target 0)", summary["lost"]),
             ("failures by kind", summary["failures_by_kind"]), ("hangs (target 0)", summary["hangs"]),
             ("connection failures, no router killed", summary["connection_failures_no_router_kill_explains"]),
             ("recompute equal", f"{summary['recompute_equal']} of {summary['recompute_sample']}"),
             ("RSS no growth, last half", summary["rss_no_growth"]),
             ("retained KV peak MiB per decode", {k: round(v, 1) for k, v in summary["retained_kv_peak_mib"].items()}),
             ("retained within budget", summary["retained_within_budget"]),
             ("Redis keys peak / bound", f"{summary['redis_keys_peak']} / {summary['redis_keys_bound']}"),
             ("faults fired", len(summary["chaos"])), ("restarts by the supervisor", len(summary["restarts"])),
             ("reuse outcomes", summary["reuse_outcomes"])]
    for name, value in lines:
        print(f"{name:>34}: {value}")
    for name, verdict in summary["rss"].items():
        print(f"{'RSS ' + name:>34}: {verdict}")


if __name__ == "__main__":
    main()
