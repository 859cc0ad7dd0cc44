"""A teacher-labeled pool of unlabeled maps for training the CNN (knowledge distillation).

Labeled maps are scarce (about a thousand) while unlabeled ones are free: any head on any sentence. A
teacher, gradient boosting on the profile scalars (the same 20 numbers the CNN's head sees), is fitted on
the labeled training part only and gives every pool map a class distribution; the CNN then learns from
the labels and, with weight ``TrainConfig.pool_weight``, from those soft targets. In cross-validation the
teacher of each fold sees that fold's training maps only, so no test label leaks into the pool. It sees the
CNN's early-stopping maps too (they are training maps): that makes the epoch choice a little optimistic, not
the out-of-fold score (docs/results.md, "What a fold's fits see").

Shapes: images (N, INPUT_CHANNELS, S, S) as classifier.model.prepare_maps makes them; probabilities (P, 5).
"""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.ensemble import HistGradientBoostingClassifier

from analysis.data import check_task
from analysis.errors import AttnpatError
from analysis.mapstore import maps_digest, parse_map_id
from analysis.models import load_model
from analysis.patterns import CLASSES
from analysis.progress import progress_bar
from analysis.sampling import sample_maps
from classifier.model import profile_scalars

DEFAULT_POOL_TASKS = ("sst2", "mrpc", "rte", "wiki")
POOL_SEED = 777  # other than the sampling seeds of the labeled sets (0, 11)


@dataclass
class UnlabeledPool:
    """maps: P (n_i, n_i) float32 maps no annotator labeled; map_ids: their ids; spec: how they were drawn."""

    maps: list[np.ndarray]
    map_ids: list[str]
    spec: dict

    @property
    def pool_hash(self) -> str:
        """sha256 over the map ids and bytes (analysis.mapstore.maps_digest; recorded in the checkpoint metadata)."""
        return maps_digest(self.maps, self.map_ids)


def boosting_classifier(seed: int = 0) -> HistGradientBoostingClassifier:
    """The teacher's model, class-balanced gradient boosting; also the 'boosting' baselines of classifier.evaluate."""
    return HistGradientBoostingClassifier(max_iter=200, learning_rate=0.1, class_weight="balanced", random_state=seed)


def teacher_probabilities(train_images: torch.Tensor, train_labels: np.ndarray, pool_images: torch.Tensor,
                          seed: int = 0) -> np.ndarray:
    """Fit the teacher (class-balanced gradient boosting on the profile scalars) on the training maps and return
    its (P, 5) class probabilities for the pool maps, in CLASSES order."""
    teacher = boosting_classifier(seed)
    teacher.fit(profile_scalars(train_images), train_labels)
    probabilities = np.zeros((len(pool_images), len(CLASSES)))
    probabilities[:, teacher.classes_] = teacher.predict_proba(profile_scalars(pool_images))
    return probabilities


def model_of(map_ids: Sequence[str]) -> str:
    """The model slug most map ids start with ('minilm:sst2:...' -> 'minilm')."""
    slugs = Counter(map_id.split(":", 1)[0] for map_id in map_ids if ":" in map_id)
    if not slugs:
        raise AttnpatError("cannot tell which model the labeled maps come from; pass --pool-model")
    return slugs.most_common(1)[0][0]


def map_cell(map_id: str) -> str:
    """'<task>:<example>:L<layer>H<head>' of a map id: the same map whatever name its model was loaded by ('minilm'
    or the folder it lives in give other slugs). An id of another form stands for itself."""
    try:
        part = parse_map_id(map_id)
    except AttnpatError:
        return str(map_id)
    return f"{part.task}:{part.example_id}:L{part.layer}H{part.head}"


def labeled_in_pool(pool_ids: Sequence[str], labeled_ids: Sequence[str]) -> list[str]:
    """The pool's map ids whose task, example, layer and head are those of a labeled map (:func:`map_cell`)."""
    labeled = {map_cell(map_id) for map_id in labeled_ids}
    return [map_id for map_id in pool_ids if map_cell(map_id) in labeled]


def check_pool_request(size: int, tasks: Sequence[str]) -> tuple[str, ...]:
    """``tasks`` lowercased, after one error line for a pool ``size`` under 1 map, no task, an unknown task or a
    task named twice (its maps would repeat): checked before the model loads."""
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise AttnpatError(f"the unlabeled pool needs at least one map, got {size}")
    if isinstance(tasks, str) or not tasks:
        raise AttnpatError(f"the unlabeled pool needs a list of one or more tasks, got {tasks!r}")
    checked = tuple(check_task(task) for task in tasks)
    repeated = sorted({task for task in checked if checked.count(task) > 1})
    if repeated:
        raise AttnpatError(f"the unlabeled pool's tasks name {', '.join(repeated)} more than once")
    return checked


def draw_pool(model: str, size: int, exclude: Sequence[str] = (), *, tasks: Sequence[str] = DEFAULT_POOL_TASKS,
              seed: int = POOL_SEED, progress: bool = False, option: str = "--pool-model") -> UnlabeledPool:
    """``size`` maps of ``model`` (stratified over tasks, layers, heads and examples, as annotation samples are),
    none of them in ``exclude`` (the labeled map ids), matched by task, example, layer and head (:func:`map_cell`)
    whatever the model's name in them. Deterministic for a model, size, exclude, tasks and seed (the
    excluded ids change how many maps are drawn, so PoolRequest.key holds their digest). ``option``: the caller's option
    that names the model, for the advice of a loading error."""
    tasks = check_pool_request(size, tasks)
    bundle = load_model(model, device="cpu", option=option)
    excluded = set(exclude)
    excluded_cells = {map_cell(map_id) for map_id in excluded}
    bar = progress_bar(size + len(excluded), progress, "unlabeled pool", unit="maps")
    maps, map_ids = [], []
    # Draw ``size`` more than the labeled maps: however many of them come up, ``size`` others remain. About
    # 2.5 maps per example keeps the pool diverse (many heads of few sentences repeat the same inputs).
    draws = size + len(excluded)
    for sampled in sample_maps(bundle, n_maps=draws, tasks=tasks, seed=seed,
                               examples_per_task=max(60, int(draws / (len(tasks) * 2.5)))):
        if bar is not None:
            bar.update(1)
        if map_cell(sampled.map_id) not in excluded_cells:
            maps.append(sampled.attn)
            map_ids.append(sampled.map_id)
    if bar is not None:
        bar.close()
    # Maps come task by task: keep an evenly spread random ``size`` of them, not the first (that cuts the last task).
    keep = np.sort(np.random.default_rng(seed).choice(len(maps), min(size, len(maps)), replace=False))
    maps, map_ids = [maps[i] for i in keep], [map_ids[i] for i in keep]
    return UnlabeledPool(maps, map_ids, {"model": model, "size": len(maps), "tasks": list(tasks), "seed": seed})


@dataclass(frozen=True)
class PoolRequest:
    """The pool `train --pool` asks for, drawn only when :meth:`draw` is called (a minute). ``exclude``: the map ids
    kept out (the labeled maps and those of --pool-exclude); ``excluded_from``: the --pool-exclude folders."""

    model: str
    size: int
    exclude: tuple[str, ...] = ()
    tasks: tuple[str, ...] = DEFAULT_POOL_TASKS
    seed: int = POOL_SEED
    excluded_from: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # checked when asked for, not when drawn: train draws only after the labels, folds and run folder
        object.__setattr__(self, "tasks", check_pool_request(self.size, self.tasks))

    def key(self) -> dict:
        """What the drawn pool depends on, as JSON (the excluded ids as one digest): a stopped `train` reuses the
        pool it drew only when its rerun asks for the same."""
        excluded = hashlib.sha256("\n".join(sorted(set(self.exclude))).encode()).hexdigest()
        return {"model": self.model, "size": self.size, "tasks": list(self.tasks), "seed": self.seed,
                "exclude_sha256": excluded, "excluded_from": list(self.excluded_from)}

    def draw(self, progress: bool = False) -> UnlabeledPool:
        drawn = draw_pool(self.model, self.size, self.exclude, tasks=self.tasks, seed=self.seed, progress=progress)
        if self.excluded_from:
            drawn.spec["excluded_from"] = list(self.excluded_from)
        return drawn
