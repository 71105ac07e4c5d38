"""Where a plan of benchmarks/plan_accuracy.py meets or misses what the bench measured, turn by turn: the figures
behind the README's account of the misses, from an accuracy run's OUT (its calibration runs and measured legs),
measuring nothing.

- Time outside compute by load: in the calibration runs, each leg's requests by how many others of the leg were
  in flight when they arrived, the median of each load, and the line the plan fitted through them.
- For each workload and leg: TTFT p50 of each measured run beside the p50 of each simulation the plan takes the
  median of (its draws of the steps' scatter); then by turn index, the median TTFT measured and simulated, the
  prompt tokens the bench sent (usage.prompt_tokens, mean) and those the plan simulates, and the median time outside
  compute measured; and how fast the leg's prompt steps and decode-only steps ran against the calibration's fits
  (the decode steps within the most tokens the calibration's steps attended to, and beyond, where the fit is
  extrapolated).

    python benchmarks/plan_details.py --out results/plan-accuracy --repeats 3
    python benchmarks/plan_details.py --out results/plan-accuracy --workloads concurrent --legs pd/P-cache-on
    python benchmarks/plan_details.py --out results/plan-accuracy-long --repeats 3 --calibration-alt
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import plan_accuracy  # noqa: E402  (a sibling script: the same OUT layout and turn counts)

from kvturn.bench.catalog import LEGS, SCENARIOS  # noqa: E402
from kvturn.cli import resolve_model  # noqa: E402
from kvturn.plan import fit, predict, step_samples, trace  # noqa: E402
from kvturn.plan.calibration import Calibration, load_many  # noqa: E402
from kvturn.plan.rows import rows_of  # noqa: E402
from kvturn.plan.sim import Deployment, Simulation  # noqa: E402
from kvturn.plan.trace import from_scenario  # noqa: E402


def median_cell(values: list[float]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def other_by_load(calibrations: list[Path], cost_model: Calibration) -> str:
    """Each calibration leg's time outside compute by the requests in flight at arrival, all runs pooled."""
    loads: dict[str, dict[int, list[float]]] = {}
    for path in calibrations:
        for leg, samples in fit.other_samples(fit.rows_by_leg(rows_of(json.loads(path.read_text())))).items():
            for load, ms in samples:
                loads.setdefault(leg, {}).setdefault(load, []).append(ms)
    most = max((n for by_load in loads.values() for n in by_load), default=0)
    lines = ["Time outside compute (ms) by other requests in flight at arrival, calibration runs "
             f"(median, requests); fit: alone + per request, up to {cost_model.other_load_seen:.0f}",
             "| leg | " + " | ".join(f"load {n}" for n in range(most + 1)) + " | fit |",
             "|---|" + "---|" * (most + 2)]
    for leg, by_load in loads.items():
        cells = [f"{median_cell(by_load[n])} ({len(by_load[n])})" if n in by_load else "-" for n in range(most + 1)]
        fitted = f"{cost_model.other_ms.get(leg, 0):.1f} + {cost_model.other_ms_per_request.get(leg, 0):.1f}/req"
        lines.append(f"| {leg} | " + " | ".join(cells) + f" | {fitted} |")
    return "\n".join(lines)


def decode_speed(cost_model: Calibration, leg: dict) -> tuple[float | None, float | None]:
    """The median of a measured leg's decode-only steps (D's, or a colocated worker's) over the calibration's step
    fit for their batch and context: of those that attended to no more tokens than the calibration's steps did, and
    of those beyond."""
    steps = step_samples.leg_steps(leg)
    kind = "colocated" if "colocated" in steps else "decode"
    most = cost_model.seen.get("decode_attended", float("inf"))
    within, beyond = [], []
    for step in steps.get(kind, []):
        if not step.prompts and step.decodes:
            ratio = step.ms / cost_model.decode_steps_ms(kind, 1, step.decodes, step.decode_context,
                                                         step.decode_longest)
            attended = cost_model.attended(step.decodes, step.decode_context, step.decode_longest)
            (within if attended <= most else beyond).append(ratio)
    return (statistics.median(within) if within else None), (statistics.median(beyond) if beyond else None)


def leg_details(workload, leg: str, cost_model: Calibration, measured: list[tuple[dict, dict]]) -> str:
    deployment = Deployment(one_host=True)
    workload = trace.resend_answers(workload, cost_model.resent_answer_ratio)  # the prompts as simulated
    draws = predict.replications(workload, cost_model)
    sims = [Simulation(workload, LEGS[leg], deployment, cost_model, seed) for seed in range(draws)]
    for sim in sims:
        sim.run()
    simulated_p50 = sorted(float(np.percentile([r.ttft_ms for r in sim.results], 50)) for sim in sims)
    measured_p50 = [summary["ttft_ms"]["p50"] for summary, _ in measured]
    rows = [row for _, results in measured for row in rows_of({"legs": {leg: results}})]
    planned_tokens: dict[int, list[int]] = {}
    for session in workload.sessions:
        for index, turn in enumerate(session.turns):
            planned_tokens.setdefault(index, []).append(turn.prompt_tokens)
    simulated_ttft: dict[int, list[float]] = {}
    for sim in sims:
        for result in sim.results:
            simulated_ttft.setdefault(result.turn, []).append(result.ttft_ms)
    speeds = [plan_accuracy.step_speed(cost_model, results) for _, results in measured]
    decodes = [decode_speed(cost_model, results) for _, results in measured]

    def ratios(values: list[float | None]) -> str:
        return ", ".join("-" if v is None else f"{v:.2f}" for v in values) or "-"
    most = cost_model.seen.get("decode_attended")

    lines = [f"### {workload.name} {leg}",
             f"TTFT p50 measured, each run: {', '.join(f'{v:.0f}' for v in measured_p50) or '-'} ms; simulated, "
             f"{len(simulated_p50)} draws: {simulated_p50[0]:.0f}-{simulated_p50[-1]:.0f} ms, median "
             f"{statistics.median(simulated_p50):.0f}",
             f"prompt steps / fit, each run: {ratios(speeds)}; decode-only steps / fit, each run, attending to at "
             f"most the calibration's {most or 0:,.0f} tokens: {ratios([d[0] for d in decodes])}, beyond: "
             f"{ratios([d[1] for d in decodes])}",
             "| turn | TTFT measured | TTFT simulated | prompt tokens sent | prompt tokens planned | outside compute |",
             "|---|---|---|---|---|---|"]
    for index in sorted(planned_tokens):
        turn_rows = [row for row in rows if row.turn == index]
        sent = f"{statistics.mean(r.input_tokens for r in turn_rows):.0f}" if turn_rows else "-"
        lines.append(f"| {index} | {median_cell([r.ttft_ms for r in turn_rows])} | "
                     f"{median_cell(simulated_ttft.get(index, []))} | {sent} | "
                     f"{statistics.mean(planned_tokens[index]):.0f} | {median_cell([r.other_ms for r in turn_rows])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/plan-accuracy"))
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the accuracy run to read")
    parser.add_argument("--workloads", default=",".join(plan_accuracy.WORKLOADS))
    parser.add_argument("--legs", default=",".join(plan_accuracy.LEGS))
    parser.add_argument("--calibration-alt", action="store_true",
                        help="plan from the calibrations of plan_accuracy.py --compare-calibration (OUT/calibration-alt)")
    args = parser.parse_args()
    folder = plan_accuracy.ALT_CALIBRATION_FOLDER if args.calibration_alt else plan_accuracy.CALIBRATION_FOLDER
    calibrations = plan_accuracy.calibration_runs(args.out, args.repeats, folder)
    if not calibrations:
        raise SystemExit(f"no calibration run in {args.out / folder} (run-1 .. run-{args.repeats})")
    cost_model = load_many(calibrations)
    legs = plan_accuracy.names(args.legs, plan_accuracy.LEGS)
    print(other_by_load(calibrations, cost_model))
    model = resolve_model(None)
    for name in plan_accuracy.names(args.workloads, plan_accuracy.WORKLOADS):
        workload = from_scenario(name, model, 0, 8192, plan_accuracy.TURNS.get(name, 4), SCENARIOS[name].sessions)
        measured = plan_accuracy.measured_runs(args.out, name, list(range(1, args.repeats + 1)))
        for leg in legs:
            if leg in measured:
                print("\n" + leg_details(workload, leg, cost_model, measured[leg]))


if __name__ == "__main__":
    main()
