"""The Classifier tab's card: the shipped checkpoint's record (classifier/checkpoints/default.json) as tables,
so the tab shows the cross-validation scores, per-class F1 and confusion matrix without a training run."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from analysis.artifacts import SHIPPED_LABELED_SET
from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from classifier.checkpoint import DEFAULT_CHECKPOINT
from classifier.evaluate import comparison_text


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
    """Tables from checkpoint metadata: scores (model, macro_f1, accuracy, macro_f1_agreed, and cnn_minus_baseline
    when the checkpoint records the paired comparison), per-class F1 with
    the labeled count, and the out-of-fold confusion matrix (rows: true class, columns: predicted)."""
    cv = meta.get("cross_validation") or {}
    folds = cv.get("folds", "?")
    summary = (f"Trained on {meta.get('trained_on', 'an unrecorded labeled set')} ({meta.get('n_maps', '?')} maps"
               + (f", plus {meta['unlabeled_pool']['size']} teacher-labeled unlabeled maps"
                  if isinstance(meta.get("unlabeled_pool"), dict) else "")
               + f"); scores are {folds}-fold cross-validated (out-of-fold"
               + {"head": "; each head's maps in one fold: heads the classifier never saw",
                  "example": "; each input's maps in one fold"}.get(cv.get("fold_groups"), "") + ")"
               + (f"; created {meta['created'][:10]}" if meta.get("created") else "") + ".")
    scores = None
    if cv:
        rows = [{"model": "pattern CNN (shipped)", "macro_f1": cv.get("macro_f1"), "accuracy": cv.get("accuracy"),
                 "macro_f1_agreed": cv.get("macro_f1_agreed")}]
        versus = cv.get("vs_baselines") or {}
        rows += [{"model": f"baseline: {name}", "macro_f1": value,
                  "cnn_minus_baseline": comparison_text(versus[name]) if name in versus else None}
                 for name, value in (cv.get("baselines_macro_f1") or {}).items()]
        scores = pd.DataFrame(rows, columns=["model", "macro_f1", "accuracy", "macro_f1_agreed"]
                              + (["cnn_minus_baseline"] if versus else []))
    per_class = None
    if cv.get("per_class_f1"):
        counts = meta.get("class_counts") or {}
        per_class = pd.DataFrame([{"class": name, "f1": cv["per_class_f1"].get(name), "labeled maps": counts.get(name)}
                                  for name in CLASSES])
    confusion = None
    if cv.get("confusion"):
        confusion = pd.DataFrame(cv["confusion"], columns=list(CLASSES))
        confusion.insert(0, "true \\ predicted", list(CLASSES))
    return ClassifierCard(summary, scores, per_class, confusion)
