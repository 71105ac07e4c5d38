"""A plan in the terminal and as plan.json: the verdict first, then each leg (TTFT p50 as value (low-high) over the
calibration's halves), the TTL x host-tier sweep, and what the model leaves out."""
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

LEG_COLUMNS = ("leg", "TTFT p50 ms (halves' range)", "TTFT p90 ms", "later-turn TTFT p50 ms", "session p50 s",
               "peak pool MiB", "peak host MiB", "reuse share", "paths")
SWEEP_COLUMNS = ("TTL s", "host tier MiB per decode worker", "later-turn TTFT p50 ms", "peak pool MiB",
                 "peak host MiB", "reuse share")


def shown(value, spec: str) -> str:
    """A figure of plan.json as the tables show it; '-' for one with nothing to measure (null)."""
    return "-" if value is None else format(value, spec)


def with_range(value, low_high, spec: str) -> str:
    """`value (low-high)`, or the value alone where the range is one number as shown."""
    low, high = low_high
    if value is None or None in (low, high) or format(low, spec) == format(high, spec):
        return shown(value, spec)
    return f"{value:{spec}} ({low:{spec}}-{high:{spec}})"


def leg_rows(plan: dict) -> list[list[str]]:
    return [[leg, with_range(p["ttft_p50_ms"], p["ttft_p50_ms_range"], ".0f"), shown(p["ttft_p90_ms"], ".0f"),
             shown(p["later_ttft_p50_ms"], ".0f"), shown(p["session_p50_s"], ".1f"), shown(p["peak_pool_mib"], ".1f"),
             shown(p["peak_host_mib"], ".1f"), shown(p["reuse_share"], ".0%"),
             ", ".join(f"{k} {v}" for k, v in sorted(p["paths"].items()))] for leg, p in plan["legs"].items()]


def sweep_rows(plan: dict) -> list[list[str]]:
    return [[shown(p["ttl_s"], ".0f"), f"{p['host_mib']}", shown(p["later_ttft_p50_ms"], ".0f"),
             shown(p["peak_pool_mib"], ".1f"), shown(p["peak_host_mib"], ".1f"), shown(p["reuse_share"], ".0%")]
            for p in plan["sweep"]["points"]]


def print_plan(plan: dict, console: Console) -> None:
    console.print(f"[bold]Verdict[/bold]: {plan['verdict']['text']}\n")
    for title, columns, rows in (("Predicted per leg", LEG_COLUMNS, leg_rows(plan)),
                                 (f"TTL x host tier ({plan['sweep']['leg']})", SWEEP_COLUMNS, sweep_rows(plan))):
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="left" if column in ("leg", "paths") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    over_time = plan["legs"][plan["sweep"]["leg"]]["retained_over_time"]
    points = over_time[::max(len(over_time) // 8, 1)]
    console.print(f"Retained KV on {plan['sweep']['leg']} over time, pool + host MiB: " + ", ".join(
        f"{s:.0f} s {pool:.0f} + {host:.0f}" for s, pool, host in points))
    console.print(f"What the model leaves out: {plan['left_out']}.")
    console.print(f"{plan['simulated_events']} events simulated in {plan['elapsed_s']:.1f} s")


def write(plan: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "plan.json"
    json_path.write_text(json.dumps(plan, indent=2, allow_nan=False))
    return json_path
