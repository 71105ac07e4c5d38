"""Whether one huge prompt stalls everyone else (issue 47): a router + P + D stack of the embedded model (pools of
the default 512 MiB, so the context is 131,072 tokens and a 10 MB prompt passes the characters-per-token guard);
one client sends a prompt of `--prompt-mb` MB of words, while another sends 4-token turns one after another and a
third probes P's /health and the router's list of prefill workers. Before any of it, the same 4-token turns alone
give the baseline.

    python benchmarks/tokenize_stall.py [--prompt-mb 10] [--label NAME] [--out results/tokenize_stall.json]

Prints and writes (JSON, with the machine and commit) the 4-token turns' latency alone and while the huge prompt is
in flight (median, max), P's slowest /health answer meanwhile, whether P left the router's rotation, and what the
huge prompt got back and after how long. Run it on two checkouts (the same command) to compare them.
"""
import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvturn.bench.machine import machine, write_json
from kvturn.launch import LocalStack
from kvturn.model.make_model import default_model_dir

WORDS = ["alpha", "beta", "gamma", "delta", "kvturn", "prefill", "decode", "lease", "tensor", "router"]


def small_turn(url: str, index: int) -> float:
    started = time.perf_counter()
    body = {"prompt": f"Small turn number {index} of the other tenant.", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-mb", type=float, default=10.0)
    parser.add_argument("--baseline-turns", type=int, default=10)
    parser.add_argument("--label", default="", help="what the run measured (e.g. a branch), kept in the JSON")
    parser.add_argument("--out", default="results/tokenize_stall.json")
    args = parser.parse_args()
    rng = random.Random(0)
    size = int(args.prompt_mb * 1e6)
    huge = " ".join(rng.choice(WORDS) for _ in range(size // 5))[:size]
    logs = Path(tempfile.mkdtemp(prefix="tokenize-stall-"))
    with LocalStack(default_model_dir("tiny"), kv_cache_mb=512, log_dir=logs, worker_args=["--no-calibrate"]) as stack:
        url, prefill = stack.url, stack.urls["prefill"]
        small_turn(url, -1)
        baseline = [small_turn(url, i) for i in range(args.baseline_turns)]
        outcome: dict = {}

        def send_huge():
            started = time.perf_counter()
            body = {"prompt": huge, "max_tokens": 4, "temperature": 0}
            try:
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
                outcome["status"] = response.status_code
                outcome["answer"] = response.text[:300]
            except httpx.HTTPError as exc:
                outcome["status"], outcome["answer"] = None, repr(exc)
            outcome["seconds"] = time.perf_counter() - started

        health_s, left_rotation = [], False

        def probe():
            nonlocal left_rotation
            while sender.is_alive():
                started = time.perf_counter()
                try:
                    httpx.get(f"{prefill}/health", timeout=60)
                    health_s.append(time.perf_counter() - started)
                    listed = httpx.get(f"{url}/health", timeout=60)
                    if listed.status_code != 200 or prefill not in listed.json().get("prefill", []):
                        left_rotation = True
                except httpx.HTTPError:
                    left_rotation = True
                time.sleep(0.1)

        sender = threading.Thread(target=send_huge)
        prober = threading.Thread(target=probe)
        sender.start()
        time.sleep(0.5)  # the huge body is in and being tokenized
        prober.start()
        during, index = [], 0
        while sender.is_alive():
            during.append(small_turn(url, index))
            index += 1
        sender.join()
        prober.join()
    result = {
        "machine": machine(), "label": args.label, "prompt_mb": args.prompt_mb,
        "baseline_s": {"median": statistics.median(baseline), "max": max(baseline), "turns": len(baseline)},
        "during_s": {"median": statistics.median(during) if during else None, "max": max(during, default=None),
                     "turns": len(during), "all": during},
        "prefill_health_max_s": max(health_s, default=None), "prefill_left_rotation": left_rotation,
        "huge_prompt": outcome,
    }
    print(f"4-token turn alone: median {result['baseline_s']['median'] * 1e3:.0f} ms, "
          f"max {result['baseline_s']['max'] * 1e3:.0f} ms")
    if during:
        print(f"4-token turn during a {args.prompt_mb:g} MB prompt: median {statistics.median(during) * 1e3:.0f} ms, "
              f"max {max(during) * 1e3:.0f} ms ({len(during)} turns)")
    print(f"P's slowest /health meanwhile: {(result['prefill_health_max_s'] or 0) * 1e3:.0f} ms; "
          f"P left the rotation: {left_rotation}")
    print(f"the huge prompt: {outcome['status']} after {outcome['seconds']:.1f} s: {outcome['answer'][:160]}")
    print(f"JSON: {write_json(args.out, result)}")


if __name__ == "__main__":
    main()
