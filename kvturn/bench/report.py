"""Summaries, the terminal table, JSON, PNG plots and one self-contained HTML page."""
import base64
import html
import json
from collections import Counter
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvturn.bench.client import RunResult
from kvturn.bench.placement import placement

BUCKET_TOKENS = 1024


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    points = [25, 50, 75, 90] + ([99] if len(values) >= 100 else []) + ([99.9] if len(values) >= 1000 else [])
    stats = {f"p{p:g}": float(np.percentile(values, p)) for p in points}
    stats["mean"] = float(np.mean(values))
    return stats


def summarize(name: str, result: RunResult) -> dict:
    measured = [r for r in result.requests if not r.warmup]
    ok = [r for r in measured if r.error is None]
    sessions = [s for s in result.sessions if s.duration_s is not None]
    outcomes = Counter(r.reuse or "none" for r in ok)
    return {
        "leg": name,
        "requests": len(measured),
        "failed": len(measured) - len(ok),
        "errors": sorted({r.error for r in measured if r.error})[:5],
        "runtime_sec": result.runtime_s,
        "requests_per_sec": len(ok) / result.runtime_s if result.runtime_s else 0.0,
        "ttft_ms": percentiles([r.ttft_ms for r in ok]),
        "later_ttft_ms": percentiles([r.ttft_ms for r in ok if r.turn > 0]),  # turns with a history to reuse
        "tpot_ms": percentiles([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "latency_ms": percentiles([r.latency_ms for r in ok]),
        "session_time_s": percentiles([s.duration_s for s in sessions if not s.failed]),
        "reuse_outcomes": dict(outcomes),
        "paths": dict(Counter(r.path for r in ok if r.path)),
        "other_ms": percentiles([r.other_ms for r in ok if r.path and r.other_ms is not None]),
        "predicted_within_20pct": _share_within(ok, 0.2),
        "bytes_d_to_p": sum(r.bytes_d_to_p for r in ok),
        "bytes_p_to_d": sum(r.bytes_p_to_d for r in ok),
        "placement": placement(result.requests),
        "link_bytes": result.link_bytes,
        "peak_retained_kv_bytes": max((b for _, b in result.retained_kv), default=0.0),
        "mean_retained_kv_bytes": float(np.mean([b for _, b in result.retained_kv])) if result.retained_kv else 0.0,
        "retention": retention_summary(result.worker_counters),
    }


def labelled(counters: dict[str, float], name: str) -> dict[str, float]:
    """label value -> count of counter `name` with one label (`name{label="value"}`)."""
    prefix = name + "{"
    return {key[len(prefix):].split('"')[1]: value for key, value in counters.items() if key.startswith(prefix)}


def retention_summary(workers: dict[str, dict[str, float]]) -> dict | None:
    """What the decode workers retained and gave up under pressure, why, and what it cost others: leases by event,
    the reasons leases were chosen to go, decode preemptions and prompt tokens decode computed itself, prefill pins
    let go, and leases let go that the router withdrew, that prefill saw before reading (both `lease_ended`) or after
    (`epoch_mismatch`). None without the workers' counters."""
    decode, prefill, router = (workers.get(role, {}) for role in ("decode", "prefill", "router"))
    if not decode:
        return None
    return {"leases": labelled(decode, "kvturn_kv_leases_total"),
            "choices": {k: v for k, v in labelled(decode, "kvturn_kv_retention_choices_total").items() if v},
            "decode_preemptions": decode.get("kvturn_preemptions_total", 0.0),
            "decode_prompt_tokens_computed": decode.get("kvturn_prompt_tokens_computed_total", 0.0),
            "prefill_pins_reclaimed": labelled(prefill, "kvturn_kv_leases_total").get("reclaimed", 0.0),
            "lease_ended": labelled(router, "kvturn_router_prefill_reuse_total").get("lease_ended", 0.0),
            "lease_ended_seen_by_prefill": labelled(prefill, "kvturn_kv_reuse_declines_total").get("lease_ended", 0.0),
            "epoch_mismatch": labelled(prefill, "kvturn_kv_reuse_declines_total").get("epoch_mismatch", 0.0)}


def retention_words(summaries: list[dict]) -> str:
    """Each leg's retention under pressure in a sentence (legs whose decode workers retained nothing are left out)."""
    words = []
    for s in summaries:
        r = s.get("retention")
        if not r or not r["leases"].get("created"):
            continue
        leases = r["leases"]
        why = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(r["choices"].items())) or "none"
        words.append(f"{s['leg']}: decode retained {leases.get('created', 0):.0f} leases and gave up "
                     f"{leases.get('reclaimed', 0):.0f} under pressure (chosen as {why}); of the leases it had let "
                     f"go, the router withdrew {r['lease_ended'] - r['lease_ended_seen_by_prefill']:.0f} and "
                     f"prefill saw {r['lease_ended_seen_by_prefill']:.0f} before reading, "
                     f"{r['epoch_mismatch']:.0f} after; decode preempted {r['decode_preemptions']:.0f} "
                     f"requests and computed {r['decode_prompt_tokens_computed']:.0f} prompt tokens itself; prefill "
                     f"let {r['prefill_pins_reclaimed']:.0f} pins go.")
    return " ".join(words)


def _share_within(records, tolerance: float) -> float | None:
    """Share of turns whose TTFT the router's cost model predicted within `tolerance` (None: no predictions)."""
    pairs = [(r.predicted_ttft_ms, r.ttft_ms) for r in records if r.predicted_ttft_ms and r.ttft_ms]
    if not pairs:
        return None
    return sum(abs(predicted - actual) <= tolerance * actual for predicted, actual in pairs) / len(pairs)


def ttft_at(result: RunResult, conversation_id: str, turn: int) -> dict | None:
    for r in result.requests:
        if r.conversation_id == conversation_id and r.turn == turn and r.error is None:
            return {"ttft_ms": r.ttft_ms, "input_num_tokens": r.input_num_tokens, "reuse": r.reuse,
                    "prefill_compute_ms": r.prefill_compute_ms, "d_to_p_read_ms": r.d_to_p_read_ms,
                    "d_to_p_read_hidden_ms": r.d_to_p_read_hidden_ms,
                    "p_to_d_read_ms": r.p_to_d_read_ms, "bytes_d_to_p": r.bytes_d_to_p, "other_ms": r.other_ms,
                    "tpot_ms": r.tpot_ms}
    return None


def longest_request(result: RunResult, conversation_id: str | None = None):
    """The run's request with the longest prompt (of one conversation, if given)."""
    ok = [r for r in result.requests if r.error is None and r.input_num_tokens
          and conversation_id in (None, r.conversation_id)]
    return max(ok, key=lambda r: r.input_num_tokens, default=None)


def print_table(summaries: list[dict], title: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=title)
    for col in ("leg", "ok/failed", "TTFT p50", "TTFT p90", "other p50", "TPOT p50", "TPOT p90", "session p50",
                "reuse / declines", "D->P MiB", "P->D MiB", "peak retained MiB"):
        # a leg's name is never cut: it is what the reader looks the row up by; other cells wrap instead
        table.add_column(col, justify="right" if col != "reuse / declines" else "left", no_wrap=col == "leg")
    for s in summaries:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s["reuse_outcomes"].items()))
        table.add_row(s["leg"], f"{s['requests'] - s['failed']}/{s['failed']}",
                      cell(s["ttft_ms"], "p50", "{:.0f} ms"), cell(s["ttft_ms"], "p90", "{:.0f} ms"),
                      cell(s.get("other_ms", {}), "p50", "{:.0f} ms"),
                      cell(s["tpot_ms"], "p50", "{:.1f} ms"), cell(s["tpot_ms"], "p90", "{:.1f} ms"),
                      cell(s["session_time_s"], "p50", "{:.1f} s"), outcomes,
                      f"{s['bytes_d_to_p'] / 2**20:.1f}", f"{s['bytes_p_to_d'] / 2**20:.1f}",
                      f"{s['peak_retained_kv_bytes'] / 2**20:.1f}")
    console.print(table)


def print_ideal_table(rows: list[dict], console: Console | None = None, on_leg: str = "bidir/P-cache-off") -> None:
    """Each conversation's longest prompt: TTFT with and without reading the history back against the ideal speedup
    (full prefill / (suffix prefill + raw NIXL read)) and the overlapped one (the read beside the suffix's compute,
    layer by layer), the ON turn's time outside compute and transfer, and TPOT."""
    table = Table(title=f"P-cache-off, each conversation's longest prompt: pd (OFF) against {on_leg} (ON)")
    for col in ("prompt tokens", "TTFT OFF", "TTFT ON", "speedup", "ideal summed", "/summed", "ideal overlapped",
                "/overlapped", "suffix prefill", "D->P read", "of it hidden", "raw read", "other (ON)", "TPOT OFF",
                "TPOT ON"):
        table.add_column(col, justify="right")
    ms = lambda value, digits=0: "-" if value is None else f"{value:.{digits}f} ms"  # noqa: E731
    for r in rows:
        table.add_row(str(r["prompt_tokens"]), ms(r["ttft_off_ms"]), ms(r["ttft_on_ms"]), f"{r['measured_speedup']:.1f}x",
                      f"{r['ideal_speedup']:.1f}x", f"{r['fraction_of_ideal']:.0%}",
                      f"{r['overlapped_ideal_speedup']:.1f}x", f"{r['fraction_of_overlapped_ideal']:.0%}",
                      ms(r["suffix_prefill_ms"]), ms(r["d_to_p_read_ms"], 1), ms(r.get("d_to_p_read_hidden_ms"), 1),
                      ms(r["raw_nixl_read_ms"], 1), ms(r["other_ms"], 1),
                      ms(r["tpot_off_ms"], 1), ms(r["tpot_on_ms"], 1))
    (console or Console()).print(table)


def _buckets(result: RunResult, later_turns: bool | None = None):
    """Requests by prompt-length bucket; later_turns True/False keeps only turns after the first / first turns."""
    rows = {}
    for r in result.requests:
        if later_turns is not None and (r.turn > 0) != later_turns:
            continue
        if r.error is None and not r.warmup and r.input_num_tokens:
            rows.setdefault(r.input_num_tokens // BUCKET_TOKENS, []).append(r)
    return dict(sorted(rows.items()))


def plot_all(results: dict[str, RunResult], out_dir: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, later, title in ((axes[0], True, "later turns (a history to reuse)"), (axes[1], False, "first turns")):
        for name, result in results.items():
            buckets = _buckets(result, later)
            xs = [(b + 0.5) * BUCKET_TOKENS for b in buckets]
            ax.plot(xs, [np.mean([r.ttft_ms for r in rs]) for rs in buckets.values()], marker="o", label=name)
        ax.set(xlabel="prompt length (tokens, 1k buckets)", title=title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean TTFT (ms)")
    axes[0].legend(fontsize=8)
    fig.suptitle("TTFT against prompt length")
    paths["ttft_vs_prompt"] = save_figure(fig, out_dir / "ttft_vs_prompt.png")

    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 4), sharey=True, squeeze=False)
    parts = [(label, key, color) for (label, key), color in zip(SPLIT_PARTS, SPLIT_COLORS)]
    for ax, (name, result) in zip(axes[0], results.items()):
        buckets = _buckets(result, later_turns=True)
        labels = [f"{b}k" for b in buckets]
        bottom = np.zeros(len(buckets))
        for label, key, color in parts:
            values = np.array([np.mean([r.in_ttft(key) for r in rs]) for rs in buckets.values()])
            ax.bar(labels, values, bottom=bottom, label=label, color=color)
            bottom += values
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("prompt bucket")
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_ylabel("ms (mean per request)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("Time to first token of later turns: compute, transfer and the rest")
    paths["prefill_split"] = save_figure(fig, out_dir / "prefill_split.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(results)
    means = [np.mean([s.duration_s for s in r.sessions if s.duration_s and not s.failed] or [0]) for r in results.values()]
    ax.bar(names, means, color="#4c72b0")
    ax.set(ylabel="mean completed-session time (s)", title="Session completion time")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    paths["session_time"] = save_figure(fig, out_dir / "session_time.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, result in results.items():
        if result.retained_kv:
            t, b = zip(*result.retained_kv)
            ax.plot(t, np.array(b) / 2**20, label=name)
    ax.set(xlabel="seconds since start", ylabel="MiB", title="KV retained on decode workers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths["retained_kv"] = save_figure(fig, out_dir / "retained_kv.png")
    return paths


def save_figure(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


PAGE_STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto}
table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px}th{background:#f3f3f3}
.verdict{font-size:16px;line-height:1.5;background:#eef5ee;padding:1em;border-left:4px solid #4c8c4c}"""
SPLIT_PARTS = (("prefill compute", "prefill_compute_ms"), ("D->P read", "d_to_p_read_ms"),
               ("P->D read", "p_to_d_read_ms"), ("compute on D", "decode_compute_ms"),
               ("other: router, side channel, queues", "other_ms"))
SPLIT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#999999")


def html_table(columns, rows) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def html_page(title: str, body: str, plots: dict[str, Path]) -> str:
    """One self-contained page: the body, then each plot embedded."""
    images = "".join(f'<h2>{html.escape(name)}</h2><img src="data:image/png;base64,'
                     f'{base64.b64encode(p.read_bytes()).decode()}" style="max-width:100%">'
                     for name, p in plots.items())
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{PAGE_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}{images}</body></html>")


def ttft_split(result: RunResult) -> dict[str, float]:
    """Mean ms per request of each part of the time to first token, the time outside compute and transfer
    included as its own part."""
    ok = [r for r in result.requests if r.error is None and not r.warmup and r.ttft_ms is not None]
    return {key: float(np.mean([r.in_ttft(key) for r in ok])) if ok else 0.0 for _, key in SPLIT_PARTS}


def verdict(summaries: list[dict]) -> str:
    """The run in words: what bidirectional transfer did to whole sessions, decoding (TPOT) and TTFT against the same
    P/D leg without it, what decode workers retained for it, and how much of TTFT was neither compute nor transfer.
    A leg whose sessions took longer is called slower whatever its TTFT did: P's first token goes out ahead of D's
    stream, so a stalled decode worker shows in TPOT and session time only."""
    legs = {s["leg"]: s for s in summaries}
    words = []
    for cache in ("off", "on"):
        off, on = legs.get(f"pd/P-cache-{cache}"), legs.get(f"bidir/P-cache-{cache}")
        if off and on and off["ttft_ms"] and on["ttft_ms"]:
            words.append(f"With prefix caching {cache} on prefill, bidirectional transfer {pair_words(off, on)}, "
                         f"holding up to {on['peak_retained_kv_bytes'] / 2**20:.1f} MiB of retained KV on decode "
                         f"workers.")
    for s in summaries:
        ttft, other = s["ttft_ms"].get("p50"), s.get("other_ms", {}).get("p50")
        if ttft and other is not None:
            words.append(f"{s['leg']}: {other:.0f} ms of its {ttft:.0f} ms TTFT p50 is outside compute and transfer.")
    if not words:
        words = [f"{s['leg']}: TTFT p50 {s['ttft_ms'].get('p50', float('nan')):.0f} ms, {s['failed']} failed."
                 for s in summaries]
    return " ".join(words)


def pair_words(before: dict, after: dict) -> str:
    """"made sessions slower: session p50 from A to B s (B/A), TPOT p50 ..., TTFT p50 ...":
    sessions decide the word; without session times, TTFT does."""
    figures = [("session p50", "session_time_s", "s", "{:.1f}"), ("TPOT p50", "tpot_ms", "ms", "{:.1f}"),
               ("TTFT p50", "ttft_ms", "ms", "{:.0f}")]
    parts, ratios = [], {}
    for label, key, unit, form in figures:
        old, new = before[key].get("p50"), after[key].get("p50")
        if old and new is not None:
            ratios[key] = new / old
            parts.append(f"{label} from {form.format(old)} to {form.format(new)} {unit} ({new / old:.2f}x)")
    if "session_time_s" in ratios:
        slower = ratios["session_time_s"] > 1
        head = f"made sessions {'slower' if slower else 'faster'}"
        if slower and ratios.get("ttft_ms", 1) < 1:
            head += " though it cut TTFT"
    else:
        head = "cut TTFT" if ratios["ttft_ms"] < 1 else "did not cut TTFT"
    return f"{head}: " + ", ".join(parts)


def _details(extra: dict) -> str:
    """Each entry of `extra` as a table of its fields (nested values as compact JSON)."""
    parts = []
    for name, value in extra.items():
        if value is None:
            continue
        rows = value.items() if isinstance(value, dict) else [("value", value)]
        cells = [[k, v if isinstance(v, (str, int)) else f"{v:.4g}" if isinstance(v, float) else json.dumps(v)]
                 for k, v in rows]
        parts.append(f"<h3>{html.escape(name)}</h3>{html_table(('field', 'value'), cells)}")
    return "".join(parts)


def cell(stats: dict, key: str, form: str) -> str:
    """A percentile for a table, or '-' where the leg has none (a colocated leg has no time outside its worker)."""
    value = stats.get(key)
    return "-" if value is None or value != value else form.format(value)


def write_html(path: Path, title: str, summaries: list[dict], plots: dict[str, Path], extra: dict,
               splits: dict[str, dict] | None = None, words: str | None = None, spread_html: str = "",
               sections: str = "") -> Path:
    """The page; `words`: a verdict other than this run's (a repeated run's), `spread_html` shown after it;
    `sections`: more of the page (HTML), after the tables."""
    head = ["leg", "ok", "failed", "TTFT p50 ms", "TTFT p90 ms", "other p50 ms", "TPOT p50 ms", "session p50 s",
            "reuse / declines", "D->P MiB", "P->D MiB", "peak retained MiB"]
    rows = [[s["leg"], s["requests"] - s["failed"], s["failed"], f"{s['ttft_ms'].get('p50', 0):.0f}",
             f"{s['ttft_ms'].get('p90', 0):.0f}", cell(s.get("other_ms", {}), "p50", "{:.0f}"),
             f"{s['tpot_ms'].get('p50', 0):.1f}", f"{s['session_time_s'].get('p50', 0):.1f}",
             ", ".join(f"{k} {v}" for k, v in sorted(s["reuse_outcomes"].items())),
             f"{s['bytes_d_to_p'] / 2**20:.1f}", f"{s['bytes_p_to_d'] / 2**20:.1f}",
             f"{s['peak_retained_kv_bytes'] / 2**20:.1f}"] for s in summaries]
    split_table = ""
    if splits:
        split_rows = [[leg] + [f"{split[key]:.1f}" for _, key in SPLIT_PARTS] for leg, split in splits.items()]
        split_table = ("<h2>Where the time to first token goes (mean ms per request)</h2>"
                       + html_table(["leg"] + [name for name, _ in SPLIT_PARTS], split_rows))
    body = (f"<p class=verdict>{html.escape(words or verdict(summaries))}</p>{spread_html}"
            f"{html_table(head, rows)}{split_table}"
            f"{sections}<h2>Details</h2>{_details(extra)}")
    path.write_text(html_page(title, body, plots))
    return path
