"""The teacher-labeled pool: what the teacher sees, that the CNN learns from the pool, and how the pool is drawn."""
from __future__ import annotations

import inspect

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import confusion_matrix, f1_score

import classifier.train as train
from analysis.errors import AttnpatError
from analysis.mapstore import maps_digest
from analysis.patterns import CLASSES
from analysis.rundir import RunDir, locked
from annotation.dataset import load_labeled_set
from app.cli import main
from app.cli_classify import train as train_verb
from classifier.distill import UnlabeledPool, draw_pool, model_of, teacher_probabilities
from classifier.model import prepare_maps
from classifier.predict import load_classifier
from classifier.synthetic import synthetic_dataset
from classifier.train import TrainConfig, cross_validate_cnn, fit, predict_images, stratified_folds
from classifier.training_run import TrainingData, train_pattern_cnn
from tests.tiny import save_tiny_labeled_set


def test_teacher_predicts_every_class_as_probabilities():
    maps, labels = synthetic_dataset(12, np.random.default_rng(0), lengths=(8, 30))
    pool_maps, pool_labels = synthetic_dataset(6, np.random.default_rng(1), lengths=(8, 30))
    probabilities = teacher_probabilities(prepare_maps(maps), labels, prepare_maps(pool_maps))
    assert probabilities.shape == (len(pool_maps), len(CLASSES))
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-9)
    assert (probabilities.argmax(1) == pool_labels).mean() >= 0.8  # synthetic classes are easy from the profile


def test_each_fold_teacher_sees_only_that_folds_training_maps(monkeypatch):
    """No test label may leak into the pool: the teacher of fold k is fitted on fold k's training maps only."""
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(2, np.random.default_rng(1), lengths=(6, 12))
    images = prepare_maps(maps)
    seen = []

    def recording_teacher(train_images, train_labels, pool_images, seed=0):
        seen.append((train_images.clone(), train_labels.copy(), len(pool_images)))
        return np.full((len(pool_images), len(CLASSES)), 1.0 / len(CLASSES))

    monkeypatch.setattr(train, "teacher_probabilities", recording_teacher)
    folds = stratified_folds(labels, 2, seed=0)
    cross_validate_cnn(maps, labels, TrainConfig(max_epochs=1, batch_size=8), folds, pool_maps=pool_maps)
    assert len(seen) == len(folds)
    for (train_idx, _), (train_images, train_labels, pool_size) in zip(folds, seen, strict=True):
        assert torch.equal(train_images, images[train_idx]) and np.array_equal(train_labels, labels[train_idx])
        assert pool_size == len(pool_maps)


def test_no_test_map_reaches_a_folds_cnn_teacher_or_early_stopping(monkeypatch):
    """The leakage check of docs/results.md: each fold's CNN fit (its training part and the early-stopping split it
    takes from it) and its teacher get that fold's training maps and labels only, and the pool holds no labeled map.
    The teacher gets the CNN's early-stopping maps too, by design: they are training maps, never test maps."""
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(2, np.random.default_rng(1), lengths=(6, 12))
    images, pool_images = prepare_maps(maps), prepare_maps(pool_maps)
    fitted, taught, real_fit = [], [], train.fit

    def recording_fit(fit_images, fit_labels, config, seed, **kwargs):
        fitted.append((fit_images.clone(), fit_labels.copy(), kwargs["pool"][0].clone()))
        return real_fit(fit_images, fit_labels, config, seed, **kwargs)

    def recording_teacher(train_images, train_labels, pool, seed=0):
        taught.append((train_images.clone(), train_labels.copy()))
        return np.full((len(pool), len(CLASSES)), 1.0 / len(CLASSES))

    monkeypatch.setattr(train, "fit", recording_fit)
    monkeypatch.setattr(train, "teacher_probabilities", recording_teacher)
    folds = stratified_folds(labels, 2, seed=0)
    cross_validate_cnn(maps, labels, TrainConfig(max_epochs=1, batch_size=8), folds, pool_maps=pool_maps)
    assert len(fitted) == len(taught) == len(folds)
    for (train_idx, test_idx), (fit_images, fit_labels, pool), (teacher_images, teacher_labels) in zip(
            folds, fitted, taught, strict=True):
        assert torch.equal(fit_images, images[train_idx]) and np.array_equal(fit_labels, labels[train_idx])
        assert torch.equal(teacher_images, fit_images) and np.array_equal(teacher_labels, fit_labels)
        assert torch.equal(pool, pool_images)
        for test_image in images[test_idx]:  # not one test map, under any index, in the fit, its split or the pool
            assert not (fit_images == test_image).flatten(1).all(1).any()
            assert not (pool == test_image).flatten(1).all(1).any()


def test_second_round_learns_from_teacher_and_first_cnn_together(monkeypatch):
    maps, labels = synthetic_dataset(3, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(2, np.random.default_rng(1), lengths=(6, 12))
    images, pool_images = prepare_maps(maps), prepare_maps(pool_maps)
    teacher = np.random.default_rng(3).dirichlet(np.ones(len(CLASSES)), len(pool_maps))
    monkeypatch.setattr(train, "teacher_probabilities", lambda *args, **kwargs: teacher)
    fits, real_fit = [], train.fit

    def recording_fit(*args, pool=None, **kwargs):
        result = real_fit(*args, pool=pool, **kwargs)
        fits.append((pool[1].copy(), predict_images(result.model, pool_images).numpy()))
        return result

    monkeypatch.setattr(train, "fit", recording_fit)
    train.fit_with_pool(images, labels, TrainConfig(max_epochs=1, pool_rounds=2), 0, None, pool_images)
    assert len(fits) == 2
    np.testing.assert_allclose(fits[0][0], teacher)
    np.testing.assert_allclose(fits[1][0], (teacher + fits[0][1]) / 2, atol=1e-6)


@pytest.mark.slow  # ~10 s
def test_the_cnn_learns_from_the_pool_targets():
    """Two labeled maps per class cannot teach the classes; a pool with right targets does, and a pool with
    wrong targets (every class shifted by one) teaches the wrong classes."""
    maps, labels = synthetic_dataset(2, np.random.default_rng(0), lengths=(8, 40))
    pool_maps, pool_labels = synthetic_dataset(30, np.random.default_rng(1), lengths=(8, 40))
    test_maps, test_labels = synthetic_dataset(12, np.random.default_rng(2), lengths=(8, 40))
    images, pool_images, test_images = prepare_maps(maps), prepare_maps(pool_maps), prepare_maps(test_maps)
    config = TrainConfig(max_epochs=25, patience=25, validation_fraction=0.5)

    def accuracy(targets):
        pool = (pool_images, np.eye(len(CLASSES))[targets])
        model = fit(images, labels, config, seed=0, pool=pool).model
        return (predict_images(model, test_images).argmax(1).numpy() == test_labels).mean()

    right, wrong = accuracy(pool_labels), accuracy((pool_labels + 1) % len(CLASSES))
    assert right >= 0.85, right
    assert wrong <= 0.5, wrong


def test_training_run_records_the_pool(tmp_path):
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(2, np.random.default_rng(1), lengths=(6, 12))
    pool = UnlabeledPool(pool_maps, [f"tiny:sst2:x{i}:L0H0" for i in range(len(pool_maps))], {"model": "tiny"})
    map_ids = [f"tiny:sst2:e{i}:L0H0" for i in range(len(maps))]
    agreement = np.ones(len(maps))
    agreement[:2] = [0.0, np.nan]  # annotators disagreed on the first map; the second had one annotator
    data = TrainingData(maps, labels, maps_digest(maps, labels=labels), "tiny", "synthetic test maps", map_ids=map_ids,
                        agreement=agreement)
    out = tmp_path / "cnn.safetensors"
    train_pattern_cnn(data, out, RunDir("classifier", "tiny", tmp_path),
                      TrainConfig(max_epochs=1, folds=2, pool_rounds=2), baselines=False, progress=False, pool=pool)
    recorded = load_classifier(out).metadata["unlabeled_pool"]
    assert recorded["model"] == "tiny" and recorded["pool_hash"] == pool.pool_hash and len(pool.pool_hash) == 64
    assert recorded["weight"] == 1.0 and recorded["rounds"] == 2
    assert recorded["map_ids"] == pool.map_ids  # evaluate checks evaluated maps against them
    predictions = pd.read_csv(tmp_path / "classifier" / "tiny" / "cv_predictions.csv")
    assert list(predictions.map_id) == map_ids and list(predictions.label) == [CLASSES[i] for i in labels]
    assert predictions.annotators_agreed.isna().tolist() == [False, True] + [False] * (len(maps) - 2)
    assert predictions.annotators_agreed[0] == False and predictions.annotators_agreed[2:].all()  # noqa: E712
    agreed = predictions.annotators_agreed.fillna(False).to_numpy(bool)
    recorded_f1 = load_classifier(out).metadata["cross_validation"]["macro_f1_agreed"]
    assert recorded_f1 == pytest.approx(f1_score(predictions.label[agreed], predictions.cnn[agreed], average="macro"))
    # the confusion matrix classify's adjusted ratios invert is the out-of-fold one, not the final fit's on its own maps
    recorded_confusion = load_classifier(out).metadata["cross_validation"]["confusion"]
    assert recorded_confusion == confusion_matrix(predictions.label, predictions.cnn, labels=list(CLASSES)).tolist()


def test_pool_model_comes_from_the_map_ids():
    assert model_of(["minilm:sst2:a:L0H0", "minilm:rte:b:L1H1", "bert:sst2:c:L0H0"]) == "minilm"
    with pytest.raises(Exception, match="--pool-model"):
        model_of(["no-prefix"])


def test_draw_pool_skips_labeled_maps_and_is_deterministic():
    """The real embedded model on the packaged data: a small pool, drawn twice, never a labeled map."""
    first = draw_pool("minilm", 12, tasks=("sst2", "rte"))
    excluded = first.map_ids[:4]
    second = draw_pool("minilm", 12, exclude=excluded, tasks=("sst2", "rte"))
    again = draw_pool("minilm", 12, exclude=excluded, tasks=("sst2", "rte"))
    assert len(first.maps) == len(second.maps) == 12
    assert not set(excluded) & set(second.map_ids) and second.map_ids == again.map_ids
    assert second.pool_hash == again.pool_hash
    assert {map_id.split(":")[1] for map_id in second.map_ids} == {"sst2", "rte"}
    for attn in second.maps:
        assert attn.ndim == 2 and attn.shape[0] == attn.shape[1]
        np.testing.assert_allclose(attn.sum(1), 1.0, atol=1e-4)


def test_cli_rejects_a_negative_pool(tmp_path, capsys):
    assert main(["train", "--data", "synthetic:4", "--pool", "-1", "--runs-dir", str(tmp_path), "-q"]) == 2
    assert main(["train", "--data", "synthetic:4", "--pool-rounds", "0", "--runs-dir", str(tmp_path), "-q"]) == 2
    assert main(["train", "--data", "synthetic:4", "--image-dropout", "1", "--runs-dir", str(tmp_path), "-q"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 3 and all("--pool-rounds" in line for line in errors[:2]) and "--image-dropout" in errors[2]



@pytest.mark.parametrize("options", [["--pool", "10"], ["--pool-model", "minilm"], ["--pool-exclude", "held-out"]])
def test_cli_refuses_a_pool_for_synthetic_data_before_any_work(tmp_path, capsys, options):
    """Synthetic maps come from no model, so no pool is drawn for them: a pool asked for is refused in one line,
    with nothing written (before, --pool was silently ignored). Left out, the default pool is not asked for."""
    assert main(["train", "--data", "synthetic:4", *options, "--runs-dir", str(tmp_path), "-q"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "synthetic" in errors[0] and f"leave out {options[0]}" in errors[0]
    assert not any(tmp_path.iterdir())


def test_cli_refuses_a_synthetic_mix_for_synthetic_data_before_any_work(tmp_path, capsys):
    """--synthetic-mix was silently ignored with --data synthetic (no maps are mixed into synthetic data); now it is
    refused in one line with nothing written, as --pool is."""
    assert main(["train", "--data", "synthetic:4", "--synthetic-mix", "10", "--runs-dir", str(tmp_path), "-q"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --data synthetic:4 trains on synthetic maps, to which no more "
                                               "are added: leave out --synthetic-mix (it mixes synthetic maps into a "
                                               "labeled set)")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("pool_rounds", 0, "pool_rounds must be a whole number, 1 or more"),
    ("pool_rounds", 1.5, "pool_rounds must be a whole number, 1 or more"),
    ("class_weight_power", -0.5, "class_weight_power must be a finite number, 0 or more"),
    ("class_weight_power", float("nan"), "class_weight_power must be a finite number, 0 or more"),
    ("class_weight_power", float("inf"), "class_weight_power must be a finite number, 0 or more")])
def test_a_training_config_refuses_pool_rounds_and_class_weight_power_the_cli_refuses(field, value, rule):
    """Only the CLI checked them: pool_rounds=0 trained one round while the manifest said 0, and a negative or NaN
    power reached the class weights of the loss. The API now refuses them when the config is made."""
    with pytest.raises(AttnpatError, match=rule):
        TrainConfig(**{field: value})
    assert TrainConfig(pool_rounds=2, class_weight_power=0).pool_rounds == 2


@pytest.mark.parametrize("weight", [-0.5, float("nan"), float("inf")])
def test_a_training_config_refuses_a_negative_or_non_finite_pool_weight(weight):
    with pytest.raises(AttnpatError, match="pool_weight must be a finite number, 0 or more"):
        TrainConfig(pool_weight=weight)
    assert TrainConfig(pool_weight=0).pool_weight == 0

def test_train_verb_defaults_are_the_training_configs_defaults():
    """The CLI keeps its own copy of the defaults (it imports the classifier lazily): a change must reach both."""
    options = {name: parameter.default.default for name, parameter in inspect.signature(train_verb).parameters.items()}
    config = TrainConfig()
    for verb_name, config_name in (("epochs", "max_epochs"), ("folds", "folds"), ("seed", "seed"),
                                   ("pool_weight", "pool_weight"), ("pool_rounds", "pool_rounds"),
                                   ("class_weight_power", "class_weight_power"), ("image_dropout", "image_dropout")):
        assert options[verb_name] == getattr(config, config_name), verb_name


def test_a_pool_of_weight_0_is_ignored_not_turned_into_nan_weights():
    """Batches of pool maps only (weight sum 0) were a 0/0 loss: NaN weights, never better than epoch 0, whose
    untrained network was then returned as the result."""
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(40, np.random.default_rng(1), lengths=(6, 12))
    pool = (prepare_maps(pool_maps), np.full((len(pool_maps), len(CLASSES)), 1.0 / len(CLASSES)))
    result = fit(prepare_maps(maps), labels, TrainConfig(max_epochs=3, batch_size=8, pool_weight=0), seed=0, pool=pool)
    assert result.best_epoch >= 1
    assert all(torch.isfinite(tensor).all() for tensor in result.model.state_dict().values()
               if tensor.is_floating_point())


def test_a_loss_that_is_not_finite_stops_training_with_one_line():
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(2, np.random.default_rng(1), lengths=(6, 12))
    pool = (prepare_maps(pool_maps), np.full((len(pool_maps), len(CLASSES)), np.nan))
    with pytest.raises(AttnpatError, match="training diverged: the loss became nan in epoch 1"):
        fit(prepare_maps(maps), labels, TrainConfig(max_epochs=3, batch_size=64), seed=0, pool=pool)


def test_train_checks_labels_folds_run_folder_and_lock_before_the_pool_is_drawn(tmp_path, capsys, monkeypatch):
    """Drawing the pool loads a model and samples maps for about a minute: every input error comes first."""
    import classifier.distill as distill  # noqa: PLC0415

    def reached(*args, **kwargs):
        raise AssertionError("the pool was drawn before the inputs were checked")

    monkeypatch.setattr(distill, "draw_pool", reached)
    few = save_tiny_labeled_set(tmp_path / "few", 2)
    enough = save_tiny_labeled_set(tmp_path / "enough", 4)
    empty = save_tiny_labeled_set(tmp_path / "empty", 2)
    (empty / "labels.csv").write_text("map_id,label\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    runs, out = tmp_path / "runs", tmp_path / "cnn.safetensors"
    cases = [([few, "--folds", "2"], "every class needs at least 4 labeled maps"),
             ([enough, "--folds", "1"], "at least 2 folds"),
             ([empty], "the training set is empty"),
             ([enough, "--folds", "2", "--runs-dir", blocker / "runs"], "a-file is a file, not a folder")]
    for arguments, message in cases:
        arguments = ["train", "--data", *map(str, arguments), "--out", str(out), "-q"]
        assert main(arguments + ([] if "--runs-dir" in arguments else ["--runs-dir", str(runs)])) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error
    with locked(RunDir("classifier", "enough", runs).file(".lock-train"), "another train"):
        assert main(["train", "--data", str(enough), "--folds", "2", "--out", str(out), "--runs-dir", str(runs),
                     "-q"]) == 2
    assert "is being written by another attnpat process" in capsys.readouterr().err
    assert not out.exists() and not list(runs.rglob("*.csv"))


def test_pool_exclude_keeps_the_named_sets_maps_out_of_the_pool(tmp_path, capsys, monkeypatch):
    """`train --pool-exclude annotation/labeled`: held-out panels stay out of the teacher-labeled pool too (the
    shipped checkpoint's pool, drawn without it, holds 37 of the seven panels' 1,830 maps)."""
    import classifier.distill as distill  # noqa: PLC0415

    labeled = save_tiny_labeled_set(tmp_path / "set", 4)
    panel = save_tiny_labeled_set(tmp_path / "held-out" / "panel", 2, seed=5, task="panel")
    asked = {}

    def fake_pool(model, size, exclude=(), **kwargs):
        asked["exclude"] = set(exclude)
        maps, _ = synthetic_dataset(1, np.random.default_rng(3), lengths=(6, 12))
        return UnlabeledPool(maps[:size], [f"tiny:sst2:p{i}:L0H0" for i in range(size)], {"model": model})

    monkeypatch.setattr(distill, "draw_pool", fake_pool)
    out = tmp_path / "cnn.safetensors"
    assert main(["train", "--data", str(labeled), "--folds", "2", "--epochs", "1", "--pool", "3", "--no-baselines",
                 "--pool-exclude", str(tmp_path / "held-out"), "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
                 "-q"]) == 0, capsys.readouterr().err
    training_ids, panel_ids = set(load_labeled_set(labeled).map_ids), set(load_labeled_set(panel).map_ids)
    assert asked["exclude"] == training_ids | panel_ids
    assert load_classifier(out).metadata["unlabeled_pool"]["excluded_from"] == [str(tmp_path / "held-out")]
    # a folder that is not there is one error line before any work
    assert main(["train", "--data", str(labeled), "--folds", "2", "--pool", "3", "--pool-exclude",
                 str(tmp_path / "nowhere"), "--out", str(tmp_path / "other.safetensors"), "--runs-dir",
                 str(tmp_path / "runs2"), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "nowhere does not exist" in error, error
    assert not (tmp_path / "runs2").exists()


def test_a_pool_model_that_cannot_load_offline_names_the_pool_option(tmp_path, capsys, monkeypatch):
    """The advice named --model, an option train does not have."""
    monkeypatch.setattr("analysis.models.hub_reachable", lambda timeout=3.0: False)
    labeled = save_tiny_labeled_set(tmp_path / "set", 4)
    assert main(["train", "--data", str(labeled), "--folds", "2", "--pool", "4", "--pool-model",
                 "nobody/not-a-cached-model", "--runs-dir", str(tmp_path / "runs"), "-q"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "offline, use --pool-model minilm" in error, error
    assert not list((tmp_path / "runs").rglob("*.csv"))


def test_a_stopped_train_resumes_with_the_pool_it_drew_not_a_new_draw(tmp_path, capsys, monkeypatch, caplog):
    """The rerun of a stopped `train` learns from the maps the stopped run drew, even where a new draw would give
    others (here every draw gives other maps, as after the model's files or the excluded sets changed): its finished
    folds are kept and the checkpoint records that pool. Before, the pool was drawn again; its other maps made every
    kept fold stale, and the checkpoint recorded the second draw. A rerun asking for another pool says so."""
    import classifier.distill as distill  # noqa: PLC0415
    import classifier.train as train_module  # noqa: PLC0415
    from classifier.training_run import RESUME_FOLDER  # noqa: PLC0415

    draws = []

    def changing_pool(model, size, exclude=(), **kwargs):  # another pool at every draw
        maps, _ = synthetic_dataset(1, np.random.default_rng(len(draws)), lengths=(6, 12))
        draws.append(UnlabeledPool(maps[:size], [f"tiny:sst2:d{len(draws)}-{i}:L0H0" for i in range(size)],
                                   {"model": model, "size": size}))
        return draws[-1]

    real_fit, seeds, stop_at = train_module.fit_with_pool, [], [3]

    def stopping_fit(images, labels, config, seed, *args, **kwargs):
        seeds.append(seed)
        if len(seeds) == stop_at[0]:
            raise KeyboardInterrupt  # Ctrl-C while the third fold trains
        return real_fit(images, labels, config, seed, *args, **kwargs)

    monkeypatch.setattr(distill, "draw_pool", changing_pool)
    monkeypatch.setattr(train_module, "fit_with_pool", stopping_fit)
    labeled = save_tiny_labeled_set(tmp_path / "set", 4)
    runs, out = tmp_path / "runs", tmp_path / "cnn.safetensors"
    command = ["train", "--data", str(labeled), "--folds", "3", "--epochs", "1", "--pool", "4", "--no-baselines",
               "--out", str(out), "--runs-dir", str(runs), "-q"]
    assert main(command) == 130
    kept = runs / "classifier" / "set" / RESUME_FOLDER
    assert len(draws) == 1 and len(list(kept.glob("fold-*.npy"))) == 2
    seeds.clear()
    stop_at[0] = None
    assert main(command) == 0, capsys.readouterr().err
    assert len(draws) == 1  # not drawn again
    assert seeds == [2, 0]  # only fold 2 and the final fit: the kept folds were trained with this very pool
    recorded = load_classifier(out).metadata["unlabeled_pool"]
    assert recorded["map_ids"] == draws[0].map_ids and recorded["pool_hash"] == draws[0].pool_hash
    assert not kept.exists()

    # a rerun asking for another pool (--pool 3) draws it, and says why the kept one is not used
    seeds.clear()
    stop_at[0] = 2
    assert main(command) == 130
    stop_at[0], caplog.records[:] = None, []
    assert main([("3" if before == "--pool" else arg) for before, arg in zip(["", *command], command)]) == 0
    assert len(draws) == 3 and load_classifier(out).metadata["unlabeled_pool"]["map_ids"] == draws[2].map_ids
    assert [record.getMessage() for record in caplog.records if "unlabeled pool" in record.getMessage()] == [
        "the unlabeled pool kept by the stopped train was drawn for another size (--pool); drawing a new one (the "
        "folds trained with the old one are trained again)"]


def test_folds_grouped_by_head_keep_every_map_of_a_head_in_one_fold():
    """`--fold-groups head`: cross-validation on heads the classifier never saw. Map ids name the head (and the
    model: L0H1 of two models are two heads); each class stays in every training part."""
    from classifier.train import fold_groups  # noqa: PLC0415

    labels = np.repeat(np.arange(len(CLASSES)), 12)
    ids = [f"{'ab'[i % 2]}:sst2:ex-{i // 10}:L{i % 3}H{i % 4}" for i in range(len(labels))]
    heads = fold_groups(ids, "head")
    assert len(np.unique(heads)) == 2 * 3 * 4 // 2  # i % 2, i % 3, i % 4: 12 (model, layer, head) combinations
    folds = stratified_folds(labels, 3, 0, heads)
    for train_idx, test_idx in folds:
        assert not set(heads[train_idx]) & set(heads[test_idx])
        assert set(labels[train_idx]) == set(range(len(CLASSES)))
    assert sorted(np.concatenate([test for _, test in folds]).tolist()) == list(range(len(labels)))
    examples = fold_groups(ids, "example")
    assert len(np.unique(examples)) == 2 * 6  # the model and ex-0..ex-5
    assert fold_groups(ids, "map") is None
    with pytest.raises(AttnpatError, match="3 folds need at least 3 groups of maps, got 2"):
        stratified_folds(labels, 3, 0, np.arange(len(labels)) % 2)
    one_head_holds_a_class = np.where(labels == len(CLASSES) - 1, 0, np.arange(len(labels)) % 4)
    with pytest.raises(AttnpatError, match=f"leave no {CLASSES[-1]} map in some fold's training part"):
        stratified_folds(labels, 3, 0, one_head_holds_a_class)
    with pytest.raises(AttnpatError, match="unknown fold grouping 'layer'"):
        fold_groups(ids, "layer")
    with pytest.raises(AttnpatError, match="need the maps' ids"):
        fold_groups([], "head")


def test_train_with_folds_grouped_by_head_scores_heads_it_never_saw(tmp_path, capsys):
    """The CLI: out-of-fold predictions of each head come from one fold that saw none of its maps; the manifest,
    the checkpoint and its card say how the folds were made. Synthetic maps have no heads: one error line."""
    from app.classifier_card import classifier_card  # noqa: PLC0415

    labeled = save_tiny_labeled_set(tmp_path / "set", 6, heads=6)
    runs, out = tmp_path / "runs", tmp_path / "cnn.safetensors"
    code = main(["train", "--data", str(labeled), "--folds", "3", "--fold-groups", "head", "--epochs", "2",
                 "--pool", "0", "--out", str(out), "--runs-dir", str(runs), "-q"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "3-fold cross-validation (out-of-fold scores; every map of a head in one fold)" in captured.out
    predictions = pd.read_csv(runs / "classifier" / "set" / "cv_predictions.csv")
    head = predictions.map_id.str.rpartition(":")[2]
    assert predictions.groupby(head).fold.nunique().max() == 1 and predictions.fold.nunique() == 3
    metadata = load_classifier(out).metadata
    assert metadata["cross_validation"]["fold_groups"] == "head"
    assert "heads the classifier never saw" in classifier_card(metadata).summary
    manifest = (runs / "classifier" / "set" / "manifest.json").read_text()
    assert '"fold_groups": "head"' in manifest
    assert main(["train", "--data", "synthetic:4", "--folds", "2", "--fold-groups", "head", "--out",
                 str(tmp_path / "s.safetensors"), "--runs-dir", str(runs), "-q"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: folds by head need the maps' ids (a labeled set), not synthetic maps"]


def test_a_pool_of_weight_0_is_not_drawn_taught_or_recorded(tmp_path, capsys, monkeypatch):
    """Weight 0 teaches nothing, yet the pool was drawn (a minute), a teacher fitted per fold, its maps shaped the
    BatchNorm statistics (so the weights differed from a fit without it) and the checkpoint recorded it."""
    import classifier.distill as distill  # noqa: PLC0415

    def refused(*args, **kwargs):
        raise AssertionError("a pool of weight 0 was drawn or taught")

    monkeypatch.setattr(distill, "draw_pool", refused)
    monkeypatch.setattr(train, "teacher_probabilities", refused)
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    pool_maps, _ = synthetic_dataset(4, np.random.default_rng(1), lengths=(6, 12))
    images, pool_images = prepare_maps(maps), prepare_maps(pool_maps)
    config = TrainConfig(max_epochs=2, batch_size=8, pool_weight=0)
    with_pool = train.fit_with_pool(images, labels, config, 0, None, pool_images).model.state_dict()
    without = fit(images, labels, config, seed=0).model.state_dict()
    assert all(torch.equal(with_pool[name], without[name]) for name in without)

    pool = UnlabeledPool(pool_maps, [f"tiny:sst2:x{i}:L0H0" for i in range(len(pool_maps))], {"model": "tiny"})
    data = TrainingData(maps, labels, maps_digest(maps, labels=labels), "tiny", "synthetic test maps",
                        map_ids=[f"tiny:sst2:e{i}:L0H0" for i in range(len(maps))])
    out = tmp_path / "api.safetensors"
    train_pattern_cnn(data, out, RunDir("classifier", "tiny", tmp_path / "api"),
                      TrainConfig(max_epochs=1, folds=2, pool_weight=0), baselines=False, progress=False, pool=pool)
    assert "unlabeled_pool" not in load_classifier(out).metadata

    labeled, out = save_tiny_labeled_set(tmp_path / "set", 4), tmp_path / "cli.safetensors"
    assert main(["train", "--data", str(labeled), "--folds", "2", "--epochs", "1", "--pool", "5", "--pool-weight",
                 "0", "--no-baselines", "--out", str(out), "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0, \
        capsys.readouterr().err
    assert "unlabeled_pool" not in load_classifier(out).metadata


def test_a_pool_of_no_maps_no_tasks_or_unknown_tasks_is_one_error_line_before_the_model_loads(monkeypatch):
    """Before, no task divided by zero after the model loaded, an unknown task failed after it loaded, a task named
    twice drew its maps twice, and a PoolRequest of size 0 was accepted until its draw."""
    import classifier.distill as distill  # noqa: PLC0415
    from classifier.distill import PoolRequest  # noqa: PLC0415

    def no_load(*args, **kwargs):
        raise AssertionError("the pool's model was loaded before its request was checked")

    monkeypatch.setattr(distill, "load_model", no_load)
    cases = [(0, ("sst2",), "the unlabeled pool needs at least one map, got 0"),
             (-3, ("sst2",), "the unlabeled pool needs at least one map, got -3"),
             (5, (), "the unlabeled pool needs a list of one or more tasks, got ()"),
             (5, "sst2", "the unlabeled pool needs a list of one or more tasks, got 'sst2'"),
             (5, ("sst2", "nope"), "unknown task 'nope'"),
             (5, ("sst2", "RTE", "rte"), "the unlabeled pool's tasks name rte more than once")]
    for size, tasks, message in cases:
        for ask in (PoolRequest, draw_pool):
            with pytest.raises(AttnpatError) as raised:
                ask("minilm", size, tasks=tasks)
            assert message in str(raised.value) and "\n" not in str(raised.value)
    assert PoolRequest("minilm", 5, tasks=("SST2", "rte")).key()["tasks"] == ["sst2", "rte"]


def test_the_pool_leaves_out_labeled_maps_whatever_name_their_model_was_loaded_by(monkeypatch):
    """Labeled ids say 'minilm:...'; the same model loaded from its folder makes ids '<folder>:...'. Those maps were
    matched by the whole id, so the labeled maps came into the pool under the other name."""
    import types  # noqa: PLC0415

    import classifier.distill as distill  # noqa: PLC0415
    from analysis.sampling import SampledMap  # noqa: PLC0415

    def fake_sample_maps(bundle, *, n_maps, tasks, seed, examples_per_task):
        for i in range(n_maps):  # the same cells in the same order at every draw, as a seeded draw gives
            example, head = f"e{i // 2}", i % 2
            yield SampledMap(f"{bundle.slug}:sst2:{example}:L0H{head}", "sst2", example, 0, head, [],
                             np.full((3, 3), 1 / 3, np.float32))

    monkeypatch.setattr(distill, "load_model", lambda model, **kwargs: types.SimpleNamespace(slug="all-MiniLM-L6-v2"))
    monkeypatch.setattr(distill, "sample_maps", fake_sample_maps)
    labeled = ["minilm:sst2:e0:L0H0", "minilm:sst2:e0:L0H1", "minilm:sst2:e3:L0H1"]
    pool = draw_pool("/models/all-MiniLM-L6-v2", 6, exclude=labeled, tasks=("sst2",))
    assert len(pool.map_ids) == 6 and len(set(pool.map_ids)) == 6
    cells = {map_id.split(":", 1)[1] for map_id in pool.map_ids}
    assert not cells & {map_id.split(":", 1)[1] for map_id in labeled}, sorted(cells)


def test_a_given_pool_holding_a_labeled_map_is_one_error_line_before_any_work(tmp_path):
    """A pool passed to train_pattern_cnn was used as given: a labeled map in it was taught the teacher's label,
    in the folds where it is a test map too."""
    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    map_ids = [f"minilm:sst2:e{i}:L0H0" for i in range(len(maps))]
    pool = UnlabeledPool(maps[:2], ["minilm:rte:x:L1H1", "elsewhere:sst2:e3:L0H0"], {"model": "minilm"})
    data = TrainingData(maps, labels, maps_digest(maps, labels=labels), "tiny", "test maps", map_ids=map_ids)
    out = tmp_path / "cnn.safetensors"
    with pytest.raises(AttnpatError, match=r"pool holds 1 of the labeled maps \(first: elsewhere:sst2:e3"):
        train_pattern_cnn(data, out, RunDir("classifier", "tiny", tmp_path / "runs"),
                          TrainConfig(max_epochs=1, folds=2), baselines=False, progress=False, pool=pool)
    assert not out.exists() and not list((tmp_path / "runs").rglob("*.csv"))


def test_a_teacher_without_a_class_gives_it_0_and_keeps_the_others_columns_on_degenerate_maps_too():
    """predict_proba has one column per class the teacher saw: with block (3) missing from its training maps its
    columns must still land under their own CLASSES, and 1-token or all-equal maps give finite distributions."""
    maps, labels = synthetic_dataset(40, np.random.default_rng(0), lengths=(8, 20))
    seen = labels != CLASSES.index("block")
    pool_maps, pool_labels = synthetic_dataset(8, np.random.default_rng(1), lengths=(8, 20))
    degenerate = [np.ones((1, 1), np.float32), np.full((2, 2), 0.5, np.float32), np.full((6, 6), 1 / 6, np.float32)]
    probabilities = teacher_probabilities(prepare_maps([m for m, keep in zip(maps, seen, strict=True) if keep]),
                                          labels[seen], prepare_maps(pool_maps + degenerate))
    assert np.isfinite(probabilities).all() and (probabilities >= 0).all()
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-9)
    assert (probabilities[:, CLASSES.index("block")] == 0).all()
    others = pool_labels != CLASSES.index("block")
    assert (probabilities[:len(pool_maps)].argmax(1)[others] == pool_labels[others]).mean() >= 0.9
