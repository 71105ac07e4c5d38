"""A plan in the terminal, as plan.json, PNG plots and one self-contained plan.html: the verdict in words first,
then the per-leg predictions, the TTL x host-tier sweep, and what the model leaves out."""
import html
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvturn.bench.report import html_page, html_table, save_figure

LEG_COLUMNS = ("leg", "TTFT p50 ms (halves' range)", "TTFT p90 ms", "later-turn TTFT p50 ms", "session p50 s",
               "peak pool MiB", "peak host MiB", "reuse share", "paths")
SWEEP_COLUMNS = ("TTL s", "host tier MiB per decode worker", "later-turn TTFT p50 ms", "share of the gain",
                 "peak pool MiB", "peak host MiB", "reuse share")


def shown(value, spec: str) -> str:
    """A figure of plan.json as the tables show it; '-' for one with nothing to measure (null)."""
    return "-" if value is None else format(value, spec)


def with_range(value, low_high, spec: str) -> str:
    """`value (low-high)`, or the value alone where the range is one number."""
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
             shown(p["gain_share"], ".0%"), shown(p["peak_pool_mib"], ".1f"), shown(p["peak_host_mib"], ".1f"),
             shown(p["reuse_share"], ".0%")] for p in plan["sweep"]["points"]]


def print_plan(plan: dict, console: Console) -> None:
    console.print(f"[bold]Verdict[/bold]: {plan['verdict']['text']}\n")
    for title, columns, rows in (("Predicted per leg", LEG_COLUMNS, leg_rows(plan)),
                                 (f"TTL x host tier ({plan['sweep']['leg']})", SWEEP_COLUMNS,
                                  sweep_rows(plan))):
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="left" if column in ("leg", "paths") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print("Left out of the model: " + "; ".join(plan["left_out"]) + ".")
    console.print(f"{plan['simulated_events']} events simulated in {plan['elapsed_s']:.1f} s")


def _nan(value) -> float:
    """A figure to plot: NaN (left out of the plot) for null."""
    return float("nan") if value is None else value


def plot(plan: dict, out_dir: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = {}
    legs = plan["legs"]
    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(legs)
    ax.bar([i - 0.2 for i in range(len(names))], [_nan(legs[n]["ttft_p50_ms"]) for n in names], 0.4, label="TTFT p50")
    ax.bar([i + 0.2 for i in range(len(names))], [_nan(legs[n]["later_ttft_p50_ms"]) for n in names], 0.4,
           label="later-turn TTFT p50")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set(ylabel="ms", title="Predicted time to first token per leg")
    ax.legend(fontsize=8)
    paths["predicted TTFT per leg"] = save_figure(fig, out_dir / "plan_legs.png")

    fig, ax = plt.subplots(figsize=(9, 4))
    points = plan["sweep"]["points"]
    for host in dict.fromkeys(p["host_mib"] for p in points):
        line = [p for p in points if p["host_mib"] == host]
        ax.plot([_nan(p["peak_pool_mib"]) + _nan(p["peak_host_mib"]) for p in line],
                [_nan(p["reuse_share"]) for p in line], marker="o", label=f"host tier {host} MiB per decode worker")
        for p in line:
            ax.annotate(f"{p['ttl_s']:.0f} s", (_nan(p["peak_pool_mib"]) + _nan(p["peak_host_mib"]),
                                                _nan(p["reuse_share"])), fontsize=7)
    ax.set(xlabel="peak retained KV, pool and host (MiB)", ylabel="share of later turns reusing KV",
           title=f"TTL and host tier: memory against reuse ({plan['sweep']['leg']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths["TTL x host tier"] = save_figure(fig, out_dir / "plan_sweep.png")
    return paths


def write(plan: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "plan.json"
    json_path.write_text(json.dumps(plan, indent=2, allow_nan=False))
    plots = plot(plan, out_dir)
    deployment = [[k, html.escape(str(v))] for k, v in plan["deployment"].items()]
    body = (f"<p class=verdict>{html.escape(plan['verdict']['text'])}</p>"
            f"<h2>Predicted per leg</h2>{html_table(LEG_COLUMNS, leg_rows(plan))}"
            f"<h2>TTL x host tier ({html.escape(plan['sweep']['leg'])})</h2>"
            f"{html_table(SWEEP_COLUMNS, sweep_rows(plan))}"
            f"<h2>Deployment</h2>{html_table(('setting', 'value'), deployment)}"
            f"<h2>Left out of the model</h2><ul>{''.join(f'<li>{html.escape(x)}</li>' for x in plan['left_out'])}</ul>")
    html_path = out_dir / "plan.html"
    html_path.write_text(html_page(f"kvturn plan: {plan['workload']['name']}", body, plots))
    return json_path, html_path
