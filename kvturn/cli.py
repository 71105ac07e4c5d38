"""The `kvturn` command line. Defaults and help of the settings come from the config dataclasses; each group of
commands lives in kvturn/commands/."""
import typer

from kvturn.commands import bench, models, plan, processes
from kvturn.commands.common import setup_logging  # noqa: F401 (the name test processes import from here)

app = typer.Typer(help="kvturn: prefill/decode disaggregated serving with bidirectional KV transfer.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.command("make-model")(processes.make_model_cmd)
app.command()(processes.worker)
app.command()(processes.router)
app.command()(processes.serve)
app.command()(bench.bench)
app.command()(plan.plan)
app.add_typer(models.models_app, name="models")

if __name__ == "__main__":
    app()
