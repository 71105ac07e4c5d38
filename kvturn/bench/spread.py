"""Numbers with their spread: each leg's figures over repeated runs (`kvturn bench --repeats N`: the legs
interleaved, each repeat a fresh stack on the same workload), their median and range, each bidirectional leg's
ratio to its P/D baseline within each repeat, and a verdict that names a winner only where the ranges are apart.

A spread is {"median", "min", "max", "values"}; everything here is plain data in, plain data out."""
from statistics import median

from kvturn.bench.catalog import LEGS, baseline_of
from kvturn.bench.report import html_table

MIB = 2**20
# key, label, unit, how one repeat's summary of a leg (report.summarize) gives it
FIGURES = (
    ("ttft_p50_ms", "TTFT p50", "ms", lambda s: s["ttft_ms"].get("p50")),
    ("ttft_p90_ms", "TTFT p90", "ms", lambda s: s["ttft_ms"].get("p90")),
    ("later_ttft_p50_ms", "later-turn TTFT p50", "ms", lambda s: s.get("later_ttft_ms", {}).get("p50")),
    ("tpot_p50_ms", "TPOT p50", "ms", lambda s: s["tpot_ms"].get("p50")),
    ("tpot_p90_ms", "TPOT p90", "ms", lambda s: s["tpot_ms"].get("p90")),
    ("session_p50_s", "session p50", "s", lambda s: s["session_time_s"].get("p50")),
    ("peak_retained_mib", "peak retained", "MiB", lambda s: s["peak_retained_kv_bytes"] / MIB),
    ("mean_retained_mib", "mean retained", "MiB", lambda s: s.get("mean_retained_kv_bytes", 0.0) / MIB),
)
LABELS = {key: label for key, label, _, _ in FIGURES}
UNITS = {key: unit for key, _, unit, _ in FIGURES}
RATIO_FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "later_ttft_p50_ms", "tpot_p50_ms", "tpot_p90_ms", "session_p50_s")
# Sessions first: they decide whether a leg is slower (P's first token goes out ahead of D's stream, so a stalled
# decode worker shows in TPOT and session time, not in TTFT).
VERDICT_FIGURES = ("session_p50_s", "tpot_p50_ms", "ttft_p50_ms", "later_ttft_p50_ms")
SESSION_CALL = {"higher": "slower", "lower": "faster", "within noise": "within noise"}
IDEAL_FIGURES = ("measured_speedup", "ideal_speedup", "fraction_of_ideal", "other_ms")


def spread(values: list) -> dict | None:
    """Median and range of the numbers among `values` (None or NaN: a repeat without the figure); None if none."""
    numbers = [float(v) for v in values if v is not None and v == v]
    if not numbers:
        return None
    return {"median": median(numbers), "min": min(numbers), "max": max(numbers), "values": numbers}


def leg_spreads(repeats: list[list[dict]]) -> dict[str, dict]:
    """leg -> figure -> spread, from each repeat's list of leg summaries; "failed" counts every repeat's failures."""
    runs: dict[str, list[dict]] = {}
    for summaries in repeats:
        for summary in summaries:
            runs.setdefault(summary["leg"], []).append(summary)
    spreads = {}
    for leg, summaries in runs.items():
        spreads[leg] = {key: spread([read(s) for s in summaries]) for key, _, _, read in FIGURES}
        spreads[leg]["failed"] = sum(s["failed"] for s in summaries)
        spreads[leg]["repeats"] = len(summaries)
    return spreads


def pairs(legs) -> list[tuple[str, str]]:
    """(candidate, baseline) for each bidirectional leg among `legs` whose P/D baseline is among them too."""
    present = set(legs)
    return [(leg, baseline_of(leg)) for leg in legs if leg in LEGS and baseline_of(leg) in present]


def ratio_name(candidate: str, baseline: str) -> str:
    return f"{candidate} / {baseline}"


def ratio_spreads(repeats: list[list[dict]]) -> dict[str, dict]:
    """"candidate / baseline" -> figure -> spread of candidate's figure over baseline's, taken within each repeat
    (below 1: the candidate's is lower)."""
    ratios: dict[str, dict[str, list]] = {}
    for summaries in repeats:
        by_leg = {s["leg"]: s for s in summaries}
        for candidate, baseline in pairs(list(by_leg)):
            into = ratios.setdefault(ratio_name(candidate, baseline), {key: [] for key in RATIO_FIGURES})
            for key, _, _, read in FIGURES:
                if key in into:
                    ours, theirs = read(by_leg[candidate]), read(by_leg[baseline])
                    into[key].append(ours / theirs if ours is not None and theirs else None)
    return {name: {key: spread(values) for key, values in figures.items()} for name, figures in ratios.items()}


def compare(baseline: dict, candidate: dict) -> str:
    """"lower", "higher" or "within noise": where the candidate's range lies against the baseline's. Ranges
    that overlap, or touch, name no winner."""
    if candidate["max"] < baseline["min"]:
        return "lower"
    if candidate["min"] > baseline["max"]:
        return "higher"
    return "within noise"


def same_side(ratio: dict | None) -> str | None:
    """"lower" or "higher" where every repeat's ratio lies on that side of 1, else None."""
    if ratio is None or len(ratio["values"]) < 2:
        return None
    return "lower" if ratio["max"] < 1 else "higher" if ratio["min"] > 1 else None


def number(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{value:.0f}%"
    return f"{value:.0f}" if unit == "ms" and value >= 100 else f"{value:.1f}"


def spread_text(s: dict | None, unit: str) -> str:
    """"median (min-max)", or the one number where the range is a point; "-" for no figure."""
    if s is None:
        return "-"
    if s["min"] == s["max"]:
        return number(s["median"], unit)
    return f"{number(s['median'], unit)} ({number(s['min'], unit)}-{number(s['max'], unit)})"


def verdict(legs: dict[str, dict], ratios: dict[str, dict], repeats: int) -> str:
    """The run in words: for each bidirectional leg against its P/D baseline, each verdict figure's medians and
    ranges, and "lower", "higher" or "within noise" by whether the ranges are apart."""
    words = []
    for candidate, baseline in pairs(list(legs)):
        parts, call = [], None
        for key in VERDICT_FIGURES:
            ours, theirs = legs[candidate][key], legs[baseline][key]
            if ours is None or theirs is None:
                continue
            unit, ratio = UNITS[key], ratios.get(ratio_name(candidate, baseline), {}).get(key)
            word = compare(theirs, ours)
            if key == "session_p50_s":
                call = f"sessions {SESSION_CALL[word]}"
            if word == "within noise" and same_side(ratio):
                # the machine's pace moved between repeats more than the legs differ within one
                word += f", though {same_side(ratio)} within each repeat"
            parts.append(f"{LABELS[key]} {spread_text(ours, unit)} against {spread_text(theirs, unit)} {unit}: "
                         f"{word}" + (f" ({spread_text(ratio, 'x')})" if ratio else ""))
        retained = legs[candidate]["peak_retained_mib"]
        if parts:
            words.append(f"{candidate} against {baseline} over {repeats} repeats: " + (f"{call}; " if call else "")
                         + "; ".join(parts)
                         + (f"; holding up to {spread_text(retained, 'MiB')} MiB of retained KV." if retained else "."))
    if not words:
        words = [f"{leg}: TTFT p50 {spread_text(figures['ttft_p50_ms'], 'ms')} ms over {repeats} repeats."
                 for leg, figures in legs.items()]
    return " ".join(words)


def ideal_spread(ideals: list[dict | None]) -> dict | None:
    """The spread over repeats of the longest prompt's measured and ideal speedups (compare.ideal_speedup)."""
    measured = [i for i in ideals if i and "ideal_speedup" in i]
    if not measured:
        return None
    return {"prompt_tokens": measured[0]["prompt_tokens"], "repeats": len(measured),
            **{key: spread([i[key] for i in measured]) for key in IDEAL_FIGURES}}


def percent(fraction: dict | None) -> dict | None:
    return fraction and {**{key: fraction[key] * 100 for key in ("median", "min", "max")},
                         "values": [v * 100 for v in fraction["values"]]}


def ideal_text(ideal: dict) -> str:
    runs = "in one run" if ideal["repeats"] == 1 else f"over {ideal['repeats']} repeats"
    return (f"At the longest prompt ({ideal['prompt_tokens']} tokens), {runs}: TTFT OFF/ON "
            f"{spread_text(ideal['measured_speedup'], 'x')} against an ideal of "
            f"{spread_text(ideal['ideal_speedup'], 'x')}, measured/ideal "
            f"{spread_text(percent(ideal['fraction_of_ideal']), '%')}"
            f"; time outside compute and transfer in the ON turn {spread_text(ideal['other_ms'], 'ms')} ms.")


def table_rows(legs: dict[str, dict], ratios: dict[str, dict]) -> tuple[list[str], list[list[str]], list[str],
                                                                          list[list[str]]]:
    """The legs' table (head, rows) and the ratios' table (head, rows), each cell "median (min-max)"."""
    head = ["leg"] + [f"{label} {unit}" for _, label, unit, _ in FIGURES] + ["failed"]
    rows = [[leg] + [spread_text(figures[key], UNITS[key]) for key, _, _, _ in FIGURES] + [str(figures["failed"])]
            for leg, figures in legs.items()]
    ratio_head = ["ratio"] + [LABELS[key] for key in RATIO_FIGURES]
    ratio_rows = [[name] + [spread_text(figures[key], "x") for key in RATIO_FIGURES]
                  for name, figures in ratios.items()]
    return head, rows, ratio_head, ratio_rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def markdown(title: str, info: dict, command: str, repeats: int, legs: dict, ratios: dict, words: str,
             ideal: dict | None = None) -> str:
    """A short summary to quote: stamp (machine, date, commit, command), the tables, the verdict."""
    head, rows, ratio_head, ratio_rows = table_rows(legs, ratios)
    stamp = (f"{info.get('cpu')}, {info.get('cores')} cores, {info.get('memory_gib')} GiB; torch {info.get('torch')}; "
             f"{info.get('date')}; commit {info.get('commit') or 'unknown'}")
    how = (f"Median (min-max) over {repeats} repeats; legs interleaved, each repeat a fresh stack on the same workload."
           if repeats > 1 else "One repeat: no spread measured (`--repeats 3` measures it).")
    parts = [f"# {title}", "", stamp, "", f"`{command}`", "", how, "", markdown_table(head, rows)]
    if ratio_rows:
        parts += ["", "Each ratio is taken within a repeat (below 1: the first leg's figure is lower).", "",
                  markdown_table(ratio_head, ratio_rows)]
    parts += ["", words]
    return "\n".join(parts + (["", ideal_text(ideal)] if ideal else []) + [""])


def print_tables(legs: dict[str, dict], ratios: dict[str, dict], title: str, console) -> None:
    from rich.table import Table
    head, rows, ratio_head, ratio_rows = table_rows(legs, ratios)
    for columns, cells, caption in ((head, rows, title), (ratio_head, ratio_rows, "ratios, each within a repeat")):
        if cells:
            table = Table(title=caption)
            for column in columns:
                table.add_column(column, justify="left" if column in ("leg", "ratio") else "right",
                                 no_wrap=column in ("leg", "ratio"))
            for row in cells:
                table.add_row(*row)
            console.print(table)


def html(legs: dict[str, dict], ratios: dict[str, dict], repeats: int) -> str:
    """The spread tables of a repeated run for the HTML report ("" for one repeat: its own table says it all)."""
    if repeats < 2:
        return ""
    head, rows, ratio_head, ratio_rows = table_rows(legs, ratios)
    return (f"<h2>Median (min-max) over {repeats} repeats</h2>{html_table(head, rows)}"
            + (html_table(ratio_head, ratio_rows) if ratio_rows else "")
            + "<h2>The first repeat</h2>")
