"""GLUE metrics as pure functions over predictions and labels.

``predictions`` are class ids (classification) or scores (STS-B regression); ``labels`` the gold values.
Every function returns a float in the metric's usual scale (0..1, or -1..1 for correlations).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from analysis.data import GLUE_TASKS
from analysis.errors import AttnpatError


def _as_arrays(predictions: Sequence, labels: Sequence) -> tuple[np.ndarray, np.ndarray]:
    preds = np.asarray(predictions, dtype=float).ravel()
    gold = np.asarray(labels, dtype=float).ravel()
    if preds.shape != gold.shape:
        raise AttnpatError(f"{preds.size} predictions but {gold.size} labels")
    if preds.size == 0:
        raise AttnpatError("cannot compute a metric over zero examples")
    return preds, gold


def accuracy(predictions: Sequence, labels: Sequence) -> float:
    """Fraction of exact matches."""
    preds, gold = _as_arrays(predictions, labels)
    return float((preds == gold).mean())


def f1(predictions: Sequence, labels: Sequence, positive: int = 1) -> float:
    """Binary F1 of the positive class (GLUE's MRPC/QQP F1); 0 when there is no true positive."""
    preds, gold = _as_arrays(predictions, labels)
    true_pos = float(((preds == positive) & (gold == positive)).sum())
    predicted, actual = float((preds == positive).sum()), float((gold == positive).sum())
    if true_pos == 0:
        return 0.0
    precision, recall = true_pos / predicted, true_pos / actual
    return 2 * precision * recall / (precision + recall)


def _ranks(values: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), as Spearman's rho needs."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=float)
    ranks[order] = np.arange(1, len(values) + 1)
    unique, inverse = np.unique(values, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    counts = np.bincount(inverse)
    return (sums / counts)[inverse]


def pearson(predictions: Sequence, labels: Sequence) -> float:
    """Pearson correlation; NaN when either side is constant."""
    preds, gold = _as_arrays(predictions, labels)
    preds, gold = preds - preds.mean(), gold - gold.mean()
    denom = math.sqrt(float((preds ** 2).sum() * (gold ** 2).sum()))
    return float((preds * gold).sum() / denom) if denom else math.nan


def spearman(predictions: Sequence, labels: Sequence) -> float:
    """Spearman rank correlation (Pearson over average ranks)."""
    preds, gold = _as_arrays(predictions, labels)
    return pearson(_ranks(preds), _ranks(gold))


def pearson_spearman(predictions: Sequence, labels: Sequence) -> float:
    """GLUE's STS-B score: the mean of Pearson and Spearman correlations."""
    return (pearson(predictions, labels) + spearman(predictions, labels)) / 2


def matthews(predictions: Sequence, labels: Sequence) -> float:
    """Matthews correlation coefficient (CoLA), multi-class form; 0 when undefined (as scikit-learn)."""
    preds, gold = _as_arrays(predictions, labels)
    classes = np.unique(np.concatenate([preds, gold]))
    index = {value: i for i, value in enumerate(classes)}
    confusion = np.zeros((len(classes), len(classes)))
    for p, g in zip(preds, gold):
        confusion[index[g], index[p]] += 1
    total = confusion.sum()
    correct = np.trace(confusion)
    true_counts, pred_counts = confusion.sum(1), confusion.sum(0)
    cov_tp = correct * total - float(true_counts @ pred_counts)
    cov_pp = total ** 2 - float(pred_counts @ pred_counts)
    cov_tt = total ** 2 - float(true_counts @ true_counts)
    denom = math.sqrt(cov_pp * cov_tt)
    return float(cov_tp / denom) if denom else 0.0


METRICS: dict[str, Callable[[Sequence, Sequence], float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "pearson_spearman": pearson_spearman,
    "matthews": matthews,
    "pearson": pearson,
    "spearman": spearman,
}


def metric_name(task_or_metric: str) -> str:
    """The metric for a GLUE task name (sst2 -> accuracy) or a metric name itself."""
    key = task_or_metric.strip().lower()
    if key in METRICS:
        return key
    if key == "cola":
        return "matthews"
    if key in GLUE_TASKS:
        return GLUE_TASKS[key].metric
    raise AttnpatError(f"unknown task or metric '{task_or_metric}'; metrics: {', '.join(METRICS)}")


def task_metric(task_or_metric: str, predictions: Sequence, labels: Sequence) -> float:
    """Score predictions with a task's GLUE metric (or a named metric)."""
    return METRICS[metric_name(task_or_metric)](predictions, labels)


# ---------------------------------------------------------------- metrics of confusion counts (vectorised)

ConfusionMetric = Callable[[np.ndarray, np.ndarray], np.ndarray]


def accuracy_of_confusion(counts: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """:func:`accuracy` of (..., K, K) confusion counts (rows = true class, columns = predicted, both in the order
    of ``classes`` (K,)). Returns (...)."""
    return np.trace(counts, axis1=-2, axis2=-1) / counts.sum((-2, -1))


def f1_of_confusion(counts: np.ndarray, classes: np.ndarray, positive: int = 1) -> np.ndarray:
    """:func:`f1` of (..., K, K) confusion counts (as :func:`accuracy_of_confusion`), with the same float steps,
    so the values equal f1's bit for bit. Returns (...); 0 where there is no true positive."""
    at = np.flatnonzero(np.asarray(classes) == positive)
    if not len(at):  # the positive class is never predicted nor true: no true positive anywhere
        return np.zeros(counts.shape[:-2])
    true_pos = counts[..., at[0], at[0]]
    predicted, actual = counts[..., :, at[0]].sum(-1), counts[..., at[0], :].sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 where there is no true positive: 0 below
        precision, recall = true_pos / predicted, true_pos / actual
        value = 2 * precision * recall / (precision + recall)
    return np.where(true_pos == 0, 0.0, value)


def matthews_of_confusion(counts: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """:func:`matthews` of (..., K, K) confusion counts (as :func:`accuracy_of_confusion`; a class absent from both
    predictions and labels adds zero rows and columns, which change none of the sums). Returns (...); 0 where
    undefined."""
    total = counts.sum((-2, -1))
    correct = np.trace(counts, axis1=-2, axis2=-1)
    true_counts, pred_counts = counts.sum(-1), counts.sum(-2)
    cov_tp = correct * total - (true_counts * pred_counts).sum(-1)
    cov_pp = total ** 2 - (pred_counts * pred_counts).sum(-1)
    cov_tt = total ** 2 - (true_counts * true_counts).sum(-1)
    denom = np.sqrt(cov_pp * cov_tt)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: constant predictions or labels, 0 below
        return np.where(denom > 0, cov_tp / denom, 0.0)


CONFUSION_METRICS: dict[str, ConfusionMetric] = {
    "accuracy": accuracy_of_confusion,
    "f1": f1_of_confusion,
    "matthews": matthews_of_confusion,
}


def confusion_metric(task_or_metric: str) -> ConfusionMetric:
    """The task's metric as a function of confusion counts (for vectorised permutation tests); refuses metrics
    of scores (correlations), which no confusion matrix determines."""
    name = metric_name(task_or_metric)
    if name not in CONFUSION_METRICS:
        raise AttnpatError(f"{name} is no function of confusion counts; those are {', '.join(CONFUSION_METRICS)}")
    return CONFUSION_METRICS[name]
