"""`kvturn models`: real models into kvturn's cache, and what is there."""
from pathlib import Path
from typing import Optional

import typer

models_app = typer.Typer(help="Real models: fetch one by name, or convert a local GGUF, into kvturn's cache.",
                         no_args_is_help=True)


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
