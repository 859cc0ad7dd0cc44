"""Shared CLI options, so every verb spells --model, --task, --n ... the same way."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from analysis.models import DEFAULT_MODEL
from analysis.stream import DEFAULT_MAX_LENGTH

Model = typer.Option(DEFAULT_MODEL, "--model", "-m", help="alias (minilm), model-store name, local path or hub id")
Task = typer.Option("sst2", "--task", "-t", help="sst2, mrpc, stsb, qqp, rte, qnli, mnli, wiki, or a .jsonl/.csv/.tsv file")
N = typer.Option(None, "--n", help="use the first N examples (default: all)")
MaxLength = typer.Option(DEFAULT_MAX_LENGTH, "--max-length", help="tokens per input; longer inputs are truncated and counted")
BatchSize = typer.Option(32, "--batch-size", help="examples per forward pass")
RunsDir = typer.Option(None, "--runs-dir", help="run directory root (default: ./runs or $ATTNPAT_HOME/runs)")
Split = typer.Option("validation", "--split", help="data split")
Quiet = typer.Option(False, "--quiet", "-q", help="no progress bar")

OptionalPath = Optional[Path]
OptionalInt = Optional[int]
