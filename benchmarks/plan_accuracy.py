"""How close `kvturn plan` comes to what `kvturn bench --compare` measures on this machine.

One short calibration run (benchmarks/plan_calibration.json, 4 sessions two at a time, seed 1), then for each
workload (the demo sweep, agent-loop, concurrent) a measured run of every leg and a plan of the same workload
calibrated from the calibration run only; prints predicted against measured TTFT p50 and peak retained KV per leg
and writes OUT/accuracy.md and OUT/accuracy.json.

By default every process shares the machine's cores and the plan models that (`--one-host`). With --pin-workers
every bench run pins P and D to cores of their own, as on machines of their own, and the plan models separate hosts.

Each leg is measured by its own `kvturn bench --compare --legs LEG` (OUT/measured-WORKLOAD/LEG/results.json), so the
runs can be made a few at a time, each short, and a run already there is kept with --reuse-measured:

    python benchmarks/plan_accuracy.py                   # everything, ~25 min on 2 cores
    python benchmarks/plan_accuracy.py --measure-only --workloads sweep --legs colocated,pd/P-cache-on
    python benchmarks/plan_accuracy.py --reuse-measured  # plan again against the runs already in OUT
    python benchmarks/plan_accuracy.py --pin-workers --out results/plan-accuracy-pinned
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LEGS = ("colocated", "pd/P-cache-on", "pd/P-cache-off", "bidir/P-cache-on", "bidir/P-cache-off", "compute-on-D")
WORKLOADS = ("sweep", "agent-loop", "concurrent")
TOLERANCE = 0.15
QUIET_FILE = Path("/tmp/kvturn-quiet")  # another measurement needs the machine to itself while it exists


def kvturn(*args: str) -> None:
    while QUIET_FILE.exists():
        time.sleep(30)
    subprocess.run([sys.executable, "-m", "kvturn.cli", *args], check=True)


def leg_dir(out: Path, workload: str, leg: str) -> Path:
    return out / f"measured-{workload}" / leg.replace("/", "_")


def measure(out: Path, workloads: list[str], legs: list[str], reuse: bool, pin: bool) -> None:
    calibration = out / "calibration"
    pinned = ["--pin-workers"] if pin else []
    if not (reuse and (calibration / "results.json").exists()):
        kvturn("bench", "--compare", "--workload", "benchmarks/plan_calibration.json", "--sessions", "2", "--seed", "1",
               "--legs", ",".join(LEGS), "--out", str(calibration), *pinned)
    for workload in workloads:
        for leg in legs:
            where = leg_dir(out, workload, leg)
            if not (reuse and (where / "results.json").exists()):
                kvturn("bench", "--compare", "--scenario", workload, "--legs", leg, "--out", str(where), *pinned)


def predict(out: Path, workloads: list[str], pin: bool) -> None:
    for workload in workloads:
        kvturn("plan", "--scenario", workload, "--calibration", str(out / "calibration" / "results.json"),
               "--legs", ",".join(LEGS), *([] if pin else ["--one-host"]), "--ttls", "", "--budgets", "",
               "--out", str(out / f"plan-{workload}"))


def error(predicted: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1


def measured_summaries(out: Path, workload: str) -> dict[str, dict]:
    summaries = {}
    for path in sorted((out / f"measured-{workload}").glob("*/results.json")):
        summaries.update({s["leg"]: s for s in json.loads(path.read_text())["summaries"]})
    return summaries


def compare(out: Path, workloads: list[str]) -> list[dict]:
    rows = []
    for workload in workloads:
        measured = measured_summaries(out, workload)
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
    ttft = sum(abs(r["ttft_p50_ms"]["error"]) <= TOLERANCE for r in rows)
    lines.append(f"\n{within} of {2 * len(rows)} predictions within {TOLERANCE:.0%}, TTFT p50 on {ttft} of "
                 f"{len(rows)} legs (**x**: outside).")
    return "\n".join(lines)


def names(text: str, known: tuple[str, ...]) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"unknown {unknown}; choose from {', '.join(known)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/plan-accuracy"))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--legs", default=",".join(LEGS), help="legs to measure in this run")
    parser.add_argument("--reuse-measured", action="store_true", help="keep bench runs already in --out")
    parser.add_argument("--measure-only", action="store_true", help="measure, then stop before planning")
    parser.add_argument("--pin-workers", action="store_true",
                        help="P and D on cores of their own in every bench run; the plan models separate hosts")
    args = parser.parse_args()
    workloads = names(args.workloads, WORKLOADS)
    measure(args.out, workloads, names(args.legs, LEGS), args.reuse_measured or args.measure_only, args.pin_workers)
    if args.measure_only:
        return
    predict(args.out, workloads, args.pin_workers)
    rows = compare(args.out, workloads)
    text = table(rows)
    (args.out / "accuracy.md").write_text(text + "\n")
    (args.out / "accuracy.json").write_text(json.dumps(rows, indent=2))
    print(text)


if __name__ == "__main__":
    main()
