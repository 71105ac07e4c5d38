"""A prefill worker killed under agent sessions on `kvturn serve`: which turns are lost, and how late the others are.

    python benchmarks/restart_turns.py [--sessions 4] [--think-s 3] [--kill-at-s 20] [--after-kill-s 60]

Starts `kvturn serve --no-prefix-caching-on-prefill` (so every later turn moves KV back from decode), runs the
sessions (each turn waits --think-s after the last answer), kills -9 the prefill worker once, and keeps going for
--after-kill-s. A session retries a failed turn with backoff (1, 2, 4, ... s) for up to --give-up-s, as an agent
would, and a turn still failing then is lost. Prints each session's turns around the kill and writes
results/restart-turns.json. serve's supervisor restarts the worker; the router holds the turns that find no
prefill worker for its --no-worker-wait-s and runs them once the worker answers its health probe again.
"""
import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvturn.bench import workload
from kvturn.bench.client import RequestRecord, model_name, one_turn
from kvturn.bench.machine import machine, write_json
from kvturn.launch import free_port, stop
from kvturn.model.make_model import default_model_dir
from kvturn.model.tokenizer import ChatTokenizer


def prefill_pid(serve_pid: int) -> int | None:
    """serve's prefill worker (None between its death and its restart)."""
    for task in os.listdir(f"/proc/{serve_pid}/task"):
        for child in Path(f"/proc/{serve_pid}/task/{task}/children").read_text().split():
            try:
                if b"--role\0prefill" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
            except OSError:
                continue
    return None


async def session(client, url: str, model: str, conv, args, started: float, turns: list[dict]) -> None:
    messages = [{"role": "system", "content": conv.system}]
    for number, turn in enumerate(conv.turns):
        if time.monotonic() - started > args.kill_at_s + args.after_kill_s:
            return
        messages.append({"role": "user", "content": turn.user})
        sent, attempts, backoff_s, answer = time.monotonic(), 0, 1.0, None
        while answer is None:
            attempts += 1
            record = RequestRecord(conv.conversation_id, 0, number, len(messages), 0.0, False)
            try:
                answer = await one_turn(client, url, model, messages, record, turn.answer_tokens, ignore_eos=True)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:160]
                if time.monotonic() - sent + backoff_s > args.give_up_s:
                    break
                await asyncio.sleep(backoff_s)
                backoff_s *= 2
        turns.append({"session": conv.conversation_id, "turn": number, "sent_s": round(sent - started, 1),
                      "latency_s": round(time.monotonic() - sent, 1), "attempts": attempts,
                      "lost": answer is None, "reuse": record.reuse if answer is not None else None,
                      "error": error if answer is None else None})
        if answer is None:
            return
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(args.think_s)


async def answers(client, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health", timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


async def run(args, url: str, serve_pid: int, conversations) -> tuple[list[dict], dict]:
    turns: list[dict] = []
    kill: dict = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        model = await model_name(client, url)
        started = time.monotonic()

        async def killer():
            await asyncio.sleep(args.kill_at_s)
            pid = prefill_pid(serve_pid)
            os.kill(pid, signal.SIGKILL)
            kill.update(pid=pid, at_s=round(time.monotonic() - started, 1))
            prefill_url = (await client.get(f"{url}/health")).json()["prefill"][0]
            while prefill_pid(serve_pid) in (None, pid) or not await answers(client, prefill_url):
                await asyncio.sleep(0.25)
            kill["prefill_back_after_s"] = round(time.monotonic() - started - kill["at_s"], 1)

        await asyncio.gather(killer(), *(session(client, url, model, conv, args, started, turns)
                                          for conv in conversations))
    return turns, kill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--think-s", type=float, default=3.0)
    parser.add_argument("--kill-at-s", type=float, default=20.0)
    parser.add_argument("--after-kill-s", type=float, default=60.0)
    parser.add_argument("--give-up-s", type=float, default=90.0, help="a session's retries of one turn stop here")
    parser.add_argument("--serve-arg", action="append", default=[], help="more arguments for kvturn serve")
    parser.add_argument("--out", default="results/restart-turns.json")
    args = parser.parse_args()
    model_dir = default_model_dir("tiny")
    spec = workload.SyntheticSpec(num_sessions=args.sessions, system_tokens=1000, num_turns=200, new_tokens=150,
                                  answer_tokens=32)
    conversations = workload.synthetic(spec, workload.TextSource(ChatTokenizer(model_dir)), 0, "restart")
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "kvturn.cli", "serve", "--port", str(port),
                              "--no-prefix-caching-on-prefill", "--model", str(model_dir), *args.serve_arg],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        for line in serve.stdout:
            output.append(line)
            if "kvturn serving on" in line:
                break
        else:
            raise RuntimeError("serve exited: " + "".join(output))
        turns, kill = asyncio.run(run(args, f"http://127.0.0.1:{port}", serve.pid, conversations))
    finally:
        stop(serve, timeout_s=60)
    log_dir = re.search(r"logs in (\S+)", "".join(output)).group(1)
    back_s = kill["at_s"] + kill.get("prefill_back_after_s", float("inf"))
    around = [t for t in turns if t["sent_s"] <= back_s and t["sent_s"] + t["latency_s"] >= kill["at_s"]]
    summary = {"sessions": args.sessions, "think_s": args.think_s, "kill": kill, "turns": len(turns),
               "lost": sum(t["lost"] for t in turns), "retried": sum(t["attempts"] > 1 for t in turns),
               "turns_while_prefill_was_down": around,
               "longest_turn_s": max((t["latency_s"] for t in turns), default=None), "log_dir": log_dir}
    for key in ("kill", "turns", "lost", "retried", "longest_turn_s", "log_dir"):
        print(f"{key:>16}: {summary[key]}")
    for turn in around:
        print(f"  while prefill was down: {turn}")
    info = machine()
    print(f"machine: {info} (shared with other work: timings are noisy)")
    print(f"wrote {write_json(args.out, {'machine': info, 'summary': summary, 'turns': turns})}")


if __name__ == "__main__":
    main()
