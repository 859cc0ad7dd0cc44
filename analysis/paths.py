"""Where the workspace lives: runs/, the fine-tuned model store, annotation data.

Everything defaults to the current directory so that a clone is its own workspace;
ATTNPAT_HOME moves it.
"""
from __future__ import annotations

import os
from pathlib import Path


def workspace() -> Path:
    return Path(os.environ.get("ATTNPAT_HOME", ".")).resolve()


def runs_root() -> Path:
    return workspace() / "runs"


def model_store() -> Path:
    return workspace() / "models"


def annotation_root() -> Path:
    return workspace() / "workspace" / "annotation"


def repo_root() -> Path:
    """The source checkout (for shipped data such as the labeled set and the default checkpoint)."""
    return Path(__file__).resolve().parent.parent
