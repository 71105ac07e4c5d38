"""A chat history of N messages without a conversation id, at the router: how long until its answer, and how
long /health takes while that request is in flight (history hashing must be linear and off the event loop).

    python benchmarks/router_history.py [--messages 1000,10000,50000] [--out results/router_history.json]

Prints a table and writes JSON with the machine it ran on.
"""
import argparse
import statistics
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvturn.bench.machine import machine, write_json
from kvturn.launch import LocalStack
from kvturn.model.make_model import default_model_dir


def measure(url: str, num_messages: int) -> dict:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(num_messages)]
    result = {}

    def send():
        started = time.perf_counter()
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                              timeout=120)
        result.update(status=response.status_code, answer_s=time.perf_counter() - started)

    sender = threading.Thread(target=send)
    sender.start()
    health_ms = []
    while sender.is_alive():
        started = time.perf_counter()
        httpx.get(f"{url}/health", timeout=30)
        health_ms.append((time.perf_counter() - started) * 1e3)
        time.sleep(0.02)
    sender.join()
    return {"messages": num_messages, **result, "health_p50_ms": statistics.median(health_ms) if health_ms else None,
            "health_max_ms": max(health_ms, default=None), "health_probes": len(health_ms)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", default="1000,10000,50000")
    parser.add_argument("--out", default="results/router_history.json")
    args = parser.parse_args()
    with LocalStack(default_model_dir("tiny"), kv_cache_mb=32) as stack:
        rows = [measure(stack.url, int(n)) for n in args.messages.split(",")]
    table = Table(title="a long history without conversation id, at the router")
    for column in ("messages", "status", "answer s", "/health p50 ms", "/health max ms", "probes"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["messages"]), str(row["status"]), f"{row['answer_s']:.2f}",
                      f"{row['health_p50_ms'] or 0:.1f}", f"{row['health_max_ms'] or 0:.1f}", str(row["health_probes"]))
    Console().print(table)
    info = machine()
    Console().print(f"machine: {info['cpu']}, {info['cores']} cores")
    print(write_json(Path(args.out), {"machine": info, "rows": rows}))


if __name__ == "__main__":
    main()
