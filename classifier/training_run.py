"""`attnpat train` end to end: data -> CNN cross-validation + baselines -> score tables -> final checkpoint.

Outputs in the run directory runs/classifier/<data name>/:
  cv_scores.csv    model, metric (macro_f1|macro_f1_fold_std|accuracy|f1|macro_f1_agreed), class, value,
                   ci_low, ci_high (95% over the labeled maps: classifier.evaluate.score_intervals)
  cv_confusion.csv model, true, predicted, count   (+ cv_confusion.png/svg for the CNN)
  cv_predictions.csv  map_id, fold, label, [annotators_agreed], <model>... (out-of-fold class), p_<class> (CNN)
  cv_vs_baselines.csv model, reference_macro_f1 (the CNN's), model_macro_f1, difference, ci_low, ci_high, p_value,
                   p_holm, verdict (classifier.evaluate.baseline_comparison: is the CNN above each baseline, with a
                   paired interval and a paired permutation test; no rows without baselines)
macro_f1_agreed and annotators_agreed come with labeled sets that keep every annotation (annotations.csv).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.errors import AttnpatError
from analysis.mapstore import maps_digest, read_single_maps, write_single_maps
from analysis.patterns import CLASSES
from analysis.rundir import RunDir, atomic_write_json
from annotation.dataset import annotator_agreement, labeled_set_name, load_labeled_set
from classifier.checkpoint import checkpoint_path, save_checkpoint
from classifier.distill import PoolRequest, UnlabeledPool, labeled_in_pool
from classifier.evaluate import (
    baseline_comparison,
    baseline_predictions,
    comparison_record,
    prediction_table,
    score_table,
    scores,
    wide_summary,
)
from classifier.figures import write_confusion_figure
from classifier.synthetic import synthetic_dataset
from classifier.train import (
    TrainConfig,
    architecture_metadata,
    check_labels,
    cross_validate_cnn,
    fold_groups,
    numerics,
    stratified_folds,
    train_final,
)

SYNTHETIC_PREFIX = "synthetic"
RESUME_FOLDER = ".resume-train"  # in the run folder: the finished folds of a run not yet landed
KEPT_POOL = "pool"  # in RESUME_FOLDER: the unlabeled pool the run drew (pool.npz, its maps; pool.json, its request)
# the parts of classifier.distill.PoolRequest.key() as a user knows them
POOL_REQUEST_NAMES = {"model": "model (--pool-model)", "size": "size (--pool)",
                      "exclude_sha256": "set of excluded maps", "excluded_from": "--pool-exclude"}

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    """maps: N (n_i, n_i) float32; labels: (N,) int; name: run-directory name; source: what it was made from;
    synthetic: True for generated maps (the checkpoint metadata then says so); agreement: (N,) 1/0/NaN, whether
    a map's annotators all agreed (annotation.dataset.annotator_agreement), None when unknown."""

    maps: list[np.ndarray]
    labels: np.ndarray
    data_hash: str
    name: str
    source: str
    synthetic: bool = False
    map_ids: list[str] = field(default_factory=list)
    agreement: np.ndarray | None = None


def load_training_data(source: str, seed: int = 0) -> TrainingData:
    """A labeled-set folder, or 'synthetic[:N]' (N synthetic maps per class, default 100)."""
    if source == SYNTHETIC_PREFIX or source.startswith(SYNTHETIC_PREFIX + ":"):
        count = source.partition(":")[2] or "100"
        if not count.isdigit() or int(count) < 2:
            raise AttnpatError(f"'{source}': use synthetic:N with N >= 2 maps per class")
        maps, labels = synthetic_dataset(int(count), np.random.default_rng(seed))
        return TrainingData(maps, labels, maps_digest(maps, labels=labels), f"synthetic-{count}",
                            f"synthetic maps (classifier.synthetic, {count} per class, seed {seed})", synthetic=True)
    labeled = load_labeled_set(source)
    return TrainingData(labeled.maps, labeled.labels, labeled.data_hash, labeled_set_name(source),
                        f"labeled set {source}",
                        map_ids=list(labeled.map_ids), agreement=annotator_agreement(labeled))


@dataclass
class TrainingReport:
    """summary: one row per model (classifier.evaluate.wide_summary); comparison: the CNN against each baseline
    (classifier.evaluate.baseline_comparison; empty without baselines)."""

    summary: pd.DataFrame
    comparison: pd.DataFrame


def train_pattern_cnn(data: TrainingData, out: str | Path, run: RunDir, config: TrainConfig | None = None, *,
                     baselines: bool = True, progress: bool = True,
                     pool: UnlabeledPool | PoolRequest | None = None, fold_grouping: str = "map"):
    """Cross-validate the CNN (and baselines) on the same folds, write the tables, train and save the final model.

    pool: unlabeled maps a teacher labels for the CNN (classifier.distill), or the request for them, drawn once the
    inputs are checked and the run folder is locked (drawing takes a minute) and kept with the finished folds, so
    that a stopped run's rerun learns from the very maps it drew (:func:`resumed_pool`); the baselines never see it.
    fold_grouping: what a fold keeps together (classifier.train.FOLD_GROUPS): "head" scores the classifier on heads
    it never saw. The final checkpoint is trained on every map either way.
    Returns the printable summary and the comparison with the baselines (TrainingReport).
    """
    config = config or TrainConfig()
    if config.pool_weight == 0:  # the CNN would learn nothing from it: none is drawn, fitted to or recorded
        pool = None
    if isinstance(pool, UnlabeledPool):
        check_pool_unlabeled(pool, data.map_ids)
    out = checkpoint_path(out)  # before the work: a bad --out fails now, not after it
    labels = check_labels(data.labels, config.folds)
    folds = stratified_folds(labels, config.folds, config.seed, fold_groups(data.map_ids, fold_grouping))
    with run.record("train", folds=config.folds, fold_groups=fold_grouping, seed=config.seed, data_source=data.source,
                    pool=None, numerics=numerics()) as entry:
        # the drawn pool, finished folds and the final fit are kept here, so that a stopped run resumes; the folder
        # goes when this run lands
        run.retire(RESUME_FOLDER)
        if isinstance(pool, PoolRequest):
            pool = resumed_pool(run.file(RESUME_FOLDER), pool, progress)
            check_pool_unlabeled(pool, data.map_ids)
        if pool is not None:
            entry["pool"] = pool.spec
        pool_maps = pool.maps if pool is not None else None
        cnn_probabilities = cross_validate_cnn(data.maps, labels, config, folds, progress=progress,
                                               pool_maps=pool_maps, resume=run.file(RESUME_FOLDER))
        predictions = {"cnn": cnn_probabilities.argmax(1)}
        if baselines:
            predictions.update(baseline_predictions(data.maps, labels, folds, seed=config.seed, progress=progress))
        agreed = data.agreement == 1 if data.agreement is not None else None
        score_frame, confusion_frame = score_table(predictions, labels, folds, agreed)
        run.write_table("cv_scores", score_frame)
        run.write_table("cv_confusion", confusion_frame)
        comparison = baseline_comparison(predictions, labels, "cnn", seed=config.seed)  # no rows without baselines
        run.write_table("cv_vs_baselines", comparison)
        map_ids = data.map_ids or [f"{data.name}:{i}" for i in range(len(labels))]
        run.write_table("cv_predictions", prediction_table(map_ids, labels, folds, predictions, cnn_probabilities,
                                                           data.agreement))
        cnn = scores(predictions["cnn"], labels)
        write_confusion_figure(run, "cv_confusion", cnn["confusion"], "CNN, cross-validated (out-of-fold)")
        cnn_agreed = score_frame[(score_frame.model == "cnn") & (score_frame.metric == "macro_f1_agreed")].value
        final = train_final(data.maps, labels, config, pool_maps=pool_maps, resume=run.file(RESUME_FOLDER))
        metadata = {
            **architecture_metadata(config),
            "trained_on": data.source,
            "data_hash": data.data_hash,
            "n_maps": int(len(labels)),
            "class_counts": {cls: int((labels == i).sum()) for i, cls in enumerate(CLASSES)},
            "cross_validation": {
                "folds": config.folds, "fold_groups": fold_grouping,
                "macro_f1": cnn["macro_f1"], "accuracy": cnn["accuracy"],
                "macro_f1_agreed": float(cnn_agreed.iloc[0]) if len(cnn_agreed) else None,
                "per_class_f1": dict(zip(CLASSES, map(float, cnn["per_class_f1"]))),
                "confusion": cnn["confusion"].tolist(),
                "baselines_macro_f1": {name: scores(pred, labels)["macro_f1"] for name, pred in predictions.items()
                                       if name != "cnn"},
                "vs_baselines": comparison_record(comparison),
            },
            "final_fit": {"epochs": final.epochs, "best_epoch": final.best_epoch,
                          "validation_macro_f1": final.validation_f1},
            # the same seed gives these weights again only under the same numerics (classifier.train.numerics)
            "numerics": numerics(),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        if pool is not None:
            # the map ids too: evaluate can then tell which evaluated maps the CNN learned with the teacher's labels
            metadata["unlabeled_pool"] = {**pool.spec, "pool_hash": pool.pool_hash, "weight": config.pool_weight,
                                          "rounds": config.pool_rounds,
                                          "teacher": "gradient boosting on the profile scalars (classifier.distill)",
                                          "map_ids": list(pool.map_ids)}
        if data.synthetic:
            metadata["note"] = ("trained on SYNTHETIC maps, not on human labels: cross-validation scores measure the "
                                "synthetic task only; retrain on a labeled set with: "
                                "attnpat train --data <labeled set>")
        path = save_checkpoint(final.model, out, metadata)
        default = run.file("classifier.safetensors")
        if path.absolute() != default.absolute():  # an earlier run's checkpoint there would disagree with these tables
            run.retire(default.name, default.with_suffix(".json").name)
        # the checkpoint is saved beside the tables, not through the run folder's writers
        entry.update(outputs=[str(path), str(path.with_suffix(".json"))], cnn_macro_f1=cnn["macro_f1"])
    return TrainingReport(wide_summary(score_frame), comparison)


def check_pool_unlabeled(pool: UnlabeledPool, labeled_ids: list[str]) -> None:
    """One error line when the pool holds a labeled map (same task, example, layer and head): the teacher's label
    for it would stand beside, or in a fold's test part for, its annotators' label."""
    both = labeled_in_pool(pool.map_ids, labeled_ids)
    if both:
        raise AttnpatError(f"the unlabeled pool holds {len(both)} of the labeled maps (first: {both[0]}); draw it "
                           "with their ids excluded (classifier.distill.draw_pool exclude=...)")


def resumed_pool(folder: Path, request: PoolRequest, progress: bool = False) -> UnlabeledPool:
    """The pool a stopped run asking for the same (``request.key()``) drew and kept in ``folder``, else a new draw,
    kept there before any fold trains. Drawing again could give other maps (the model's files, the data or the
    excluded labeled sets changed in between), and the finished folds were trained with the kept ones. A kept pool
    of another request is replaced, and the log says so: the folds trained with it are trained again."""
    kept = _read_kept_pool(folder)
    if kept is not None and kept[0] == request.key():
        return kept[1]
    if kept is not None:
        differing = [POOL_REQUEST_NAMES.get(key, key) for key, value in request.key().items()
                     if kept[0].get(key) != value]
        log.warning("the unlabeled pool kept by the stopped train was drawn for another %s; drawing a new one (the "
                    "folds trained with the old one are trained again)", ", ".join(differing) or "request")
    drawn = request.draw(progress)
    write_single_maps(folder / f"{KEPT_POOL}.npz", dict(zip(drawn.map_ids, drawn.maps, strict=True)))
    atomic_write_json(folder / f"{KEPT_POOL}.json", {"request": request.key(), "spec": drawn.spec,
                                                    "pool_hash": drawn.pool_hash})  # last: it vouches for the maps
    return drawn


def _read_kept_pool(folder: Path) -> tuple[dict, UnlabeledPool] | None:
    """(request key, pool) kept in ``folder`` by :func:`resumed_pool`, or None when there is none or it is damaged
    (its maps must give the hash its record holds: a record beside another run's maps is no kept pool)."""
    record_path, maps_path = folder / f"{KEPT_POOL}.json", folder / f"{KEPT_POOL}.npz"
    if not record_path.is_file() or not maps_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        found = read_single_maps(maps_path)
        pool = UnlabeledPool(list(found.values()), list(found), dict(record["spec"]))
        if pool.pool_hash != record["pool_hash"]:
            return None
        return dict(record["request"]), pool
    except (OSError, ValueError, KeyError, TypeError, AttnpatError):  # json's errors are ValueErrors
        return None
