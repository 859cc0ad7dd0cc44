"""`attnpat demo`: the default pipeline on the embedded model and packaged data, then the web app.

Each step is an ordinary `attnpat` verb run in-process, so the demo shows exactly what a user would type.
"""
from __future__ import annotations

import time
from typing import Optional

import typer

from app import options as opt

# (title, argv) — everything offline on the embedded MiniLM; sizes keep the whole pipeline to minutes on a CPU.
PIPELINE = (
    ("per-layer overview of all 872 SST-2 dev maps", ["overview", "--task", "sst2"]),
    ("pattern classes of every head on SST-2, MRPC and RTE (Kovaleva Fig. 2)",
     ["classify", "--task", "all", "--n", "200"]),
    ("attention to [CLS]/[SEP] and the last layer's [CLS] row on SST-2 (Kovaleva Fig. 6-7)",
     ["special", "--task", "sst2", "--n", "300"]),
    ("Clark's surface statistics and entropy on wiki segments", ["surface", "--task", "wiki", "--n", "200"]),
    ("Jensen-Shannon head clustering with MDS", ["cluster", "--task", "wiki", "--n", "50"]),
    ("coreference probing on WinoBias (Clark Table 2)", ["probe-coref"]),
)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo(no_app: bool = typer.Option(False, "--no-app", help="run the pipeline only"),
         host: str = typer.Option("127.0.0.1", "--host", help="web app interface"),
         port: int = typer.Option(7860, "--port", help="web app port"),
         runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet,
         only: Optional[str] = typer.Option(None, "--only", help="comma-separated verbs of the pipeline to run")) -> None:
    """Run the default pipeline on the embedded MiniLM and packaged data into runs/, then start the web app."""
    from analysis.errors import AttnpatError
    from app.cli import main

    wanted = {verb.strip() for verb in only.split(",")} if only else None
    extra = (["--runs-dir", str(runs_dir)] if runs_dir else []) + (["-q"] if quiet else [])
    steps = [(title, argv) for title, argv in PIPELINE if wanted is None or argv[0] in wanted]
    for number, (title, argv) in enumerate(steps, 1):
        typer.echo(f"\n[{number}/{len(steps)}] {title}\n$ attnpat {' '.join(argv)}")
        started = time.time()
        code = main(argv + extra)
        if code != 0:
            raise AttnpatError(f"demo step `attnpat {' '.join(argv)}` failed (exit {code}); see the message above")
        typer.echo(f"({time.time() - started:.0f} s)")
    if no_app:
        return
    typer.echo(f"\nstarting the web app on http://{host}:{port} (Ctrl+C stops it)")
    main(["app", "--host", host, "--port", str(port)] + (["--runs-dir", str(runs_dir)] if runs_dir else []))
