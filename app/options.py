"""Shared CLI options, so every verb spells --model, --task, --n ... the same way."""
from __future__ import annotations

from pathlib import Path

import typer

from analysis.data import check_n
from analysis.mapkinds import check_map_kind
from analysis.models import DEFAULT_MODEL
from analysis.stream import DEFAULT_MAX_LENGTH, check_batch_size

Model = typer.Option(DEFAULT_MODEL, "--model", "-m", help="alias (minilm), model-store name, local path or hub id")
Task = typer.Option("sst2", "--task", "-t",
                    help="sst2, mrpc, stsb, qqp, rte, qnli, mnli, wiki, or a .jsonl/.csv/.tsv file")


def _checked_n(value: int | None) -> int | None:
    # Every verb's --n follows the one rule of analysis.data.check_n, checked before any work starts.
    return check_n(value)


def n_option(default: int | None = None, help: str = "use the first N examples (default: all)"):
    """A --n option (examples to use), checked the same way on every verb."""
    return typer.Option(default, "--n", callback=_checked_n, help=help)


N = n_option()
TextColumn = typer.Option(None, "--text-column", help="a data file's text column (default: text, any case)")
LabelColumn = typer.Option(None, "--label-column", help="a data file's label column (default: label, any case; "
                           "class names map to ids in sorted order, recorded in the manifest)")
MaxLength = typer.Option(DEFAULT_MAX_LENGTH, "--max-length",
                         help="tokens per input; longer inputs are truncated and counted")
def batch_size_option(default: int = 32, help: str = "examples per forward pass"):
    """A --batch-size option, checked (analysis.stream.check_batch_size) before any work starts."""
    return typer.Option(default, "--batch-size", callback=check_batch_size, help=help)


BatchSize = batch_size_option()
RunsDir = typer.Option(None, "--runs-dir", help="run directory root (default: ./runs or $ATTNPAT_HOME/runs)")
Split = typer.Option("validation", "--split", help="data split")
Quiet = typer.Option(False, "--quiet", "-q", help="no progress bar")
MapKind = typer.Option("weight", "--map-kind", help="maps to analyse: weight (attention weights), norm (Kobayashi "
                       "et al. 2020: ||alpha f(x)|| per head, each row renormalised to sum 1) or rollout (Abnar & "
                       "Zuidema 2020, per layer, repeated over its heads); other kinds than weight write to "
                       "runs/<model>@<kind>/", callback=check_map_kind)

OptionalPath = Path | None
OptionalInt = int | None
OptionalStr = str | None
