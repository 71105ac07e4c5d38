"""What every `kvturn` command shares: options whose default and help are the config dataclasses', the model and
leg arguments, how the command line is quoted back in a report, and logging."""
from pathlib import Path
from typing import Optional

import typer

from kvturn.config import ConfigError, default_of, help_of

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
