"""`kvturn plan` at a scale this machine cannot serve: 10,000 agent sessions x 20 turns over 64 prefill and 64 decode
workers, timed end to end (reading the trace, simulating, writing plan.json).

The trace is seeded: sessions start uniformly over an hour; first prompts 1k-8k tokens; each turn adds its answer
(16-128 tokens) and 50-400 new tokens; think time between turns exponential with a 30 s mean.

    python benchmarks/plan_scale.py --calibration results/plan-accuracy/calibration/run-1/results.json
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def write_trace(path: Path, sessions: int, turns: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    lines = []
    for session in range(sessions):
        clock, prompt = float(rng.uniform(0, 3600)), int(rng.integers(1000, 8000))
        for _ in range(turns):
            output = int(rng.integers(16, 128))
            lines.append(json.dumps({"timestamp": round(clock, 3), "conversation_id": f"conv-{session}",
                                     "prompt_tokens": prompt, "output_tokens": output}))
            clock += float(rng.exponential(30.0))
            prompt += output + int(rng.integers(50, 400))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", type=Path, required=True)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--ttls", default="", help="TTLs to sweep beside 480 s (each one more simulation)")
    parser.add_argument("--out", type=Path, default=Path("results/plan-scale"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / "trace.jsonl"
    requests = write_trace(trace, args.sessions, args.turns, seed=0)
    command = [sys.executable, "-m", "kvturn.cli", "plan", "--workload", str(trace), "--calibration",
               str(args.calibration), "--prefill", "64", "--decode", "64", "--kv-cache-mb", "16384",
               "--legs", "pd/P-cache-on,bidir/P-cache-on", "--ttls", args.ttls, "--host-budgets", "", "--out",
               str(args.out)]
    started = time.perf_counter()
    subprocess.run(command, check=True)
    elapsed = time.perf_counter() - started
    plan = json.loads((args.out / "plan.json").read_text())
    print(f"{requests} requests ({args.sessions} sessions x {args.turns} turns), 64 P + 64 D: kvturn plan took "
          f"{elapsed:.1f} s end to end ({plan['simulated_events']} events in {plan['elapsed_s']:.1f} s of simulation)")


if __name__ == "__main__":
    main()
