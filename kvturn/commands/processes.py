"""`kvturn make-model`, `worker`, `router` and `serve`: the processes of a deployment, one by one or all together."""
import logging
from pathlib import Path
from typing import Optional

import typer

from kvturn.commands.common import ModelOption, build, option, resolve_model, setup_logging
from kvturn.config import ConnectorConfig, EngineConfig, RouterConfig, SupervisorConfig, WorkerConfig

def make_model_cmd(out: Path = typer.Option(..., "--out", help="directory to write"),
                   preset: str = typer.Option("tiny", help="tiny or small"),
                   seed: int = typer.Option(0, help="weight seed; same seed, same bytes")):
    """Write a Hugging Face-format Qwen3 model directory with seeded random weights and a BPE tokenizer."""
    from kvturn.model.make_model import PRESETS, make_model
    if preset not in PRESETS:
        raise typer.BadParameter(f"preset must be one of {sorted(PRESETS)}")
    path = make_model(out, preset=preset, seed=seed)
    typer.echo(f"wrote {path}")


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
