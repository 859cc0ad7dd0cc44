"""Where the workspace lives: runs/, the fine-tuned model store, annotation data.

Everything defaults to the current directory so that a clone is its own workspace;
ATTNPAT_HOME moves it.
"""
from __future__ import annotations

import os
from pathlib import Path

from analysis.errors import AttnpatError


def workspace() -> Path:
    """$ATTNPAT_HOME (a leading ~ is the user's home, as a shell would read it unquoted), else the current folder."""
    return expand_home(os.environ.get("ATTNPAT_HOME", ".")).resolve()


def display_name(name: str) -> str:
    """A file or folder name as text every writer takes (figure titles, CSV cells, the terminal): the bytes of
    a name that is not UTF-8, which reach Python as lone surrogates, become U+FFFD."""
    if name.isascii():
        return name
    return "".join("\ufffd" if "\ud800" <= char <= "\udfff" else char for char in name)


def runs_root(root: str | Path | None = None) -> Path:
    """The runs folder: ``root`` when given (a leading ~ is the home folder, also when quoted, as in
    `--runs-dir "~/runs"`), else <workspace>/runs."""
    return expand_home(root) if root is not None else workspace() / "runs"


def expand_home(path: str | Path) -> Path:
    """``path`` with a leading ~ or ~user made the home folder; an unknown user is one AttnpatError."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:  # ~nosuchuser
        raise AttnpatError(f"cannot expand {str(path).split('/')[0]} in {path}: no such user's home") from exc


def model_store() -> Path:
    return workspace() / "models"


def annotation_root() -> Path:
    return workspace() / "workspace" / "annotation"


def repo_root() -> Path:
    """The source checkout (for shipped data such as the labeled set and the default checkpoint)."""
    return Path(__file__).resolve().parent.parent
