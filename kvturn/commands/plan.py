"""`kvturn plan`: predict, from a workload or a trace and a bench run's calibration, whether bidirectional KV transfer
pays on a deployment."""
from pathlib import Path
from typing import Optional

import typer

from kvturn.bench import catalog
from kvturn.commands.common import ModelOption, build, chosen_legs, option, resolve_model
from kvturn.config import ConnectorConfig, EngineConfig, RouterConfig

# What `kvturn plan --scenario` builds at most (its text is generated and tokenized before anything is simulated)
MAX_PLAN_SESSIONS, MAX_PLAN_TURNS, MAX_PLAN_PROMPT_TOKENS = 10_000, 1_000, 2**20


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
