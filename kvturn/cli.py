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
                          bidirectional=bidirectional, cluster_secret=cluster_secret, engine=engine)
    uvicorn.run(create_app(config), host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)


if __name__ == "__main__":
    app()
