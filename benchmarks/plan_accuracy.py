"""How close `kvturn plan` comes to what `kvturn bench --compare` measures on this machine.

A round is one short calibration run (benchmarks/plan_calibration.json, 8 sessions four at a time, seed 1), then for
each workload (the demo sweep, agent-loop, concurrent) a measured run of every leg. The plan of each workload is
calibrated from the calibration runs only (all rounds' pooled); it is compared with the median of the rounds'
measurements, TTFT p50 and peak retained KV per leg, and the table is printed and written to OUT/accuracy.md and
OUT/accuracy.json. With several rounds, each round's own calibration against that round's runs alone is counted too.

Why rounds: on this shared 2-core machine one bench run of a leg differs from the next by up to a quarter, and the
same prompt computed in two calibration legs minutes apart by up to a third: as much as the tolerance. `--repeats N`
makes N rounds, each every workload and leg once, so that a slow spell of the machine falls on all legs alike. Each
round starts its workloads one further along (sweep, agent-loop, concurrent; then agent-loop, concurrent, sweep; ...):
the machine's speed drifts within a round as well (on 2026-12-02, against the calibration run that opened a round,
the decode steps of its first workload ran 1.03-1.15x the fit and those of its last, 10 minutes later, 1.15-1.32x),
and a workload always measured last would always meet the machine furthest from its calibration.

The column "prompt steps / fit" is the median, over a leg's runs, of the median of its prompt steps in service
(P's, or the colocated worker's) over what the calibration fit puts them at, with the decodes beside them, shape
for shape: how fast the machine ran during those runs against the calibration runs. A prediction that misses by as much
as that ratio is off by the machine's drift, not by the simulation.

The bench runs every process on this machine. By default they share its cores; with --pin-workers every bench run
pins P and D to cores of their own, as on machines of their own, but they still share the caches, the memory and the
router's and client's processes. The plan models one host (`kvturn plan --one-host`) either way: the slowdown of one
role while the other computes is what the calibration runs measured, pinned or not.

With --from-workers the same measured runs are also planned from a calibration read off running workers by URL,
as `kvturn plan --calibration http://P --calibration http://D` reads them with no bench run: a stack of the
adaptive leg serves the calibration workload (four sessions at a time) through its router, then its P and D are
read and fitted (OUT/workers/calibration.json; made once, even with --plan-only, and kept). No worker measures the
time outside compute, so that plan leaves it out, as its verdict says.

Each leg is measured by its own `kvturn bench --compare --legs LEG` (OUT/measured-WORKLOAD/LEG/run-K/results.json;
calibrations in OUT/calibration/run-K), so the runs can be made a few at a time, each short, and a run already there
is kept with --reuse-measured:

    python benchmarks/plan_accuracy.py                   # one round, ~16 min on 2 cores
    python benchmarks/plan_accuracy.py --measure-only --workloads sweep --legs colocated,pd/P-cache-on
    python benchmarks/plan_accuracy.py --reuse-measured  # plan again, measuring only the runs OUT lacks
    python benchmarks/plan_accuracy.py --plan-only --repeats 3  # plan again against the runs in OUT, measuring none
    python benchmarks/plan_accuracy.py --pin-workers --repeats 3 --out results/plan-accuracy-pinned
    python benchmarks/plan_accuracy.py --pin-workers --repeats 3 --from-workers --out results/plan-accuracy-pinned

With --compare-calibration WORKLOAD every round also calibrates on another workload (OUT/calibration-alt; the two
take turns going first), and the same measured runs are planned from those calibrations too, side by side: whether
another calibration workload plans better is then measured against one machine's drift, not two. E.g. first prompts
to 14000 tokens instead of 9000 (benchmarks/plan_calibration_long.json), so that D's decodes attend to as many
tokens as agent-loop's do:

    python benchmarks/plan_accuracy.py --pin-workers --repeats 3 \
        --compare-calibration benchmarks/plan_calibration_long.json --out results/plan-accuracy-long
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvturn.bench.compare import leg_stack
from kvturn.cli import resolve_model
from kvturn.config import EngineConfig, default_of
from kvturn.plan import step_samples
from kvturn.plan.calibration import Calibration, load_many

# Turns per session, where the bench's default (4) does not serve: in `concurrent` the eight sessions start together,
# so their first two turns queue and the last two do not, and the TTFT p50 of 4 x 8 turns is the mean of the 16th
# and 17th, one from either side of that gap (the simulation put them at 223 and 384 ms): it tells on which side
# one turn fell, not how fast the turns ran. With 6 turns the p50 of 48 fell at the 75th percentile of the 32 that
# did not queue, still near that gap: three sets of rounds on 2026-12-02 missed on a different reuse leg each (runs of
# one leg 104-176 ms); with 10 turns it falls at the 62nd percentile of 64. The demo sweep
# likewise: where the history is reused, its four sessions' later turns come in four clusters by history length, and
# at 4 turns the p50 of 16 turns is the mean of the two slowest of the third session's three, next to the jump to
# the fourth's (80 and 108 ms in the simulation of colocated); one slow turn of those three moved a run's p50 by a
# quarter (81-126 ms in three runs of 2026-12-02). At 6 turns it is the mean of the middle two of that session's five.
TURNS = {"concurrent": 10, "sweep": 6}
LEGS = ("colocated", "pd/P-cache-on", "pd/P-cache-off", "bidir/P-cache-on", "bidir/P-cache-off", "compute-on-D")
WORKLOADS = ("sweep", "agent-loop", "concurrent")
TOLERANCE = 0.15
CALIBRATION_WORKLOAD = Path(__file__).parent / "plan_calibration.json"
CALIBRATION_SESSIONS = 4
# Under OUT: the calibration runs, and those of --compare-calibration's workload
CALIBRATION_FOLDER, ALT_CALIBRATION_FOLDER = "calibration", "calibration-alt"
QUIET_FILE = Path("/tmp/kvturn-quiet")  # another measurement needs the machine to itself while it exists


def kvturn(*args: str) -> None:
    while QUIET_FILE.exists():
        time.sleep(30)
    subprocess.run([sys.executable, "-m", "kvturn.cli", *args], check=True)


def turns(workload: str) -> list[str]:
    return ["--turns", str(TURNS[workload])] if workload in TURNS else []


def leg_dir(out: Path, workload: str, leg: str, run: int) -> Path:
    measured = f"measured-{workload}" + (f"-{TURNS[workload]}-turns" if workload in TURNS else "")
    return out / measured / leg.replace("/", "_") / f"run-{run}"


def calibration_runs(out: Path, repeats: int, folder: str = CALIBRATION_FOLDER) -> list[Path]:
    """The calibration runs of rounds 1..repeats that are there (a round of an earlier, longer run is not counted)."""
    return [path for run in range(1, repeats + 1)
            if (path := out / folder / f"run-{run}" / "results.json").exists()]


def rotated(items: list[str], by: int) -> list[str]:
    by %= max(len(items), 1)
    return items[by:] + items[:by]


def measure(out: Path, workloads: list[str], legs: list[str], repeats: int, reuse: bool, pin: bool,
            calibrations: dict[str, Path]) -> None:
    """Every round: each calibration workload (into OUT/FOLDER/run-K, taken in turn first), then every leg of every
    workload."""
    pinned = ["--pin-workers"] if pin else []
    for run in range(1, repeats + 1):
        for folder in rotated(list(calibrations), run - 1):
            calibration = out / folder / f"run-{run}"
            if not (reuse and (calibration / "results.json").exists()):
                kvturn("bench", "--compare", "--workload", str(calibrations[folder]), "--sessions",
                       str(CALIBRATION_SESSIONS), "--seed", "1", "--legs", ",".join(LEGS), "--out", str(calibration),
                       *pinned)
        for workload in rotated(workloads, run - 1):
            for leg in legs:
                where = leg_dir(out, workload, leg, run)
                if not (reuse and (where / "results.json").exists()):
                    kvturn("bench", "--compare", "--scenario", workload, *turns(workload), "--legs", leg,
                           "--out", str(where), *pinned)


def calibrate_from_workers(out: Path, pin: bool) -> Path:
    """OUT/workers/calibration.json, the cost model `kvturn plan --calibration URL` reads from running workers: a
    stack of the adaptive leg (P's cache off, so that each of the three paths is taken and D computes prompts too)
    serves the calibration workload through its router, as a cluster serves its users, and its P and D are then read
    by URL and fitted. Made once; kept in OUT."""
    saved = out / "workers" / "calibration.json"
    if saved.exists():
        return saved
    stack = leg_stack(resolve_model(None), "adaptive", out / "workers" / "logs",
                      default_of(EngineConfig, "kv_cache_mb"), pin_workers=pin)
    with stack:
        kvturn("bench", "--url", stack.url, "--workload", str(CALIBRATION_WORKLOAD), "--sessions",
               str(CALIBRATION_SESSIONS), "--seed", "1", "--out", str(out / "workers" / "bench"))
        load_many([stack.urls["prefill"], stack.urls["decode0"]], stack.cluster_secret).save(saved)
    return saved


def predict(out: Path, workloads: list[str], calibrations: list[Path], name: str) -> None:
    """Plan each workload from `calibrations` pooled, into OUT/NAME-WORKLOAD."""
    pooled = [arg for path in calibrations for arg in ("--calibration", str(path))]
    for workload in workloads:
        kvturn("plan", "--scenario", workload, *turns(workload), *pooled, "--legs", ",".join(LEGS), "--one-host",
               "--ttls", "", "--budgets", "", "--out", str(out / f"{name}-{workload}"))


def error(predicted: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1


def measured_runs(out: Path, workload: str, rounds: list[int]) -> dict[str, list[tuple[dict, dict]]]:
    """The bench runs of `rounds` of each leg of `workload`: (summary, the leg's results), by leg name."""
    runs: dict[str, list[tuple[dict, dict]]] = {}
    for leg in LEGS:
        for run in rounds:
            path = leg_dir(out, workload, leg, run) / "results.json"
            if path.exists():
                results = json.loads(path.read_text())
                for summary in results["summaries"]:
                    runs.setdefault(summary["leg"], []).append((summary, results["legs"].get(summary["leg"], {})))
    return runs


def step_speed(cost_model: Calibration, leg: dict) -> float | None:
    """The median of a measured leg's prompt steps (P's, or a colocated worker's) over what the calibration fit
    puts them at (with what the decodes beside them add): how fast this machine ran during the run against the
    calibration runs, shape for shape."""
    steps = step_samples.leg_steps(leg)
    kind = "colocated" if "colocated" in steps else "prefill"
    ratios = [step.ms / (cost_model.step_prefill_ms(list(step.prompts), kind) + cost_model.decodes_beside_prompts_ms(
        kind, step.decodes, step.decode_context, step.decode_longest)) for step in steps.get(kind, []) if step.prompts]
    return statistics.median(ratios) if ratios else None


def entry(predicted: float, measured: list[float]) -> dict:
    """The prediction against the median of the runs, and the runs themselves."""
    median = statistics.median(measured)
    return {"predicted": predicted, "measured": median, "error": error(predicted, median), "runs": measured}


def compare(out: Path, workloads: list[str], name: str, rounds: list[int], cost_model: Calibration) -> list[dict]:
    rows = []
    for workload in workloads:
        measured = measured_runs(out, workload, rounds)
        planned = json.loads((out / f"{name}-{workload}" / "plan.json").read_text())["legs"]
        for leg, prediction in planned.items():
            if leg not in measured:
                continue
            ttft = [summary["ttft_ms"]["p50"] for summary, _ in measured[leg]]
            peak = [summary["peak_retained_kv_bytes"] / 2**20 for summary, _ in measured[leg]]
            speeds = [speed for _, results in measured[leg] if (speed := step_speed(cost_model, results)) is not None]
            rows.append({"workload": workload, "leg": leg, "runs": len(ttft),
                         "ttft_p50_ms": entry(prediction["ttft_p50_ms"], ttft),
                         "peak_retained_mib": entry(prediction["peak_retained_mib"], peak),
                         "prompt_steps_vs_fit": statistics.median(speeds) if speeds else None})
    return rows


def within(rows: list[dict], key: str = "ttft_p50_ms") -> int:
    return sum(abs(r[key]["error"]) <= TOLERANCE for r in rows)


def table(rows: list[dict]) -> str:
    def cell(entry: dict, unit: str) -> str:
        mark = "" if abs(entry["error"]) <= TOLERANCE else " **x**"
        return f"{entry['predicted']:.0f} / {entry['measured']:.0f} {unit} ({entry['error']:+.0%}){mark}"

    def spread(entry: dict) -> str:
        low, high = min(entry["runs"]), max(entry["runs"])
        return f"{low:.0f}-{high:.0f} ms" if len(entry["runs"]) > 1 else "-"
    def speed(ratio: float | None) -> str:
        return "-" if ratio is None else f"{ratio:.2f}"
    lines = ["| workload | leg | TTFT p50 predicted / measured (median of runs) | runs: range | "
             "prompt steps / fit | peak retained predicted / measured |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['leg']} | {cell(r['ttft_p50_ms'], 'ms')} | {r['runs']}: "
              f"{spread(r['ttft_p50_ms'])} | {speed(r.get('prompt_steps_vs_fit'))} | "
              f"{cell(r['peak_retained_mib'], 'MiB')} |" for r in rows]
    lines.append(f"\n{within(rows) + within(rows, 'peak_retained_mib')} of {2 * len(rows)} predictions within "
                 f"{TOLERANCE:.0%}, TTFT p50 on {within(rows)} of {len(rows)} legs (**x**: outside).")
    return "\n".join(lines)


def plan_against(out: Path, workloads: list[str], rounds: list[int], folder: str, name: str) \
        -> tuple[list[dict], dict[int, list[dict]], str]:
    """Plan from the calibrations in OUT/FOLDER pooled against the median of all rounds' runs, and, with several
    rounds, each round's own calibration against that round's runs alone: (pooled rows, rows by round, the table)."""
    calibrations = calibration_runs(out, len(rounds), folder)
    if not calibrations:
        raise SystemExit(f"no calibration run in {out / folder} (run-1 .. run-{len(rounds)})")
    predict(out, workloads, calibrations, name)
    rows = compare(out, workloads, name, rounds, load_many(calibrations))
    text = table(rows)
    by_round = {}
    if len(calibrations) > 1:
        for run in rounds:
            path = out / folder / f"run-{run}" / "results.json"
            if path in calibrations:
                predict(out, workloads, [path], f"{name}-round-{run}")
                by_round[run] = compare(out, workloads, f"{name}-round-{run}", [run], load_many([path]))
        text += ("\nEach round's own calibration against that round's runs alone: TTFT p50 within "
                 f"{TOLERANCE:.0%} on " + ", ".join(f"{within(r)} of {len(r)}" for r in by_round.values()) + " legs.")
    return rows, by_round, text


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
    parser.add_argument("--repeats", type=int, default=1, help="rounds of calibration and measurement; the plan "
                                                               "pools the calibrations and meets the median")
    parser.add_argument("--reuse-measured", action="store_true",
                        help="keep the runs of rounds 1..--repeats already in --out (and plan against them)")
    parser.add_argument("--measure-only", action="store_true", help="measure, then stop before planning")
    parser.add_argument("--plan-only", action="store_true", help="plan against the runs of rounds 1..--repeats "
                                                                  "already in --out, measuring none that is missing")
    parser.add_argument("--pin-workers", action="store_true", help="P and D on cores of their own in every bench run")
    parser.add_argument("--from-workers", action="store_true",
                        help="also plan from a calibration read off running workers by URL (made once in "
                             "OUT/workers) and compare it with the same measured runs")
    parser.add_argument("--compare-calibration", type=Path, metavar="WORKLOAD",
                        help="also calibrate on this workload in every round (OUT/calibration-alt), taking turns "
                             "with the standard one, and plan the same measured runs from it too")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    workloads = names(args.workloads, WORKLOADS)
    if args.plan_only and args.measure_only:
        raise SystemExit("--plan-only and --measure-only exclude each other")
    if not args.plan_only:
        calibrations = {CALIBRATION_FOLDER: CALIBRATION_WORKLOAD}
        if args.compare_calibration:
            calibrations[ALT_CALIBRATION_FOLDER] = args.compare_calibration
        measure(args.out, workloads, names(args.legs, LEGS), args.repeats, args.reuse_measured or args.measure_only,
                args.pin_workers, calibrations)
    if args.measure_only:
        return
    all_rounds = list(range(1, args.repeats + 1))
    rows, rounds, text = plan_against(args.out, workloads, all_rounds, CALIBRATION_FOLDER, "plan")
    if args.compare_calibration:
        other, other_rounds, other_text = plan_against(args.out, workloads, all_rounds, ALT_CALIBRATION_FOLDER, "plan-alt")
        text += (f"\n\nPlanned instead from the calibrations of {args.compare_calibration}, made in the same rounds "
                 f"(OUT/calibration-alt):\n\n" + other_text)
    workers = []
    if args.from_workers:
        saved = calibrate_from_workers(args.out, args.pin_workers)
        predict(args.out, workloads, [saved], "plan-workers")
        workers = compare(args.out, workloads, "plan-workers", all_rounds, load_many([saved]))
        text += ("\n\nPlanned instead from the running workers' URLs (no bench run; no time outside compute):\n\n"
                 + table(workers))
    (args.out / "accuracy.md").write_text(text + "\n")
    alternative = {"pooled": other, "rounds": other_rounds} if args.compare_calibration else None
    (args.out / "accuracy.json").write_text(json.dumps({"pooled": rows, "rounds": rounds, "from_workers": workers,
                                                        "compare_calibration": alternative}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
