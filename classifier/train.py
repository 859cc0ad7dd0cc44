"""Training the pattern CNN: class-weighted loss, early stopping, stratified k-fold cross-validation.

Every random choice (folds, initialisation, batches, augmentation) derives from one seed, and torch
runs deterministic ops on the CPU, so the same data and seed give the same scores and weights under the same
:func:`numerics` (torch version, CPU kernel set, thread count: each changes the rounding of the sums).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold
from torch import nn

from analysis.errors import AttnpatError
from analysis.mapstore import parse_map_id
from analysis.patterns import CLASSES
from analysis.progress import progress_bar
from analysis.rundir import atomic_write
from analysis.stats import PROFILE_NAMES
from classifier.checkpoint import load_checkpoint, save_checkpoint
from classifier.distill import teacher_probabilities
from classifier.model import (
    CHANNELS,
    IMAGE_CHANNELS,
    INPUT_SIZE,
    INPUT_TRANSFORM,
    PROFILE_BINS,
    STRIDES,
    PatternCNN,
    prepare_maps,
)
from classifier.synthetic import synthetic_dataset

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Hyper-parameters. ``patience``: epochs without a better validation macro-F1 before stopping."""

    max_epochs: int = 100
    patience: int = 25  # small validation splits are noisy: 10 stopped too early (CV macro-F1 0.713 vs 0.742)
    batch_size: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    validation_fraction: float = 0.15
    folds: int = 5
    seed: int = 0
    input_size: int = INPUT_SIZE
    augment: bool = True
    synthetic_per_class: int = 0  # synthetic maps per class added to every training part (never to test)
    # class imbalance: loss weights = inverse frequency ** power; 1.0 over-predicted the rarest class
    # (heterogeneous) on maps in natural proportions, 0.5 kept its recall with fewer false positives
    class_weight_power: float = 0.5
    select_on: str = "loss"  # early stopping on validation "loss" (class-weighted) or "f1" (macro-F1)
    pool_weight: float = 1.0  # weight of a teacher-labeled pool map's loss relative to a labeled map's (distill.py)
    # 1: the CNN learns the pool from the teacher; 2: a second CNN learns it from the teacher and the first CNN
    # together (with the linear profile path, one round scored as well or better on every fold seed, in half the time)
    pool_rounds: int = 1
    # share of training maps classified from the profile scalars alone (PatternCNN.image_dropout): 0.5 lifted the
    # cross-validated macro-F1 on 4 of 5 fold seeds (mean 0.897 -> 0.907 on v5)
    image_dropout: float = 0.5

    def __post_init__(self) -> None:
        # a negative weight would train the CNN away from the teacher's labels, and NaN would make every loss NaN
        if not 0 <= self.pool_weight < float("inf"):
            raise AttnpatError(f"pool_weight must be a finite number, 0 or more (got {self.pool_weight})")
        # a negative power up-weights the common classes, NaN makes every loss NaN (the CLI's --class-weight-power)
        if not 0 <= self.class_weight_power < float("inf"):
            raise AttnpatError(f"class_weight_power must be a finite number, 0 or more (got {self.class_weight_power})")
        # 0 rounds (or fewer) still trained one round, the same as 1, while the manifest recorded 0 (--pool-rounds)
        if isinstance(self.pool_rounds, bool) or not isinstance(self.pool_rounds, int) or self.pool_rounds < 1:
            raise AttnpatError(f"pool_rounds must be a whole number, 1 or more (got {self.pool_rounds})")


@dataclass
class FitResult:
    model: PatternCNN
    epochs: int
    best_epoch: int
    validation_f1: float


def check_labels(labels: np.ndarray, folds: int = 1) -> np.ndarray:
    """labels: (N,) int indices into CLASSES. Every class must appear at least ``folds`` times and twice in every
    fold's training part (``folds`` 1: the whole set is the training part), so the early-stopping split gets one."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise AttnpatError("the training set is empty")
    if not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0 or labels.max() >= len(CLASSES):
        raise AttnpatError(f"labels must be class indices 0..{len(CLASSES) - 1} ({', '.join(CLASSES)})")
    counts = np.bincount(labels, minlength=len(CLASSES))
    # a fold's training part keeps n - ceil(n / folds) of a class's n maps: 2 folds need 4 to keep 2 (3 keep 1)
    need = 4 if folds == 2 else max(folds, 2)
    scarce = [f"{CLASSES[i]} ({counts[i]})" for i in range(len(CLASSES)) if counts[i] < need]
    if scarce:
        split = (f"{folds}-fold cross-validation and its early-stopping splits" if folds > 1
                 else "an early-stopping split")
        raise AttnpatError(f"every class needs at least {need} labeled maps for {split}; too few: {', '.join(scarce)}")
    return labels.astype(np.int64)


def class_weights(labels: np.ndarray, power: float = 1.0) -> torch.Tensor:
    """(5,) inverse-frequency weights to the ``power`` (1 = rare classes count as much as common ones;
    0.5 = a softer correction that keeps rare classes from being over-predicted)."""
    counts = np.bincount(labels, minlength=len(CLASSES)).astype(np.float64)
    weights = np.where(counts > 0, (len(labels) / (len(CLASSES) * np.maximum(counts, 1))) ** power, 0.0)
    return torch.tensor(weights, dtype=torch.float32)


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Label-preserving jitter of (N, C, S, S) images: a random contrast curve (gamma) and faint noise.

    No flips or transposes: a transposed vertical stripe would be a horizontal one, another pattern
    (a 180-degree rotation is label-preserving but did not help in cross-validation).
    """
    pictures = images[:, :IMAGE_CHANNELS]  # the profile channel holds exact scalars: never jittered
    gamma = torch.empty((images.shape[0], 1, 1, 1)).uniform_(0.7, 1.4, generator=generator)
    noise = torch.rand(pictures.shape, generator=generator) * 0.03
    return torch.cat([(pictures.clamp_min(0) ** gamma + noise).clamp(0, 1), images[:, IMAGE_CHANNELS:]], dim=1)


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices) with every class represented in both when it can be."""
    rng = np.random.default_rng(seed)
    train, valid = [], []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        take = int(round(fraction * len(members))) if len(members) >= 2 else 0
        take = max(take, 1) if len(members) >= 2 else 0
        valid.extend(members[:take])
        train.extend(members[take:])
    return np.sort(np.asarray(train, dtype=np.int64)), np.sort(np.asarray(valid, dtype=np.int64))


def macro_f1(predicted: np.ndarray, labels: np.ndarray) -> float:
    """Unweighted mean of F1 over the classes present in the labels or the predictions (a class absent from both
    does not enter it), as sklearn's f1_score(average="macro", zero_division=0) gives it with no class list, and
    as classifier.agreement scores a labeled set: one definition for cross-validation, `evaluate` and every
    comparison with a baseline. Counted with one bincount, since the bootstrap and permutation tests of
    classifier.evaluate call it thousands of times."""
    k = len(CLASSES)
    predicted, labels = np.asarray(predicted, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    if predicted.shape != labels.shape:
        raise AttnpatError(f"{len(predicted)} predictions for {len(labels)} labels")
    confusion = np.bincount(labels * k + predicted, minlength=k * k).reshape(k, k)
    true_positive = np.diag(confusion)
    denominator = confusion.sum(0) + confusion.sum(1)  # predicted + labeled maps of each class
    present = denominator > 0
    if not present.any():  # no maps at all: nothing scored
        return 0.0
    return float((2 * true_positive[present] / denominator[present]).mean())


def predict_images(model: nn.Module, images: torch.Tensor, batch_size: int = 2048) -> torch.Tensor:
    """(N, C, S, S) -> (N, 5) probabilities with the model in eval mode."""
    model.eval()
    with torch.inference_mode():
        return torch.cat([torch.softmax(model(images[s:s + batch_size]), 1) for s in range(0, len(images), batch_size)])


def recalibrate_batchnorm(model: nn.Module, images: torch.Tensor, batch_size: int = 512) -> None:
    """Set every BatchNorm's running statistics to the exact mean/variance over ``images`` (N, C, S, S).

    With few optimiser steps per epoch (small labeled sets) the moving averages lag far behind the
    weights, and evaluation mode then sees wrong statistics; one extra pass fixes that.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average over the pass
    model.train()
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            if len(images) - start >= 2:
                model(images[start:start + batch_size])
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    model.eval()


def fit(images: torch.Tensor, labels: np.ndarray, config: TrainConfig, seed: int,
        on_epoch: Callable[[int, float], None] | None = None,
        extra: tuple[torch.Tensor, np.ndarray] | None = None,
        pool: tuple[torch.Tensor, np.ndarray] | None = None) -> FitResult:
    """Train one CNN on (N, C, S, S) images; a stratified validation part drives early stopping.

    ``extra``: (images, labels) added to the training part only. ``pool``: (images (P, C, S, S), teacher
    probabilities (P, 5)) learned as soft targets with weight config.pool_weight (classifier.distill).
    The loss of a map is its class-weighted cross-entropy against its target distribution (one-hot for a
    label). Returns the weights of the epoch with the best validation score (config.select_on).
    """
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    train_idx, valid_idx = stratified_split(labels, config.validation_fraction, seed)
    model = PatternCNN(image_dropout=config.image_dropout)
    model.fit_profile_edges(images[train_idx], labels[train_idx])  # this training part's labeled maps only
    optimiser = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=config.max_epochs)
    train_images, train_labels = images[train_idx], labels[train_idx]
    if extra is not None:
        train_images = torch.cat([train_images, extra[0]])
        train_labels = np.concatenate([train_labels, extra[1]])
    weights = class_weights(train_labels, config.class_weight_power)
    targets = nn.functional.one_hot(torch.as_tensor(train_labels, dtype=torch.int64), len(CLASSES)).float()
    sample_weights = torch.ones(len(targets))
    if pool is not None:
        train_images = torch.cat([train_images, pool[0]])
        targets = torch.cat([targets, torch.as_tensor(pool[1], dtype=torch.float32)])
        sample_weights = torch.cat([sample_weights, torch.full((len(pool[0]),), float(config.pool_weight))])
    valid_images, valid_labels = images[valid_idx], labels[valid_idx]
    best_score = -float("inf")
    best_state, best_epoch, best_f1, epoch = copy.deepcopy(model.state_dict()), 0, 0.0, 0
    for epoch in range(1, config.max_epochs + 1):
        model.train()
        order = torch.randperm(len(targets), generator=generator)
        for start in range(0, len(order), config.batch_size):
            batch = order[start:start + config.batch_size]
            if len(batch) < 2:  # BatchNorm needs two samples
                continue
            if not sample_weights[batch].any():  # only pool maps of weight 0: nothing to learn (the loss is 0/0)
                continue
            inputs = augment(train_images[batch], generator) if config.augment else train_images[batch]
            per_map = -(targets[batch] * weights * torch.log_softmax(model(inputs), 1)).sum(1)
            loss = (per_map * sample_weights[batch]).sum() / sample_weights[batch].sum()
            if not torch.isfinite(loss):  # NaN weights would never beat the best epoch: epoch 0's would be saved
                raise AttnpatError(f"training diverged: the loss became {loss.item()} in epoch {epoch}; no network "
                                   "is saved (check --class-weight-power and --pool-weight)")
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        scheduler.step()
        recalibrate_batchnorm(model, train_images)
        probabilities = predict_images(model, valid_images)
        score = macro_f1(probabilities.argmax(1).numpy(), valid_labels)
        valid_loss = float(nn.functional.nll_loss(probabilities.clamp_min(1e-9).log(), torch.as_tensor(valid_labels),
                                                  weight=weights))
        if on_epoch is not None:
            on_epoch(epoch, score)
        selected = -valid_loss if config.select_on == "loss" else score - 1e-6 * valid_loss
        if selected > best_score:
            best_score, best_f1, best_state, best_epoch = selected, score, copy.deepcopy(model.state_dict()), epoch
        elif epoch - best_epoch >= config.patience:
            break
    model.load_state_dict(best_state)
    return FitResult(model.eval(), epoch, best_epoch, best_f1)


# What a fold keeps together. "map": maps are split freely, so other maps of a test map's head (and of its input)
# are in the training part: the score is for new maps of the heads it was trained on. "head": every map of a head
# is in one fold, so the score is for heads the classifier never saw (as another model's). "example": every map
# of one input is in one fold.
FOLD_GROUPS = ("map", "example", "head")


def fold_groups(map_ids: Sequence[str], by: str) -> np.ndarray | None:
    """(N,) group codes of the maps for ``by`` in FOLD_GROUPS (None for "map": no grouping). Map ids are
    <model>:<task>:<example>:L<layer>H<head>; a head is one of one model, an example one input of one task."""
    if by not in FOLD_GROUPS:
        raise AttnpatError(f"unknown fold grouping '{by}'; choose one of: {', '.join(FOLD_GROUPS)}")
    if by == "map":
        return None
    if not map_ids:
        raise AttnpatError(f"folds by {by} need the maps' ids (a labeled set), not synthetic maps")
    parts = [parse_map_id(map_id) for map_id in map_ids]
    keys = ([f"{p.model}:L{p.layer}H{p.head}" for p in parts] if by == "head"
            else [f"{p.model}:{p.task}:{p.example_id}" for p in parts])
    return np.unique(keys, return_inverse=True)[1]


def stratified_folds(labels: np.ndarray, folds: int, seed: int,
                     groups: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Stratified k-fold (train, test) index pairs, shared by the CNN and every baseline. groups: (N,) codes
    (:func:`fold_groups`): the maps of one group stay in one fold, classes as balanced as the groups allow."""
    if folds < 2:
        raise AttnpatError(f"cross-validation needs at least 2 folds, got {folds}")
    check_labels(labels, folds)
    if groups is None:
        splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        return list(splitter.split(np.zeros(len(labels)), labels))
    if len(np.unique(groups)) < folds:
        raise AttnpatError(f"{folds} folds need at least {folds} groups of maps, got {len(np.unique(groups))}")
    splitter = StratifiedGroupKFold(n_splits=folds, shuffle=True, random_state=seed)
    split = list(splitter.split(np.zeros(len(labels)), labels, groups))
    for _, test in split:  # a class absent from a fold's training part could not be learned there
        missing = sorted(set(range(len(CLASSES))) - set(np.unique(np.delete(labels, test))))
        if missing:
            raise AttnpatError(f"grouped folds leave no {CLASSES[missing[0]]} map in some fold's training part "
                               f"(too few groups hold that class); use fewer --folds or other --fold-groups")
    return split


def cross_validate_cnn(maps: Sequence[np.ndarray], labels: np.ndarray, config: TrainConfig,
                       folds: list[tuple[np.ndarray, np.ndarray]], progress: bool = False,
                       pool_maps: Sequence[np.ndarray] | None = None, resume: Path | None = None) -> np.ndarray:
    """Out-of-fold class probabilities (N, 5) of the CNN: each fold's test maps predicted by a CNN trained
    without them (argmax(1) gives the predicted classes).

    pool_maps: unlabeled maps; each fold's teacher labels them from that fold's training maps only.
    resume: a folder keeping each finished fold's probabilities under a digest of everything they depend on (the
    maps, labels, config, pool and fold); a fold found there is not trained again. Every fit seeds its own random
    numbers, so a run resumed there gives the probabilities of one never stopped.
    """
    images = prepare_maps(maps, config.input_size)
    extra = synthetic_extra(config)
    pool_images = prepare_maps(pool_maps, config.input_size) if pool_maps and config.pool_weight else None
    kept_paths = [None] * len(folds)
    if resume is not None:
        digest = _inputs_digest(images, labels, config, pool_images)
        kept_paths = [_fold_path(resume, digest, k, *fold) for k, fold in enumerate(folds)]
        _note_stale_folds(resume, {path.name for path in kept_paths})
    probabilities = np.full((len(labels), len(CLASSES)), np.nan)
    bar = progress_bar(len(folds), bool(progress), "cnn folds", unit="it")
    for k, ((train_idx, test_idx), kept) in enumerate(zip(folds, kept_paths, strict=True)):
        found = _read_fold(kept, (len(test_idx), len(CLASSES)))
        if found is None:
            result = fit_with_pool(images[train_idx], labels[train_idx], config, config.seed + k, extra, pool_images)
            found = predict_images(result.model, images[test_idx]).numpy()
            if kept is not None:
                atomic_write(kept, lambda tmp, found=found: np.save(tmp, found))  # tmp ends in .npy: kept as named
        probabilities[test_idx] = found
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return probabilities


def _fold_path(resume: Path, digest: str, k: int, train_idx: np.ndarray, test_idx: np.ndarray) -> Path:
    """Where fold ``k``'s (test maps, 5) probabilities are kept: named by the inputs' digest and the fold's indices."""
    fold = hashlib.sha256(f"{digest} fold {k}".encode())
    fold.update(np.ascontiguousarray(train_idx, dtype=np.int64).tobytes())
    fold.update(np.ascontiguousarray(test_idx, dtype=np.int64).tobytes())
    return resume / f"fold-{k}-{fold.hexdigest()[:16]}.npy"


def _note_stale_folds(resume: Path, used: set[str]) -> None:
    """Say so when ``resume`` keeps folds this run could not use (a rerun with other data, settings or numerics
    trains every fold again, silently before: the user had been told the rerun resumes)."""
    stale = sorted(path.name for path in resume.glob("fold-*.npy") if path.name not in used)
    if stale:
        log.warning("%d fold(s) kept by a stopped train were trained on other maps, labels, settings or numerics "
                    "(this run's: %s) and are not reused; their folds are trained again", len(stale),
                    ", ".join(f"{key} {value}" for key, value in numerics().items()))


def numerics() -> dict:
    """What a seeded CPU fit's bits depend on besides its inputs: the torch version, the CPU kernel set torch
    dispatches to and its intra-op thread count (1 and 2 threads, or AVX2 and the default kernels, train other
    weights from the same seed)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def _inputs_digest(images: torch.Tensor, labels: np.ndarray, config: TrainConfig,
                   pool_images: torch.Tensor | None) -> str:
    """sha256 over what a fold's probabilities depend on besides the fold: the prepared maps, labels, config, pool
    and :func:`numerics` (a fold kept under other numerics would not be the fold this run trains)."""
    digest = hashlib.sha256(json.dumps([asdict(config), numerics()], sort_keys=True).encode())
    for array in (images.numpy(), np.asarray(labels, dtype=np.int64),
                  pool_images.numpy() if pool_images is not None else np.zeros(0)):
        digest.update(str(array.shape).encode())
        digest.update(np.ascontiguousarray(array))
    return digest.hexdigest()


def _read_fold(path: Path | None, shape: tuple[int, int]) -> np.ndarray | None:
    """A finished fold's kept probabilities, or None (none kept, or a file that is not them: the fold is refit)."""
    if path is None or not path.is_file():
        return None
    try:
        found = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return found if found.shape == shape and found.dtype == np.float32 else None


def train_final(maps: Sequence[np.ndarray], labels: np.ndarray, config: TrainConfig,
                pool_maps: Sequence[np.ndarray] | None = None, resume: Path | None = None) -> FitResult:
    """The model to ship: trained on all maps (a held-out part still drives early stopping), and on the pool
    labeled by a teacher fitted on all maps.

    resume: a folder keeping the fitted model under a digest of its inputs (as :func:`cross_validate_cnn` keeps
    its folds); a model found there is returned instead of trained again, the same weights a fit would give."""
    images, labels = prepare_maps(maps, config.input_size), check_labels(labels)
    pool_images = prepare_maps(pool_maps, config.input_size) if pool_maps and config.pool_weight else None
    kept = resume / f"final-{_inputs_digest(images, labels, config, pool_images)[:16]}.safetensors" if resume else None
    if kept is not None and kept.is_file():
        try:
            model, metadata = load_checkpoint(kept)
            fitted = metadata["final_fit"]
            return FitResult(model, fitted["epochs"], fitted["best_epoch"], fitted["validation_f1"])
        except (AttnpatError, KeyError, TypeError):
            pass  # not a kept fit after all: fit again
    result = fit_with_pool(images, labels, config, config.seed, synthetic_extra(config), pool_images)
    if kept is not None:
        save_checkpoint(result.model, kept, {**architecture_metadata(config), "final_fit": {
            "epochs": result.epochs, "best_epoch": result.best_epoch, "validation_f1": result.validation_f1}})
    return result


def fit_with_pool(images: torch.Tensor, labels: np.ndarray, config: TrainConfig, seed: int,
                  extra: tuple[torch.Tensor, np.ndarray] | None, pool_images: torch.Tensor | None) -> FitResult:
    """:func:`fit`, with the unlabeled pool when there is one (classifier.distill).

    Round 1 learns the pool from the teacher fitted on these labeled ``images`` only; each further round
    (config.pool_rounds) trains a fresh CNN on the mean of the teacher's and the last CNN's pool probabilities.
    A pool of weight 0 is no pool: no teacher is fitted, and its maps stay out of the batches and the BatchNorm
    statistics, so the fit is the one without a pool.
    """
    if pool_images is None or config.pool_weight == 0:
        return fit(images, labels, config, seed=seed, extra=extra)
    teacher = teacher_probabilities(images, labels, pool_images, seed)
    result = fit(images, labels, config, seed=seed, extra=extra, pool=(pool_images, teacher))
    for round_index in range(1, config.pool_rounds):
        targets = (teacher + predict_images(result.model, pool_images).numpy()) / 2
        result = fit(images, labels, config, seed=seed + 100 * round_index, extra=extra, pool=(pool_images, targets))
    return result


def synthetic_extra(config: TrainConfig) -> tuple[torch.Tensor, np.ndarray] | None:
    """config.synthetic_per_class synthetic maps of every class as (images, labels), or None."""
    if config.synthetic_per_class <= 0:
        return None
    maps, labels = synthetic_dataset(config.synthetic_per_class, np.random.default_rng(config.seed + 10_000))
    return prepare_maps(maps, config.input_size), labels


def architecture_metadata(config: TrainConfig) -> dict:
    return {"input_size": config.input_size, "channels": list(CHANNELS), "strides": list(STRIDES),
            "profile_features": list(PROFILE_NAMES), "profile_bins": PROFILE_BINS,
            "input_transform": INPUT_TRANSFORM,
            "train_config": asdict(config)}
