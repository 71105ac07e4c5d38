"""The `kvturn` command line. Defaults and help of the settings come from the config dataclasses."""
import logging
from pathlib import Path
from typing import Optional

import typer

from kvturn.bench import catalog
from kvturn.config import (ConfigError, ConnectorConfig, EngineConfig, RouterConfig, SupervisorConfig,
                           WorkerConfig, default_of, help_of)

app = typer.Typer(help="kvturn: prefill/decode disaggregated serving with bidirectional KV transfer.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

ModelOption = typer.Option(None, "--model", help="Hugging Face model directory, or the name of a pulled model "
                                                 "(`kvturn models list`); default: the embedded tiny model, written "
                                                 "on first use")


def option(cls, name: str, *flags: str, **extra):
    """A command-line option whose default and help are those of the config field `cls.name`."""
    return typer.Option(default_of(cls, name), *flags, help=help_of(cls, name), **extra)


def build(cls, **values):
    """Make a config, turning a validation error into a usage error that names the setting."""
    try:
        return cls(**values)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None


def resolve_model(model: Optional[Path], preset: str = "tiny") -> str:
    from kvturn.model.pull import ModelNotFound, resolve
    try:
        return str(resolve(model, preset))
    except ModelNotFound as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None


def chosen_legs(legs: str) -> list[str]:
    """The comma-separated leg names of `kvturn bench --compare` and `kvturn plan`, each one known."""
    from kvturn.bench.catalog import LEGS
    chosen = [leg.strip() for leg in legs.split(",") if leg.strip()]
    unknown = [leg for leg in chosen if leg not in LEGS]
    if unknown:
        raise typer.BadParameter(f"unknown legs {unknown}; choose from {list(LEGS)}")
    return chosen


def command_line() -> str:
    """This command as a user would type it, for a report to say how it was made."""
    import shlex
    import sys
    return shlex.join(["kvturn", *sys.argv[1:]])


def setup_logging(level: str) -> None:
    from kvturn import logs
    logs.setup(level)


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
    port: int = option(WorkerConfig, "port"),
    host: str = option(WorkerConfig, "host"),
    model: Optional[Path] = ModelOption,
    role: str = option(WorkerConfig, "role"),
    bidirectional: bool = option(WorkerConfig, "bidirectional", "--bidirectional/--no-bidirectional"),
    served_model_name: Optional[str] = option(WorkerConfig, "served_model_name"),
    advertise_host: Optional[str] = option(WorkerConfig, "advertise_host"),
    max_logprobs: int = option(WorkerConfig, "max_logprobs"),
    default_max_output_tokens: int = option(WorkerConfig, "default_max_output_tokens"),
    unread_stream_timeout_s: float = option(WorkerConfig, "unread_stream_timeout_s"),
    max_body_mb: int = option(WorkerConfig, "max_body_mb"),
    register: Optional[str] = option(WorkerConfig, "register_url", "--register"),
    register_ttl_s: float = option(WorkerConfig, "register_ttl_s"),
    calibrate: bool = option(WorkerConfig, "calibrate", "--calibrate/--no-calibrate"),
    otlp_traces_endpoint: Optional[str] = option(WorkerConfig, "otlp_traces_endpoint"),
    prefix_caching: bool = option(EngineConfig, "enable_prefix_caching", "--prefix-caching/--no-prefix-caching"),
    prefix_host_mb: int = option(EngineConfig, "prefix_host_mb"),
    block_size: int = option(EngineConfig, "block_size"),
    kv_cache_mb: int = option(EngineConfig, "kv_cache_mb"),
    num_kv_blocks: Optional[int] = option(EngineConfig, "num_kv_blocks"),
    max_num_seqs: int = option(EngineConfig, "max_num_seqs"),
    max_num_batched_tokens: int = option(EngineConfig, "max_num_batched_tokens"),
    prefill_pack_tokens: int = option(EngineConfig, "prefill_pack_tokens"),
    max_model_len: Optional[int] = option(EngineConfig, "max_model_len"),
    dtype: str = option(EngineConfig, "dtype"),
    step_history_steps: int = option(EngineConfig, "step_history_steps"),
    kv_recompute_threshold_tokens: int = option(ConnectorConfig, "kv_recompute_threshold_tokens"),
    decoder_kv_blocks_ttl_s: float = option(ConnectorConfig, "decoder_kv_blocks_ttl_s"),
    kv_pin_timeout_s: float = option(ConnectorConfig, "kv_pin_timeout_s"),
    kv_read_timeout_s: float = option(ConnectorConfig, "kv_read_timeout_s"),
    kv_expiry_margin_s: float = option(ConnectorConfig, "kv_expiry_margin_s"),
    retained_kv_budget_mb: Optional[int] = option(ConnectorConfig, "retained_kv_budget_mb"),
    retained_host_mb: Optional[int] = option(ConnectorConfig, "retained_host_mb"),
    kv_lease_max_age_s: float = option(ConnectorConfig, "kv_lease_max_age_s"),
    side_channel_timeout_s: float = option(ConnectorConfig, "side_channel_timeout_s"),
    kv_read_overlap: bool = option(ConnectorConfig, "kv_read_overlap", "--kv-read-overlap/--no-kv-read-overlap"),
    kv_read_layer_wait_s: float = option(ConnectorConfig, "kv_read_layer_wait_s"),
    cluster_secret: Optional[str] = option(ConnectorConfig, "cluster_secret", envvar="KVTURN_CLUSTER_SECRET"),
    trusted_peer: list[str] = option(ConnectorConfig, "trusted_peers", "--trusted-peer"),
    log_level: str = typer.Option("info"),
):
    """Run one worker: engine + NIXL agent + OpenAI-compatible API."""
    from kvturn.http_server import run_server
    from kvturn.server.app import create_app
    engine = build(EngineConfig, block_size=block_size, kv_cache_mb=kv_cache_mb, num_kv_blocks=num_kv_blocks,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   prefill_pack_tokens=prefill_pack_tokens, max_model_len=max_model_len,
                   enable_prefix_caching=prefix_caching, prefix_host_mb=prefix_host_mb, dtype=dtype,
                   step_history_steps=step_history_steps)
    connector = build(ConnectorConfig, kv_recompute_threshold_tokens=kv_recompute_threshold_tokens,
                      decoder_kv_blocks_ttl_s=decoder_kv_blocks_ttl_s, kv_pin_timeout_s=kv_pin_timeout_s,
                      kv_read_timeout_s=kv_read_timeout_s, kv_expiry_margin_s=kv_expiry_margin_s,
                      retained_kv_budget_mb=retained_kv_budget_mb, retained_host_mb=retained_host_mb,
                      kv_lease_max_age_s=kv_lease_max_age_s, side_channel_timeout_s=side_channel_timeout_s,
                      kv_read_overlap=kv_read_overlap, kv_read_layer_wait_s=kv_read_layer_wait_s, cluster_secret=cluster_secret or None, trusted_peers=trusted_peer)
    config = build(WorkerConfig, model_dir=resolve_model(model), role=role, host=host, port=port,
                   advertise_host=advertise_host, served_model_name=served_model_name, bidirectional=bidirectional,
                   max_logprobs=max_logprobs, default_max_output_tokens=default_max_output_tokens,
                   unread_stream_timeout_s=unread_stream_timeout_s, max_body_mb=max_body_mb, register_url=register,
                   register_ttl_s=register_ttl_s, calibrate=calibrate,
                   otlp_traces_endpoint=otlp_traces_endpoint or None, engine=engine, connector=connector)
    setup_logging(log_level)
    run_server(create_app(config), host, port)


@app.command()
def router(
    prefill: list[str] = option(RouterConfig, "prefill_urls", "--prefill"),
    decode: list[str] = option(RouterConfig, "decode_urls", "--decode"),
    port: int = option(RouterConfig, "port"),
    host: str = option(RouterConfig, "host"),
    conversation_ttl_s: float = option(RouterConfig, "conversation_ttl_s"),
    max_conversations: int = option(RouterConfig, "max_conversations"),
    state: Optional[str] = option(RouterConfig, "state_path", "--state"),
    discover: Optional[str] = option(RouterConfig, "discover_url", "--discover"),
    max_in_flight_per_decode: int = option(RouterConfig, "max_in_flight_per_decode"),
    upstream_timeout_s: float = option(RouterConfig, "upstream_timeout_s"),
    no_worker_wait_s: float = option(RouterConfig, "no_worker_wait_s"),
    health_interval_s: float = option(RouterConfig, "health_interval_s"),
    max_body_mb: int = option(RouterConfig, "max_body_mb"),
    cluster_secret: Optional[str] = option(RouterConfig, "cluster_secret", envvar="KVTURN_CLUSTER_SECRET"),
    api_key: list[str] = option(RouterConfig, "api_keys", "--api-key", envvar="KVTURN_API_KEY"),
    admin_key: list[str] = option(RouterConfig, "admin_keys", "--admin-key", envvar="KVTURN_ADMIN_KEY"),
    expose_internals: bool = option(RouterConfig, "expose_internals", "--expose-internals/--no-expose-internals"),
    path_policy: str = option(RouterConfig, "path_policy"),
    stall_weight: float = option(RouterConfig, "stall_weight"),
    prefill_choice: str = option(RouterConfig, "prefill_choice"),
    prefill_spill_ms: float = option(RouterConfig, "prefill_spill_ms"),
    backend: str = option(RouterConfig, "backend"),
    tokenizer: Optional[str] = option(RouterConfig, "tokenizer_dir", "--tokenizer"),
    kv_recompute_threshold_tokens: int = option(RouterConfig, "kv_recompute_threshold_tokens"),
    vllm_retain_streamed_turns: bool = option(RouterConfig, "vllm_retain_streamed_turns",
                                              "--vllm-retain-streamed-turns/--no-vllm-retain-streamed-turns"),
    vllm_retention_lease_s: float = option(RouterConfig, "vllm_retention_lease_s"),
    trace_out: Optional[str] = option(RouterConfig, "trace_out"),
    session_header: list[str] = option(RouterConfig, "session_headers", "--session-header"),
    otlp_traces_endpoint: Optional[str] = option(RouterConfig, "otlp_traces_endpoint"),
    log_level: str = typer.Option("info"),
):
    """Run the KV-aware router in front of prefill and decode workers."""
    from kvturn.http_server import run_server
    from kvturn.router.app import create_app
    config = build(RouterConfig, prefill_urls=prefill, decode_urls=decode, host=host, port=port,
                   conversation_ttl_s=conversation_ttl_s, max_conversations=max_conversations,
                   state_path=state or None, discover_url=discover or None,
                   max_in_flight_per_decode=max_in_flight_per_decode,
                   upstream_timeout_s=upstream_timeout_s, no_worker_wait_s=no_worker_wait_s,
                   health_interval_s=health_interval_s, max_body_mb=max_body_mb,
                   cluster_secret=cluster_secret or None, api_keys=api_key, admin_keys=admin_key,
                   expose_internals=expose_internals, path_policy=path_policy,
                   stall_weight=stall_weight, prefill_choice=prefill_choice, prefill_spill_ms=prefill_spill_ms,
                   backend=backend,
                   tokenizer_dir=tokenizer if not tokenizer or Path(tokenizer).is_dir() else resolve_model(Path(tokenizer)),
                   kv_recompute_threshold_tokens=kv_recompute_threshold_tokens,
                   vllm_retain_streamed_turns=vllm_retain_streamed_turns,
                   vllm_retention_lease_s=vllm_retention_lease_s, trace_out=trace_out or None,
                   session_headers=session_header, otlp_traces_endpoint=otlp_traces_endpoint or None)
    setup_logging(log_level)
    run_server(create_app(config), host, port)


@app.command()
def serve(
    port: int = typer.Option(8000, help="router port; workers take the next two"),
    model: Optional[Path] = ModelOption,
    bidirectional: bool = typer.Option(True, "--bidirectional/--no-bidirectional",
                                       help="read the history back from decode (D->P) on later turns"),
    prefix_caching_on_prefill: bool = typer.Option(True, "--prefix-caching-on-prefill/--no-prefix-caching-on-prefill",
                                                   help="off emulates a prefill cache miss, as in vLLM's published run"),
    kv_cache_mb: int = option(EngineConfig, "kv_cache_mb"),
    decoder_kv_blocks_ttl_s: float = option(ConnectorConfig, "decoder_kv_blocks_ttl_s"),
    kv_recompute_threshold_tokens: int = option(ConnectorConfig, "kv_recompute_threshold_tokens"),
    retained_kv_budget_mb: Optional[int] = option(ConnectorConfig, "retained_kv_budget_mb"),
    retained_host_mb: Optional[int] = option(ConnectorConfig, "retained_host_mb"),
    prefix_host_mb: int = option(EngineConfig, "prefix_host_mb"),
    api_key: list[str] = option(RouterConfig, "api_keys", "--api-key", envvar="KVTURN_API_KEY"),
    admin_key: list[str] = option(RouterConfig, "admin_keys", "--admin-key", envvar="KVTURN_ADMIN_KEY"),
    expose_internals: bool = option(RouterConfig, "expose_internals", "--expose-internals/--no-expose-internals"),
    path_policy: str = option(RouterConfig, "path_policy"),
    no_worker_wait_s: float = option(RouterConfig, "no_worker_wait_s"),
    calibrate: bool = option(WorkerConfig, "calibrate", "--calibrate/--no-calibrate"),
    log_dir: Optional[Path] = typer.Option(None, help="write each process's log here (default: a new folder under "
                                                      "the kvturn cache, $KVTURN_CACHE_DIR/logs, printed at start)"),
    restart: bool = option(SupervisorConfig, "restart", "--restart/--no-restart"),
    restart_backoff_s: float = option(SupervisorConfig, "restart_backoff_s"),
    restart_backoff_max_s: float = option(SupervisorConfig, "restart_backoff_max_s"),
    restart_settled_s: float = option(SupervisorConfig, "restart_settled_s"),
    pin_workers: bool = typer.Option(False, "--pin-workers", help="prefill workers on half of this machine's cores, "
                                     "decode workers on the other half, as on machines of their own"),
    prefill: int = typer.Option(1, "--prefill", min=1, max=16, help="prefill workers"),
    decode: int = typer.Option(1, "--decode", min=1, max=16, help="decode workers"),
    prefill_choice: str = option(RouterConfig, "prefill_choice"),
):
    """Start a router + N prefill + M decode workers (default 1P1D) on this machine, sharing a cluster secret made
    for this stack. Each process logs to a file of its own; one that exits is started again; Ctrl-C or SIGTERM
    stops them all."""
    import signal
    import time

    from kvturn.launch import LocalStack, default_log_dir
    supervisor = build(SupervisorConfig, restart=restart, restart_backoff_s=restart_backoff_s,
                       restart_backoff_max_s=restart_backoff_max_s, restart_settled_s=restart_settled_s)
    worker_args = ["--kv-recompute-threshold-tokens", str(kv_recompute_threshold_tokens),
                   "--decoder-kv-blocks-ttl-s", str(decoder_kv_blocks_ttl_s)] + ([] if calibrate else ["--no-calibrate"])
    decode_args = ["--retained-kv-budget-mb", str(retained_kv_budget_mb)] if retained_kv_budget_mb else []
    build(EngineConfig, prefix_host_mb=prefix_host_mb, enable_prefix_caching=prefix_caching_on_prefill)
    prefill_args = ["--prefix-host-mb", str(prefix_host_mb)] if prefix_host_mb else []  # P's, as the bench legs'
    from kvturn.config import PREFILL_CHOICES
    if prefill_choice not in PREFILL_CHOICES:
        raise typer.BadParameter(f"--prefill-choice must be one of {PREFILL_CHOICES}")
    router_args = ["--path-policy", path_policy, "--no-worker-wait-s", str(no_worker_wait_s),
                   "--prefill-choice", prefill_choice,
                   *(a for key in api_key for a in ("--api-key", key)),
                   *(a for key in admin_key for a in ("--admin-key", key))]
    log_dir = log_dir or default_log_dir("serve")
    log_dir.mkdir(parents=True, exist_ok=True)
    setup_logging("info")
    own_log = logging.FileHandler(log_dir / "serve.log")
    from kvturn.logs import FORMAT, OneLineFormatter
    own_log.setFormatter(OneLineFormatter(FORMAT))
    logging.getLogger().addHandler(own_log)
    decode_args += ["--retained-host-mb", str(retained_host_mb)] if retained_host_mb else []
    stack = LocalStack(resolve_model(model), bidirectional=bidirectional,
                       prefix_caching_on_prefill=prefix_caching_on_prefill, kv_cache_mb=kv_cache_mb,
                       worker_args=worker_args, prefill_args=prefill_args, decode_args=decode_args,
                       router_args=router_args, log_dir=log_dir, base_port=port, pin_workers=pin_workers,
                       supervisor=supervisor, expose_internals=expose_internals, num_prefill=prefill,
                       num_decode=decode)
    typer.echo(f"kvturn serve: logs in {log_dir} (router.log, prefill*.log, decode*.log; this process: serve.log)")
    signalled: list[int] = []

    def shutdown(signum, _frame):
        if not signalled:  # the first signal stops the stack; more while it stops must not interrupt that
            signalled.append(signum)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    failed: list[str] = []
    try:
        with stack:
            workers = ", ".join(f"{name} {url}" for name, url in stack.urls.items() if name != "router")
            typer.echo(f"kvturn serving on {stack.url}/v1 ({prefill}P{decode}D: {workers}; prefill choice "
                       f"{prefill_choice}, bidirectional {'on' if bidirectional else 'off'}, cluster secret set, "
                       f"restarts {'on' if restart else 'off'})")
            while not failed:
                time.sleep(0.2)
                if not restart:  # nobody restarts a process that exits: stop the others with it
                    failed = [name for name, p in stack.processes.items() if p.poll() is not None]
            signalled.append(0)  # stopping now: a signal meanwhile must not cut the stop short
    except KeyboardInterrupt:
        if not signalled:
            raise
    logging.getLogger("kvturn.serve").info("stopped (%s)", f"{failed} exited" if failed else "signal")
    raise typer.Exit(1 if failed else 0)


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


@app.command()
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


# What `kvturn plan --scenario` builds at most (its text is generated and tokenized before anything is simulated)
MAX_PLAN_SESSIONS, MAX_PLAN_TURNS, MAX_PLAN_PROMPT_TOKENS = 10_000, 1_000, 2**20


@app.command()
def plan(
    workload_file: Optional[Path] = typer.Option(None, "--workload", help="what kvturn bench --workload takes, or a "
                                                                          "JSONL trace (kvturn router --trace-out)"),
    scenario: Optional[str] = typer.Option(None, help="a kvturn bench scenario instead of a file: "
                                                      + ", ".join(catalog.SCENARIOS)),
    calibration_files: list[Path] = typer.Option(..., "--calibration", metavar="FILE",
                                                 help="a kvturn bench --compare results JSON from this hardware "
                                                 "(fitted to its workers' steps in service), or a saved "
                                                 "--save-calibration; give it again to pool several bench runs"),
    prefill: int = typer.Option(1, help="prefill workers"),
    decode: int = typer.Option(1, help="decode workers (and colocated workers)"),
    topology: Optional[str] = typer.Option(None, help="NPMD, e.g. 2P2D, instead of --prefill and --decode"),
    prefill_choice: str = option(RouterConfig, "prefill_choice"),
    link: Optional[str] = typer.Option(None, help="the link between hosts, RATE:DELAY (e.g. 25gbit:50us): a KV read "
                                                  "costs at least its bytes at the rate plus a round trip (default: "
                                                  "the calibration's own reads)"),
    link_read_fixed_ms: float = typer.Option(0.0, min=0.0, help="with --link: what one read over it costs besides "
                                             "its bytes, ms (kvturn bench --hosts netns prints it for its link)"),
    prefill_kv_cache_mb: Optional[int] = typer.Option(None, min=1, help="each prefill worker's KV pool, MiB (its "
                                                      "prefix cache's size; default --kv-cache-mb)"),
    kv_read_overlap: bool = option(ConnectorConfig, "kv_read_overlap", "--kv-read-overlap/--no-kv-read-overlap"),
    policy: str = typer.Option("pull", help="path of a turn with a live lease: pull, compute_on_decode or adaptive"),
    prefix_caching_on_prefill: bool = typer.Option(True, "--prefix-caching-on-prefill/--no-prefix-caching-on-prefill",
                                                   help="whether prefill workers keep a prefix cache"),
    legs: str = typer.Option(",".join(["colocated", "pd/P-cache-on", "pd/P-cache-off", "bidir/P-cache-on",
                                       "bidir/P-cache-off", "compute-on-D", "adaptive"]), help="legs to predict"),
    ttls: str = typer.Option("60,120,240,480", help="decode TTLs to sweep, s (the deployment's own is added)"),
    host_budgets: str = typer.Option("0.25,0.5,1", help="host tiers to sweep beside the deployment's own, as shares "
                                                        "of one decode worker's peak retained KV ('' for none)"),
    reuse_target: float = typer.Option(0.95, help="the share of the sweep's best reuse the TTL and host tier "
                                                  "answered must keep"),
    sessions: Optional[int] = typer.Option(None, help="sessions replayed at once (default: the scenario's; a trace "
                                                      "keeps its own start times)"),
    turns: int = typer.Option(4, help="turns per session in the built-in scenarios"),
    max_prompt_tokens: int = typer.Option(8192, help="longest first-turn prompt of the sweep scenario"),
    gap_scale: float = typer.Option(1.0, "--gap-scale", min=0.0, help="multiply a scenario's think times, as "
                                    "kvturn bench --gap-scale"),
    seed: int = typer.Option(0),
    one_host: bool = typer.Option(False, "--one-host", help="all workers share this machine's cores, as kvturn bench "
                                                            "--compare runs them (slowdown calibrated from the run)"),
    kv_cache_mb: int = option(EngineConfig, "kv_cache_mb"),
    decoder_kv_blocks_ttl_s: float = option(ConnectorConfig, "decoder_kv_blocks_ttl_s"),
    retained_kv_budget_mb: Optional[int] = option(ConnectorConfig, "retained_kv_budget_mb"),
    retained_host_mb: Optional[int] = option(ConnectorConfig, "retained_host_mb"),
    kv_recompute_threshold_tokens: int = option(ConnectorConfig, "kv_recompute_threshold_tokens"),
    model: Optional[Path] = ModelOption,
    save_calibration: Optional[Path] = typer.Option(None, help="write the fitted cost model here, to reuse"),
    out: Optional[Path] = typer.Option(None, help="output directory (default results/plan-WORKLOAD)"),
):
    """Predict, from a workload or a trace of real traffic, whether bidirectional KV transfer pays on this
    deployment, which path, and what TTL and memory per tier (pool, host) keep its reuse: a discrete-event
    simulation calibrated by a short kvturn bench --compare run on your hardware (or several, pooled). Figures the
    calibration is unsure of print as value (low-high): the same plan from each half of its samples."""
    import sys

    from rich.console import Console

    from kvturn.bench.catalog import SCENARIOS
    from kvturn.plan import calibration, planner, predict, report, trace
    from kvturn.plan.sim import Deployment
    console = Console(width=None if sys.stdout.isatty() else 160)
    if (workload_file is None) == (scenario is None):
        raise typer.BadParameter("give --workload FILE or --scenario NAME")
    if scenario is not None and scenario not in SCENARIOS:
        raise typer.BadParameter(f"scenario must be one of {sorted(SCENARIOS)}")
    if policy not in planner.POLICY_LEGS:
        raise typer.BadParameter(f"policy must be one of {sorted(planner.POLICY_LEGS)}")
    chosen = chosen_legs(legs)
    from kvturn.config import PREFILL_CHOICES
    if prefill_choice not in PREFILL_CHOICES:
        raise typer.BadParameter(f"--prefill-choice must be one of {PREFILL_CHOICES}")
    try:
        if topology:
            from kvturn.bench.topology import Topology
            shape = Topology.parse(topology)
            prefill, decode = shape.prefill, shape.decode
        plan_link = None
        if link:
            from kvturn.bench.netns import Link
            plan_link = Link.parse(link)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        ttl_values = [float(t) for t in ttls.split(",") if t.strip()]
        budget_shares = tuple(float(b) for b in host_budgets.split(",") if b.strip())
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if any(not 0 < b <= 1 for b in budget_shares) or prefill < 1 or decode < 1 or not 0 < reuse_target <= 1:
        raise typer.BadParameter("worker counts must be positive, host budget shares and --reuse-target within (0, 1]")
    if (sessions is not None and sessions < 1) or turns < 1 or max_prompt_tokens < 1:
        raise typer.BadParameter("--sessions, --turns and --max-prompt-tokens must be at least 1")
    if (sessions or 0) > MAX_PLAN_SESSIONS or turns > MAX_PLAN_TURNS or max_prompt_tokens > MAX_PLAN_PROMPT_TOKENS:
        raise typer.BadParameter(f"--sessions, --turns and --max-prompt-tokens are at most {MAX_PLAN_SESSIONS}, "
                                 f"{MAX_PLAN_TURNS} and {MAX_PLAN_PROMPT_TOKENS}")
    # The deployment's settings as the workers would take them: a worker refuses what the plan would misplan
    connector = build(ConnectorConfig, decoder_kv_blocks_ttl_s=decoder_kv_blocks_ttl_s,
                      retained_kv_budget_mb=retained_kv_budget_mb, retained_host_mb=retained_host_mb,
                      kv_recompute_threshold_tokens=kv_recompute_threshold_tokens)
    build(EngineConfig, kv_cache_mb=kv_cache_mb)
    if any(not connector.kv_expiry_margin_s < t < float("inf") for t in [*ttl_values, decoder_kv_blocks_ttl_s]):
        raise typer.BadParameter(f"--ttls and --decoder-kv-blocks-ttl-s must be finite and above the lease expiry "
                                 f"margin ({connector.kv_expiry_margin_s:g} s), or no retained KV is ever read")
    try:
        cost_model = calibration.load_many(calibration_files)
        clients = sessions or (SCENARIOS[scenario].sessions if scenario else 1)
        if scenario:
            workload = trace.from_scenario(scenario, resolve_model(model), seed, max_prompt_tokens, turns, clients,
                                           sessions, gap_scale)
        else:
            workload = trace.load(workload_file, lambda: resolve_model(model), seed, clients)
        predict.bounded(workload, cost_model)
    except (trace.TraceError, calibration.CalibrationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if save_calibration:
        cost_model.save(save_calibration)
    layers = 0
    if kv_read_overlap:  # P computes each of the model's layers as that layer of the history arrives
        from kvturn.model.config import ModelConfig
        layers = ModelConfig.from_dir(resolve_model(model)).num_hidden_layers
    deployment = Deployment(num_prefill=prefill, num_decode=decode, kv_cache_mb=kv_cache_mb,
                            decoder_kv_blocks_ttl_s=decoder_kv_blocks_ttl_s,
                            retained_kv_budget_mb=retained_kv_budget_mb,
                            kv_recompute_threshold_tokens=kv_recompute_threshold_tokens, one_host=one_host,
                            prefill_kv_cache_mb=prefill_kv_cache_mb, prefill_choice=prefill_choice,
                            link_bits_per_s=plan_link.rate_bits_per_s if plan_link else None,
                            link_delay_s=plan_link.delay_s if plan_link else 0.0,
                            link_read_fixed_ms=link_read_fixed_ms if plan_link else 0.0, read_overlap_layers=layers)
    if scenario:
        deployment = planner.with_scenario(deployment, SCENARIOS[scenario])
    # the router remembers a conversation a little less long than D keeps its KV, as at every TTL of the sweep
    deployment = planner.sweep_settings(deployment, deployment.decoder_kv_blocks_ttl_s, retained_host_mb)
    result = planner.plan(workload, cost_model, deployment, chosen, policy, prefix_caching_on_prefill, ttl_values,
                          budget_shares, reuse_target)
    report.print_plan(result, console)
    if plan_link:
        console.print(f"link {plan_link.text}: reads priced at its rate and delay; the compute is the calibration's "
                      f"({cost_model.source}): another machine's compute this plan cannot know")
    console.print(f"JSON: {report.write(result, out or Path('results') / f'plan-{workload.name}')}")


models_app = typer.Typer(help="Real models: fetch one by name, or convert a local GGUF, into kvturn's cache.",
                         no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("pull")
def models_pull(name: str = typer.Argument(..., help="a known model (`kvturn models list`), or a name for --gguf's"),
                gguf_file: Optional[Path] = typer.Option(None, "--gguf", help="a local GGUF of a Llama or Qwen3 model "
                                                         "to convert instead of downloading"),
                force: bool = typer.Option(False, "--force", help="convert again even if already in the cache")):
    """Write a Hugging Face model directory into the cache ($KVTURN_CACHE_DIR/models/NAME); then
    `kvturn serve --model NAME`."""
    import time

    from kvturn.model import pull
    from kvturn.model.gguf_import import UnsupportedGGUF
    if not force and gguf_file is None and (done := pull.pulled_dir(name)) is not None:
        typer.echo(f"{name} is already in {done} (--force converts it again)")
        return
    started = time.monotonic()
    try:
        path = pull.pull_gguf(gguf_file, name) if gguf_file else pull.pull_known(name)
    except (pull.ModelNotFound, UnsupportedGGUF, ValueError, OSError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path} in {time.monotonic() - started:.0f} s; serve it with `kvturn serve --model {name}`")


@models_app.command("list")
def models_list():
    """Models in the cache, and known ones not pulled yet."""
    from kvturn.model import pull
    for row in pull.list_models():
        where = (f"{row['path']}  {row['size_bytes'] / 2**20:.0f} MiB  {row['architecture']}, {row['layers']} layers"
                 if row["path"] else "not pulled (`kvturn models pull " + row["name"] + "`)")
        typer.echo(f"{row['name']:<16} {where}  {row['description']}".rstrip())


if __name__ == "__main__":
    app()
