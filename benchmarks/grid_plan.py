"""The answer grid's check of `kvturn plan` (benchmarks/production_grid.py): calibrated on one cell that read KV
back from a decode worker, the planner predicts every other cell's gains from its link, P pools and topology, and
the table sets them beside the measured ones. Its point is the plan from the calibration cell's repeats pooled; its
range, the plans from each repeat alone (the drift from one calibration run to the next) and the scatter of the plan's
own simulations (how far one run's p50 moves from the next's)."""
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BIDIR_LEGS = ("bidir/P-cache-on", "adaptive/P-cache-on")
ALTERNATIVES = ("pd/P-cache-on", "pd/P-cache-host")  # legs without bidirectional transfer the planner simulates
PLANNED_LEGS = (*ALTERNATIVES, *BIDIR_LEGS)
WITHIN = 0.2  # the target: a predicted gain within 20% of the measured one


def read_results(folder: Path) -> dict:
    path = folder / "results.json"
    packed = path.with_suffix(".json.gz")  # publish.sh packs large ones
    return json.loads(path.read_text() if path.exists() else gzip.decompress(packed.read_bytes()))


def repeat_files(folder: Path, into: Path) -> list[Path]:
    """The cell's run as one results JSON per repeat (what `kvturn plan --calibration` reads: its legs)."""
    results = read_results(folder)
    runs = [results["legs"], *(more["legs"] for more in results.get("more_repeats", []))]
    files = []
    for index, legs in enumerate(runs):
        files.append(into / f"repeat{index + 1}.json")
        files[-1].write_text(json.dumps({"scenario": results.get("scenario"), "legs": legs}))
    return files


def predicted_gains(args, cell: dict, calibrations: list[Path], out: Path) -> dict:
    """`kvturn plan` of one cell from `calibrations` (pooled): {"session"|"ttft": {"vs_best"|"vs_pd": {leg: gain}}},
    or {"error": ...}. It runs in the calibrations' folder (one scratch folder: repeat_files), so that the plan and
    the command it records name them as repeatN.json, not by a path of this machine."""
    command = [sys.executable, "-m", "kvturn.cli", "plan", "--scenario", "production", "--topology", args.topology,
               "--prefill-choice", args.prefill_choice, "--sessions", str(args.sessions), "--max-prompt-tokens",
               str(args.max_prompt_tokens), "--gap-scale", str(args.gap_scale), "--seed", str(args.seed),
               "--one-host", "--legs", ",".join(PLANNED_LEGS), "--ttls", "480", "--host-budgets", "", "--out", str(out)]
    for path in calibrations:
        command += ["--calibration", path.name]
    if getattr(args, "model", None):
        command += ["--model", args.model]
    if cell.get("link_measured_gbit_per_s"):
        command += ["--link", f"{cell['link_measured_gbit_per_s']:.3f}gbit:{args.delay}",
                    "--link-read-fixed-ms", f"{cell.get('link_fixed_ms') or 0.0:.3f}"]
    if cell.get("prefill_kv_cache_mb") and cell["pressure"] != "none":
        command += ["--prefill-kv-cache-mb", str(cell["prefill_kv_cache_mb"])]
    run = [str(out.resolve()) if part == str(out) else part for part in command]
    done = subprocess.run(run, capture_output=True, text=True, cwd=calibrations[0].parent)
    if done.returncode != 0 or not (out / "plan.json").exists():
        said = " ".join(line.strip("│╭╮╰╯─ ") for line in (done.stderr or done.stdout).splitlines()[-6:])
        return {"error": said.strip() or "kvturn plan failed"}
    legs = json.loads((out / "plan.json").read_text())["legs"]
    gains, scatter = {}, {}
    for measure, key in (("session_p50_s", "session"), ("ttft_p50_ms", "ttft")):
        values = {leg: legs[leg][measure] for leg in PLANNED_LEGS if legs.get(leg, {}).get(measure)}
        best = min((leg for leg in ALTERNATIVES if leg in values), key=values.get, default=None)
        against = {"vs_best": best, "vs_pd": "pd/P-cache-on" if "pd/P-cache-on" in values else None}
        gains[key] = {name: {leg: values[base] / values[leg] for leg in BIDIR_LEGS if base and leg in values}
                      for name, base in against.items()}
        scatter[key] = {name: {leg: replica_spread(legs[base], legs[leg], measure) for leg in BIDIR_LEGS
                               if base and leg in values} for name, base in against.items()}
    return {"command": " ".join(["kvturn", *command[3:]]), "gains": gains, "scatter": scatter}


def replica_spread(base: dict, leg: dict, measure: str) -> list[float]:
    """The 10th-90th percentile of base / leg over every pair of the two legs' simulations (each a draw of the
    steps' scatter, as each bench repeat runs its legs apart): how far one run's gain moves from the next's."""
    ratios = sorted(b / x for b in (base.get("replicas") or {}).get(measure) or [] if b
                    for x in (leg.get("replicas") or {}).get(measure) or [] if x)
    if len(ratios) < 2:
        return []
    return [ratios[int(0.1 * (len(ratios) - 1))], ratios[int(round(0.9 * (len(ratios) - 1)))]]


def planned(args, cell: dict, calibrations: list[Path], out: Path, scratch: Path) -> dict:
    """The cell's predicted gains, `"LEG KEY AGAINST"` -> [point, low, high]: the point planned from the
    calibration's repeats pooled (its plan.json in `out`), the range over the plans from each repeat alone and the
    pooled plan's own scatter; or {"error": ...}."""
    pooled = predicted_gains(args, cell, calibrations, out)
    if "error" in pooled:
        return pooled
    alone = [predicted_gains(args, cell, [path], scratch / out.name / path.stem) for path in calibrations] \
        if len(calibrations) > 1 else []
    alone = [plan for plan in alone if "error" not in plan]
    gains = {}
    for leg in BIDIR_LEGS:
        for key in ("session", "ttft"):
            for against in ("vs_best", "vs_pd"):
                guess = pooled["gains"][key][against].get(leg)
                if not guess:
                    continue
                others = [plan["gains"][key][against][leg] for plan in alone if leg in plan["gains"][key][against]]
                others += pooled["scatter"][key][against].get(leg, [])
                gains[f"{leg} {key} {against}"] = [guess, min([guess, *others]), max([guess, *others])]
    return {"command": pooled["command"], "gains": gains}


def plan_cell(args, cell: dict, calibrations: list[Path], out: Path, scratch: Path) -> dict:
    """The cell's predicted gains (planned) beside the measured ones (median and range over the cell's repeats)."""
    plan = planned(args, cell, calibrations, out, scratch)
    if "error" in plan:
        return plan
    comparison = {}
    for name, (guess, low, high) in plan["gains"].items():
        leg, key, against = name.split(" ")
        measured = cell["gains"].get(leg, {}).get(key if against == "vs_best" else f"{key}_vs_pd") or {}
        if not measured.get("median"):
            continue
        comparison[name] = {
            "predicted": guess, "predicted_range": [low, high], "measured": measured["median"],
            "measured_range": [measured["min"], measured["max"]], "error": guess / measured["median"] - 1,
            "range_holds_measured": low <= measured["median"] <= high,
            "ranges_meet": low <= measured["max"] and measured["min"] <= high}
    return {"command": plan["command"], "calibration_repeats": len(calibrations), "gains": comparison}


def plan_unmeasured(args, cell: dict, calibrations: list[Path], out: Path, scratch: Path) -> dict:
    """A link this machine cannot carry, planned only: each gain over the best alternative, with its range."""
    plan = planned(args, cell, calibrations, out, scratch)
    if "error" in plan:
        return plan
    gains = {name.removesuffix(" vs_best"): {"predicted": guess, "predicted_range": [low, high]}
             for name, (guess, low, high) in plan["gains"].items() if name.endswith(" vs_best")}
    return {"link": cell["link"], "pressure": cell["pressure"], "command": plan["command"], "gains": gains}


def unmeasured_cells(links: list[str], cells: dict) -> list[dict]:
    """Cells of `links` at each measured pressure: P pools as the measured cell of that pressure had them, each read's
    fixed cost as over the measured netns link."""
    from kvturn.bench.netns import Link
    fixed = max((c.get("link_fixed_ms") or 0.0 for c in cells.values()), default=0.0)
    out = []
    for link in links:
        rate = Link.parse(f"{link}:0us").rate_bits_per_s
        for pressure in dict.fromkeys(c["pressure"] for c in cells.values()):
            pools = next(c.get("prefill_kv_cache_mb") for c in cells.values() if c["pressure"] == pressure)
            out.append({"link": link, "pressure": pressure, "link_measured_gbit_per_s": rate / 1e9,
                        "link_fixed_ms": fixed, "prefill_kv_cache_mb": pools})
    return out


def cell_name(link: str, pressure: str) -> str:
    return f"{link}-pressure-{pressure}"


def plan_check(args, cells: list[dict]) -> dict:
    """Each cell but the calibration one, planned from it."""
    names = {cell_name(c["link"], c["pressure"]): c for c in cells if "error" not in c}
    # the planner fits KV bytes and read time to reads of D's history: the cell whose legs read the most
    reading = [name for name, c in names.items() if c.get("bytes_d_to_p")]
    chosen = args.calibrate_on if args.calibrate_on not in (None, "auto") else \
        max(reading, key=lambda name: names[name]["bytes_d_to_p"], default=None)
    if chosen not in names or len(names) < 2:
        return {"calibrated_on": chosen or "nothing: no cell read KV back from a decode worker", "cells": {}}
    planned_only = [link for link in (getattr(args, "plan_links", "") or "").split(",") if link.strip()]
    with tempfile.TemporaryDirectory() as scratch:
        calibrations = repeat_files(Path(names[chosen]["folder"]), Path(scratch))
        return {"calibrated_on": chosen, "calibration_repeats": len(calibrations),
                "cells": {name: plan_cell(args, cell, calibrations, args.out / "plans" / name, Path(scratch))
                          for name, cell in names.items() if name != chosen},
                "unmeasured": [plan_unmeasured(args, cell, calibrations,
                                               args.out / "plans" / cell_name(cell["link"], cell["pressure"]),
                                               Path(scratch))
                               for cell in unmeasured_cells(planned_only, names)]}


def fmt_range(value: float, low_high: list[float]) -> str:
    low, high = low_high
    return f"{value:.2f}x" if abs(high - low) < 0.005 else f"{value:.2f}x ({low:.2f}-{high:.2f})"


def render(checks: dict | None) -> list[str]:
    """The check as markdown lines (none without a check)."""
    lines = []
    if not checks:
        return lines
    repeats = checks.get("calibration_repeats", 1)
    lines += ["", f"## The planner on cells it was not calibrated on (calibrated on {checks['calibrated_on']})", "",
              f"Predicted: the plan from the calibration cell's {repeats} repeat(s) pooled, (range) the plans from "
              "each repeat alone and the 10th-90th percentile of the gain over pairs of the plan's simulations (each "
              "a draw of its steps' scatter, as each repeat is); measured: median (min-max) over the cell's repeats. Against the best alternative "
              "(P/D with P's cache, or with its host tier, whichever is faster) and against P/D with P's cache.", "",
              "| cell | gain | predicted | measured | error | range holds the measured median |",
              "|---|---|---|---|---|---|"]
    for name, check in checks["cells"].items():
        if "error" in check:
            lines.append(f"| {name} | kvturn plan failed: {check['error']} | | | | |")
        for gain, row in check.get("gains", {}).items():
            lines.append(f"| {name} | {gain.replace('vs_best', 'vs best').replace('vs_pd', 'vs P/D')} | "
                         f"{fmt_range(row['predicted'], row['predicted_range'])} | "
                         f"{fmt_range(row['measured'], row['measured_range'])} | {row['error']:+.0%}"
                         f"{'' if abs(row['error']) <= WITHIN else ' (outside 20%)'} | "
                         f"{'yes' if row['range_holds_measured'] else 'ranges meet' if row['ranges_meet'] else 'no'} |")
    rows = [r for c in checks["cells"].values() for r in c.get("gains", {}).values()]
    if rows:
        within = sum(abs(r["error"]) <= WITHIN for r in rows)
        held = sum(r["range_holds_measured"] for r in rows)
        meet = sum(r["range_holds_measured"] or r["ranges_meet"] for r in rows)
        lines += ["", f"{within} of {len(rows)} predicted gains within 20% of the measured median; the predicted "
                      f"range holds the measured median in {held} of {len(rows)} and meets the measured range in "
                      f"{meet}. The compute is this machine's calibration: another machine's compute the planner "
                      "cannot know."]
    unmeasured = checks.get("unmeasured") or []
    if unmeasured:
        lines += ["", "### Links this machine cannot carry: the planner's answer, not measured", "",
                  "A veth between namespaces here carries a few Gb/s at most, so faster links would measure the same "
                  "as the 10gbit cells; the planner prices reads at these rates (gain over the best alternative).", "",
                  "| link | P pools | bidir: session | bidir: TTFT p50 | adaptive: session | adaptive: TTFT p50 |",
                  "|---|---|---|---|---|---|"]
        for cell in unmeasured:
            if "error" in cell:
                lines.append(f"| {cell.get('link', '?')} | {cell.get('pressure', '?')} | kvturn plan failed: "
                             f"{cell['error']} | | | |")
                continue
            g = cell["gains"]
            shown = [fmt_range(g[k]["predicted"], g[k]["predicted_range"]) if k in g else "-"
                     for k in (f"{leg} {key}" for leg in BIDIR_LEGS for key in ("session", "ttft"))]
            lines.append(f"| {cell['link']} | {cell['pressure']} | " + " | ".join(shown) + " |")
    return lines
