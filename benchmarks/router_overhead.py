"""The router's own work per turn in front of vLLM workers (issue 10: at most 2 ms p50 at 8k-token prompts), without
vLLM: `kvturn router --backend vllm` fronts two fake vLLM workers (tests/fake_vllm.py, real HTTP servers in vLLM's
shapes that answer at once), and multi-turn conversations with ~8k-token prompts go through it, streamed and not.

    python benchmarks/router_overhead.py [--conversations 6] [--turns 6] [--prompt-tokens 8192]
                                         [--backend vllm|kvturn] [--out results/router_overhead.json]

Per turn it reads the router's own account of its work (the growth of `kvturn_router_own_work_seconds_sum` and
`..._cpu_seconds_sum` over the turn; turns run one at a time, so each growth is one turn's), the CPU time of the
router's whole process over the turn (Linux schedstat: the HTTP server and client as well, which the work clock counts
as waiting), and the turn's latency at the client. Prints a table of p50/p99 per mode and writes JSON with every turn
and the machine it ran on. With `--backend kvturn` the router fronts kvturn's own workers (the tiny model, a real
stack: they compute, so the client's latency is theirs): the work clock reports vLLM turns only, so the router's
process CPU per turn is the measure there.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvturn import launch
from kvturn.launch import LocalStack
from kvturn.bench.machine import machine, write_json
from kvturn.bench.workload import TextSource
from kvturn.model.make_model import default_model_dir
from kvturn.model.tokenizer import ChatTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from chat import metric, send  # noqa: E402
from fake_vllm import FakeVLLM  # noqa: E402

OWN_WALL = "kvturn_router_own_work_seconds_sum"
OWN_CPU = "kvturn_router_own_work_cpu_seconds_sum"
USER_TOKENS = 64
ANSWER_TOKENS = 32
WARMUP_TURNS = 3
FIRST_TURN = ("no_params", "None")  # a conversation's first turn has no lease to reuse (vLLM, kvturn workers)


def conversations(source: TextSource, count: int, turns: int, prompt_tokens: int, seed: int) -> list[dict]:
    """Conversations whose prompts grow through `prompt_tokens` (half the turns below it, half above)."""
    rng = np.random.default_rng(seed)
    system_tokens = prompt_tokens - turns * (USER_TOKENS + ANSWER_TOKENS) // 2
    return [{"system": source.text(rng, system_tokens), "users": [source.text(rng, USER_TOKENS) for _ in range(turns)]}
            for _ in range(count)]


def process_cpu_s(pid: int) -> float:
    """CPU time of all the threads of a process so far, in ns resolution (/proc/PID/task/*/schedstat)."""
    return sum(int(stat.read_text().split()[0]) for stat in Path(f"/proc/{pid}/task").glob("*/schedstat")) / 1e9


def run_conversation(url: str, router_pid: int, conversation: dict, conversation_id: str, stream: bool) -> list[dict]:
    messages, records = [{"role": "system", "content": conversation["system"]}], []
    for user in conversation["users"]:
        messages.append({"role": "user", "content": user})
        wall_before, cpu_before = metric(url, OWN_WALL), metric(url, OWN_CPU)
        process_before, started = process_cpu_s(router_pid), time.perf_counter()
        result = send(url, messages, conversation_id, stream, max_tokens=ANSWER_TOKENS)
        latency_ms = (time.perf_counter() - started) * 1e3
        process_ms = (process_cpu_s(router_pid) - process_before) * 1e3
        kvturn, vllm = result["kvturn"], result["kvturn"].get("backend") == "vllm"
        prompt_tokens = kvturn.get("prompt_tokens") or (result["usage"] or {}).get("prompt_tokens") or 0
        records.append({"stream": stream, "prompt_tokens": prompt_tokens,
                        "reuse": str(kvturn["reuse"]), "tokens_passed": kvturn.get("tokens_passed"),
                        "own_wall_ms": (metric(url, OWN_WALL) - wall_before) * 1e3 if vllm else None,
                        "own_cpu_ms": (metric(url, OWN_CPU) - cpu_before) * 1e3 if vllm else None,
                        "process_cpu_ms": process_ms, "client_ms": latency_ms})
        messages.append({"role": "assistant", "content": result["text"]})
    return records


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summary(records: list[dict]) -> dict:
    row = {"turns": len(records), "prompt_tokens_min": min(r["prompt_tokens"] for r in records),
           "prompt_tokens_max": max(r["prompt_tokens"] for r in records),
           "reuse": {o: sum(r["reuse"] == o for r in records) for o in sorted({r["reuse"] for r in records})}}
    for key in ("own_wall_ms", "own_cpu_ms", "process_cpu_ms", "client_ms"):
        values = [r[key] for r in records if r[key] is not None]
        row[key] = {"p50": statistics.median(values), "p99": percentile(values, 99), "max": max(values)} \
            if values else None
    return row


def measure_turns(args, source: TextSource, url: str, router_pid: int) -> dict:
    warmup = conversations(source, 1, WARMUP_TURNS, args.prompt_tokens, args.seed + 1)[0]
    for stream in (False, True):
        run_conversation(url, router_pid, warmup, f"warmup-{stream}", stream)
    rows, records = {}, []
    for stream in (False, True):
        mode = "streamed" if stream else "not streamed"
        mode_records = []
        for i, conversation in enumerate(conversations(source, args.conversations, args.turns, args.prompt_tokens,
                                                       args.seed)):
            mode_records += run_conversation(url, router_pid, conversation, f"{mode}-{i}", stream)
        rows[mode] = summary(mode_records)
        rows[mode + ", later turns"] = summary([r for r in mode_records if r["reuse"] not in FIRST_TURN])
        records += mode_records
    rows["all"] = summary(records)
    return {"rows": rows, "records": records}


def measure(args, workdir: Path) -> dict:
    model_dir = default_model_dir("tiny")
    source = TextSource(ChatTokenizer(model_dir))
    if args.backend == "kvturn":
        with LocalStack(model_dir, log_dir=workdir) as stack:
            return measure_turns(args, source, stack.url, stack.processes["router"].pid)
    prefill, decode = (FakeVLLM(launch.free_port(), workdir, model_dir) for _ in range(2))
    port = launch.free_port()
    router = launch.start(["router", "--backend", "vllm", "--prefill", prefill.url, "--decode", decode.url,
                           "--port", str(port)], workdir / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        prefill.wait_listening()
        decode.wait_listening()
        launch.wait_healthy(url, router)
        return measure_turns(args, source, url, router.pid)
    finally:
        launch.stop(router)
        prefill.stop()
        decode.stop()


def cell(row: dict, key: str) -> str:
    return f"{row[key]['p50']:.2f} / {row[key]['p99']:.2f}" if row[key] else "-"


def print_table(rows: dict, info: dict, backend: str) -> None:
    title = "vLLM backend, fake workers that answer at once" if backend == "vllm" else \
        "kvturn workers (tiny model), router process CPU"
    table = Table(title=f"kvturn router's own work per turn, {title}")
    for column in ("turns", "n", "prompt tokens", "own work wall p50 / p99 ms", "own work CPU p50 / p99 ms",
                   "process CPU p50 / p99 ms", "client p50 ms", "reuse"):
        table.add_column(column, justify="right")
    for mode, row in rows.items():
        table.add_row(mode, str(row["turns"]), f"{row['prompt_tokens_min']}-{row['prompt_tokens_max']}",
                      *(cell(row, k) for k in ("own_wall_ms", "own_cpu_ms", "process_cpu_ms")),
                      f"{row['client_ms']['p50']:.1f}", " ".join(f"{k}={v}" for k, v in row["reuse"].items()))
    console = Console(width=200)
    console.print(table)
    console.print(f"machine: {info['cpu']}, {info['cores']} cores, load average before {info['load_before']}")
    if backend == "kvturn":
        console.print("own work: the work clock reports vLLM turns only; process CPU is the router's whole process")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("vllm", "kvturn"), default="vllm",
                        help="fake vLLM workers, or kvturn's own (tiny model)")
    parser.add_argument("--out", default="results/router_overhead.json")
    args = parser.parse_args()
    info = machine() | {"load_before": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(args, Path(workdir))
    info["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_table(result["rows"], info, args.backend)
    print(write_json(Path(args.out), {"machine": info, "args": vars(args), **result}))


if __name__ == "__main__":
    main()
