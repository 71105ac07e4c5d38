"""`kvturn bench`: measure a running server, or launch each deployment leg in turn and compare them."""
from pathlib import Path
from typing import Optional

import typer

from kvturn.bench import catalog
from kvturn.commands.common import ModelOption, chosen_legs, command_line, option, resolve_model
from kvturn.config import EngineConfig, RouterConfig

def spec_topology(scenario: str) -> str:
    spec = catalog.SCENARIOS.get(scenario)
    return (spec.topology if spec else None) or "1P1D"


def bench_layout(topology: str, prefill_choice: str, hosts: str, link: Optional[str], compare: bool):
    """Every leg's stack shape from the bench's options, each checked."""
    from kvturn.bench.topology import HOSTS, Layout, Topology
    from kvturn.config import PREFILL_CHOICES
    try:
        shape = Topology.parse(topology)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if prefill_choice not in PREFILL_CHOICES:
        raise typer.BadParameter(f"--prefill-choice must be one of {PREFILL_CHOICES}")
    if hosts not in HOSTS:
        raise typer.BadParameter(f"--hosts must be one of {HOSTS}")
    if not compare and hosts != "one":
        raise typer.BadParameter("--hosts places the stacks --compare launches")
    if link is not None and hosts != "netns":
        raise typer.BadParameter("--link shapes the namespaces' links: give --hosts netns")
    if link is not None:
        from kvturn.bench.netns import Link
        try:
            Link.parse(link)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return Layout(shape, prefill_choice, hosts, link)


def bench(
    url: Optional[str] = typer.Option(None, help="OpenAI-compatible server to measure (kvturn, vLLM, ...)"),
    compare: bool = typer.Option(False, "--compare", help="launch each local deployment leg in turn and compare"),
    scenario: str = typer.Option("sweep", help=catalog.scenarios_help()),
    workload_file: Optional[Path] = typer.Option(None, "--workload", help="JSON workload: vLLM's conversation list, "
                                                                          "its generate_conversations config, or a "
                                                                          "kvturn_synthetic config"),
    legs: Optional[str] = typer.Option(None, help=catalog.legs_help()),
    repeats: int = typer.Option(1, "--repeats", min=1, help="with --compare: run the legs this many times, "
                                "interleaved, each repeat on fresh stacks, and report each figure's median and range"),
    gap_scale: float = typer.Option(1.0, "--gap-scale", min=0.0, help="multiply every think time between turns "
                                    "(coding-agent's median 5.2 s and p99 81 s; 0.05 makes them seconds)"),
    sessions: Optional[int] = typer.Option(None, help="sessions of a scenario, all at once (default: the scenario's); "
                                            "with --workload, how many of its conversations run in parallel"),
    max_turns: Optional[int] = typer.Option(None, help="cut every conversation after this many turns"),
    turns: int = typer.Option(4, help="turns per session in the built-in scenarios"),
    max_prompt_tokens: int = typer.Option(8192, help="longest first-turn prompt of the sweep; the context a "
                                          "coding-agent session grows to (its sizes scale with it)"),
    request_rate: float = typer.Option(0.0, help="requests per second, Poisson arrivals (0: as fast as sessions go)"),
    warmup_turns: int = typer.Option(0, help="leading turns of each session left out of the statistics"),
    limit_min_tokens: Optional[int] = typer.Option(None, help="floor on answer tokens per turn"),
    limit_max_tokens: Optional[int] = typer.Option(None, help="cap on answer tokens per turn"),
    seed: int = typer.Option(0),
    model: Optional[Path] = ModelOption,
    kv_cache_mb: int = option(EngineConfig, "kv_cache_mb"),
    pin_workers: bool = typer.Option(False, "--pin-workers", help="with --compare: prefill workers on half of this "
                                     "machine's cores, decode workers on the other half, one thread a core, as on "
                                     "machines of their own (a colocated worker, the router and the client: all)"),
    topology: Optional[str] = typer.Option(None, help="with --compare: prefill and decode workers of every P/D leg, "
                                           "e.g. 2P2D (default: the scenario's, else 1P1D; a colocated leg runs one "
                                           "worker)"),
    p_pool_share: Optional[float] = typer.Option(None, "--p-pool-share", min=0.01, max=10.0,
                                                 help="with --compare: size every prefill worker's KV pool so that "
                                                 "together they hold this share of the workload's live histories "
                                                 "(P's prefix cache under pressure; each still fits the longest "
                                                 "prompt); default: --kv-cache-mb"),
    prefill_choice: str = option(RouterConfig, "prefill_choice"),
    hosts: str = typer.Option("one", help="with --compare: one (every process on this host, UCX as it likes) or "
                              "netns (each worker, and the router with the client, in a network namespace of its "
                              "own behind a veth into one bridge, UCX over TCP only; needs root)"),
    link: Optional[str] = typer.Option(None, help="with --hosts netns: each namespace's link shaped to RATE:DELAY "
                                       "with tc, e.g. 25gbit:50us (default: unshaped)"),
    out: Optional[Path] = typer.Option(None, help="output directory (default results/bench-SCENARIO)"),
):
    """Multi-turn agent benchmark: TTFT, TPOT, session time, prefill split, reuse and bytes moved."""
    import asyncio
    import sys

    from rich.console import Console

    from kvturn.bench import client, compare as comparison, prefix_sources, report, spread, workload
    from kvturn.bench.machine import machine, write_json
    from kvturn.bench.placement import placement_text
    from kvturn.model.tokenizer import ChatTokenizer
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not compare and not url:
        raise typer.BadParameter("give --url URL, or --compare to launch local legs")
    if repeats > 1 and not compare:
        raise typer.BadParameter("--repeats needs --compare: each repeat starts fresh stacks")
    if scenario not in catalog.SCENARIOS:
        raise typer.BadParameter(f"scenario must be one of {sorted(catalog.SCENARIOS)}")
    layout = bench_layout(topology or spec_topology(scenario), prefill_choice, hosts, link, compare)
    model_dir = resolve_model(model)
    tokenizer = ChatTokenizer(model_dir)
    source = workload.TextSource(tokenizer)
    spec = catalog.SCENARIOS[scenario]
    if workload_file:
        try:
            conversations = workload.load_file(workload_file, tokenizer, seed)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    else:
        try:
            conversations = catalog.build_workload(scenario, source, seed, max_prompt_tokens, turns, sessions)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    for conv in conversations:
        for turn in conv.turns:
            turn.answer_tokens = max(turn.answer_tokens, limit_min_tokens or 1)
            if limit_max_tokens:
                turn.answer_tokens = min(turn.answer_tokens, limit_max_tokens)
    workload.scale_gaps(conversations, gap_scale)
    if p_pool_share is not None:
        import dataclasses

        from kvturn.bench.topology import prefill_pool_mb
        layout = dataclasses.replace(layout, prefill_kv_cache_mb=prefill_pool_mb(
            conversations, tokenizer.count, model_dir, p_pool_share, layout.topology.prefill))
    name = workload_file.stem if workload_file else scenario
    out_dir = out or Path("results") / f"bench-{name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"workload {name}: {len(conversations)} conversations, "
                  f"{sum(len(c.turns) for c in conversations)} turns")
    link_measure = None
    if compare:
        chosen = chosen_legs(legs) if legs else list(catalog.default_legs(scenario))
        with comparison.hosts_of(layout) as layout:  # --hosts netns: the namespaces live as long as the legs
            runs = comparison.run_repeats(repeats, model_dir, chosen, spec, conversations, seed, kv_cache_mb,
                                          out_dir / "logs", console, source, sessions, pin_workers, layout)
            ideals = [comparison.ideal_speedup(run, model_dir, layout) for run in runs]
            whole_read = [comparison.ideal_speedup(run, model_dir, layout, catalog.ON_LEGS[1]) for run in runs]
            link_measure = comparison.link_ideal(model_dir, layout)
            if link_measure:
                console.print(comparison.link_text(link_measure))
    else:
        runs = [{url: asyncio.run(client.run(url, conversations, sessions=sessions or spec.sessions,
                                             request_rate=request_rate, warmup_turns=warmup_turns,
                                             max_turns=max_turns, seed=seed, count_tokens=tokenizer.count,
                                             ignore_eos=spec.ignore_eos))}]
        ideals, whole_read = [None], [None]
    results = runs[0]
    every_summary = [[report.summarize(leg, result) for leg, result in run.items()] for run in runs]
    summaries = every_summary[0]
    ideal = ideals[0]
    info = machine()
    leg_spreads, ratios = spread.leg_spreads(every_summary), spread.ratio_spreads(every_summary)
    words = spread.verdict(leg_spreads, ratios, repeats) if repeats > 1 else report.verdict(summaries)
    console.print(words)
    retention = report.retention_words(summaries)  # the first repeat's, with its counters
    if retention:
        console.print(retention)
    pinned = ", P and D pinned to their own cores" if compare and pin_workers else ""
    title = f"kvturn bench: {name} ({info['cpu']}, {info['cores']} cores{pinned}; {layout.describe()})"
    if repeats > 1:
        spread.print_tables(leg_spreads, ratios, f"{title}, median (min-max) over {repeats} repeats", console)
    else:
        report.print_table(summaries, title, console)
    sources = prefix_sources.by_leg(results)
    prefix_sources.print_table(sources, console)
    answers = comparison.answers_equal(results) if compare else None
    if compare:
        console.print(placement_text(summaries, str(layout.topology), layout.prefill_choice))
    if answers:
        console.print(comparison.answers_text(answers))
    if whole_read[0] and "ideal_speedup" in whole_read[0]:
        report.print_ideal_table(whole_read[0]["by_length"], console, catalog.ON_LEGS[1])
    if ideal and "ideal_speedup" in ideal:
        report.print_ideal_table(ideal["by_length"], console)
        console.print(f"longest prompt {ideal['prompt_tokens']} tokens: TTFT {ideal['ttft_off_ms']:.0f} ms (OFF) -> "
                      f"{ideal['ttft_on_ms']:.0f} ms (ON) = {ideal['measured_speedup']:.2f}x; ideal "
                      f"{ideal['ideal_speedup']:.2f}x (full prefill {ideal['full_prefill_ms']:.0f} ms / (suffix "
                      f"{ideal['suffix_prefill_ms']:.0f} ms + raw NIXL read {ideal['raw_nixl_read_ms']:.1f} ms)); "
                      f"measured/ideal {ideal['fraction_of_ideal']:.0%}; time outside compute and transfer in the ON "
                      f"turn: {ideal['other_ms']:.0f} ms (router, side channel, queues)")
    elif ideal:
        console.print(f"ideal speedup: {ideal.get('note')}")
    ideal_spread = spread.ideal_spread(ideals)
    if ideal_spread and repeats > 1:
        console.print(spread.ideal_text(ideal_spread))
    shown = conversations[0].conversation_id if spec.show_conversation and conversations else None
    if shown:
        from kvturn.bench import transcript
        transcript.print_conversation(results, shown, console)
    paths_verdict = comparison.path_verdict(summaries) if compare else None
    if paths_verdict:
        v = paths_verdict
        console.print(f"three paths: adaptive TTFT p50 {v['adaptive_ttft_p50_ms']:.0f} ms = {v['ttft_ratio']:.2f}x the "
                      f"better fixed path ({v['better_fixed_ttft_p50_ms']:.0f} ms); TPOT p90 {v['tpot_ratio']:.2f}x "
                      f"pull only; adaptive took {v['adaptive_paths']}; predicted TTFT within 20%: "
                      + ", ".join(f"{k} {x:.0%}" for k, x in v["predicted_within_20pct"].items() if x is not None))
    # the first repeat where it always was (what kvturn plan reads), the others after it, every one raw
    payload = {"scenario": name, "description": spec.description if not workload_file else str(workload_file),
               "machine": info, "command": command_line(), "pin_workers": bool(compare and pin_workers), "seed": seed,
               "layout": {"topology": str(layout.topology), "prefill_choice": layout.prefill_choice,
                          "hosts": layout.hosts, "link": layout.link, "measured_link": link_measure,
                          "prefill_kv_cache_mb": layout.prefill_kv_cache_mb,
                          "kv_cache_mb": kv_cache_mb, "p_pool_share": p_pool_share},
               "gap_scale": gap_scale, "repeats": repeats, "verdict": {"text": words, "retention": retention},
               "summaries": summaries, "prefix_sources": sources, "answers_equal": answers,
               "ideal_speedup": ideal, "ideal_speedup_whole_read": whole_read[0], "paths": paths_verdict,
               "conversation": shown and {"turns": transcript.turn_rows(results, shown),
                                          "messages": list(results.values())[-1].transcript},
               "legs": {leg: result.to_json() for leg, result in results.items()},
               "spread": {"legs": leg_spreads, "ratios": ratios,
                          "ideal_speedup": ideal_spread},
               "more_repeats": [{"summaries": s, "ideal_speedup": i,
                                 "legs": {leg: result.to_json() for leg, result in run.items()}}
                                for s, i, run in zip(every_summary[1:], ideals[1:], runs[1:])]}
    json_path = write_json(out_dir / "results.json", payload)
    summary_path = out_dir / "summary.md"
    summary_path.write_text(spread.markdown(f"kvturn bench: {name}", info, payload["command"], repeats, leg_spreads,
                                            ratios, " ".join(filter(None, (words, retention))), ideal_spread)
                             + prefix_sources.markdown(sources))
    plots = report.plot_all(results, out_dir)
    html_path = report.write_html(out_dir / "report.html", f"kvturn bench: {name}", summaries, plots,
                                  {"machine": info, "ideal_speedup": ideal, "three paths": paths_verdict,
                                   "scenario": payload["description"]},
                                  splits={leg: report.ttft_split(result) for leg, result in results.items()},
                                  words=" ".join(filter(None, (words, retention))), spread_html=spread.html(leg_spreads, ratios, repeats),
                                  sections=transcript.html_section(results, shown) if shown else "")
    console.print(f"JSON: {json_path}\nsummary: {summary_path}\nplots: {', '.join(str(p) for p in plots.values())}"
                  f"\nHTML report: {html_path}")
    failed = sum(s["failed"] for summaries in every_summary for s in summaries)
    raise typer.Exit(1 if failed else 0)
