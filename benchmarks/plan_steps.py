"""What the workers' steps in service say against a calibration, for the misses `plan_accuracy.py` leaves: figures
the README's accuracy section quotes, from the runs plan_accuracy keeps (OUT/calibration/run-K, OUT/measured-*).

- P's prompt steps started back to back (under GAP_MS after P's previous step) or after a gap, over the fit of
  the calibration runs pooled: in the calibration runs and in the measured ones.
- D's prompt steps on the compute-on-D path (each over the fit with the decodes beside it), per measured run.
- D's own wait in the calibration's compute-on-D requests (D's first token less its read and compute).

    python benchmarks/plan_steps.py results/pa6
    python benchmarks/plan_steps.py results/pa46 --calibration results/pa46
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import plan_accuracy  # noqa: E402  (a sibling script: the same OUT layout)

from kvturn.plan import step_samples  # noqa: E402
from kvturn.plan.calibration import Calibration, load_many  # noqa: E402
from kvturn.plan.rows import rows_of  # noqa: E402

GAP_MS = 2.0


def runs(out: Path, pattern: str) -> list[tuple[str, dict]]:
    """(the run's folder under `out`, its results) of each run matching `pattern`."""
    return [(str(path.parent.relative_to(out)), json.loads(path.read_text())) for path in sorted(out.glob(pattern))]


def ratio(cost_model: Calibration, kind: str, step: step_samples.Step) -> float:
    return step.ms / (cost_model.step_prefill_ms(list(step.prompts), kind) + cost_model.decodes_beside_prompts_ms(
        kind, step.decodes, step.decode_context, step.decode_longest))


def p_steps_by_gap(cost_model: Calibration, results: list[dict]) -> dict[str, list[float]]:
    by_gap: dict[str, list[float]] = {"back to back": [], "after a gap": []}
    for run in results:
        for leg in run["legs"].values():
            previous_end = None
            for step in step_samples.leg_steps(leg).get("prefill", []):
                back_to_back = previous_end is not None and (step.start_s - previous_end) * 1e3 < GAP_MS
                previous_end = step.interval[1]
                if step.prompts:
                    by_gap["back to back" if back_to_back else "after a gap"].append(ratio(cost_model, "prefill", step))
    return by_gap


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({len(values)} steps)" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a plan_accuracy OUT folder with measured runs")
    parser.add_argument("--calibration", type=Path, help="the OUT folder whose calibration runs to pool (default: out)")
    args = parser.parse_args()
    folder = plan_accuracy.CALIBRATION_FOLDER
    calibration_runs = runs(args.calibration or args.out, f"{folder}/run-*/results.json")
    if not calibration_runs:
        raise SystemExit(f"no calibration runs in {(args.calibration or args.out) / folder}")
    calibration_dir = args.calibration or args.out
    cost_model = load_many([calibration_dir / run / "results.json" for run, _ in calibration_runs])
    measured = runs(args.out, "measured-*/*/run-*/results.json")
    print(f"P's prompt steps over the fit of {len(calibration_runs)} calibration runs (gap under {GAP_MS:g} ms: back "
          "to back):")
    for name, results in (("calibration", [r for _, r in calibration_runs]), ("measured", [r for _, r in measured])):
        print(f"  {name}: " + ", ".join(f"{gap} {median(v)}" for gap, v in p_steps_by_gap(cost_model, results).items()))
    print("D's prompt steps on the compute-on-D path over the fit with the decodes beside them, per run:")
    for name, run in measured + calibration_runs:
        leg = run["legs"].get("compute-on-D")
        if leg is not None:
            steps = [s for s in step_samples.leg_steps(leg).get("decode", []) if s.prompts]
            print(f"  {name}: {median([ratio(cost_model, 'decode', s) for s in steps])}")
    waits = [row.decode_wait_ms for _, run in calibration_runs for row in rows_of(run)
             if row.leg == "compute-on-D" and row.decode_compute_ms]
    print(f"D's own wait in the calibration's compute-on-D requests: median {statistics.median(waits):.1f} ms "
          f"({len(waits)} requests)" if waits else "no compute-on-D requests in the calibration runs")


if __name__ == "__main__":
    main()
