"""Cross-validated comparison of the CNN with the baselines, on the same stratified folds.

Baselines (annotation.preannotate supplies the features and the rules; no second feature extractor here):
  rules      the rule-based pre-annotator, no training (scored on every map)
  logreg     logistic regression on the map features (standardised, class-balanced)
  boosting   gradient boosting on the map features (class-balanced sample weights)
  boosting_profile  gradient boosting on the CNN's 20 profile scalars: the teacher of classifier.distill,
             fitted per fold exactly as it is when it labels the unlabeled pool
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from analysis.progress import progress_bar
from analysis.uncertainty import (
    DEFAULT_BOOTSTRAP,
    bootstrap_difference_interval,
    confusion_class_f1_interval,
    confusion_counts,
    confusion_score_interval,
    holm_adjust,
    paired_permutation_p,
)
from annotation import preannotate
from classifier.distill import boosting_classifier, teacher_probabilities
from classifier.model import prepare_maps
from classifier.train import macro_f1


def scores(predicted: np.ndarray, labels: np.ndarray) -> dict:
    """predicted, labels: (N,) class indices -> macro_f1, accuracy, per-class F1 (5,), confusion (5, 5) true x
    predicted."""
    classes = list(range(len(CLASSES)))
    return {
        "macro_f1": macro_f1(predicted, labels),
        "accuracy": float(accuracy_score(labels, predicted)),
        "per_class_f1": f1_score(labels, predicted, labels=classes, average=None, zero_division=0).astype(float),
        "confusion": confusion_matrix(labels, predicted, labels=classes),
    }


def fold_macro_f1(predicted: np.ndarray, labels: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """(k,) macro-F1 of each test fold."""
    return np.asarray([scores(predicted[test], labels[test])["macro_f1"] for _, test in folds])


def score_table(results: dict[str, np.ndarray], labels: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]],
                agreed: np.ndarray | None = None):
    """results: {model name: (N,) out-of-fold predictions}. Returns (scores frame, confusion frame).

    scores: model, metric (macro_f1|macro_f1_fold_std|accuracy|f1[|macro_f1_agreed]), class ('' or a class),
    value, ci_low, ci_high (:func:`score_intervals`: 95% over the labeled maps; NaN for the fold std).
    agreed: (N,) bool, the maps all of whose annotators gave the same label; with it, macro_f1_agreed
    scores each model on those maps only, apart from the maps people themselves disagreed on.
    confusion: model, true, predicted, count.
    """
    rows, confusion_rows = [], []
    for name, predicted in results.items():
        found = scores(predicted, labels)
        (f1_bounds, accuracy_bounds), class_bounds = score_intervals(found["confusion"])
        rows += [{"model": name, "metric": "macro_f1", "class": "", "value": found["macro_f1"], **_bounds(f1_bounds)},
                 {"model": name, "metric": "macro_f1_fold_std", "class": "",  # a spread itself: no interval
                  "value": float(fold_macro_f1(predicted, labels, folds).std())},
                 {"model": name, "metric": "accuracy", "class": "", "value": found["accuracy"],
                  **_bounds(accuracy_bounds)}]
        if agreed is not None and agreed.any():
            on_agreed = scores(predicted[agreed], labels[agreed])
            rows.append({"model": name, "metric": "macro_f1_agreed", "class": "", "value": on_agreed["macro_f1"],
                         **_bounds(score_intervals(on_agreed["confusion"])[0][0])})
        rows += [{"model": name, "metric": "f1", "class": cls, "value": float(v), **_bounds(bounds)}
                 for cls, v, bounds in zip(CLASSES, found["per_class_f1"], class_bounds, strict=True)]
        confusion_rows += [{"model": name, **row} for row in confusion_rows_of(found["confusion"])]
    return pd.DataFrame(rows, columns=SCORE_COLUMNS), pd.DataFrame(confusion_rows)


# cv_scores.csv's columns: each score with its 95% interval over the labeled maps (score_intervals)
SCORE_COLUMNS = ["model", "metric", "class", "value", "ci_low", "ci_high"]


def _bounds(bounds) -> dict:
    return {"ci_low": float(bounds[0]), "ci_high": float(bounds[1])}


def score_intervals(confusion: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """(K, K) out-of-fold confusion counts (rows: true class) -> ((2, 2) bounds of macro-F1 and accuracy, (K, 2)
    bounds of each class's F1): percentile bootstrap intervals resampling the labeled maps within their true class
    (analysis.uncertainty.confusion_score_interval; maps of one head or example are alike, so the real spread is
    wider). NaN where a true class has no map (as on the maps annotators agreed on): its rates are unknown, so
    the matrix cannot be redrawn."""
    counts = np.asarray(confusion, dtype=np.float64)
    if unlabeled_class_reason(counts) is not None:
        return np.full((2, 2), np.nan), np.full((len(counts), 2), np.nan)
    return (confusion_score_interval(counts, level=level), confusion_class_f1_interval(counts, level=level))


def baseline_comparison(results: dict[str, np.ndarray], labels: np.ndarray, reference: str = "cnn", *,
                        level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Is the reference model above each other model? Its macro-F1 minus theirs, with a paired bootstrap interval
    and a paired permutation test.

    results: {model name: (N,) out-of-fold predictions}, holding ``reference``; labels: (N,). One row per other
    model: model, reference_macro_f1, model_macro_f1, difference (reference minus model), ci_low, ci_high (paired
    percentile bootstrap over the maps: every draw resamples the maps once for all models), p_value (two-sided
    paired permutation test of the macro-F1 difference, analysis.uncertainty.paired_permutation_p), p_holm (Holm's
    correction across the other models: one family of comparisons) and verdict: 'above' or 'below' when the
    interval excludes 0 and p_holm < 1 - level, else 'level'. Both must agree because a bootstrap of macro-F1
    with a class of a few maps can exclude 0 on a handful of differing maps. The predictions are held fixed, so
    neither covers the spread between training runs.
    """
    if reference not in results:
        raise AttnpatError(f"no predictions of {reference!r} to compare (models: {', '.join(results)})")
    others = [name for name in results if name != reference]
    columns = ["model", "reference_macro_f1", "model_macro_f1", "difference", "ci_low", "ci_high", "p_value",
               "p_holm", "verdict"]
    if not others:
        return pd.DataFrame(columns=columns)
    labels = np.asarray(labels)
    ours = np.asarray(results[reference])
    # bootstrap_difference_interval bounds (model - reference); the table reports (reference - model)
    theirs = np.stack([np.asarray(results[name]) for name in others], 1)  # (N, models)
    bounds = -bootstrap_difference_interval(macro_f1, ours, theirs, labels, level=level, n_boot=n_boot,
                                            seed=seed)[:, ::-1]
    p_values = paired_permutation_p(macro_f1, ours, theirs, labels, n_perm=n_boot, seed=seed)
    p_holm = holm_adjust(p_values)
    reference_f1 = macro_f1(ours, labels)
    rows = []
    for name, (low, high), p, p_adjusted in zip(others, bounds, p_values, p_holm, strict=True):
        model_f1 = macro_f1(np.asarray(results[name]), labels)
        significant = p_adjusted < 1 - level
        verdict = "above" if low > 0 and significant else "below" if high < 0 and significant else "level"
        rows.append({"model": name, "reference_macro_f1": reference_f1, "model_macro_f1": model_f1,
                     "difference": reference_f1 - model_f1, "ci_low": float(low), "ci_high": float(high),
                     "p_value": float(p), "p_holm": float(p_adjusted), "verdict": verdict})
    return pd.DataFrame(rows, columns=columns)


def comparison_record(comparison: pd.DataFrame) -> dict[str, dict]:
    """The rows of :func:`baseline_comparison` as {model: {difference, ci_low, ci_high, p_value, p_holm, verdict}},
    for run manifests and the checkpoint metadata."""
    return comparison.set_index("model")[["difference", "ci_low", "ci_high", "p_value", "p_holm", "verdict"]] \
        .to_dict("index")


def signed(value: float) -> str:
    """'+0.019': rounded first, so that -0.0000001 reads +0.000, not -0.000."""
    return f"{round(float(value), 3) + 0.0:+.3f}"


def comparison_text(entry: dict, level: float = 0.95) -> str:
    """One comparison (a row of :func:`baseline_comparison`, or its record in the checkpoint metadata) as text:
    '+0.037 macro-F1 (95% paired bootstrap +0.013 to +0.060; permutation p = 0.004 (Holm)): above' (``level``:
    the one it was computed at; a checkpoint trained by an earlier version records no p, and its text shows none)."""
    test = f"; permutation p = {entry['p_holm']:.3f} (Holm)" if entry.get("p_holm") is not None else ""
    interval = paired_interval_text(entry["ci_low"], entry["ci_high"], level)
    return f"{signed(entry['difference'])} macro-F1 ({interval}{test}): {entry['verdict']}"


def paired_interval_text(low: float, high: float, level: float = 0.95) -> str:
    """'95% paired bootstrap +0.013 to +0.060', or, when one map gave NaN bounds (nothing to resample), what stands
    in for it."""
    if np.isnan(low) or np.isnan(high):
        return f"no {level:.0%} paired bootstrap interval from one map"
    return f"{level:.0%} paired bootstrap {signed(low)} to {signed(high)}"


def comparison_lines(comparison: pd.DataFrame, reference: str = "CNN", level: float = 0.95) -> list[str]:
    """One printable line per row of :func:`baseline_comparison`."""
    return [f"{reference} vs {row['model']}: {comparison_text(row, level)}" for row in comparison.to_dict("records")]


def cross_validation_intervals(cv: dict, level: float = 0.95) -> dict | None:
    """The intervals of a checkpoint's cross-validated scores (its metadata's ``cross_validation``), from its
    out-of-fold (K, K) confusion counts (analysis.uncertainty.confusion_score_interval: the labeled maps
    resampled within their true class; maps of one head or example are alike, so the real spread is wider).

    Returns {"macro_f1": (low, high), "accuracy": (low, high), "per_class_f1": {class: (low, high)}, "n_maps": int,
    "no_interval": why the bounds are NaN, or None} (NaN bounds for fewer than 2 maps, and where a class has no
    labeled map: :func:`score_intervals`, and ``no_interval`` names the class), or None when no confusion matrix is
    recorded (a checkpoint from before it was kept). A recorded matrix that is no (K, K) table of counts,
    K = len(CLASSES): one-line AttnpatError.
    """
    confusion = cv.get("confusion") if isinstance(cv, dict) else None
    if confusion is None:
        return None
    counts = confusion_counts(confusion)
    if counts.shape != (len(CLASSES), len(CLASSES)):
        raise AttnpatError(f"the recorded confusion matrix is not {len(CLASSES)} x {len(CLASSES)} (one row and "
                           f"column per class: {', '.join(CLASSES)})")
    ((f1_low, f1_high), (accuracy_low, accuracy_high)), per_class = score_intervals(counts, level)
    return {"macro_f1": (float(f1_low), float(f1_high)), "accuracy": (float(accuracy_low), float(accuracy_high)),
            "per_class_f1": {name: (float(low), float(high)) for name, (low, high) in zip(CLASSES, per_class)},
            "n_maps": int(np.rint(counts.sum())), "no_interval": unlabeled_class_reason(counts)}


def unlabeled_class_reason(counts: np.ndarray) -> str | None:
    """Why :func:`score_intervals` gives no interval for (K, K) confusion counts (rows: true class): the classes
    with no labeled map, whose rates are unknown, so the matrix cannot be redrawn; None when every class has one."""
    empty = [CLASSES[i] for i in np.flatnonzero(counts.sum(1) == 0)]
    if not empty:
        return None
    return (f"no labeled map of {', '.join(empty)} in the cross-validation, so the confusion matrix cannot be "
            "redrawn")


def confusion_rows_of(confusion: np.ndarray) -> list[dict]:
    """(K, K) counts (rows: label, columns: predicted) -> K * K rows of true, predicted, count."""
    return [{"true": CLASSES[t], "predicted": CLASSES[p], "count": int(confusion[t, p])}
            for t in range(len(CLASSES)) for p in range(len(CLASSES))]


def prediction_table(map_ids: Sequence[str], labels: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]],
                     results: dict[str, np.ndarray], probabilities: np.ndarray, agreement: np.ndarray | None = None):
    """One row per map, for auditing where models and labels disagree.

    map_ids: N; labels: (N,) class indices; results: {model name: (N,) out-of-fold predictions};
    probabilities: (N, 5) the CNN's out-of-fold class probabilities; agreement: (N,) 1/0/NaN, whether the map's
    annotators agreed. Columns: map_id, fold (the test fold that predicted it), label, [annotators_agreed],
    one column per model (its predicted class), p_<class> (the CNN's probabilities).
    """
    fold_of = np.full(len(labels), -1, dtype=np.int64)
    for k, (_, test) in enumerate(folds):
        fold_of[test] = k
    frame = pd.DataFrame({"map_id": list(map_ids), "fold": fold_of, "label": [CLASSES[i] for i in labels]})
    if agreement is not None:
        frame["annotators_agreed"] = pd.array([None if np.isnan(v) else bool(v) for v in agreement], dtype="boolean")
    for name, predicted in results.items():
        frame[name] = [CLASSES[i] for i in predicted]
    for i, cls in enumerate(CLASSES):
        frame[f"p_{cls}"] = probabilities[:, i]
    return frame


def wide_summary(score_frame):
    """One row per model: macro_f1 with its 95% interval (macro_f1_ci_low, macro_f1_ci_high, when the frame has
    ci_low, ci_high), fold std, accuracy and per-class F1 columns (for printing)."""
    overall = score_frame[score_frame["class"] == ""].pivot(index="model", columns="metric", values="value")
    per_class = score_frame[score_frame.metric == "f1"].pivot(index="model", columns="class", values="value")
    if {"ci_low", "ci_high"} <= set(score_frame.columns):
        bounds = score_frame[score_frame.metric == "macro_f1"].set_index("model")[["ci_low", "ci_high"]]
        overall = overall.join(bounds.rename(columns=lambda bound: f"macro_f1_{bound}"))
    columns = ["macro_f1", *(c for c in ("macro_f1_ci_low", "macro_f1_ci_high") if c in overall),
               "macro_f1_fold_std", "accuracy"] + [c for c in ("macro_f1_agreed",) if c in overall]
    frame = overall[columns].join(per_class[list(CLASSES)])
    return frame.sort_values("macro_f1", ascending=False)


# ---------------------------------------------------------------- baselines

def feature_matrix(maps: Sequence[np.ndarray], tokens: Sequence[list[str] | None] | None = None) -> np.ndarray:
    """(N, F) map features of annotation.preannotate (its FEATURE_NAMES order)."""
    return np.asarray(preannotate.feature_matrix(maps, tokens), dtype=np.float64)


def rule_class_indices(maps: Sequence[np.ndarray], tokens: Sequence[list[str] | None] | None = None) -> np.ndarray:
    """(N,) class indices from the rule-based pre-annotator (it needs no training, so no folds)."""
    tokens = tokens if tokens is not None else [None] * len(maps)
    labels = [preannotate.preannotate(np.asarray(attn, dtype=np.float32), toks)[0] for attn, toks in zip(maps, tokens)]
    unknown = sorted(set(labels) - set(CLASSES))
    if unknown:
        raise AttnpatError(f"the pre-annotator returned unknown labels {unknown}")
    return np.asarray([CLASSES.index(label) for label in labels], dtype=np.int64)


def feature_model_predictions(features: np.ndarray, labels: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]],
                              kind: str, seed: int = 0) -> np.ndarray:
    """Out-of-fold predictions (N,) of a feature model: kind 'logreg' or 'boosting'."""
    predicted = np.full(len(labels), -1, dtype=np.int64)
    for train, test in folds:
        if kind == "logreg":
            model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, class_weight="balanced"))
        elif kind == "boosting":
            model = boosting_classifier(seed)
        else:
            raise AttnpatError(f"unknown baseline {kind!r}; use logreg or boosting")
        model.fit(features[train], labels[train])
        predicted[test] = model.predict(features[test])
    return predicted


def teacher_predictions(maps: Sequence[np.ndarray], labels: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]],
                        seed: int = 0) -> np.ndarray:
    """Out-of-fold predictions (N,) of the distillation teacher (classifier.distill), seeded per fold as in
    classifier.train.cross_validate_cnn: the model the CNN learns from on the pool, scored on its own."""
    images = prepare_maps(maps)
    predicted = np.full(len(labels), -1, dtype=np.int64)
    for k, (train, test) in enumerate(folds):
        predicted[test] = teacher_probabilities(images[train], labels[train], images[test], seed + k).argmax(1)
    return predicted


def baseline_predictions(maps: Sequence[np.ndarray], labels: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]],
                         tokens: Sequence[list[str] | None] | None = None, seed: int = 0,
                         progress: bool = False) -> dict[str, np.ndarray]:
    """{'rules': ..., 'logreg': ..., 'boosting': ..., 'boosting_profile': ...}: (N,) predictions of every baseline,
    with a bar over the five steps (map features, then each baseline) when ``progress``."""
    bar = progress_bar(5, progress, "baselines", unit="step")

    def step(name: str, compute):
        if bar is not None:
            bar.set_postfix_str(name)
        value = compute()
        if bar is not None:
            bar.update(1)
        return value

    features = step("features", lambda: feature_matrix(maps, tokens))
    found = {
        "rules": step("rules", lambda: rule_class_indices(maps, tokens)),
        "logreg": step("logreg", lambda: feature_model_predictions(features, labels, folds, "logreg", seed)),
        "boosting": step("boosting", lambda: feature_model_predictions(features, labels, folds, "boosting", seed)),
        "boosting_profile": step("boosting_profile", lambda: teacher_predictions(maps, labels, folds, seed)),
    }
    if bar is not None:
        bar.close()
    return found


def held_out_baseline_predictions(training_maps: Sequence[np.ndarray], training_labels: np.ndarray,
                                  maps: Sequence[np.ndarray], seed: int = 0,
                                  progress: bool = False) -> dict[str, np.ndarray]:
    """Every baseline of :func:`baseline_predictions` fitted on the N training maps (labels (N,)) and applied to M
    other maps: {'rules': (M,), 'logreg': (M,), ...}. The two sets form one train/test split of
    :func:`baseline_predictions`, so each baseline is fitted exactly as in cross-validation; the other maps'
    labels are never asked for, so none can reach a fit."""
    n = len(training_maps)
    if not n or not len(maps):
        raise AttnpatError(f"held-out baselines need training and evaluated maps, got {n} and {len(maps)}")
    labels = np.concatenate([np.asarray(training_labels, dtype=np.int64), np.full(len(maps), -1, dtype=np.int64)])
    split = [(np.arange(n), np.arange(n, n + len(maps)))]
    found = baseline_predictions([*training_maps, *maps], labels, split, seed=seed, progress=progress)
    return {name: predicted[n:] for name, predicted in found.items()}
