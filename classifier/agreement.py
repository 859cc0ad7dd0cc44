"""How well the classifier agrees with a labeled set: `attnpat evaluate` (e.g. against a held-out panel's labels).

Outputs in the run directory runs/classifier/<labeled set folder name>/:
  evaluation_scores.csv       metric (macro_f1|accuracy|precision|recall|f1|support), class ('' or a class), value,
                              low, high (95% percentile bootstrap over maps; empty for support)
  evaluation_confusion.csv    true, predicted, count (+ evaluation_confusion.png/svg)
  evaluation_predictions.csv  map_id, label, predicted, p_<class>
  evaluation_vs_baselines.csv model, reference_macro_f1 (the CNN's), model_macro_f1, difference, ci_low, ci_high,
                              p_value, p_holm, verdict: the CNN against each baseline on these maps (classifier.evaluate
                              .baseline_comparison). The rules need no training; logreg, boosting and boosting_profile
                              (the CNN's distillation teacher) are fitted on the checkpoint's training set, when that
                              set is here and unchanged, exactly as in cross-validation.
  evaluation_panel_size.csv   panel_size, quantile, macro_f1 (with --panel-size): what a fresh panel of that many maps,
                              drawn as these were, would score (panel_score_quantiles)
  evaluation_paired.csv       metric (accuracy|macro_f1), value, paired_value, difference, ci_low, ci_high (with
                              --paired-with B): the CNN's score against these labels minus against B's labels of the
                              same maps, 95% paired bootstrap over maps (paired_label_comparison)
  evaluation_annotator_pairs.csv  annotator_a, annotator_b, maps, macro_f1, macro_f1_low, macro_f1_high, agreement,
                              agreement_low, agreement_high, kappa, kappa_low, kappa_high (Cohen's) (when
                              annotations.csv holds two or more annotators): each
                              pair of annotators scored against each other on the maps both labeled in the first
                              round (annotator_pair_table)

With --annotator NAME (a name shown for them, or their Label Studio user id) the labels are that annotator's own
first-round ones (annotation.dataset.annotator_labeled_set), on the maps they labeled, and the run directory is
<labeled set>-by-<the name shown for them>.

Which classes are scored: those present in the labels or the predictions (what sklearn's f1_score does when
given no class list). A class absent from both has no precision, recall or F1 (an empty cell, never 0 or 1)
and does not enter macro-F1; a class present on one side only scores 0 there (zero_division=0: labeled maps
never predicted, or predictions never right). Each bootstrap draw applies the same rule to its own maps, and
evaluation_vs_baselines.csv scores every model by it (classifier.train.macro_f1), so its reference_macro_f1 is the
macro-F1 printed and in evaluation_scores.csv.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

from analysis.errors import AttnpatError
from analysis.mapstore import maps_digest, parse_map_id
from analysis.paths import display_name, repo_root, workspace
from analysis.patterns import CLASSES
from analysis.progress import progress_bar
from analysis.rundir import RunDir
from analysis.uncertainty import DEFAULT_BOOTSTRAP, bootstrap_draws, bootstrap_statistic_interval
from annotation.dataset import (
    LabeledSet,
    cohen_kappa,
    first_round_annotations,
    labeled_set_name,
    load_labeled_set,
)
from classifier.evaluate import (
    baseline_comparison,
    comparison_lines,
    comparison_record,
    confusion_rows_of,
    held_out_baseline_predictions,
    paired_interval_text,
    rule_class_indices,
    signed,
)
from classifier.figures import write_confusion_figure
from classifier.predict import PatternClassifier

RUN_MODEL = "classifier"  # runs/classifier/<labeled set>/, beside the training runs
LABELED_SET_SOURCE = "labeled set "  # how a checkpoint's "trained_on" names a labeled-set folder
PER_CLASS = ("precision", "recall", "f1")
BATCH = 256


@dataclass
class ClassScores:
    """Scores of predictions against labels. macro_f1, accuracy: floats; precision, recall, f1: (K,) per class of
    CLASSES, NaN for a class absent from labels and predictions; support: (K,) labeled maps per class."""

    macro_f1: float
    accuracy: float
    precision: np.ndarray
    recall: np.ndarray
    f1: np.ndarray
    support: np.ndarray

    def vector(self) -> np.ndarray:
        """(2 + 3K,) macro_f1, accuracy, precision, recall, f1: what the bootstrap resamples."""
        return np.concatenate([[self.macro_f1, self.accuracy], self.precision, self.recall, self.f1])

    @property
    def absent(self) -> list[str]:
        """The classes neither labeled nor predicted (not scored)."""
        return unscored_classes(self.f1)


def unscored_classes(f1: np.ndarray) -> list[str]:
    """f1: (K,) per class of CLASSES, NaN where a class was neither labeled nor predicted -> those classes."""
    return [name for name, value in zip(CLASSES, f1, strict=True) if np.isnan(value)]


def class_scores(labels: np.ndarray, predicted: np.ndarray) -> ClassScores:
    """labels, predicted: (N,) class indices into CLASSES. Scores over the classes present in either (see the
    module docstring): macro-F1 is sklearn's f1_score(average='macro') over those classes."""
    labels, predicted = np.asarray(labels), np.asarray(predicted)
    present = np.union1d(labels, predicted)
    precision, recall, f1, _ = precision_recall_fscore_support(labels, predicted, labels=present, zero_division=0)
    per_class = {}
    for name, values in (("precision", precision), ("recall", recall), ("f1", f1)):
        per_class[name] = np.full(len(CLASSES), np.nan)
        per_class[name][present] = values
    return ClassScores(macro_f1=float(f1.mean()), accuracy=float(accuracy_score(labels, predicted)),
                       support=np.bincount(labels, minlength=len(CLASSES)), **per_class)


def scored_pairs(labels: np.ndarray, predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """labels, predicted as (N,) arrays, N >= 1 and the same for both."""
    labels, predicted = np.asarray(labels), np.asarray(predicted)
    if len(labels) != len(predicted) or not len(labels):
        raise AttnpatError(f"scoring needs one prediction per labeled map, got {len(predicted)} for {len(labels)}")
    return labels, predicted


def score_table(labels: np.ndarray, predicted: np.ndarray, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                seed: int = 0) -> pd.DataFrame:
    """labels, predicted: (N,) class indices. Returns metric, class, value, low, high: macro_f1 and accuracy
    (class ''), then precision, recall, f1 and support per class; low/high: percentile bootstrap interval over
    maps (resampled N at a time), empty for support and for classes never scored (their values are empty too)."""
    labels, predicted = scored_pairs(labels, predicted)
    found = class_scores(labels, predicted)
    bounds = bootstrap_statistic_interval(lambda draw: class_scores(labels[draw], predicted[draw]).vector(),
                                          len(labels), level=level, n_boot=n_boot, seed=seed)  # (2 + 3K, 2)
    names = [("macro_f1", ""), ("accuracy", "")] + [(metric, cls) for metric in PER_CLASS for cls in CLASSES]
    rows = [{"metric": metric, "class": cls, "value": value, "low": low, "high": high}
            for (metric, cls), value, (low, high) in zip(names, found.vector(), bounds, strict=True)]
    rows += [{"metric": "support", "class": cls, "value": int(count), "low": np.nan, "high": np.nan}
             for cls, count in zip(CLASSES, found.support, strict=True)]
    return pd.DataFrame(rows)


PANEL_QUANTILES = np.round(np.arange(0.05, 1.0, 0.05), 2)


MAX_PANEL_SIZE = 10_000  # far past any panel of annotators; the draws' time and memory grow with the size


def check_panel_size(panel_size: int, n_maps: int | None = None) -> None:
    """Refuse a panel size under 1, above MAX_PANEL_SIZE or (given n_maps: `evaluate --panel-size`) above the labeled
    maps it is drawn from: drawn with replacement from N maps, a larger panel would show a spread narrower than N
    maps support."""
    if not 1 <= panel_size <= MAX_PANEL_SIZE:
        raise AttnpatError(f"--panel-size must be at least 1 and at most {MAX_PANEL_SIZE}, got {panel_size}")
    if n_maps is not None and panel_size > n_maps:
        raise AttnpatError(f"--panel-size {panel_size} is above the {n_maps} labeled maps: a fresh panel is drawn "
                           f"from them, so it can hold at most {n_maps}")


def panel_score_quantiles(labels: np.ndarray, predicted: np.ndarray, panel_size: int, *,
                          n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """labels, predicted: (N,) class indices. The macro-F1 a fresh panel of ``panel_size`` maps would score, drawn
    as these N were: ``n_boot`` draws of panel_size maps with replacement (an m-out-of-n bootstrap), each scored as
    evaluate scores a set (class_scores). Returns panel_size, quantile (0.05, 0.10, ..., 0.95), macro_f1.

    On a small natural panel a rare class has one map or none, so its macro-F1 spreads far wider than the
    interval of the N maps' own score."""
    check_panel_size(panel_size)
    labels, predicted = scored_pairs(labels, predicted)
    scores = bootstrap_draws(lambda draw: class_scores(labels[draw], predicted[draw]).macro_f1, len(labels),
                             size=panel_size, n_boot=n_boot, seed=seed)
    return pd.DataFrame({"panel_size": panel_size, "quantile": PANEL_QUANTILES,
                         "macro_f1": np.quantile(scores, PANEL_QUANTILES)})


def confusion_table(confusion: np.ndarray) -> pd.DataFrame:
    """(K, K) counts (rows: label, columns: predicted) -> true, predicted, count (K * K rows)."""
    return pd.DataFrame(confusion_rows_of(confusion))


def prediction_table(map_ids: list[str], labels: np.ndarray, probabilities: np.ndarray) -> pd.DataFrame:
    """map_ids: N; labels: (N,) class indices; probabilities: (N, K) -> map_id, label, predicted, p_<class>."""
    frame = pd.DataFrame({"map_id": map_ids, "label": [CLASSES[i] for i in labels],
                          "predicted": [CLASSES[i] for i in probabilities.argmax(1)]})
    for i, cls in enumerate(CLASSES):
        frame[f"p_{cls}"] = probabilities[:, i]
    return frame


# ---------------------------------------------------------------- two label sets, and annotators, side by side

def paired_labels(labeled: LabeledSet, other: LabeledSet, flag: str = "--paired-with") -> np.ndarray:
    """(N,) ``other``'s labels of ``labeled``'s N maps, in ``labeled``'s order. AttnpatError, naming the first
    difference (and ``other`` by the option that named it), unless ``other`` holds exactly the same map ids with
    the same maps."""
    ours, theirs = set(labeled.map_ids), set(other.map_ids)
    if ours != theirs:
        missing, extra = sorted(ours - theirs), sorted(theirs - ours)
        first = f"{ascii(missing[0][:80])} not in it" if missing else f"{ascii(extra[0][:80])} only in it"
        raise AttnpatError(f"{flag} {other.path} must hold the same maps as --data {labeled.path}: "
                           f"{len(missing)} missing, {len(extra)} more (first: {first})")
    index = {map_id: i for i, map_id in enumerate(other.map_ids)}
    for map_id, attn in zip(labeled.map_ids, labeled.maps, strict=True):
        if not np.array_equal(attn, other.maps[index[map_id]]):
            raise AttnpatError(f"{flag} {other.path} holds map {ascii(map_id[:80])} with other values than "
                               f"--data {labeled.path}; the label sets must label the same maps")
    return other.labels[[index[map_id] for map_id in labeled.map_ids]]


def paired_label_comparison(labels: np.ndarray, paired: np.ndarray, predicted: np.ndarray, *, level: float = 0.95,
                            n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """The same (N,) predictions scored against two (N,) label sets of the same maps. Returns metric (accuracy,
    macro_f1), value (against ``labels``), paired_value (against ``paired``), difference (value minus
    paired_value), ci_low, ci_high: percentile bootstrap over maps, each draw scoring both label sets on the same
    maps (class_scores), so the interval is of the paired difference."""
    labels, predicted = scored_pairs(labels, predicted)
    paired, _ = scored_pairs(paired, predicted)

    def both(draw: np.ndarray) -> np.ndarray:  # (2, 2): accuracy, macro_f1 x labels, paired
        found = [class_scores(given[draw], predicted[draw]) for given in (labels, paired)]
        return np.array([[score.accuracy for score in found], [score.macro_f1 for score in found]])

    values = both(np.arange(len(labels)))
    bounds = bootstrap_statistic_interval(lambda draw: np.subtract(*both(draw).T), len(labels), level=level,
                                          n_boot=n_boot, seed=seed)  # (2, 2)
    return pd.DataFrame({"metric": ["accuracy", "macro_f1"], "value": values[:, 0], "paired_value": values[:, 1],
                         "difference": values[:, 0] - values[:, 1], "ci_low": bounds[:, 0], "ci_high": bounds[:, 1]})


def pair_scores(first: np.ndarray, second: np.ndarray, draw: np.ndarray) -> np.ndarray:
    """(3,) macro-F1, agreement and Cohen's kappa (annotation.dataset.cohen_kappa) of two annotators' (N,) labels at
    ``draw`` (indices into N)."""
    found = class_scores(first[draw], second[draw])
    return np.array([found.macro_f1, found.accuracy, cohen_kappa(first[draw], second[draw])])


PAIR_SCORES = ("macro_f1", "agreement", "kappa")  # what pair_scores gives, in its order
PAIR_COLUMNS = ["annotator_a", "annotator_b", "maps"] + [f"{score}{end}" for score in PAIR_SCORES
                                                         for end in ("", "_low", "_high")]


def pair_row(first: np.ndarray, second: np.ndarray, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
             seed: int = 0) -> list[float]:
    """Two (N,) label arrays of the same maps -> each of PAIR_SCORES followed by its percentile bootstrap interval
    over the maps (all three on the same draws): 9 values."""
    found = pair_scores(first, second, np.arange(len(first)))
    bounds = bootstrap_statistic_interval(partial(pair_scores, first, second), len(first), level=level,
                                          n_boot=n_boot, seed=seed)  # (3, 2)
    return [value for score, (low, high) in zip(found, bounds, strict=True) for value in (score, low, high)]


def annotator_pair_table(labeled: LabeledSet, earlier: str | None = None, *, level: float = 0.95,
                         n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> pd.DataFrame:
    """Every pair of annotators of ``labeled``'s maps scored against each other, on the maps both labeled in the
    first round (annotation.dataset.first_round_annotations): macro-F1 as evaluate scores the CNN (class_scores;
    it is the same either way round), agreement (the share of maps labeled alike) and Cohen's kappa, each with a
    percentile
    bootstrap interval over those maps. Annotators are told apart by user id where known and named as
    annotation.dataset.annotator_names shows them. earlier: a file of earlier labels in the set's folder that stand
    in for annotations.csv's (annotation.dataset.read_single_annotations). Columns PAIR_COLUMNS; no rows without
    annotations.csv or two annotators."""
    if labeled.path is None or not (labeled.path / "annotations.csv").is_file():
        return pd.DataFrame(columns=PAIR_COLUMNS)
    first_round = first_round_annotations(labeled, earlier)
    # one column per annotator (their user id where known: an email can change, two users can show one name),
    # headed by the name shown for them
    names = dict(zip(first_round.annotator_key, first_round.annotator_name, strict=True))
    table = first_round.pivot(index="map_id", columns="annotator_key", values="label").rename(columns=names)
    annotators = sorted(table.columns)
    rows = []
    for k, first in enumerate(annotators):
        for second in annotators[k + 1:]:
            both = table[[first, second]].dropna()
            if both.empty:
                continue
            a, b = (np.asarray([CLASSES.index(label) for label in both[name]]) for name in (first, second))
            rows.append([first, second, len(a), *pair_row(a, b, level=level, n_boot=n_boot, seed=seed)])
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


def paired_lines(paired: pd.DataFrame, data: str, other: str) -> list[str]:
    """What evaluate prints for --paired-with: the difference per metric with its interval."""
    lines = []
    for row in paired.to_dict("records"):
        interval = paired_interval_text(row["ci_low"], row["ci_high"])
        metric = {"macro_f1": "macro-F1"}.get(row["metric"], row["metric"])
        lines.append(f"{metric} against {data} minus against {other} on the same maps: "
                     f"{row['value']:.3f} - {row['paired_value']:.3f} = {signed(row['difference'])} ({interval})")
    return lines


def pair_lines(pairs: pd.DataFrame) -> list[str]:
    """What evaluate prints of the annotator pairs: one line per pair, macro-F1, agreement and Cohen's kappa each
    with its bootstrap interval over the pair's maps."""
    return [f"annotators {row['annotator_a']} vs {row['annotator_b']} ({row['maps']} maps, first round): "
            + pair_scores_text(row) for row in pairs.to_dict("records")]


def pair_scores_text(row: dict) -> str:
    """'macro-F1 0.886 (95% CI 0.775-0.998), agreement 0.985 (...), Cohen's kappa 0.972 (...)' of a row holding
    PAIR_SCORES and their bounds; a kappa undefined (every label one class) says so."""
    kappa = (f"Cohen's kappa {row['kappa']:.3f} ({ci_text(row['kappa_low'], row['kappa_high'])})"
             if not np.isnan(row["kappa"]) else "Cohen's kappa undefined (every label one class)")
    return (f"macro-F1 {row['macro_f1']:.3f} ({ci_text(row['macro_f1_low'], row['macro_f1_high'])}), agreement "
            f"{row['agreement']:.3f} ({ci_text(row['agreement_low'], row['agreement_high'])}), {kappa}")


def first_second_row(labeled: LabeledSet, earlier: str | None = None, *, level: float = 0.95,
                     n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> dict | None:
    """Each map's first first-round label against its second, whoever gave them (annotation.dataset
    .first_round_annotations, earliest first), over every map with two: one figure for a set whose maps were
    shared out among several pairs of annotators. Returns maps and PAIR_SCORES with their bounds; None when no map
    has two such labels."""
    first_round = first_round_annotations(labeled, earlier)
    pairs = [list(group.label[:2]) for _, group in first_round.groupby("map_id") if len(group) >= 2]
    if not pairs:
        return None
    first, second = (np.asarray([CLASSES.index(pair[k]) for pair in pairs]) for k in (0, 1))
    values = pair_row(first, second, level=level, n_boot=n_boot, seed=seed)
    return {"maps": len(pairs), **dict(zip(PAIR_COLUMNS[3:], values, strict=True))}


def against_row(labeled: LabeledSet, other: LabeledSet, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                seed: int = 0) -> dict:
    """Two labeled sets of the same maps (paired_labels) side by side: their labels as two annotators' are in
    annotator_pair_table. Returns maps and PAIR_SCORES with their bounds."""
    paired = paired_labels(labeled, other, "--against")
    values = pair_row(labeled.labels, paired, level=level, n_boot=n_boot, seed=seed)
    return {"maps": len(paired), **dict(zip(PAIR_COLUMNS[3:], values, strict=True))}


# ---------------------------------------------------------------- is the labeled set held out?

@dataclass
class TrainingOverlap:
    """How many maps of the evaluated set the classifier was trained on. in_training: None when its training
    set cannot be found here, or cannot be told apart (ambiguous); training_set: what it was checked against;
    changed: the training folder found no longer holds exactly the maps and labels the checkpoint's data hash
    records."""

    in_training: int | None
    training_set: str
    changed: bool = False
    training: LabeledSet | None = None  # the training set itself, when found and unchanged (baselines fit on it)
    unlabeled_pool: int | None = None  # teacher-labeled unlabeled maps it also learned from
    in_pool: int | None = None  # how many evaluated maps that pool held; None when its map ids are not recorded
    ambiguous: bool = False  # several folders of other contents go by the name "trained_on" gives, none unchanged


def training_folders(trained_on: str, roots: tuple[Path, ...] | None = None) -> list[Path]:
    """Every labeled-set folder a checkpoint's "trained_on" ("labeled set <folder>") may name: the folder as given
    (relative to the current directory), in the workspace and in the source checkout, each place once, those holding
    a labels.csv only, in that order; [] if it names none."""
    if not trained_on.startswith(LABELED_SET_SOURCE):
        return []
    folder = Path(trained_on[len(LABELED_SET_SOURCE):])
    roots = roots if roots is not None else (Path.cwd(), workspace(), repo_root())
    candidates = [folder] if folder.is_absolute() else [root / folder for root in roots]
    found: dict[Path, Path] = {}
    for path in candidates:
        if (path / "labels.csv").is_file():
            found.setdefault(path.resolve(), path)
    return list(found.values())


def training_folder(trained_on: str, roots: tuple[Path, ...] | None = None) -> Path | None:
    """The first of :func:`training_folders`, or None."""
    return next(iter(training_folders(trained_on, roots)), None)


def maps_in(training: LabeledSet, labeled: LabeledSet) -> int:
    """How many maps of ``labeled`` ``training`` holds: by map_id, or by the map itself (the same map sampled again
    under another id, e.g. of another model name)."""
    map_ids = set(training.map_ids)
    digests = {maps_digest([attn]) for attn in training.maps}
    return sum(map_id in map_ids or maps_digest([attn]) in digests
               for map_id, attn in zip(labeled.map_ids, labeled.maps, strict=True))


def training_overlap(labeled: LabeledSet, metadata: dict, roots: tuple[Path, ...] | None = None) -> TrainingOverlap:
    """Count the maps of ``labeled`` that the checkpoint (its ``metadata``) was trained on: all of them when the
    data hashes match, else those the training labeled set named by "trained_on" holds (:func:`maps_in`).

    Of several folders by that name (a copy in the workspace beside the shipped one, e.g. merged with new labels),
    the one holding the data hash the checkpoint records is its training set, wherever it is; when none does,
    folders that differ from one another leave the overlap unchecked (ambiguous) rather than counted on a guess.
    """
    trained_on = str(metadata.get("trained_on", "unknown"))
    pool = metadata.get("unlabeled_pool")
    pool_size = pool.get("size") if isinstance(pool, dict) else None
    pool_ids = pool.get("map_ids") if isinstance(pool, dict) else None
    # the teacher-labeled pool, when its map ids are recorded: these maps were learned with the teacher's labels
    in_pool = len(set(pool_ids) & set(labeled.map_ids)) if isinstance(pool_ids, list) else None
    if metadata.get("data_hash") == labeled.data_hash:
        return TrainingOverlap(len(labeled), f"{trained_on}, the same data hash", training=labeled)
    if trained_on.startswith("synthetic"):  # generated maps, none of them a labeled map
        return TrainingOverlap(0, trained_on)
    pool_counts = {"unlabeled_pool": pool_size, "in_pool": in_pool}
    found: dict[Path, LabeledSet | AttnpatError] = {}
    for folder in training_folders(trained_on, roots):
        try:
            found[folder] = load_labeled_set(folder)
        except AttnpatError as exc:
            found[folder] = exc
            continue
        if found[folder].data_hash == metadata.get("data_hash"):
            return TrainingOverlap(maps_in(found[folder], labeled), str(folder), training=found[folder],
                                   **pool_counts)
    if not found:
        return TrainingOverlap(None, trained_on, **pool_counts)
    contents = {value.data_hash if isinstance(value, LabeledSet) else str(value) for value in found.values()}
    if len(contents) > 1:
        return TrainingOverlap(None, ", ".join(map(str, found)), ambiguous=True, **pool_counts)
    folder, training = next(iter(found.items()))
    if isinstance(training, AttnpatError):
        return TrainingOverlap(None, f"{folder} ({training})", **pool_counts)
    return TrainingOverlap(maps_in(training, labeled), str(folder), changed=True, **pool_counts)


def map_models(map_ids: list[str]) -> set[str]:
    """The models named by map ids (<model>:<task>:<example>:L<layer>H<head>); ids of another form name none."""
    models = set()
    for map_id in map_ids:
        try:
            models.add(parse_map_id(map_id).model)
        except AttnpatError:
            continue
    return models


def trained_models(overlap: TrainingOverlap, metadata: dict) -> set[str]:
    """The models whose maps the classifier learned from, as far as they are known here: its labeled training set's
    (when found unchanged) and its unlabeled pool's; empty when neither is known."""
    models = map_models(overlap.training.map_ids) if overlap.training is not None else set()
    pool = metadata.get("unlabeled_pool")
    if isinstance(pool, dict) and isinstance(pool.get("model"), str):
        models.add(pool["model"])
    return models


def other_models(labeled: LabeledSet, metadata: dict, overlap: TrainingOverlap) -> list[str]:
    """The models of ``labeled``'s maps that the classifier learned from no map of (sorted); [] when they are all
    among its models or those are unknown."""
    trained = trained_models(overlap, metadata)
    return sorted(map_models(labeled.map_ids) - trained) if trained else []


# ---------------------------------------------------------------- the verb

@dataclass
class Evaluation:
    """What `attnpat evaluate` found: scores (the evaluation_scores table), confusion (K, K) counts, the
    overlap with the training set, the files written and the CNN against each baseline (the
    evaluation_vs_baselines table)."""

    scores: pd.DataFrame
    confusion: np.ndarray
    overlap: TrainingOverlap
    files: list[Path]
    n_maps: int
    comparison: pd.DataFrame
    panel: pd.DataFrame | None = None  # panel_score_quantiles, with --panel-size
    other_models: list[str] = field(default_factory=list)  # models of these maps the classifier never learned from
    annotator: str | None = None  # whose first-round labels were scored (--annotator); None: the set's own
    pairs: pd.DataFrame | None = None  # annotator_pair_table, when two or more annotators labeled these maps
    paired: pd.DataFrame | None = None  # paired_label_comparison, with --paired-with

    def value(self, metric: str, cls: str = "") -> pd.Series:
        """value, low, high of one row of the scores table."""
        return self.scores[(self.scores.metric == metric) & (self.scores["class"] == cls)].iloc[0]

    @property
    def absent(self) -> list[str]:
        """The classes neither labeled nor predicted (their F1 is empty in the scores table)."""
        return unscored_classes(np.array([self.value("f1", cls).value for cls in CLASSES], dtype=float))


def evaluation_run(folder: str | Path, root: str | Path | None = None, annotator: str | None = None) -> RunDir:
    """runs/classifier/<the labeled set's name>/ (annotation.dataset.labeled_set_name), or, scoring one
    annotator's labels, <name>-by-<annotator> (characters other than letters, digits, '.', '_', '-' as '-')."""
    name = labeled_set_name(folder)
    if annotator is not None:
        name += "-by-" + re.sub(r"[^A-Za-z0-9._-]+", "-", annotator)
    return RunDir(RUN_MODEL, name, root)


def predict_in_batches(classifier: PatternClassifier, maps: list[np.ndarray], progress: bool = True,
                       batch: int = BATCH) -> np.ndarray:
    """maps: N (n_i, n_i) -> (N, K) class probabilities, with a progress bar over maps."""
    bar = progress_bar(len(maps), progress, "classifying labeled maps", unit="maps")
    parts = []
    for start in range(0, len(maps), batch):
        parts.append(classifier.predict_proba(maps[start:start + batch]))
        if bar is not None:
            bar.update(len(parts[-1]))
    if bar is not None:
        bar.close()
    return np.concatenate(parts) if parts else np.empty((0, len(CLASSES)), dtype=np.float32)


def baseline_predictions_on(labeled: LabeledSet, training: LabeledSet | None, seed: int = 0,
                            progress: bool = False) -> dict[str, np.ndarray]:
    """{baseline: (N,) class indices} for the maps of ``labeled``: the rules always; with the classifier's
    ``training`` set, also every fitted baseline of cross-validation, fitted on that set."""
    if training is None:
        return {"rules": rule_class_indices(labeled.maps)}
    return held_out_baseline_predictions(training.maps, training.labels, labeled.maps, seed, progress)


def evaluate_labeled_set(labeled: LabeledSet, classifier: PatternClassifier, run: RunDir, *,
                         n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, progress: bool = True,
                         panel_size: int | None = None, paired_with: LabeledSet | None = None) -> Evaluation:
    """Classify every map of ``labeled``, score the predictions against its labels and write the tables and the
    confusion figure into ``run``; with ``panel_size``, also what a fresh panel of that size would score; with
    ``paired_with`` (another label set of the same maps), the scores' difference between the two label sets;
    when annotations.csv holds two or more annotators, how they score against each other."""
    if not len(labeled):  # before, 'scoring needs one prediction per labeled map, got 0 for 0', after the load
        raise AttnpatError(f"{labeled.path}: labels.csv lists no maps; there is nothing to evaluate")
    run.check_writable()  # before the maps are classified: a read-only runs folder failed only after the work
    if panel_size is not None:
        check_panel_size(panel_size, len(labeled))  # before the maps are classified
    other_labels = paired_labels(labeled, paired_with) if paired_with is not None else None
    pairs = annotator_pair_table(labeled, n_boot=n_boot, seed=seed)  # a malformed annotations.csv fails here
    probabilities = predict_in_batches(classifier, labeled.maps, progress)
    predicted = probabilities.argmax(1)
    with run.record("evaluate", data_source=str(labeled.path), data_hash=labeled.data_hash,
                    annotator=labeled.annotator, classifier=classifier.path or "shipped default",
                    trained_on=classifier.trained_on, n_boot=n_boot, seed=seed) as entry:
        scores = score_table(labeled.labels, predicted, n_boot=n_boot, seed=seed)
        confusion = confusion_matrix(labeled.labels, predicted, labels=list(range(len(CLASSES))))
        overlap = training_overlap(labeled, classifier.metadata)
        unseen = other_models(labeled, classifier.metadata, overlap)
        predictions = {"cnn": predicted, **baseline_predictions_on(labeled, overlap.training, seed, progress)}
        comparison = baseline_comparison(predictions, labeled.labels, "cnn", n_boot=n_boot, seed=seed)
        whose = f", {display_name(labeled.annotator)}'s labels" if labeled.annotator is not None else ""
        title = f"CNN against {display_name(Path(labeled.path or '.').name)}{whose} ({len(labeled)} maps)"
        files = [run.write_table("evaluation_scores", scores),
                 run.write_table("evaluation_confusion", confusion_table(confusion)),
                 *write_confusion_figure(run, "evaluation_confusion", confusion, title),
                 run.write_table("evaluation_predictions", prediction_table(labeled.map_ids, labeled.labels,
                                                                            probabilities)),
                 run.write_table("evaluation_vs_baselines", comparison)]
        panel = None
        if panel_size is not None:
            panel = panel_score_quantiles(labeled.labels, predicted, panel_size, n_boot=n_boot, seed=seed)
            files.append(run.write_table("evaluation_panel_size", panel))
        else:  # an earlier run's, made with --panel-size (perhaps of another checkpoint), leaves with it
            run.retire("evaluation_panel_size.csv")
        paired = None
        if other_labels is not None:
            paired = paired_label_comparison(labeled.labels, other_labels, predicted, n_boot=n_boot, seed=seed)
            files.append(run.write_table("evaluation_paired", paired))
        else:
            run.retire("evaluation_paired.csv")
        if len(pairs):
            files.append(run.write_table("evaluation_annotator_pairs", pairs))
        else:
            run.retire("evaluation_annotator_pairs.csv")
        found = scores[scores["class"] == ""].set_index("metric").value
        entry.update(n_maps=len(labeled), macro_f1=float(found.macro_f1),
                     accuracy=float(found.accuracy), maps_in_training=overlap.in_training,
                     maps_in_unlabeled_pool=overlap.in_pool, training_set=overlap.training_set,
                     vs_baselines=comparison_record(comparison), panel_size=panel_size, other_models=unseen,
                     paired_with=str(paired_with.path) if paired_with is not None else None,
                     paired=paired.set_index("metric").to_dict("index") if paired is not None else None,
                     annotator_pairs=pairs.to_dict("records"))
    return Evaluation(scores, confusion, overlap, files, len(labeled), comparison, panel, unseen, labeled.annotator,
                      pairs if len(pairs) else None, paired)


def ci_text(low: float, high: float) -> str:
    """'95% CI 0.879-0.971' for an interval's bounds, or what stands in for it when one map gave NaN bounds."""
    if np.isnan(low) or np.isnan(high):
        return "no 95% CI: one map"
    return f"95% CI {low:.3f}-{high:.3f}"


def summary_lines(found: Evaluation, data: str, trained_on: str, paired_with: str | None = None) -> list[str]:
    """What `attnpat evaluate` prints: macro-F1 with its interval, accuracy, F1 per class, the classes not scored
    and whether the maps are held out (data, paired_with: the folders as the user named them)."""
    macro, accuracy = found.value("macro_f1"), found.value("accuracy")
    whose = f" labeled by {found.annotator} (first round)" if found.annotator is not None else ""
    lines = [f"macro-F1 {macro.value:.3f} ({ci_text(macro.low, macro.high)}) on {found.n_maps} maps of {data}{whose} "
             f"(classifier trained on {trained_on})",
             f"accuracy {accuracy.value:.3f} ({ci_text(accuracy.low, accuracy.high)})",
             "F1 per class: " + ", ".join(f"{cls} {found.value('f1', cls).value:.3f} "
                                          f"(n={int(found.value('support', cls).value)})"
                                          for cls in CLASSES if cls not in found.absent)]
    if found.absent:
        lines.append(f"not scored (neither labeled nor predicted): {', '.join(found.absent)}")
    lines += comparison_lines(found.comparison)
    if found.paired is not None:
        lines += paired_lines(found.paired, data, paired_with or "the paired set")
    if found.pairs is not None:
        lines += pair_lines(found.pairs)
    if found.panel is not None:
        quantile = found.panel.set_index("quantile").macro_f1
        lines.append(f"a fresh panel of {int(found.panel.panel_size.iloc[0])} maps drawn like these: macro-F1 "
                     f"{quantile[0.05]:.3f}-{quantile[0.95]:.3f} in 90% of draws, median {quantile[0.5]:.3f} "
                     "(evaluation_panel_size.csv)")
    if found.other_models:
        lines.append(f"note: maps of {', '.join(found.other_models)}, a model the classifier learned from no map of: "
                     "these scores are for heads it never saw (docs/results.md: about 0.11 below its own model's)")
    overlap = found.overlap
    if overlap.training is None:
        lines.append("note: the fitted baselines (logreg, boosting, boosting_profile) need the classifier's training "
                     "set as it was trained on; compared with the rules only")
    if overlap.ambiguous:
        lines.append(f"note: the classifier's training set cannot be told apart: the folders {overlap.training_set} "
                     f"go by the name it was trained on ({trained_on}), differ, and none holds the maps and labels "
                     "it records (data hash); whether these maps are held out is unchecked")
    elif overlap.in_training is None:
        lines.append(f"note: the classifier's training set ({overlap.training_set}) is not here; whether these maps "
                     "are held out is unchecked")
    elif overlap.in_training == 0 and overlap.unlabeled_pool and overlap.in_pool is None:
        lines.append(f"held out: none of these maps is in the labeled training set ({overlap.training_set}); the "
                     f"{overlap.unlabeled_pool} unlabeled maps the classifier also learned from (teacher labels) are "
                     "not checked and may hold some of them")
    elif overlap.in_training == 0 and overlap.in_pool:
        lines.append(f"held out from the labeled training set ({overlap.training_set}); {overlap.in_pool} of these "
                     f"maps were among the {overlap.unlabeled_pool} unlabeled maps the classifier also learned from, "
                     "with its teacher's labels, not these")
    elif overlap.in_training == 0 and overlap.unlabeled_pool:
        lines.append(f"held out: none of these maps is in the training set ({overlap.training_set}) or in the "
                     f"{overlap.unlabeled_pool} unlabeled maps the classifier also learned from")
    elif overlap.in_training == 0:
        lines.append(f"held out: none of these maps is in the training set ({overlap.training_set})")
    if overlap.changed:
        lines.append(f"note: {overlap.training_set} has changed since the classifier was trained on it")
    return lines


def overlap_warning(found: Evaluation) -> str | None:
    """The one warning line when some evaluated maps were in the training set, else None."""
    count = found.overlap.in_training
    if not count:
        return None
    return (f"warning: {count} of these maps were in the training set: scores are not held out "
            f"({found.overlap.training_set})")
