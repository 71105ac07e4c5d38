"""The `kvturn` command line."""
import logging
from pathlib import Path
from typing import Optional

import typer

from kvturn.config import EngineConfig

app = typer.Typer(help="kvturn: prefill/decode disaggregated serving with bidirectional KV transfer.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

ModelOption = typer.Option(None, "--model", help="Hugging Face model directory (default: the embedded tiny model, "
                                                 "written on first use)")


def resolve_model(model: Optional[Path], preset: str = "tiny") -> str:
    from kvturn.model.make_model import default_model_dir
    return str(model) if model else str(default_model_dir(preset))


@app.command("make-model")
def make_model_cmd(out: Path = typer.Option(..., "--out", help="directory to write"),
                   preset: str = typer.Option("tiny", help="tiny or small"),
                   seed: int = typer.Option(0, help="weight seed; same seed, same bytes")):
    """Write a Hugging Face-format Qwen3 model directory with seeded random weights and a BPE tokenizer."""
    from kvturn.model.make_model import PRESETS, make_model
    if preset not in PRESETS:
        raise typer.BadParameter(f"preset must be one of {sorted(PRESETS)}")
    path = make_model(out, preset=preset, seed=seed)
    typer.echo(f"wrote {path}")


@app.command()
def worker(
    port: int = typer.Option(8100, help="HTTP port (OpenAI API and KV side channel)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    model: Optional[Path] = ModelOption,
    role: str = typer.Option("both", help="prefill, decode or both (colocated)"),
    bidirectional: bool = typer.Option(False, "--bidirectional/--no-bidirectional",
                                       help="decode retains finished KV for the next turn's prefill to read back"),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching"),
    served_model_name: Optional[str] = typer.Option(None, help="model name in the API (default: the directory name)"),
    block_size: int = typer.Option(16, help="tokens per KV block"),
    kv_cache_mb: int = typer.Option(512, help="size of the KV pool, MiB"),
    max_num_seqs: int = typer.Option(32, help="most requests running at once"),
    max_num_batched_tokens: int = typer.Option(8192, help="token budget of one step (chunked prefill)"),
    max_model_len: Optional[int] = typer.Option(None, help="longest prompt + completion (default: the model's)"),
    kv_recompute_threshold_tokens: int = typer.Option(64, help="read remote KV only if it saves at least this many "
                                                               "tokens"),
    decoder_kv_blocks_ttl_s: float = typer.Option(480.0, help="how long decode retains a finished turn's KV, s"),
    kv_pin_timeout_s: float = typer.Option(30.0, help="how long prefill pins a prompt's KV for decode to read, s"),
    kv_read_timeout_s: float = typer.Option(5.0, help="give up on a remote KV read after this long, s"),
    kv_expiry_margin_s: float = typer.Option(5.0, help="decline a remote read whose lease ends within this, s"),
    retained_kv_budget_mb: Optional[int] = typer.Option(None, help="most KV retained under leases, MiB (oldest "
                                                                   "reclaimed first)"),
    cluster_secret: Optional[str] = typer.Option(None, envvar="KVTURN_CLUSTER_SECRET",
                                                 help="shared secret peers must present on the side channel"),
    advertise_host: Optional[str] = typer.Option(None, help="address peers use to reach this worker"),
    side_channel_timeout_s: float = typer.Option(5.0, help="give up on a peer's side channel after this long, s"),
    log_level: str = typer.Option("info"),
):
    """Run one worker: engine + NIXL agent + OpenAI-compatible API."""
    import uvicorn

    from kvturn.server.app import create_app
    from kvturn.server.worker_config import ROLES, WorkerConfig
    if role not in ROLES:
        raise typer.BadParameter(f"role must be one of {ROLES}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = EngineConfig(block_size=block_size, kv_cache_mb=kv_cache_mb, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                          enable_prefix_caching=prefix_caching,
                          kv_recompute_threshold_tokens=kv_recompute_threshold_tokens,
                          decoder_kv_blocks_ttl_s=decoder_kv_blocks_ttl_s, kv_pin_timeout_s=kv_pin_timeout_s,
                          kv_read_timeout_s=kv_read_timeout_s, kv_expiry_margin_s=kv_expiry_margin_s,
                          retained_kv_budget_mb=retained_kv_budget_mb)
    config = WorkerConfig(model_dir=resolve_model(model), role=role, host=host, port=port,
                          advertise_host=advertise_host, served_model_name=served_model_name,
                          bidirectional=bidirectional, cluster_secret=cluster_secret,
                          side_channel_timeout_s=side_channel_timeout_s, engine=engine)
    uvicorn.run(create_app(config), host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)


@app.command()
def router(
    prefill: list[str] = typer.Option(..., "--prefill", help="prefill worker URL (repeat for several)"),
    decode: list[str] = typer.Option(..., "--decode", help="decode worker URL (repeat for several)"),
    port: int = typer.Option(8000, help="HTTP port"),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    conversation_ttl_s: float = typer.Option(450.0, help="how long the router remembers a conversation's lease, s "
                                                         "(keep it below the decode TTL)"),
    state: Optional[Path] = typer.Option(None, "--state", help="SQLite file that keeps the conversation table "
                                                               "across restarts"),
    max_in_flight_per_decode: int = typer.Option(32, help="a conversation's decode worker is skipped above this load"),
    upstream_timeout_s: float = typer.Option(120.0, help="give up on a worker that sends nothing for this long, s"),
    health_interval_s: float = typer.Option(2.0, help="how often dead workers are probed, s"),
    log_level: str = typer.Option("info"),
):
    """Run the KV-aware router in front of prefill and decode workers."""
    import uvicorn

    from kvturn.router.app import RouterConfig, create_app
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = RouterConfig(prefill_urls=prefill, decode_urls=decode, conversation_ttl_s=conversation_ttl_s,
                          state_path=str(state) if state else None, max_in_flight_per_decode=max_in_flight_per_decode,
                          request_timeout_s=upstream_timeout_s, health_interval_s=health_interval_s)
    uvicorn.run(create_app(config), host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)


@app.command()
def serve(
    port: int = typer.Option(8000, help="router port; workers take the next two"),
    model: Optional[Path] = ModelOption,
    bidirectional: bool = typer.Option(True, "--bidirectional/--no-bidirectional",
                                       help="read the history back from decode (D->P) on later turns"),
    prefix_caching_on_prefill: bool = typer.Option(True, "--prefix-caching-on-prefill/--no-prefix-caching-on-prefill",
                                                   help="off emulates a prefill cache miss, as in vLLM's published run"),
    kv_cache_mb: int = typer.Option(1024, help="KV pool of each worker, MiB"),
    decoder_kv_blocks_ttl_s: float = typer.Option(480.0, help="decode's retention lease, s"),
    kv_recompute_threshold_tokens: int = typer.Option(64, help="least reusable tokens worth a read"),
    retained_kv_budget_mb: Optional[int] = typer.Option(None, help="cap on KV retained by decode, MiB"),
    cluster_secret: Optional[str] = typer.Option(None, envvar="KVTURN_CLUSTER_SECRET"),
    log_dir: Optional[Path] = typer.Option(None, help="write each process's log here"),
):
    """Start router + 1 prefill + 1 decode worker on this machine; Ctrl-C stops them all."""
    import signal
    import time

    from kvturn import launch
    model_dir = resolve_model(model)
    p_port, d_port = port + 1, port + 2
    common = ["--model", model_dir, "--kv-cache-mb", str(kv_cache_mb),
              "--kv-recompute-threshold-tokens", str(kv_recompute_threshold_tokens),
              "--decoder-kv-blocks-ttl-s", str(decoder_kv_blocks_ttl_s),
              "--bidirectional" if bidirectional else "--no-bidirectional"]
    if cluster_secret:
        common += ["--cluster-secret", cluster_secret]
    p_args = ["worker", "--role", "prefill", "--port", str(p_port), *common]
    if not prefix_caching_on_prefill:
        p_args.append("--no-prefix-caching")
    d_args = ["worker", "--role", "decode", "--port", str(d_port), *common]
    if retained_kv_budget_mb is not None:
        d_args += ["--retained-kv-budget-mb", str(retained_kv_budget_mb)]
    logs = (lambda name: log_dir / f"{name}.log") if log_dir else (lambda name: None)
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    children = [launch.start(p_args, logs("prefill")), launch.start(d_args, logs("decode"))]
    stopping = False

    def shutdown(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    try:
        for child, child_port in zip(children, (p_port, d_port)):
            launch.wait_healthy(f"http://127.0.0.1:{child_port}", child)
        children.append(launch.start(["router", "--port", str(port), "--prefill", f"http://127.0.0.1:{p_port}",
                                      "--decode", f"http://127.0.0.1:{d_port}"], logs("router")))
        launch.wait_healthy(f"http://127.0.0.1:{port}", children[-1])
        typer.echo(f"kvturn serving on http://127.0.0.1:{port}/v1 (prefill :{p_port}, decode :{d_port}, "
                   f"bidirectional {'on' if bidirectional else 'off'})")
        while not stopping and all(c.poll() is None for c in children):
            time.sleep(0.2)
    finally:
        for child in reversed(children):
            launch.stop(child)
    failed = [c for c in children if c.returncode not in (0, -15)]
    raise typer.Exit(1 if failed and not stopping else 0)


@app.command()
def bench(
    url: Optional[str] = typer.Option(None, help="OpenAI-compatible server to measure (kvturn, vLLM, ...)"),
    compare: bool = typer.Option(False, "--compare", help="launch each local deployment leg in turn and compare"),
    scenario: str = typer.Option("sweep", help="sweep, no-reuse, resume-after-ttl, edited-history, short-turns, "
                                               "concurrent"),
    workload_file: Optional[Path] = typer.Option(None, "--workload", help="JSON workload: vLLM's conversation list, "
                                                                          "its generate_conversations config, or a "
                                                                          "kvturn_synthetic config"),
    legs: str = typer.Option(",".join(["colocated", "pd/P-cache-on", "pd/P-cache-off", "bidir/P-cache-on",
                                       "bidir/P-cache-off"]), help="legs to run with --compare"),
    sessions: Optional[int] = typer.Option(None, help="sessions (clients) in parallel (default: the scenario's)"),
    max_turns: Optional[int] = typer.Option(None, help="cut every conversation after this many turns"),
    turns: int = typer.Option(4, help="turns per session in the built-in scenarios"),
    max_prompt_tokens: int = typer.Option(8192, help="longest first-turn prompt of the sweep"),
    request_rate: float = typer.Option(0.0, help="requests per second, Poisson arrivals (0: as fast as sessions go)"),
    warmup_turns: int = typer.Option(0, help="leading turns of each session left out of the statistics"),
    limit_min_tokens: Optional[int] = typer.Option(None, help="floor on answer tokens per turn"),
    limit_max_tokens: Optional[int] = typer.Option(None, help="cap on answer tokens per turn"),
    seed: int = typer.Option(0),
    model: Optional[Path] = ModelOption,
    kv_cache_mb: int = typer.Option(512, help="KV pool of each launched worker, MiB"),
    out: Optional[Path] = typer.Option(None, help="output directory (default results/bench-SCENARIO)"),
):
    """Multi-turn agent benchmark: TTFT, TPOT, session time, prefill split, reuse and bytes moved."""
    import asyncio
    import sys

    from rich.console import Console

    from kvturn.bench import client, compare as comparison, report, workload
    from kvturn.bench.machine import machine, write_json
    from kvturn.model.tokenizer import ChatTokenizer
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not compare and not url:
        raise typer.BadParameter("give --url URL, or --compare to launch local legs")
    if scenario not in comparison.SCENARIOS:
        raise typer.BadParameter(f"scenario must be one of {sorted(comparison.SCENARIOS)}")
    model_dir = resolve_model(model)
    tokenizer = ChatTokenizer(model_dir)
    source = workload.TextSource(tokenizer)
    spec = comparison.SCENARIOS[scenario]
    if workload_file:
        conversations = workload.load_file(workload_file, tokenizer, seed)
    else:
        conversations = comparison.build_workload(scenario, source, seed, max_prompt_tokens, turns)
    for conv in conversations:
        for turn in conv.turns:
            turn.answer_tokens = max(turn.answer_tokens, limit_min_tokens or 1)
            if limit_max_tokens:
                turn.answer_tokens = min(turn.answer_tokens, limit_max_tokens)
    name = workload_file.stem if workload_file else scenario
    out_dir = out or Path("results") / f"bench-{name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"workload {name}: {len(conversations)} conversations, "
                  f"{sum(len(c.turns) for c in conversations)} turns")
    if compare:
        chosen = [leg.strip() for leg in legs.split(",") if leg.strip()]
        unknown = [leg for leg in chosen if leg not in comparison.LEGS]
        if unknown:
            raise typer.BadParameter(f"unknown legs {unknown}; choose from {list(comparison.LEGS)}")
        results = comparison.run_legs(model_dir, chosen, spec, conversations, seed, kv_cache_mb, out_dir / "logs",
                                      console, source, sessions)
    else:
        results = {url: asyncio.run(client.run(url, conversations, sessions=sessions or spec.sessions,
                                               request_rate=request_rate, warmup_turns=warmup_turns,
                                               max_turns=max_turns, seed=seed))}
    summaries = [report.summarize(leg, result) for leg, result in results.items()]
    ideal = comparison.ideal_speedup(results, model_dir) if compare else None
    info = machine()
    report.print_table(summaries, f"kvturn bench: {name} ({info['cpu']}, {info['cores']} cores)", console)
    if ideal and "ideal_speedup" in ideal:
        console.print(f"longest prompt {ideal['prompt_tokens']} tokens: TTFT {ideal['ttft_off_ms']:.0f} ms (OFF) -> "
                      f"{ideal['ttft_on_ms']:.0f} ms (ON) = {ideal['measured_speedup']:.2f}x; ideal "
                      f"{ideal['ideal_speedup']:.2f}x (full prefill {ideal['full_prefill_ms']:.0f} ms / (suffix "
                      f"{ideal['suffix_prefill_ms']:.0f} ms + raw NIXL read {ideal['raw_nixl_read_ms']:.1f} ms)); "
                      f"measured/ideal {ideal['fraction_of_ideal']:.0%}")
    elif ideal:
        console.print(f"ideal speedup: {ideal.get('note')}")
    payload = {"scenario": name, "description": spec.description if not workload_file else str(workload_file),
               "machine": info, "seed": seed, "summaries": summaries, "ideal_speedup": ideal,
               "legs": {leg: result.to_json() for leg, result in results.items()}}
    json_path = write_json(out_dir / "results.json", payload)
    plots = report.plot_all(results, out_dir)
    html_path = report.write_html(out_dir / "report.html", f"kvturn bench: {name}", summaries, plots,
                                  {"machine": info, "ideal_speedup": ideal, "scenario": payload["description"]})
    console.print(f"JSON: {json_path}\nplots: {', '.join(str(p) for p in plots.values())}\nHTML report: {html_path}")
    failed = sum(s["failed"] for s in summaries)
    raise typer.Exit(1 if failed else 0)


if __name__ == "__main__":
    app()
