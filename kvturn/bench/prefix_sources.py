"""Where each later turn's prompt came from, per leg: P's pool (its prefix cache), P's host tier (the prefix cache's
second tier), D's pool or D's host tier (a retained lease read back over NIXL), or computed. Tokens summed over the
later turns of a leg (a first turn has no history), from each turn's own account (the response's `kvturn` object)."""
from kvturn.bench.client import RunResult

SOURCES = ("P pool", "P host", "D pool", "D host", "computed")


def turn_sources(record) -> dict[str, int]:
    """One turn's prompt tokens by where their KV came from: P's account, or D's on the compute-on-decode path (D
    computed the new tokens on the history it held)."""
    if record.path == "compute_on_decode" and record.decode_tokens_computed is not None:
        computed = min(record.decode_tokens_computed, record.input_num_tokens or 0)
        return {"P pool": 0, "P host": 0, "D pool": (record.input_num_tokens or 0) - computed, "D host": 0,
                "computed": computed}
    cached = record.prompt_tokens_cached_prefill or 0
    from_host = record.prompt_tokens_cached_prefill_host or 0
    from_decode = record.prompt_tokens_from_decode or 0
    d_tier = "D host" if record.kv_tier == "host" else "D pool"
    sources = {"P pool": cached - from_host, "P host": from_host, "D pool": 0, "D host": 0}
    sources[d_tier] = from_decode
    sources["computed"] = max((record.input_num_tokens or 0) - sum(sources.values()), 0)
    return sources


def leg_sources(result: RunResult) -> dict:
    """Later turns' prompt tokens by source, their shares, and how many turns took most of their prompt from each."""
    later = [r for r in result.requests if r.error is None and not r.warmup and r.turn > 0]
    tokens = dict.fromkeys(SOURCES, 0)
    mostly = dict.fromkeys(SOURCES, 0)
    for record in later:
        sources = turn_sources(record)
        for source, count in sources.items():
            tokens[source] += count
        mostly[max(SOURCES, key=lambda s: sources[s])] += 1
    total = sum(tokens.values())
    return {"later_turns": len(later), "tokens": tokens,
            "share": {s: (tokens[s] / total if total else 0.0) for s in SOURCES}, "turns_mostly_from": mostly}


def by_leg(results: dict[str, RunResult]) -> dict[str, dict]:
    return {leg: leg_sources(result) for leg, result in results.items()}


def print_table(sources: dict[str, dict], console) -> None:
    from rich.table import Table
    table = Table(title="where later turns' prompts came from: share of tokens (turns mostly from it)")
    table.add_column("leg", no_wrap=True)
    table.add_column("later turns", justify="right")
    for source in SOURCES:
        table.add_column(source, justify="right")
    for leg, row in sources.items():
        table.add_row(leg, str(row["later_turns"]),
                      *(f"{row['share'][s]:.0%} ({row['turns_mostly_from'][s]})" for s in SOURCES))
    console.print(table)


def markdown(sources: dict[str, dict]) -> str:
    lines = ["", "## Where later turns' prompts came from", "",
             "Share of later turns' prompt tokens by source (turns that took most of their prompt from it).", "",
             "| leg | later turns | " + " | ".join(SOURCES) + " |", "|---|---:|" + "---:|" * len(SOURCES)]
    for leg, row in sources.items():
        cells = " | ".join(f"{row['share'][s]:.0%} ({row['turns_mostly_from'][s]})" for s in SOURCES)
        lines.append(f"| {leg} | {row['later_turns']} | {cells} |")
    return "\n".join(lines) + "\n"
