"""The `app` verb: serve the Gradio web app (offline, on 127.0.0.1 by default; no share links)."""
from __future__ import annotations

import typer

from app import options as opt


def register(app: typer.Typer) -> None:
    app.command("app")(serve)


def serve(host: str = typer.Option("127.0.0.1", "--host",
                                   help="interface to listen on (0.0.0.0 exposes it to the network)"),
          port: int = typer.Option(7860, "--port", help="port to listen on"),
          runs_dir: opt.OptionalPath = opt.RunsDir,
          allow_any_model: bool = typer.Option(False, "--allow-any-model",
                                               help="let Explore and batch jobs use any model path or hub id a "
                                               "client sends (default: only the listed models)")) -> None:
    """Start the web app: explore a sentence live and browse the runs in the run directory."""
    # imported here on purpose: gradio loads in seconds; only the `app` verb needs it
    from app.webapp import launch  # noqa: PLC0415

    demo, web = launch(host, port, runs_dir, block=False, quiet=True, allow_any_model=allow_any_model)
    typer.echo(f"attnpat app on http://{host}:{port} (runs from {web.runs.root}; Ctrl+C stops it)")
    demo.block_thread()
