"""The Classifier tab's card: the shipped checkpoint's record (classifier/checkpoints/default.json) as tables,
so the tab shows the cross-validation scores with their intervals, per-class F1 and confusion matrix without a
training run."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.artifacts import SHIPPED_LABELED_SET
from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from app.display import interval_text
from classifier.checkpoint import DEFAULT_CHECKPOINT
from classifier.evaluate import comparison_text, cross_validation_intervals


@dataclass
class ClassifierCard:
    """What the card shows: a summary line and three tables (None when the metadata lacks them)."""

    summary: str
    scores: pd.DataFrame | None
    per_class: pd.DataFrame | None
    confusion: pd.DataFrame | None

    def tables(self) -> dict[str, pd.DataFrame]:
        """The tables the metadata holds, by name (scores, per_class, confusion), in the card's order."""
        named = {"scores": self.scores, "per_class": self.per_class, "confusion": self.confusion}
        return {name: frame for name, frame in named.items() if frame is not None}


def read_metadata(path: str | Path | None = None) -> dict:
    """The readable metadata JSON beside a checkpoint (default: the shipped one)."""
    path = Path(path) if path is not None else DEFAULT_CHECKPOINT.with_suffix(".json")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise AttnpatError(f"no classifier metadata at {path}; train one with `attnpat train --data "
                           f"{SHIPPED_LABELED_SET}`") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AttnpatError(f"{path} is not readable classifier metadata ({type(exc).__name__})") from exc


def classifier_card(meta: dict) -> ClassifierCard:
    """:func:`card_of` ``meta``; metadata of the wrong shape (edited, or written by another version) is a one-line
    AttnpatError, which the tab shows in place of the card, rather than a traceback that stops the app starting."""
    try:
        return card_of(meta)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise AttnpatError(f"the classifier metadata cannot be shown ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:120] if str(exc) else 'no detail'}); retrain it with "
                           f"`attnpat train --data {SHIPPED_LABELED_SET}`") from exc


def card_of(meta: dict) -> ClassifierCard:
    """Tables from checkpoint metadata: scores (model, macro_f1, accuracy, each with its 95% interval
    <score>_ci_low, <score>_ci_high; macro_f1_agreed, and cnn_minus_baseline when the checkpoint records the paired
    comparison), per-class F1 with its interval and the labeled count, and the out-of-fold confusion matrix (rows:
    true class, columns: predicted). The intervals are classifier.evaluate.cross_validation_intervals' (NaN, an
    empty cell, where there is none: the baselines' scores, a checkpoint without a confusion matrix or whose matrix
    has a class with no labeled map, which the summary names)."""
    cv = meta.get("cross_validation") or {}
    try:
        intervals, why_none = cross_validation_intervals(cv), "the checkpoint records no confusion matrix"
    except AttnpatError as exc:  # an edited or damaged record: the scores are still shown, said to lack intervals
        intervals, why_none = None, str(exc)
    if intervals is not None and intervals["no_interval"]:  # NaN bounds (empty cells), the matrix still shown
        why_none = intervals["no_interval"]
    summary = _summary(meta, cv, intervals, why_none)
    nan = (float("nan"), float("nan"))
    scores = None
    if cv:
        f1_bounds, accuracy_bounds = (intervals["macro_f1"], intervals["accuracy"]) if intervals else (nan, nan)
        rows = [{"model": "pattern CNN (shipped)", "macro_f1": cv.get("macro_f1"), "macro_f1_ci_low": f1_bounds[0],
                 "macro_f1_ci_high": f1_bounds[1], "accuracy": cv.get("accuracy"),
                 "accuracy_ci_low": accuracy_bounds[0], "accuracy_ci_high": accuracy_bounds[1],
                 "macro_f1_agreed": cv.get("macro_f1_agreed")}]
        versus = cv.get("vs_baselines") or {}
        rows += [{"model": f"baseline: {name}", "macro_f1": value,
                  "cnn_minus_baseline": comparison_text(versus[name]) if name in versus else None}
                 for name, value in (cv.get("baselines_macro_f1") or {}).items()]
        scores = pd.DataFrame(rows, columns=list(SCORE_COLUMNS) + (["cnn_minus_baseline"] if versus else []))
    per_class = None
    if cv.get("per_class_f1"):
        counts = meta.get("class_counts") or {}
        bounds = intervals["per_class_f1"] if intervals else {}
        per_class = pd.DataFrame([{"class": name, "f1": cv["per_class_f1"].get(name),
                                   "f1_ci_low": bounds.get(name, nan)[0], "f1_ci_high": bounds.get(name, nan)[1],
                                   "labeled maps": counts.get(name)} for name in CLASSES])
    confusion = None
    if cv.get("confusion") and intervals is not None:  # without intervals it was refused: the summary says why
        confusion = pd.DataFrame(cv["confusion"], columns=list(CLASSES))
        confusion.insert(0, "true \\ predicted", list(CLASSES))
    return ClassifierCard(summary, scores, per_class, confusion)


# The scores table's columns before the paired comparison: each score right before its interval's bounds.
SCORE_COLUMNS = ("model", "macro_f1", "macro_f1_ci_low", "macro_f1_ci_high", "accuracy", "accuracy_ci_low",
                 "accuracy_ci_high", "macro_f1_agreed")


def _summary(meta: dict, cv: dict, intervals: dict | None, why_none: str) -> str:
    """The card's first line: what the checkpoint was trained on, how it was scored, and its cross-validated
    macro-F1 with its 95% interval (or why it has none)."""
    folds = cv.get("folds", "?")
    text = (f"Trained on {meta.get('trained_on', 'an unrecorded labeled set')} ({meta.get('n_maps', '?')} maps"
            + (f", plus {meta['unlabeled_pool']['size']} teacher-labeled unlabeled maps"
               if isinstance(meta.get("unlabeled_pool"), dict) else "")
            + f"); scores are {folds}-fold cross-validated (out-of-fold"
            + {"head": "; each head's maps in one fold: heads the classifier never saw",
               "example": "; each input's maps in one fold"}.get(cv.get("fold_groups"), "") + ")"
            + (f"; created {meta['created'][:10]}" if meta.get("created") else "") + ".")
    f1 = cv.get("macro_f1")
    if not isinstance(f1, int | float):
        return text
    if intervals is None or intervals["no_interval"]:
        return text + f" Cross-validated macro-F1 {f1:.3f} (no interval: {why_none})."
    return (text + f" Cross-validated macro-F1 {interval_text(f1, *intervals['macro_f1'])} (95% bootstrap intervals "
            f"over its {intervals['n_maps']} labeled maps, the tables' _ci_low and _ci_high columns; maps of one head "
            "or example are alike, so the real spread is wider).")
