"""How close `kvturn plan` comes to what `kvturn bench --compare` measures on this machine.

One short calibration run (benchmarks/plan_calibration.json, 4 sessions two at a time, seed 1), then for each
workload (the demo sweep, agent-loop, concurrent) a measured run of every leg and a plan of the same workload
calibrated from the calibration run only; prints predicted against measured TTFT p50 and peak retained KV per leg
and writes OUT/accuracy.md and OUT/accuracy.json.

    python benchmarks/plan_accuracy.py                   # ~25 min on 2 cores
    python benchmarks/plan_accuracy.py --reuse-measured  # plan again against the runs already in OUT
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LEGS = "colocated,pd/P-cache-on,pd/P-cache-off,bidir/P-cache-on,bidir/P-cache-off,compute-on-D"
WORKLOADS = ("sweep", "agent-loop", "concurrent")
TOLERANCE = 0.15
QUIET_FILE = Path("/tmp/kvturn-quiet")  # another measurement needs the machine to itself while it exists


def kvturn(*args: str) -> None:
    while QUIET_FILE.exists():
        time.sleep(30)
    subprocess.run([sys.executable, "-m", "kvturn.cli", *args], check=True)


def measure(out: Path, reuse: bool) -> None:
    runs = [("calibration", ["--workload", "benchmarks/plan_calibration.json", "--sessions", "2", "--seed", "1"])]
    runs += [(f"measured-{w}", ["--scenario", w]) for w in WORKLOADS]
    for name, args in runs:
        if not (reuse and (out / name / "results.json").exists()):
            kvturn("bench", "--compare", *args, "--legs", LEGS, "--out", str(out / name))


def predict(out: Path) -> None:
    for workload in WORKLOADS:
        kvturn("plan", "--scenario", workload, "--calibration", str(out / "calibration" / "results.json"),
               "--legs", LEGS, "--one-host", "--ttls", "", "--budgets", "", "--out", str(out / f"plan-{workload}"))


def error(predicted: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1


def compare(out: Path) -> list[dict]:
    rows = []
    for workload in WORKLOADS:
        measured = {s["leg"]: s for s in json.loads((out / f"measured-{workload}" / "results.json").read_text())
                    ["summaries"]}
        planned = json.loads((out / f"plan-{workload}" / "plan.json").read_text())["legs"]
        for leg, prediction in planned.items():
            if leg not in measured:
                continue
            ttft, peak = measured[leg]["ttft_ms"]["p50"], measured[leg]["peak_retained_kv_bytes"] / 2**20
            rows.append({"workload": workload, "leg": leg,
                         "ttft_p50_ms": {"predicted": prediction["ttft_p50_ms"], "measured": ttft,
                                         "error": error(prediction["ttft_p50_ms"], ttft)},
                         "peak_retained_mib": {"predicted": prediction["peak_retained_mib"], "measured": peak,
                                               "error": error(prediction["peak_retained_mib"], peak)}})
    return rows


def table(rows: list[dict]) -> str:
    def cell(entry: dict, unit: str) -> str:
        mark = "" if abs(entry["error"]) <= TOLERANCE else " **x**"
        return f"{entry['predicted']:.0f} / {entry['measured']:.0f} {unit} ({entry['error']:+.0%}){mark}"
    lines = ["| workload | leg | TTFT p50 predicted / measured | peak retained predicted / measured |",
             "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['leg']} | {cell(r['ttft_p50_ms'], 'ms')} | {cell(r['peak_retained_mib'], 'MiB')} |"
              for r in rows]
    within = sum(abs(r[k]["error"]) <= TOLERANCE for r in rows for k in ("ttft_p50_ms", "peak_retained_mib"))
    lines.append(f"\n{within} of {2 * len(rows)} predictions within {TOLERANCE:.0%} (**x**: outside).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/plan-accuracy"))
    parser.add_argument("--reuse-measured", action="store_true", help="keep bench runs already in --out")
    args = parser.parse_args()
    measure(args.out, args.reuse_measured)
    predict(args.out)
    rows = compare(args.out)
    text = table(rows)
    (args.out / "accuracy.md").write_text(text + "\n")
    (args.out / "accuracy.json").write_text(json.dumps(rows, indent=2))
    print(text)


if __name__ == "__main__":
    main()
