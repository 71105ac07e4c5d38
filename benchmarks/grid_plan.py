"""The answer grid's check of `kvturn plan` (benchmarks/production_grid.py): calibrated on one cell that read KV
back from a decode worker, the planner predicts every other cell's gains from its link, P pools and topology, and
the table sets them beside the measured ones."""
import json
import subprocess
import sys
from pathlib import Path

BIDIR_LEGS = ("bidir/P-cache-on", "adaptive/P-cache-on")
PLANNED_LEGS = ("pd/P-cache-on", "bidir/P-cache-on", "adaptive/P-cache-on")  # those the planner simulates


def plan_cell(args, cell: dict, calibration: Path, out: Path) -> dict:
    """`kvturn plan` of one cell from another cell's run: the gains it predicts against those measured."""
    command = [sys.executable, "-m", "kvturn.cli", "plan", "--scenario", "production", "--calibration",
               str(calibration), "--topology", args.topology, "--prefill-choice", args.prefill_choice,
               "--sessions", str(args.sessions), "--max-prompt-tokens", str(args.max_prompt_tokens),
               "--gap-scale", str(args.gap_scale), "--seed", str(args.seed), "--one-host",
               "--legs", ",".join(PLANNED_LEGS), "--ttls", "480", "--host-budgets", "", "--out", str(out)]
    if getattr(args, "model", None):
        command += ["--model", args.model]
    if cell.get("link_measured_gbit_per_s"):
        command += ["--link", f"{cell['link_measured_gbit_per_s']:.3f}gbit:{args.delay}",
                    "--link-read-fixed-ms", f"{cell.get('link_fixed_ms') or 0.0:.3f}"]
    if cell.get("prefill_kv_cache_mb") and cell["pressure"] != "none":
        command += ["--prefill-kv-cache-mb", str(cell["prefill_kv_cache_mb"])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "plan.json").exists():
        said = " ".join(line.strip("│╭╮╰╯─ ") for line in (done.stderr or done.stdout).splitlines()[-6:])
        return {"error": said.strip() or "kvturn plan failed"}
    legs = json.loads((out / "plan.json").read_text())["legs"]
    predicted = {}
    for measure, key in (("session_p50_s", "session"), ("ttft_p50_ms", "ttft")):
        values = {leg: legs[leg][measure] for leg in PLANNED_LEGS if legs.get(leg, {}).get(measure)}
        if "pd/P-cache-on" in values:
            predicted[key] = {leg: values["pd/P-cache-on"] / values[leg] for leg in BIDIR_LEGS if leg in values}
    comparison = {}
    for leg in BIDIR_LEGS:
        for key in ("session", "ttft"):
            measured = (cell["gains"].get(leg, {}).get(key) or {}).get("median")
            guess = predicted.get(key, {}).get(leg)
            if measured and guess:
                comparison[f"{leg} {key}"] = {"predicted": guess, "measured": measured,
                                              "error": guess / measured - 1}
    return {"command": " ".join(["kvturn", *command[3:]]), "gains": comparison}


def cell_name(link: str, pressure: str) -> str:
    return f"{link}-pressure-{pressure}"


def plan_check(args, cells: list[dict]) -> dict:
    """Each cell but the calibration one, planned from it."""
    names = {cell_name(c["link"], c["pressure"]): c for c in cells if "error" not in c}
    # the planner fits KV bytes and read time to reads of D's history: the first cell whose legs read some
    chosen = args.calibrate_on or next((name for name, c in names.items() if c.get("bytes_d_to_p")), None)
    if chosen not in names or len(names) < 2:
        return {"calibrated_on": chosen or "nothing: no cell read KV back from a decode worker", "cells": {}}
    calibration = Path(names[chosen]["folder"]) / "results.json"
    return {"calibrated_on": chosen,
            "cells": {name: plan_cell(args, cell, calibration, args.out / "plans" / name)
                      for name, cell in names.items() if name != chosen}}


def render(checks: dict | None) -> list[str]:
    """The check as markdown lines (none without a check)."""
    lines = []
    if not checks:
        return lines
    lines += ["", f"## The planner on cells it was not calibrated on (calibrated on {checks['calibrated_on']})",
              "", "| cell | gain | predicted | measured | error |", "|---|---|---|---|---|"]
    for name, check in checks["cells"].items():
        if "error" in check:
            lines.append(f"| {name} | kvturn plan failed: {check['error']} | | | |")
        for gain, row in check.get("gains", {}).items():
            lines.append(f"| {name} | {gain} | {row['predicted']:.2f}x | {row['measured']:.2f}x | "
                         f"{row['error']:+.0%}{'' if abs(row['error']) <= 0.2 else ' (outside 20%)'} |")
    within = [abs(r["error"]) <= 0.2 for c in checks["cells"].values() for r in c.get("gains", {}).values()]
    if within:
        lines += ["", f"{sum(within)} of {len(within)} predicted gains within 20% of the measured ones. The "
                      "compute is this machine's calibration: another machine's compute the planner cannot know."]
    return lines
