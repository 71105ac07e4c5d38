"""Where a leg's later turns met their history: whether the prefill worker that served a turn also served the
conversation's previous turn (the router's choice of P, `--prefill-choice`), whether that P's prefix cache still
held the history, and what each kind of turn cost (where its tokens came from: prefix_sources.py)."""
import statistics
from collections import defaultdict

HELD_SHARE = 0.5  # a P "holds" a turn's history when its cache gave at least this share of the previous prompt


def _p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def placement(requests) -> dict:
    """The measures above over the run's successful, measured later turns (turn > 0, its previous turn answered)."""
    by_conversation = defaultdict(dict)
    for r in requests:
        if r.error is None and not r.warmup:
            by_conversation[r.conversation_id][r.turn] = r
    later, same, held = 0, 0, 0
    ttft_same, ttft_other = [], []
    for turns in by_conversation.values():
        for index, r in sorted(turns.items()):
            previous = turns.get(index - 1)
            if index == 0 or previous is None:
                continue
            later += 1
            cached = r.prompt_tokens_cached_prefill or 0
            met = bool(r.prefill_worker) and r.prefill_worker == previous.prefill_worker
            same += met
            held += cached >= HELD_SHARE * (previous.input_num_tokens or 0) > 0
            if r.ttft_ms is not None and r.prefill_worker:
                (ttft_same if met else ttft_other).append(r.ttft_ms)
    return {"later_turns": later,
            "same_p_share": same / later if later else None,
            "p_cache_held_share": held / later if later else None,
            "later_ttft_p50_ms_same_p": _p50(ttft_same), "later_ttft_p50_ms_other_p": _p50(ttft_other)}


def placement_text(summaries: list[dict], topology: str, prefill_choice: str) -> str:
    """One line per P/D leg: how often a later turn met the P of its previous turn and a P cache holding it."""
    pct = lambda share: "-" if share is None else f"{share:.0%}"  # noqa: E731
    ms = lambda value: "-" if value is None else f"{value:.0f} ms"  # noqa: E731
    lines = [f"prefill choice {prefill_choice} on {topology}: later turns that met the P of their previous turn, "
             f"that met a P whose cache held >= {HELD_SHARE:.0%} of it, TTFT p50 same P / other P"]
    for s in summaries:
        p = s.get("placement") or {}
        if p.get("later_turns") and (p.get("later_ttft_p50_ms_same_p") or p.get("later_ttft_p50_ms_other_p")):
            links = s.get("link_bytes") or {}
            carried = sum(way["out"] for way in links.values()) / 2**20 if links else None
            lines.append(f"  {s['leg']}: same P {pct(p['same_p_share'])}, P cache held {pct(p['p_cache_held_share'])}"
                         f", TTFT p50 {ms(p['later_ttft_p50_ms_same_p'])} / {ms(p['later_ttft_p50_ms_other_p'])}"
                         + (f"; links carried {carried:.1f} MiB" if carried is not None else ""))
    return "\n".join(lines)
