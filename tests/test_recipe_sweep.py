"""bench/recipe_sweep.py: its settings parser and the table it builds from fold fits."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.errors import AttnpatError
from classifier.distill import UnlabeledPool
from classifier.model import prepare_maps
from classifier.synthetic import synthetic_dataset
from classifier.train import TrainConfig, cross_validate_cnn, macro_f1, stratified_folds
from tests.tiny import save_tiny_labeled_set

spec = importlib.util.spec_from_file_location("recipe_sweep", Path(__file__).parents[1] / "bench" / "recipe_sweep.py")
recipe_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe_sweep)


def test_a_setting_is_typed_as_its_train_config_field():
    assert recipe_sweep.parse_setting("bs32:batch_size=32,pool_weight=2,augment=false") == (
        "bs32", {"batch_size": 32, "pool_weight": 2.0, "augment": False})
    name, changes = recipe_sweep.parse_setting("f1:select_on=f1")
    assert (name, changes) == ("f1", {"select_on": "f1"}) and type(changes["select_on"]) is str
    assert recipe_sweep.parse_seeds(["0-2", "7", "1"]) == [0, 1, 2, 7]


@pytest.mark.parametrize("item", ["-1", "4-2", "a", "1-b"])
def test_a_bad_fold_seed_is_one_clear_error(item):
    with pytest.raises(AttnpatError, match="use fold seeds 0 or more"):
        recipe_sweep.parse_seeds([item])


@pytest.mark.parametrize("text, message", [
    ("bs32", "NAME:field=value"),
    ("base:batch_size=32", "NAME not 'base'"),
    ("x:bogus=1", "'bogus' is not a TrainConfig setting"),
    ("x:seed=3", "'seed' is not a TrainConfig setting"),  # the fold seed is --seeds'
    ("x:folds=3", "'folds' is not a TrainConfig setting"),  # every setting is scored on the same folds
    ("x:input_size=48", "'input_size' is not a TrainConfig setting"),  # the images are prepared once
    ("x:batch_size=big", "batch_size takes a int"),
    ("x:augment=maybe", "augment takes a bool"),
])
def test_a_bad_setting_is_one_clear_error(text, message):
    with pytest.raises(AttnpatError, match=message):
        recipe_sweep.parse_setting(text)


def fold_records(name: str, predicted: np.ndarray, labels: np.ndarray, seed: int, folds=None) -> list[dict]:
    """Fold fits as fit_fold writes them, whose argmax is ``predicted``."""
    records = []
    for fold, (_, test) in enumerate(stratified_folds(labels, TrainConfig().folds, seed)):
        if folds is not None and fold not in folds:
            continue
        probabilities = np.eye(5)[predicted[test]] * 0.9 + 0.02
        records.append({"setting": name, "changes": {}, "seed": seed, "fold": fold, "test": test.tolist(),
                        "probabilities": probabilities.tolist()})
    return records


def test_the_table_scores_each_complete_setting_against_the_base_and_the_teacher():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(5), 12)
    base = labels.copy()
    base[rng.choice(60, 12, replace=False)] = rng.integers(0, 5, 12)
    better = labels.copy()
    better[rng.choice(60, 3, replace=False)] = 0
    teacher = labels.copy()
    teacher[:6] = 4
    records = (fold_records("base", base, labels, 3) + fold_records("better", better, labels, 3)
               + fold_records("unfinished", labels, labels, 3, folds={0, 1, 2, 3}))
    table = recipe_sweep.sweep_table(records, labels, {3: teacher}).set_index("setting")
    assert sorted(table.index) == ["base", "better"]  # a setting missing a fold has no row
    assert table.loc["better", "macro_f1"] == pytest.approx(macro_f1(better, labels))
    assert table.loc["better", "base_difference"] == pytest.approx(macro_f1(better, labels)
                                                                      - macro_f1(base, labels))
    assert table.loc["base", "teacher_difference"] == pytest.approx(macro_f1(base, labels)
                                                                       - macro_f1(teacher, labels))
    low, high = table.loc["better", ["base_ci_low", "base_ci_high"]]
    assert low <= table.loc["better", "base_difference"] <= high
    assert np.isnan(table.loc["base", "base_difference"])


def test_a_fold_fit_is_the_fold_of_attnpat_trains_cross_validation(monkeypatch):
    # the sweep's rows are comparable with `attnpat train` only if each fold fit is the same fit, synthetic maps and
    # pool included
    maps, labels = synthetic_dataset(6, np.random.default_rng(1))
    pool_maps, _ = synthetic_dataset(3, np.random.default_rng(2))
    monkeypatch.setattr(recipe_sweep, "_inputs", {"images": prepare_maps(maps), "labels": labels,
                                                  "pool": prepare_maps(pool_maps), "synthetic_mix": 2})
    changes = {"max_epochs": 2, "batch_size": 16}
    # a fold fit runs on one torch thread, the reference too: on two, sums in another order moved it by 1.4e-5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = cross_validate_cnn(maps, labels, TrainConfig(seed=4, synthetic_per_class=2, **changes),
                                      stratified_folds(labels, 5, 4), pool_maps=pool_maps)
        found = np.full_like(expected, np.nan)
        for fold in range(5):
            record = recipe_sweep.fit_fold(("x", changes, 4, fold))
            found[record["test"]] = record["probabilities"]
    finally:
        torch.set_num_threads(threads)  # fit_fold sets one thread for the process: the later tests keep theirs
    assert np.allclose(found, expected, atol=1e-5)


def test_a_fold_cut_off_by_a_stop_is_dropped_and_the_cache_stays_appendable(tmp_path):
    cache = tmp_path / "sweep.csv.key.folds.jsonl"
    assert recipe_sweep.read_fold_cache(cache) == []
    whole = [{"setting": "base", "fold": 0}, {"setting": "base", "fold": 1}]
    cache.write_text("".join(json.dumps(record) + "\n" for record in whole) + '{"setting": "ba')
    assert recipe_sweep.read_fold_cache(cache) == whole
    with cache.open("a") as appended:  # as the sweep goes on after a resume
        appended.write(json.dumps({"setting": "base", "fold": 2}) + "\n")
    assert [record["fold"] for record in recipe_sweep.read_fold_cache(cache)] == [0, 1, 2]


class SerialPool:
    """multiprocessing's Pool run in this process (the fits here are stand-ins)."""

    def __init__(self, workers):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap_unordered(self, function, jobs):
        return map(function, jobs)


def test_a_sweep_writes_its_out_into_a_folder_that_does_not_exist_yet(tmp_path, monkeypatch):
    # --out passed the check before the work (its folder can be made), then the fold cache beside it could not be
    # opened: a FileNotFoundError after the unlabeled pool had been drawn
    labeled = save_tiny_labeled_set(tmp_path / "labeled", 6)
    pool_maps, _ = synthetic_dataset(1, np.random.default_rng(2))
    monkeypatch.setattr(recipe_sweep, "draw_pool", lambda model, size, **kwargs: UnlabeledPool(
        pool_maps, [f"tiny:syn:pool-{i}:L0H0" for i in range(len(pool_maps))], {"size": size}))
    monkeypatch.setattr(recipe_sweep, "_inputs", {})  # main fills it
    monkeypatch.setattr(recipe_sweep.multiprocessing, "get_context", lambda method: SimpleNamespace(Pool=SerialPool))

    def fit_fold(job):  # a stand-in fit: every test map called vertical
        name, changes, seed, fold = job
        _, test = stratified_folds(np.asarray(recipe_sweep._inputs["labels"]), TrainConfig().folds, seed)[fold]
        return {"setting": name, "changes": changes, "seed": seed, "fold": fold, "test": test.tolist(),
                "probabilities": np.eye(5)[np.zeros(len(test), dtype=int)].tolist()}

    monkeypatch.setattr(recipe_sweep, "fit_fold", fit_fold)
    monkeypatch.setattr(recipe_sweep, "teacher_predictions", lambda maps, labels, folds, seed: np.asarray(labels))
    out = tmp_path / "new" / "folder" / "sweep.csv"
    assert recipe_sweep.main(["--data", str(labeled), "--pool", "3", "--seeds", "0", "--workers", "1",
                              "--out", str(out)]) == 0
    assert list(pd.read_csv(out)["setting"]) == ["base"]
    (cache,) = out.parent.glob("sweep.csv.*.folds.jsonl")
    assert len(recipe_sweep.read_fold_cache(cache)) == TrainConfig().folds
