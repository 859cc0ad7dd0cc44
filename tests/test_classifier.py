"""The pattern CNN: synthetic maps, input transform, training, checkpoints and bad input."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from sklearn.metrics import f1_score
from torchvision.transforms.v2 import functional as TF

import classifier.predict as predict
from analysis.artifacts import SHIPPED_LABELED_SET
from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from analysis.stats import PROFILE_NAMES, map_profile_batch_last
from analysis.uncertainty import confusion_score_interval
from annotation.dataset import load_labeled_set
from classifier.agreement import class_scores
from classifier.checkpoint import DEFAULT_CHECKPOINT, save_checkpoint
from classifier.evaluate import baseline_comparison, comparison_lines, score_table, wide_summary
from classifier.model import (
    CHANNELS,
    IMAGE_CHANNELS,
    INPUT_CHANNELS,
    INPUT_SIZE,
    INPUT_TRANSFORM,
    PROFILE_BINS,
    PROFILE_FEATURES,
    STRIDES,
    PatternCNN,
    inference_copy,
    map_profile,
    prepare_maps,
    resize_maps,
    target_aware_edges,
    write_inputs,
)
from classifier.predict import classify_heads, head_class_table, load_classifier
from classifier.synthetic import synthetic_dataset, synthetic_map
from classifier.train import (
    TrainConfig,
    architecture_metadata,
    check_labels,
    class_weights,
    fit,
    macro_f1,
    predict_images,
    stratified_folds,
)

METADATA = {"input_size": INPUT_SIZE, "channels": list(CHANNELS), "strides": list(STRIDES),
            "trained_on": "random weights (test)"}

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def random_checkpoint(tmp_path):
    torch.manual_seed(0)
    return save_checkpoint(PatternCNN().eval(), tmp_path / "random.safetensors", METADATA)


# ---------------------------------------------------------------- synthetic maps

@pytest.mark.parametrize("kind", CLASSES)
def test_synthetic_maps_are_attention_maps(kind):
    rng = np.random.default_rng(1)
    for n in (4, 9, 40):
        attn = synthetic_map(kind, n, rng)
        assert attn.shape == (n, n) and attn.dtype == np.float32
        assert np.allclose(attn.sum(1), 1.0, atol=1e-5) and (attn >= 0).all()


def test_synthetic_patterns_have_their_structure():
    rng = np.random.default_rng(2)
    n = 30
    diagonal = np.mean([max(np.trace(synthetic_map("diagonal", n, rng), k) for k in (-1, 0, 1)) / n for _ in range(20)])
    vertical = np.mean([np.sort(synthetic_map("vertical", n, rng).mean(0))[-2:].sum() for _ in range(20)])
    block = np.mean([synthetic_map("block", n, rng).max(1).mean() for _ in range(20)])
    assert diagonal > 0.5  # most weight on one band
    assert vertical > 0.6  # most weight on at most two columns
    assert block < 0.2  # weight spread broadly


def test_synthetic_dataset_balanced_and_rejects_unknown_kind():
    maps, labels = synthetic_dataset(3, np.random.default_rng(0), lengths=(5, 12))
    assert len(maps) == 15 and np.bincount(labels).tolist() == [3] * 5
    assert all(5 <= m.shape[0] <= 12 for m in maps)
    with pytest.raises(ValueError):
        synthetic_map("stripes", 10, np.random.default_rng(0))


# ---------------------------------------------------------------- input transform and model

@pytest.mark.parametrize("n", [3, 17, 32, 100])
def test_resize_matches_torchvision_resize(n):
    maps = torch.softmax(torch.randn(4, n, n) * 3, dim=-1)
    resized = TF.resize(maps[:, None], [INPUT_SIZE, INPUT_SIZE], interpolation=TF.InterpolationMode.BILINEAR,
                        antialias=True)
    images = resize_maps(maps)
    assert torch.allclose(images[:, :1], resized / resized.amax(dim=(2, 3), keepdim=True), atol=1e-5)
    # the second view: weight relative to uniform attention (1/n), log scale, within [0, 1]
    assert torch.allclose(images[:, 1:2], torch.log1p(resized.clamp_min(0) * n) / np.log1p(n), atol=1e-5)
    # the third view, scaled to its maximum: max-pooled when longer than the input, else nearest-neighbour upsampled
    if n > INPUT_SIZE:
        crisp = torch.nn.functional.adaptive_max_pool2d(maps[:, None], INPUT_SIZE)
    else:
        crisp = TF.resize(maps[:, None], [INPUT_SIZE, INPUT_SIZE], interpolation=TF.InterpolationMode.NEAREST)
    assert torch.allclose(images[:, 2:3], crisp / crisp.amax(dim=(2, 3), keepdim=True), atol=1e-6)
    # the profile channel: the original map's scalars in its first row, nothing elsewhere
    torch.testing.assert_close(images[:, 3, 0, :PROFILE_FEATURES], map_profile(maps))
    assert images[:, 3, 1:].abs().sum() == 0 and images[:, 3, 0, PROFILE_FEATURES:].abs().sum() == 0
    assert images[:, 1].min() >= 0 and images[:, 1].max() <= 1 + 1e-6


def test_maps_of_any_length_become_fixed_size_images_in_order():
    rng = np.random.default_rng(3)
    maps = [synthetic_map("diagonal", n, rng) for n in (5, 70, 5, 128, 9)]
    images = prepare_maps(maps)
    assert images.shape == (5, INPUT_CHANNELS, INPUT_SIZE, INPUT_SIZE)
    assert torch.allclose(images[:, 0].amax(dim=(1, 2)), torch.ones(5))
    assert torch.allclose(images[3], resize_maps(torch.from_numpy(maps[3])[None])[0])
    with pytest.raises(ValueError):
        prepare_maps([np.ones((3, 4))])


def test_cnn_has_eight_conv_layers_and_five_outputs():
    model = PatternCNN().eval()
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 8
    assert model(torch.rand(3, INPUT_CHANNELS, INPUT_SIZE, INPUT_SIZE)).shape == (3, len(CLASSES))


# ---------------------------------------------------------------- training

@pytest.mark.slow  # ~5 s alone, more on a busy machine
def test_short_training_learns_synthetic_patterns():
    rng = np.random.default_rng(0)
    maps, labels = synthetic_dataset(40, rng, lengths=(8, 40))
    test_maps, test_labels = synthetic_dataset(12, np.random.default_rng(99), lengths=(8, 40))
    result = fit(prepare_maps(maps), labels, TrainConfig(max_epochs=25, patience=25), seed=0)
    accuracy = (predict_images(result.model, prepare_maps(test_maps)).argmax(1).numpy() == test_labels).mean()
    assert accuracy >= 0.85, accuracy


def test_training_is_reproducible_with_a_seed():
    maps, labels = synthetic_dataset(6, np.random.default_rng(0), lengths=(6, 12))
    images = prepare_maps(maps)
    config = TrainConfig(max_epochs=2, batch_size=8)
    first, second = fit(images, labels, config, seed=5), fit(images, labels, config, seed=5)
    for key, value in first.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[key]), key


def test_scores_on_the_maps_annotators_agreed_on():
    labels = np.repeat(np.arange(5), 4)  # 2 folds need 4 maps per class (check_labels)
    predicted = labels.copy()
    predicted[[1, 2, 5]] = 4  # every error falls on a map the annotators disagreed about
    agreed = np.ones(len(labels), bool)
    agreed[[1, 2, 5]] = False
    folds = stratified_folds(labels, 2, seed=0)
    frame, _ = score_table({"model": predicted}, labels, folds, agreed)
    value = frame.set_index("metric").value
    assert value["macro_f1_agreed"] == 1.0 and value["macro_f1"] < 0.9
    assert wide_summary(frame).loc["model", "macro_f1_agreed"] == 1.0
    assert "macro_f1_agreed" not in set(score_table({"model": predicted}, labels, folds)[0].metric)


def test_cv_scores_carry_their_intervals_over_the_labeled_maps():
    """cv_scores.csv gives each model's macro-F1, accuracy, per-class F1 and agreed-maps macro-F1 its 95% interval
    from its out-of-fold confusion matrix (before: bare values, so the Classifier tab showed a training run's
    scores with no uncertainty); the fold std has none, nor a score on agreed maps that lack a class."""
    labels = np.repeat(np.arange(5), 12)
    predicted = labels.copy()
    predicted[::5] = (labels[::5] + 1) % 5  # a fifth of the maps wrong
    agreed = np.ones(len(labels), bool)
    folds = stratified_folds(labels, 2, seed=0)
    frame, confusion = score_table({"model": predicted}, labels, folds, agreed)
    assert list(frame.columns) == ["model", "metric", "class", "value", "ci_low", "ci_high"]
    counts = confusion.pivot(index="true", columns="predicted", values="count").loc[list(CLASSES), list(CLASSES)]
    (f1_bounds, accuracy_bounds) = confusion_score_interval(counts.to_numpy())
    overall = frame[frame["class"] == ""].set_index("metric")
    assert overall.loc["macro_f1", ["ci_low", "ci_high"]].tolist() == f1_bounds.tolist()
    assert overall.loc["accuracy", ["ci_low", "ci_high"]].tolist() == accuracy_bounds.tolist()
    assert overall.loc["macro_f1_agreed", ["ci_low", "ci_high"]].tolist() == f1_bounds.tolist()  # every map agreed
    assert overall.loc["macro_f1_fold_std", ["ci_low", "ci_high"]].isna().all()
    printed = wide_summary(frame).loc["model"]  # what `attnpat train` prints: the macro-F1 beside its bounds
    assert printed[["macro_f1", "macro_f1_ci_low", "macro_f1_ci_high"]].tolist() == [overall.loc["macro_f1", "value"],
                                                                                     *f1_bounds]
    per_class = frame[frame.metric == "f1"]
    assert ((per_class.ci_low < per_class.value) & (per_class.value < per_class.ci_high)).all()
    agreed[labels == 4] = False  # no agreed map of the last class: its rates, and so the interval, are unknown
    overall = score_table({"model": predicted}, labels, folds, agreed)[0].set_index("metric")
    assert overall.loc["macro_f1_agreed", ["ci_low", "ci_high"]].isna().all()


def test_image_dropout_hides_the_image_from_a_share_of_training_maps_only():
    maps, _ = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    images = prepare_maps(maps)
    blank = images.clone()
    blank[:, :IMAGE_CHANNELS] = torch.rand(blank[:, :IMAGE_CHANNELS].shape)  # other pictures, the same profile
    torch.manual_seed(0)
    model = PatternCNN(image_dropout=0.999999)
    half = PatternCNN(image_dropout=0.5)
    for layer in [*model.modules(), *half.modules()]:  # compare passes without the ordinary dropouts' randomness
        if isinstance(layer, torch.nn.Dropout):
            layer.p = 0.0
    model.train()
    with torch.no_grad():
        assert torch.allclose(model(images), model(blank))  # training: nearly every map sees its profile only
        model.eval()
        assert not torch.allclose(model(images), model(blank))  # evaluation: the pictures always count
    half.train()
    with torch.no_grad():
        torch.manual_seed(1)
        first = half(images)
        torch.manual_seed(1)  # the same maps dropped in both passes
        changed = (first != half(blank)).any(1).float().mean()
    assert 0.2 < changed < 0.8  # about half the maps kept their pictures
    with pytest.raises(ValueError, match="image_dropout"):
        PatternCNN(image_dropout=1.0)


def test_baseline_comparison_says_above_below_or_level_with_a_paired_interval():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(5), 60)
    def with_errors(rate):  # a model that gets a chosen share of the maps wrong (always the next class)
        wrong = rng.random(len(labels)) < rate
        return np.where(wrong, (labels + 1) % 5, labels)
    cnn = with_errors(0.10)
    twin = cnn.copy()
    twin[[0, 150]] = (labels[[0, 150]] + 1) % 5  # two maps apart from the CNN: within any interval of 300 maps
    results = {"weak": with_errors(0.40), "cnn": cnn, "strong": with_errors(0.0), "twin": twin}
    table = baseline_comparison(results, labels, "cnn", n_boot=300).set_index("model")
    assert list(table.index) == ["weak", "strong", "twin"]
    assert table.verdict.to_dict() == {"weak": "above", "strong": "below", "twin": "level"}
    assert (table.ci_low <= table.difference).all() and (table.difference <= table.ci_high).all()
    assert table.loc["strong", "model_macro_f1"] == 1.0
    assert table.difference.to_numpy() == pytest.approx(table.reference_macro_f1 - table.model_macro_f1)
    assert (table.p_holm >= table.p_value).all()
    assert table.loc["weak", "p_holm"] < 0.05 and table.loc["strong", "p_holm"] < 0.05
    assert table.loc["twin", "p_value"] > 0.05
    assert "CNN vs weak: +" in comparison_lines(table.reset_index())[0]
    assert "; permutation p = 0.0" in comparison_lines(table.reset_index())[0]
    # identical predictions: a zero difference and interval read as +0.000, never -0.000
    same = baseline_comparison({"cnn": cnn, "copy": cnn.copy()}, labels, "cnn", n_boot=50)
    assert comparison_lines(same) == [
        "CNN vs copy: +0.000 macro-F1 (95% paired bootstrap +0.000 to +0.000; permutation p = 1.000 (Holm)): level"]
    assert comparison_lines(pd.DataFrame([{"model": "tiny", "difference": -4e-4, "ci_low": -0.0012, "ci_high": -1e-17,
                                           "verdict": "level"}])) == [
        "CNN vs tiny: +0.000 macro-F1 (95% paired bootstrap -0.001 to +0.000): level"]
    assert baseline_comparison({"cnn": cnn}, labels).empty
    with pytest.raises(AttnpatError, match="no predictions of 'cnn'"):
        baseline_comparison({"weak": cnn}, labels)


def test_a_bootstrap_interval_clear_of_0_on_a_handful_of_maps_is_not_enough_for_above():
    # the CNN alone is right on 5 of 300 maps: nearly every bootstrap draw holds one of them, so the interval
    # excludes 0, yet all 5 falling the CNN's way has chance 2/32 under the null: the verdict stays 'level'
    labels = np.repeat(np.arange(5), 60)
    cnn = labels.copy()
    other = labels.copy()
    other[:5] = 1
    table = baseline_comparison({"cnn": cnn, "other": other}, labels, "cnn", n_boot=1000).iloc[0]
    assert table.ci_low > 0
    assert table.p_value == pytest.approx(2 / 32, abs=0.02)
    assert table.verdict == "level"


def test_the_comparison_scores_each_model_as_the_evaluation_does_when_a_class_is_missing():
    """A held-out panel with no heterogeneous map, and a baseline that predicts some: the CNN's figure in the
    comparison is the one `evaluate` prints (classes in the labels or its predictions), and the baseline's is
    sklearn's macro-F1 of its own predictions (before, every model was averaged over all 5 classes: the CNN's
    0.928 on panel-3 showed as 0.743 beside the printed 0.928)."""
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 4, 60)  # no heterogeneous (class 4) labeled
    cnn = np.where(rng.random(60) < 0.8, labels, rng.integers(0, 4, 60))
    rules = np.where(rng.random(60) < 0.6, labels, rng.integers(0, 5, 60))
    assert 4 in rules and 4 not in cnn
    row = baseline_comparison({"cnn": cnn, "rules": rules}, labels, "cnn", n_boot=200).iloc[0]
    assert row.reference_macro_f1 == pytest.approx(class_scores(labels, cnn).macro_f1, abs=1e-12)
    assert row.reference_macro_f1 == pytest.approx(f1_score(labels, cnn, average="macro"), abs=1e-12)
    assert row.model_macro_f1 == pytest.approx(f1_score(labels, rules, average="macro"), abs=1e-12)
    assert row.difference == pytest.approx(row.reference_macro_f1 - row.model_macro_f1)


def test_macro_f1_counts_as_sklearn_does():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, present = rng.integers(1, 40), rng.integers(1, 6)  # some classes absent from labels, predictions or both
        labels, predicted = rng.integers(0, present, n), rng.integers(0, 5, n)
        expected = f1_score(labels, predicted, average="macro", zero_division=0)
        assert macro_f1(predicted, labels) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(AttnpatError, match="3 predictions for 2 labels"):
        macro_f1(np.zeros(3), np.zeros(2))


def test_class_weights_favour_rare_classes():
    labels = np.array([0] * 8 + [1] * 2 + [2, 3, 4])
    weights = class_weights(labels)
    assert weights[1] == pytest.approx(4 * weights[0]) and weights[2] > weights[1]
    softer = class_weights(labels, power=0.5)
    assert softer[1] == pytest.approx(2 * softer[0]) and softer[2] / softer[0] < weights[2] / weights[0]


def test_labels_with_an_empty_or_unknown_class_are_rejected():
    with pytest.raises(AttnpatError, match="heterogeneous"):
        check_labels(np.array([0, 0, 1, 1, 2, 2, 3, 3]))
    with pytest.raises(AttnpatError, match="class indices"):
        check_labels(np.array([0, 1, 2, 3, 4, 7]))
    with pytest.raises(AttnpatError, match="2 folds"):
        stratified_folds(np.repeat(np.arange(5), 3), folds=1, seed=0)


def test_folds_are_stratified():
    labels = np.repeat(np.arange(5), 10)
    for _, test in stratified_folds(labels, 5, seed=0):
        assert np.bincount(labels[test]).tolist() == [2] * 5


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_round_trip(random_checkpoint):
    maps = [synthetic_map(kind, n, np.random.default_rng(n)) for kind, n in zip(CLASSES, (6, 20, 33, 64, 90))]
    torch.manual_seed(0)
    original = PatternCNN().eval()
    loaded = load_classifier(random_checkpoint, bf16=False)  # exact float32 (bf16 is tested on its own below)
    with torch.inference_mode():
        expected = torch.softmax(original(prepare_maps(maps)), 1).numpy()
    assert np.allclose(loaded.predict_proba(maps), expected, atol=1e-6)
    assert loaded.metadata["trained_on"] == "random weights (test)"
    assert loaded.metadata["classes"] == list(CLASSES)
    assert json.loads(random_checkpoint.with_suffix(".json").read_text())["input_size"] == INPUT_SIZE
    assert loaded.predict(maps) == [CLASSES[i] for i in expected.argmax(1)]


def test_a_checkpoint_without_the_linear_profile_path_loads_as_the_network_without_it(tmp_path):
    """Checkpoints saved before PatternCNN.profile_logits existed hold no such weights; they load with a zero path,
    which is exactly the network they were trained as."""
    maps = [synthetic_map(kind, n, np.random.default_rng(n)) for kind, n in zip(CLASSES, (6, 20, 33, 64, 90))]
    torch.manual_seed(1)
    model = PatternCNN().eval()
    older = tmp_path / "older.safetensors"
    save_checkpoint(model, older, METADATA)
    state = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith("profile_logits.")}
    header = json.dumps({"format": "attnpat-pattern-cnn/1", "classes": list(CLASSES), **METADATA})
    save_file(state, str(older), metadata={"attnpat": header})
    with torch.inference_mode():
        model.profile_logits.weight.zero_()
        model.profile_logits.bias.zero_()
        expected = torch.softmax(model(prepare_maps(maps)), 1).numpy()
    loaded = load_classifier(older, bf16=False)
    assert not loaded.model.profile_logits.weight.any()
    assert np.allclose(loaded.predict_proba(maps), expected, atol=1e-6)


def test_predict_accepts_a_tensor_batch_and_lists(random_checkpoint):
    classifier = load_classifier(random_checkpoint)
    batch = torch.softmax(torch.randn(3, 12, 12), -1)
    from_tensor = classifier.predict_proba(batch)
    assert from_tensor.shape == (3, 5) and np.allclose(from_tensor.sum(1), 1, atol=1e-5)
    assert np.allclose(classifier.predict_proba(list(batch.numpy())), from_tensor, atol=1e-6)
    assert classifier.predict_proba([]).shape == (0, 5)
    with pytest.raises(AttnpatError, match="square"):
        classifier.predict_proba([np.ones((3, 5))])


def test_classify_heads_names_each_heads_class_and_tables_its_probabilities(random_checkpoint):
    classifier = load_classifier(random_checkpoint)
    maps = torch.softmax(torch.randn(2, 3, 9, 9), -1)  # (L, H, n, n) of one example
    classes, probs = classify_heads(classifier, maps)
    expected = classifier.predict(maps.reshape(6, 9, 9))
    assert classes == [expected[:3], expected[3:]] and probs.shape == (2, 3, len(CLASSES))
    table = head_class_table(classes, probs)
    assert table[["layer", "head"]].values.tolist() == [[layer, head] for layer in range(2) for head in range(3)]
    assert table["class"].tolist() == expected
    assert np.allclose(table[[f"p_{name}" for name in CLASSES]].to_numpy(), probs.reshape(6, -1))


def test_bad_checkpoints_give_one_line_errors(tmp_path, random_checkpoint):
    with pytest.raises(AttnpatError, match="not found"):
        load_classifier(tmp_path / "missing.safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00\x01not a checkpoint" * 10)
    with pytest.raises(AttnpatError, match="not a readable"):
        load_classifier(corrupt)
    wrong_shape = save_checkpoint(PatternCNN(channels=(4,) * 8), tmp_path / "shape.safetensors", METADATA)
    with pytest.raises(AttnpatError, match="does not fit"):
        load_classifier(wrong_shape)
    other_classes = tmp_path / "classes.safetensors"
    header = json.dumps({**METADATA, "format": "attnpat-pattern-cnn/1", "classes": ["a", "b", "c", "d", "e"]})
    save_file(PatternCNN().state_dict(), str(other_classes), metadata={"attnpat": header})
    with pytest.raises(AttnpatError, match="predicts classes"):
        load_classifier(other_classes)
    # the same number of scalars in another order: the weights fit, and would read each scalar as another one
    reordered = save_checkpoint(PatternCNN(), tmp_path / "reordered.safetensors",
                                {**METADATA, "profile_features": list(reversed(PROFILE_NAMES))})
    with pytest.raises(AttnpatError, match="other profile scalars"):
        load_classifier(reordered)
    assert load_classifier(save_checkpoint(PatternCNN(), tmp_path / "named.safetensors",
                                           {**METADATA, "profile_features": list(PROFILE_NAMES)})) is not None
    # classify inverts the recorded confusion after classifying every map: a broken one must stop it at load
    bad_confusions = {"4x5": [[1] * 5] * 4, "text": [["a"] * 5] * 5, "negative": [[-1] + [1] * 4] * 5,
                      "empty row": [[0] * 5] + [[1] * 5] * 4, "ragged": [[1] * 5] * 4 + [[1]]}
    bad_confusion_paths = []
    for name, confusion in bad_confusions.items():
        bad_confusion_paths.append(save_checkpoint(
            PatternCNN(), tmp_path / f"confusion-{name.replace(' ', '-')}.safetensors",
            {**METADATA, "cross_validation": {"confusion": confusion}}))
        with pytest.raises(AttnpatError, match="invalid cross-validated confusion"):
            load_classifier(bad_confusion_paths[-1])
    # whole but not invertible (every row alike): it loads, and classify writes no adjusted ratios, saying why
    assert load_classifier(save_checkpoint(PatternCNN(), tmp_path / "confusion.safetensors",
                                           {**METADATA, "cross_validation": {"confusion": [[3] * 5] * 5}})) is not None
    for path in (corrupt, wrong_shape, other_classes, reordered, *bad_confusion_paths):
        with pytest.raises(AttnpatError) as info:
            load_classifier(path)
        assert "\n" not in str(info.value)


def test_a_checkpoint_trained_on_maps_rendered_otherwise_is_refused_at_load(tmp_path, capsys):
    """A checkpoint whose recorded input_transform is not the one this version renders maps with (channels drawn
    another way, same shapes) is one error line at load, before any map is classified: its weights would read every
    map as drawn otherwise (before, it loaded and classified without a word). The shipped checkpoint and train's
    metadata record the current transform; a checkpoint that records none loads as before."""
    from app.cli import main  # noqa: PLC0415

    other = INPUT_TRANSFORM.replace("channel 2: max-pooled", "channel 2: bilinear")
    older = save_checkpoint(PatternCNN(), tmp_path / "older.safetensors", {**METADATA, "input_transform": other})
    with pytest.raises(AttnpatError, match="trained on maps rendered otherwise .* than this version renders them"):
        load_classifier(older)
    assert main(["classify", "--maps", str(tmp_path / "none"), "--classifier", str(older), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rendered otherwise" in err
    assert json.loads(DEFAULT_CHECKPOINT.with_suffix(".json").read_text())["input_transform"] == INPUT_TRANSFORM
    assert architecture_metadata(TrainConfig())["input_transform"] == INPUT_TRANSFORM
    assert load_classifier(save_checkpoint(PatternCNN(), tmp_path / "current.safetensors",
                                           {**METADATA, "input_transform": INPUT_TRANSFORM})) is not None


def test_a_checkpoint_whose_input_size_cannot_hold_the_profile_scalars_is_refused_at_load(tmp_path):
    """An input size under PROFILE_FEATURES loaded, and classify stopped in a RuntimeError traceback on its first
    map: the profile channel's first row cannot hold the scalars."""
    maps = [synthetic_map("diagonal", 25, np.random.default_rng(0))]
    for size in (8, PROFILE_FEATURES - 1):
        small = save_checkpoint(PatternCNN(), tmp_path / f"size-{size}.safetensors", {**METADATA, "input_size": size})
        with pytest.raises(AttnpatError, match=f"invalid input size {size} .an integer in {PROFILE_FEATURES}..256"):
            load_classifier(small)
    # the network pools globally: a checkpoint of any size that holds the scalars loads and classifies
    for size in (PROFILE_FEATURES, 32):
        fitting = save_checkpoint(PatternCNN(), tmp_path / f"size-{size}.safetensors", {**METADATA, "input_size": size})
        assert load_classifier(fitting, bf16=False).predict(maps)[0] in CLASSES


def test_shipped_default_checkpoint_loads_and_says_what_it_was_trained_on():
    classifier = load_classifier()
    assert DEFAULT_CHECKPOINT.is_file() and DEFAULT_CHECKPOINT.stat().st_size < 5_000_000
    assert classifier.metadata["cross_validation"]["macro_f1"] > 0.5
    assert classifier.trained_on and classifier.metadata["data_hash"]
    # the checkpoint is the one trained on the labeled set the repository ships and names everywhere
    assert classifier.trained_on == f"labeled set {SHIPPED_LABELED_SET}"
    assert classifier.metadata["data_hash"] == load_labeled_set(REPO / SHIPPED_LABELED_SET).data_hash
    maps = [synthetic_map("diagonal", 25, np.random.default_rng(0)),
            synthetic_map("vertical", 25, np.random.default_rng(0))]
    assert classifier.predict(maps) == ["diagonal", "vertical"]


def test_inference_copy_gives_the_same_outputs():
    torch.manual_seed(3)
    model = PatternCNN()
    for norm in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 2.0)
        norm.weight.data.uniform_(0.5, 1.5)
    model.eval()
    images = torch.rand(6, INPUT_CHANNELS, INPUT_SIZE, INPUT_SIZE)
    with torch.inference_mode():
        assert torch.allclose(inference_copy(model)(images.contiguous(memory_format=torch.channels_last)),
                              model(images), atol=1e-5)


def test_profile_scalars_on_hand_made_maps():
    n = 8
    identity = torch.eye(n)[None]
    next_token = torch.diag(torch.ones(n - 1), 1)
    next_token[-1, -1] = 1.0  # the last token has no next one: it attends to itself
    uniform = torch.full((1, n, n), 1.0 / n)
    profiles = map_profile(torch.cat([identity, next_token[None], uniform]))
    offsets = dict(zip((-2, -1, 0, 1, 2), range(5)))
    assert profiles[0, offsets[0]] == 1 and profiles[0, offsets[1]] == 0
    assert profiles[1, offsets[1]] == pytest.approx((n - 1) / n) and profiles[1, offsets[0]] == pytest.approx(1 / n)
    broadness = 9  # index of broadness after 5 bands, top1, top2, first and last column
    assert profiles[2, broadness] == pytest.approx(1.0) and profiles[0, broadness] == pytest.approx(0.0, abs=1e-6)
    assert profiles[2, 5] == pytest.approx(1 / n) and profiles[2, 6] == pytest.approx(2 / n)
    texture = {name: PROFILE_NAMES.index(name) for name in
               ("rows_on_top_column", "row_peak_keys", "excess_over_uniform", "speckle", "row_peak_spread")}
    column = torch.zeros(1, n, n)
    column[0, :, 0] = 1.0  # every row on the first key: a pure stripe
    scattered = torch.zeros(1, n, n)
    scattered[0, torch.arange(n), torch.tensor([3, 0, 5, 1, 7, 2, 6, 4])] = 1.0  # one peak per row, all different
    scattered[0, 0, 3], scattered[0, 0, 0] = 0.6, 0.4  # row 0 peaks lower: its weight is split
    stripe, speckle = map_profile(torch.cat([column, scattered]))
    assert stripe[texture["rows_on_top_column"]] == 1 and stripe[texture["row_peak_keys"]] == pytest.approx(1 / n)
    assert speckle[texture["rows_on_top_column"]] < 0.3 and speckle[texture["row_peak_keys"]] == pytest.approx(1.0)
    assert stripe[texture["excess_over_uniform"]] == pytest.approx(1 - 1 / n)
    assert profiles[2, texture["excess_over_uniform"]] == pytest.approx(0) and profiles[2, texture["speckle"]] == 0
    assert stripe[texture["speckle"]] == pytest.approx(1 / n) and stripe[texture["row_peak_spread"]] == 0
    assert speckle[texture["row_peak_spread"]] > 0


def _reference_profile(attn: torch.Tensor) -> list[float]:
    """PROFILE_NAMES of one (n, n) map computed the plain way, one definition at a time (float64)."""
    a = attn.to(torch.float64)
    n = a.shape[0]
    columns = a.mean(0)
    row_peaks, row_peak_keys = a.max(1)  # first maximum on ties, like argmax
    top = columns.sort(descending=True).values
    entropy = -(a * torch.where(a > 0, a.log(), torch.zeros_like(a))).sum(1).mean()
    off_band = a.clone()
    for offset in (-1, 0, 1):
        off_band.diagonal(offset).zero_()
    top_off = off_band.mean(0).sort(descending=True).values
    return [*(float(a.diagonal(offset).sum() / n) for offset in (-2, -1, 0, 1, 2)),
            float(top[0]), float(top[:2].sum()), float(columns[0]), float(columns[-1]),
            float(entropy / np.log(n)) if n > 1 else 0.0, float(row_peaks.mean()), np.log(n) / np.log(512),
            float((row_peak_keys == columns.argmax()).double().mean()), float(top[:3].sum()),
            len(set(row_peak_keys.tolist())) / n, float((a - 1 / n).clamp_min(0).sum(1).mean()),
            float((a > 4 / n).double().mean()), float(row_peaks.std(unbiased=False)),
            float(top_off[0]), float(top_off[:2].sum())]


@pytest.mark.parametrize("n", [1, 2, 5, 24, 61])
def test_profile_equals_its_plain_definition(n):
    """The batched, vectorised profile (map_profile, via map_profile_batch_last) against each scalar written out
    plainly, on random maps, sparse maps with exact zeros and ties (uniform rows, equal peaks)."""
    rng = np.random.default_rng(n)
    dense = torch.as_tensor(rng.random((3, n, n)) ** 4)
    sparse = torch.as_tensor(rng.random((3, n, n)) * (rng.random((3, n, n)) < 0.3))
    sparse[:, :, 0] += 1e-3  # no empty row
    maps = torch.cat([dense, sparse, torch.ones((1, n, n))])
    maps[-1, : n // 2, : max(1, n // 3)] = 2.0  # tied peaks in the first rows
    maps = maps / maps.sum(-1, keepdim=True)
    expected = torch.tensor([_reference_profile(m) for m in maps])
    torch.testing.assert_close(map_profile(maps).double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(map_profile(maps.float()).double(), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(map_profile_batch_last(maps.permute(1, 2, 0).contiguous()).T, map_profile(maps))


def test_forward_parts_is_the_forward_pass(random_checkpoint):
    """The batch classifier's split input (pictures + float32 profile) gives the 4-channel forward's output."""
    classifier = load_classifier(random_checkpoint, bf16=False)
    rng = np.random.default_rng(2)
    maps = torch.as_tensor(np.stack([synthetic_map(kind, 30, rng) for kind in CLASSES]), dtype=torch.float32)
    images = resize_maps(maps)
    pictures = torch.empty((len(maps), 3, INPUT_SIZE, INPUT_SIZE))
    profile = torch.empty((len(maps), PROFILE_FEATURES))
    write_inputs(maps, pictures, profile)
    torch.testing.assert_close(pictures, images[:, :3])
    torch.testing.assert_close(profile, images[:, 3, 0, :PROFILE_FEATURES])
    with torch.inference_mode():
        torch.testing.assert_close(classifier.model.forward_parts(pictures, profile), classifier.model(images))
    torch.testing.assert_close(classifier.proba_parts(pictures, profile), classifier.proba_images(images))
    with pytest.raises(AttnpatError, match="profile must be"):
        classifier.proba_parts(pictures, profile[:, :3])


def test_bfloat16_inference_agrees_with_float32(random_checkpoint, monkeypatch):
    """bf16 runs only where the CPU has native support (auto), can be forced either way, and changes almost no
    prediction: the probabilities stay within bf16 rounding of the float32 ones."""
    rng = np.random.default_rng(5)
    maps = [synthetic_map(kind, n, rng) for kind in CLASSES for n in (7, 30, 90) for _ in range(4)]
    exact = load_classifier(random_checkpoint, bf16=False)
    fast = load_classifier(random_checkpoint, bf16=True)
    assert exact.input_dtype == torch.float32 and fast.input_dtype == torch.bfloat16
    p32, p16 = exact.predict_proba(maps), fast.predict_proba(maps)
    assert p16.dtype == np.float32 and np.allclose(p16.sum(1), 1, atol=1e-5)
    assert np.abs(p16 - p32).max() < 0.05
    assert (p16.argmax(1) == p32.argmax(1)).mean() >= 0.95
    monkeypatch.setattr(predict, "bf16_supported", lambda: False)
    assert load_classifier(random_checkpoint).bf16 is False
    monkeypatch.setattr(predict, "bf16_supported", lambda: True)
    assert load_classifier(random_checkpoint).bf16 is True


def test_target_aware_edges_put_a_bin_edge_where_the_labels_change():
    rng = np.random.default_rng(0)
    values = np.column_stack([rng.random(400), rng.random(400), np.full(400, 0.3)])  # label cue, noise, constant
    labels = (values[:, 0] >= 0.37).astype(np.int64) + 2 * (values[:, 0] >= 0.81)
    edges = target_aware_edges(values, labels, bins=8)
    assert edges.shape == (3, 9) and (np.diff(edges, axis=1) >= 0).all()
    assert edges[0, 0] == values[:, 0].min() and edges[0, -1] == values[:, 0].max()
    for cutoff in (0.37, 0.81):  # an edge between the last value below the cutoff and the first above it
        below, above = values[values[:, 0] < cutoff, 0].max(), values[values[:, 0] >= cutoff, 0].min()
        assert ((edges[0] > below) & (edges[0] < above)).any(), cutoff
    quantile_edges = np.quantile(values[:, 0], np.linspace(0, 1, 9))
    assert not all(((quantile_edges > values[values[:, 0] < c, 0].max()) &
                    (quantile_edges < values[values[:, 0] >= c, 0].min())).any() for c in (0.37, 0.81))
    assert (edges[2] == 0.3).all()  # a constant scalar: every edge at its one value
    model = PatternCNN()
    images = prepare_maps([synthetic_map(kind, n, np.random.default_rng(n)) for kind in CLASSES for n in (6, 20, 50)])
    model.fit_profile_edges(images, np.repeat(np.arange(len(CLASSES)), 3))
    assert model.profile_edges.shape == (PROFILE_FEATURES, PROFILE_BINS + 1)
    assert (model.profile_edges.diff(dim=1) >= 0).all()


def test_profile_scalars_are_encoded_piecewise_linearly_with_fitted_edges(tmp_path):
    model = PatternCNN().eval()
    images = prepare_maps([synthetic_map(kind, n, np.random.default_rng(n)) for kind in CLASSES for n in (6, 20, 50)])
    model.fit_profile_edges(images)
    profile = images[:, 3, 0, :PROFILE_FEATURES]
    assert torch.allclose(model.profile_edges[:, 0], profile.min(0).values)
    assert torch.allclose(model.profile_edges[:, -1], profile.max(0).values)
    # a value at the lower edge of bin t: bins below it are full, bin t and above are empty
    edges = torch.linspace(0, 1, PROFILE_BINS + 1).repeat(PROFILE_FEATURES, 1)
    model.profile_edges.copy_(edges)
    x = torch.full((1, PROFILE_FEATURES), float(edges[0, 3]) + 0.5 / PROFILE_BINS)  # halfway through bin 3
    encoded = model.encode_profile(x).reshape(PROFILE_FEATURES, PROFILE_BINS)
    assert torch.allclose(encoded[:, :3], torch.ones(PROFILE_FEATURES, 3))
    assert torch.allclose(encoded[:, 3], torch.full((PROFILE_FEATURES,), 0.5))
    assert encoded[:, 4:].abs().sum() == 0
    # fitted edges travel with the checkpoint
    model.fit_profile_edges(images)
    path = save_checkpoint(model, tmp_path / "fitted.safetensors", METADATA)
    assert torch.equal(load_classifier(path, bf16=False).model.profile_edges, model.profile_edges)


def test_a_checkpoint_gets_the_mode_the_umask_gives_every_output(random_checkpoint):
    """safetensors' save_file made its own 0600 file in place of atomic_write's, unlike the .json and the tables."""
    umask = os.umask(0o022)
    os.umask(umask)
    for path in (random_checkpoint, random_checkpoint.with_suffix(".json")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_a_checkpoint_lands_whole_or_not_at_all(random_checkpoint, monkeypatch):
    """The weights were renamed into place before the .json was written: a stop or a failure in between left new
    weights beside the old .json (which load_checkpoint then refuses as disagreeing)."""
    before = {path: path.read_bytes() for path in (random_checkpoint, random_checkpoint.with_suffix(".json"))}

    def stopped(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", stopped)
    torch.manual_seed(1)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(PatternCNN().eval(), random_checkpoint, {**METADATA, "trained_on": "other weights"})
    monkeypatch.undo()
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(path.name for path in random_checkpoint.parent.iterdir()) == sorted(path.name for path in before)
    assert load_classifier(random_checkpoint).metadata["trained_on"] == "random weights (test)"
