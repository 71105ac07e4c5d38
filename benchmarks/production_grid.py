"""Does bidirectional KV transfer pay in production? The production scenario (coding-agent sessions on 2P2D with P's
prefix cache on) across links (shared memory on one host; 100, 25, 10 Gb/s between network namespaces) and P-pool
pressure (none; P's pools holding ~1/3 of the live histories): in each cell, bidir's and adaptive's gain in session
time and TTFT p50 over the best alternative without it (P/D with P's cache, and with its host tier where built),
median (min-max) over --repeats, and where bidirectional transfer does not pay, the table says so.

    python benchmarks/production_grid.py [--links shm,100gbit,25gbit,10gbit] [--pressures none,0.33] [--repeats 3]
    python benchmarks/production_grid.py --report-only        # re-render the table from the grid's JSON
Each cell is one `kvturn bench --compare --scenario production` run (its folder under OUT/cells); the machine's
load (uptime) before and after each cell is recorded beside its numbers. --hosts netns needs root.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvturn.bench.catalog import LEGS, SCENARIOS  # noqa: E402
from kvturn.bench.machine import machine, write_json  # noqa: E402

import grid_plan  # noqa: E402

BIDIR_LEGS, cell_name = grid_plan.BIDIR_LEGS, grid_plan.cell_name
NOISE = 0.15  # one repeat has no spread: a gain within 15% of 1 (this shared machine's run-to-run drift) names no winner


def run_cell(args, link: str, pressure: str, out: Path) -> dict:
    command = [sys.executable, "-m", "kvturn.cli", "bench", "--compare", "--scenario", "production",
               "--sessions", str(args.sessions), "--max-prompt-tokens", str(args.max_prompt_tokens),
               "--gap-scale", str(args.gap_scale), "--repeats", str(args.repeats), "--topology", args.topology,
               "--prefill-choice", args.prefill_choice, "--legs", args.legs, "--seed", str(args.seed),
               "--out", str(out)]
    if link != "shm":
        command += ["--hosts", "netns", "--link", f"{link}:{args.delay}"]
    if args.model:
        command += ["--model", args.model]
    if pressure != "none":
        command += ["--p-pool-share", pressure]
    load_before = os.getloadavg()
    started = time.monotonic()
    print(f"== {cell_name(link, pressure)}: load {load_before[0]:.1f}; {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command)
    return {"link": link, "pressure": pressure, "command": " ".join(["python", *command[1:]]),
            "returncode": done.returncode, "wall_s": time.monotonic() - started,
            "load_before": load_before, "load_after": os.getloadavg(), "folder": str(out)}


def repeat_summaries(results: dict) -> list[dict]:
    """Each repeat's summaries by leg."""
    runs = [results["summaries"], *(more["summaries"] for more in results.get("more_repeats", []))]
    return [{s["leg"]: s for s in run} for run in runs]


def p50(summary: dict, measure: str) -> float | None:
    value = (summary.get(measure) or {}).get("p50")
    return value if value else None


def gains(results: dict) -> dict:
    """Per bidirectional leg: its gain (alternative / leg, >1 pays) in session time and TTFT p50 each repeat, against
    the best leg without bidirectional transfer in the same repeat (`session`, `ttft`) and against plain P/D with
    P's cache (`session_vs_pd`, `ttft_vs_pd`); adaptive against the better fixed choice."""
    out = {}
    for measure, key in (("session_time_s", "session"), ("ttft_ms", "ttft")):
        for run in repeat_summaries(results):
            alternatives = [p50(s, measure) for name, s in run.items()
                            if not LEGS.get(name, LEGS["pd/P-cache-on"]).bidirectional and p50(s, measure)]
            if not alternatives:
                continue
            best = min(alternatives)
            for leg in BIDIR_LEGS:
                if leg in run and p50(run[leg], measure):
                    out.setdefault(leg, {}).setdefault(key, []).append(best / p50(run[leg], measure))
                    if p50(run.get("pd/P-cache-on", {}), measure):
                        out[leg].setdefault(f"{key}_vs_pd", []).append(
                            p50(run["pd/P-cache-on"], measure) / p50(run[leg], measure))
            if "adaptive/P-cache-on" in run and "bidir/P-cache-on" in run and p50(run["adaptive/P-cache-on"], measure):
                better_fixed = min(best, p50(run["bidir/P-cache-on"], measure))
                out.setdefault("adaptive_vs_better_fixed", {}).setdefault(key, []).append(
                    p50(run["adaptive/P-cache-on"], measure) / better_fixed)
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def verdict(values: list[float]) -> str:
    """Whether a gain (>1 pays) pays: by its whole range over repeats, or within NOISE of 1 with one repeat."""
    low, high = (min(values), max(values)) if len(values) > 1 else (values[0] * (1 - NOISE), values[0] * (1 + NOISE))
    if low > 1:
        return "pays"
    if high < 1:
        return "does not pay"
    return "within noise" if len(values) > 1 else f"within {NOISE:.0%}"


def summarize_cell(cell: dict) -> dict:
    try:
        results = grid_plan.read_results(Path(cell["folder"]))
    except FileNotFoundError:
        return {**cell, "error": "no results.json"}
    found = gains(results)
    layout = results.get("layout") or {}
    measured = layout.get("measured_link") or {}
    first = {s["leg"]: s for s in results["summaries"]}
    return {**cell, "repeats": results.get("repeats"),
            "gains": {leg: {key: spread(values) for key, values in by.items()} for leg, by in found.items()},
            "bidir_verdict": verdict(found["bidir/P-cache-on"]["session"]) if "bidir/P-cache-on" in found else None,
            "adaptive_verdict": verdict(found["adaptive/P-cache-on"]["session"])
            if "adaptive/P-cache-on" in found else None,
            "prefill_kv_cache_mb": layout.get("prefill_kv_cache_mb"),
            "link_measured_gbit_per_s": measured.get("measured_bytes_per_s", 0) * 8 / 1e9 or None,
            "link_fixed_ms": measured.get("measured_fixed_ms"), "delay_applied": measured.get("delay_applied"),
            "placement": {leg: s.get("placement") for leg, s in first.items()},
            "bytes_d_to_p": sum(s.get("bytes_d_to_p", 0) for s in first.values()),
            "bidir_read_back": bool((first.get("bidir/P-cache-on") or {}).get("bytes_d_to_p")),
            "answers_equal": results.get("answers_equal"),
            "best_alternative": min((name for name, s in first.items() if not LEGS.get(name, LEGS["pd/P-cache-on"])
                                     .bidirectional and p50(s, "session_time_s")),
                                    key=lambda name: p50(first[name], "session_time_s"), default=None),
            "failed": sum(s["failed"] for run in repeat_summaries(results) for s in run.values())}


def fmt(gain: dict | None) -> str:
    if not gain:
        return "-"
    if gain["n"] == 1:
        return f"{gain['median']:.2f}x"
    return f"{gain['median']:.2f}x ({gain['min']:.2f}-{gain['max']:.2f})"


def render(grid: dict) -> str:
    m = grid["machine"]
    model = grid["settings"].get("model") or "the embedded tiny model"
    lines = [f"# Does bidirectional KV transfer pay? (production scenario, {grid['settings']['topology']}, "
             f"P's prefix cache on, {model})", "",
             f"{m['cpu']}, {m['cores']} cores, {m['date']}, commit {m['commit']}; {grid['settings']['sessions']} "
             f"sessions, contexts to {grid['settings']['max_prompt_tokens']} tokens, gap scale "
             f"{grid['settings']['gap_scale']}, prefill choice {grid['settings']['prefill_choice']}, "
             f"{grid['settings']['repeats']} repeat(s). Gain = best leg without bidirectional transfer / the leg "
             f"(>1: faster), median (min-max) over repeats; load = 1-min load average before/after the cell.", "",
             "| link (measured) | P pools | best alternative | bidir: session | bidir: TTFT p50 | adaptive: session | "
             "adaptive: TTFT p50 | adaptive / better fixed (session) | verdict | bidir vs P/D without a P host tier: "
             "session, TTFT p50 | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell in grid["cells"]:
        if "error" in cell:
            lines.append(f"| {cell['link']} | {cell['pressure']} | {cell['error']} | | | | | | |")
            continue
        g = cell["gains"]
        link = cell["link"] + (f" ({cell['link_measured_gbit_per_s']:.1f} Gb/s)" if cell["link_measured_gbit_per_s"]
                               else "")
        pools = "all histories" if cell["pressure"] == "none" else \
            f"~{float(cell['pressure']):.0%} of live ({cell['prefill_kv_cache_mb']} MiB each)"
        words = {"pays": "bidir pays", "does not pay": "**bidir does not pay**"}.get(cell["bidir_verdict"],
                                                                                   f"bidir {cell['bidir_verdict']}")
        if cell.get("bidir_read_back") is False:  # P's cache held every history: any difference is not the read's
            words = ("**bidir does not pay**" if cell["bidir_verdict"] == "does not pay" else "bidir no different") \
                + ": nothing read back (P's cache held every history)"
        bidir, adaptive = g.get("bidir/P-cache-on", {}), g.get("adaptive/P-cache-on", {})
        lines.append(f"| {link} | {pools} | {cell.get('best_alternative') or '-'} | {fmt(bidir.get('session'))} | "
                     f"{fmt(bidir.get('ttft'))} | {fmt(adaptive.get('session'))} | {fmt(adaptive.get('ttft'))} | "
                     f"{fmt(g.get('adaptive_vs_better_fixed', {}).get('session'))} | {words}"
                     f"{'; ' + str(cell['failed']) + ' failed' if cell['failed'] else ''} | "
                     f"{fmt(bidir.get('session_vs_pd'))}, {fmt(bidir.get('ttft_vs_pd'))} | "
                     f"{cell['load_before'][0]:.1f}/{cell['load_after'][0]:.1f} |")
    for cell in grid["cells"]:
        equal = cell.get("answers_equal") or {}
        rows = [f"{leg} {row['equal']} of {row['compared']}" for leg, row in equal.items() if leg != "reference_leg"]
        if rows:
            lines.append(f"\n{cell_name(cell['link'], cell['pressure'])}: answers equal to "
                         f"{equal['reference_leg']}'s, turn by turn: {', '.join(rows)}.")
    lines += grid_plan.render(grid.get("plan_check"))
    if any(c.get("delay_applied") is False for c in grid["cells"]):
        lines += ["", "The links' delay was not applied: this kernel has no netem (rate only, tbf)."]
    lines += ["", f"Command: `{grid['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", default="shm,100gbit,25gbit,10gbit")
    parser.add_argument("--pressures", default="none,0.33", help="P-pool shares of the live histories, or none")
    parser.add_argument("--delay", default="50us", help="each link's one-way delay")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=SCENARIOS["production"].sessions)
    parser.add_argument("--max-prompt-tokens", type=int, default=4096)
    parser.add_argument("--gap-scale", type=float, default=0.05)
    parser.add_argument("--topology", default="2P2D")
    parser.add_argument("--prefill-choice", default="prefix-affine")
    parser.add_argument("--legs", default=",".join(SCENARIOS["production"].legs))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a pulled model's name (e.g. smollm2); default: the embedded one")
    parser.add_argument("--out", type=Path, default=Path("results/production-grid"))
    parser.add_argument("--plan-links", default="", help="links to plan only (faster than this machine carries "
                        "between namespaces, e.g. 25gbit,100gbit): the planner's answer beside the measured cells")
    parser.add_argument("--report-only", action="store_true", help="re-render the table from OUT/grid.json")
    parser.add_argument("--keep-cells", action="store_true", help="keep OUT/grid.json's cells this run does not "
                        "run again (a grid grown a few cells at a time, with the same settings)")
    parser.add_argument("--calibrate-on", default=None, help="the cell kvturn plan is calibrated on (default, or "
                        "'auto': the one that read most KV back from D); the planner predicts every other cell's gains "
                        "from it ('none': no check; with --report-only, plans again only when given)")
    args = parser.parse_args()
    grid_path = args.out / "grid.json"
    if args.report_only:
        grid = json.loads(grid_path.read_text())
        for key, value in grid["settings"].items():  # the plan check replans with the settings the grid ran
            if key not in ("calibrate_on", "plan_links"):
                setattr(args, key, value)
        grid["cells"] = [summarize_cell(cell) for cell in grid["cells"]]
    else:
        cells = [run_cell(args, link, pressure, args.out / "cells" / cell_name(link, pressure))
                 for link in args.links.split(",") for pressure in args.pressures.split(",")]
        if grid_path.exists() and args.keep_cells:  # cells of an earlier run of the same settings stay
            ran = {cell_name(c["link"], c["pressure"]) for c in cells}
            cells = [c for c in json.loads(grid_path.read_text())["cells"]
                     if cell_name(c["link"], c["pressure"]) not in ran] + cells
        grid = {"machine": machine(), "command": " ".join(["python", "benchmarks/production_grid.py", *sys.argv[1:]]),
                "settings": {key: value for key, value in vars(args).items()
                             if key not in ("out", "report_only", "keep_cells")},
                "cells": [summarize_cell(cell) for cell in cells]}
    if args.calibrate_on != "none" and (not args.report_only or args.calibrate_on):  # --report-only: asked for
        grid["plan_check"] = grid_plan.plan_check(args, grid["cells"])
    write_json(grid_path, grid)
    table = render(grid)
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
