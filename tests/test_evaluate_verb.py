"""`attnpat evaluate`: the classifier scored against a labeled set (classifier.agreement)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import (
    accuracy_score,
    cohen_kappa_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
)

from analysis.artifacts import ARTIFACTS, listed
from analysis.errors import AttnpatError
from analysis.mapstore import single_map, write_maps
from analysis.patterns import CLASSES
from annotation.dataset import labeled_set_name, load_labeled_set, save_labeled_set, write_labeled_folder
from app.cli import main
from classifier.agreement import class_scores, panel_score_quantiles, score_table, training_folder
from classifier.checkpoint import save_checkpoint
from classifier.distill import teacher_probabilities
from classifier.evaluate import comparison_lines, held_out_baseline_predictions, rule_class_indices
from classifier.model import CHANNELS, INPUT_SIZE, STRIDES, PatternCNN, prepare_maps
from tests.tiny import save_tiny_labeled_set

REPO = Path(__file__).resolve().parents[1]
PANEL = REPO / "annotation" / "labeled" / "panel-1"


def write_checkpoint(path: Path, fitted_on: Path, **metadata) -> Path:
    """A random CNN whose profile bins are fitted on a labeled set's maps (so its predictions vary)."""
    torch.manual_seed(0)
    model = PatternCNN().eval()
    model.fit_profile_edges(prepare_maps(load_labeled_set(fitted_on).maps))
    return save_checkpoint(model, path, {"input_size": INPUT_SIZE, "channels": list(CHANNELS),
                                         "strides": list(STRIDES), **metadata})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(evaluated set, training set of other maps, checkpoint 'trained' on the latter)."""
    root = tmp_path_factory.mktemp("evaluate")
    evaluated = save_tiny_labeled_set(root / "panel", 6, seed=1, task="panel")
    training = save_tiny_labeled_set(root / "train", 4, seed=2, task="train")
    checkpoint = write_checkpoint(root / "cnn.safetensors", evaluated, trained_on=f"labeled set {training}",
                                  data_hash=load_labeled_set(training).data_hash)
    return evaluated, training, checkpoint


def run_evaluate(capsys, *argv) -> tuple[int, str, str]:
    code = main(["evaluate", *map(str, argv), "-q"])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- the scores

def test_class_scores_equal_sklearn_and_leave_absent_classes_unscored():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 60)  # heterogeneous (4) is neither labeled nor predicted
    predicted = np.where(rng.random(60) < 0.7, labels, rng.integers(0, 4, 60))
    found = class_scores(labels, predicted)
    assert found.macro_f1 == pytest.approx(f1_score(labels, predicted, average="macro"))
    assert found.accuracy == pytest.approx(accuracy_score(labels, predicted))
    precision, recall, f1, support = precision_recall_fscore_support(labels, predicted, labels=[0, 1, 2, 3])
    np.testing.assert_allclose(found.f1[:4], f1)
    np.testing.assert_allclose(found.precision[:4], precision)
    np.testing.assert_allclose(found.recall[:4], recall)
    np.testing.assert_array_equal(found.support, [*support, 0])
    assert np.isnan(found.f1[4]) and np.isnan(found.precision[4]) and found.absent == ["heterogeneous"]
    # a class only predicted (never labeled) is scored, at 0
    predicted[:3] = 4
    found = class_scores(labels, predicted)
    assert found.f1[4] == 0 and found.absent == []
    assert found.macro_f1 == pytest.approx(f1_score(labels, predicted, average="macro"))


def noisy_predictions(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), n)
    return labels, np.where(rng.random(n) < 0.75, labels, rng.integers(0, len(CLASSES), n))


def test_interval_contains_the_estimate_and_narrows_with_more_maps():
    widths = []
    for n in (50, 800):
        labels, predicted = noisy_predictions(n, seed=n)
        table = score_table(labels, predicted, n_boot=300)
        scored = table[table.metric != "support"]
        assert (scored.low <= scored.value + 1e-12).all() and (scored.value <= scored.high + 1e-12).all()
        macro = table[table.metric == "macro_f1"].iloc[0]
        assert macro.value == pytest.approx(f1_score(labels, predicted, average="macro"))
        widths.append(macro.high - macro.low)
    assert widths[1] < widths[0] / 2  # about 1/sqrt(16) as wide


# ---------------------------------------------------------------- the verb

def test_evaluate_writes_registered_tables_that_agree_with_sklearn(tiny, tmp_path, capsys):
    evaluated, training, checkpoint = tiny
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path,
                                  "--panel-size", 12)
    assert code == 0, err
    run = tmp_path / "classifier" / "panel"
    written = {path.name for path in run.iterdir()}
    expected = {name for entry in ARTIFACTS if entry.verb == "evaluate" for name in entry.files()}
    # written only with --paired-with, and for a set whose annotations.csv holds annotators (tests below)
    conditional = {"evaluation_paired.csv", "evaluation_annotator_pairs.csv"}
    assert written == (expected - conditional) | {"manifest.json"} and all(listed(name) for name in written)

    predictions = pd.read_csv(run / "evaluation_predictions.csv")
    labels = load_labeled_set(evaluated)
    assert list(predictions.map_id) == labels.map_ids and list(predictions.label) == [CLASSES[i] for i in labels.labels]
    assert (predictions.predicted == predictions[[f"p_{c}" for c in CLASSES]].idxmax(axis=1).str[2:]).all()
    y, p = predictions.label, predictions.predicted
    scores = pd.read_csv(run / "evaluation_scores.csv").fillna({"class": ""})
    overall = scores[scores["class"] == ""].set_index("metric").value
    assert overall.macro_f1 == pytest.approx(f1_score(y, p, average="macro"))
    assert overall.accuracy == pytest.approx(accuracy_score(y, p))
    per_class = scores[scores.metric == "f1"].set_index("class").value
    present = sorted(set(y) | set(p))
    assert dict(per_class[present]) == pytest.approx(dict(zip(present, f1_score(y, p, labels=present, average=None))))
    confusion = pd.read_csv(run / "evaluation_confusion.csv").pivot(index="true", columns="predicted", values="count")
    np.testing.assert_array_equal(confusion.loc[list(CLASSES), list(CLASSES)].to_numpy(),
                                  confusion_matrix(y, p, labels=list(CLASSES)))
    assert len(set(p)) > 1  # the random CNN's predictions vary, so the comparison means something

    low, high = scores[scores.metric == "macro_f1"][["low", "high"]].iloc[0]
    assert f"macro-F1 {overall.macro_f1:.3f} (95% CI {low:.3f}-{high:.3f}) on 30 maps of {evaluated}" in out
    assert f"(classifier trained on labeled set {training})" in out
    assert f"held out: none of these maps is in the training set ({training})" in out and err == ""
    manifest = json.loads((run / "manifest.json").read_text())["analyses"]["evaluate"]
    assert manifest["maps_in_training"] == 0 and manifest["macro_f1"] == pytest.approx(overall.macro_f1)

    # the CNN against every baseline, each fitted on the training set the checkpoint names
    versus = pd.read_csv(run / "evaluation_vs_baselines.csv").set_index("model")
    assert list(versus.index) == ["rules", "logreg", "boosting", "boosting_profile"]
    np.testing.assert_allclose(versus.reference_macro_f1, overall.macro_f1)
    np.testing.assert_allclose(versus.difference, versus.reference_macro_f1 - versus.model_macro_f1)
    assert ((versus.ci_low <= versus.difference + 1e-12) & (versus.difference <= versus.ci_high + 1e-12)).all()
    panel, trained = load_labeled_set(evaluated), load_labeled_set(training)
    rules = rule_class_indices(panel.maps)
    teacher = teacher_probabilities(prepare_maps(trained.maps), trained.labels, prepare_maps(panel.maps)).argmax(1)
    assert versus.model_macro_f1["rules"] == pytest.approx(f1_score(panel.labels, rules, average="macro"))
    assert versus.model_macro_f1["boosting_profile"] == pytest.approx(f1_score(panel.labels, teacher, average="macro"))
    for line in comparison_lines(versus.reset_index()):
        assert line in out.splitlines()
    assert set(manifest["vs_baselines"]) == set(versus.index)
    assert ((versus.p_value > 0) & (versus.p_value <= versus.p_holm) & (versus.p_holm <= 1)).all()
    described = next(artifact.columns for artifact in ARTIFACTS if artifact.stem == "evaluation_vs_baselines")
    assert all(column in described for column in ["model", *versus.columns])  # the catalogue names every column

    # --panel-size: fresh panels of 12 maps drawn from these 30
    panel_sizes = pd.read_csv(run / "evaluation_panel_size.csv")
    pd.testing.assert_frame_equal(panel_sizes, panel_score_quantiles(labels.labels, np.array(
        [CLASSES.index(c) for c in p]), 12), check_dtype=False)
    quantile = panel_sizes.set_index("quantile").macro_f1
    assert f"a fresh panel of 12 maps drawn like these: macro-F1 {quantile[0.05]:.3f}-{quantile[0.95]:.3f}" in out
    assert manifest["panel_size"] == 12

    # a rerun without --panel-size takes the earlier run's panel table away with it (it may describe another
    # checkpoint); one that fails leaves the folder as it was
    before = sorted(path.name for path in run.iterdir())
    code, _, err = run_evaluate(capsys, "--data", evaluated, "--classifier", tmp_path / "none.safetensors",
                                "--runs-dir", tmp_path)
    assert code != 0 and sorted(path.name for path in run.iterdir()) == before
    code, _, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0, err
    assert not (run / "evaluation_panel_size.csv").exists()
    assert sorted(path.name for path in run.iterdir()) == sorted(set(before) - {"evaluation_panel_size.csv"})
    assert json.loads((run / "manifest.json").read_text())["analyses"]["evaluate"]["panel_size"] is None


def test_a_small_panel_usually_misses_a_rare_class_that_a_large_one_holds():
    """99 vertical maps found and 1 heterogeneous map missed: the whole set scores (0.995 + 0) / 2. A panel of 10
    drawn from it holds that map in about 1 draw in 10 and otherwise scores vertical alone (1.0); a panel of
    1,000 holds it about 10 times over and scores about 0.5."""
    labels = np.array([0] * 99 + [4])
    predicted = np.zeros(100, dtype=int)
    assert class_scores(labels, predicted).macro_f1 == pytest.approx((2 * 99 / 199) / 2)
    small = panel_score_quantiles(labels, predicted, 10).set_index("quantile").macro_f1
    large = panel_score_quantiles(labels, predicted, 1000).set_index("quantile").macro_f1
    assert list(small.index) == pytest.approx(np.arange(0.05, 0.96, 0.05))
    assert small[0.05] < 0.6 and (small[small.index >= 0.15] == 1.0).all()
    assert large[0.05] == pytest.approx(0.5, abs=0.01) and large[0.95] < 0.51
    assert np.all(np.diff(small.to_numpy()) >= 0) and np.all(np.diff(large.to_numpy()) >= 0)
    assert (panel_score_quantiles(labels, labels, 10).macro_f1 == 1.0).all()  # a perfect classifier, any draw
    with pytest.raises(AttnpatError, match="--panel-size must be at least 1 and at most 10000, got 0"):
        panel_score_quantiles(labels, predicted, 0)


def test_held_out_baselines_are_fitted_on_the_training_maps_only(tmp_path, capsys):
    training = load_labeled_set(save_tiny_labeled_set(tmp_path / "train", 6, seed=4))
    held_out = load_labeled_set(save_tiny_labeled_set(tmp_path / "held-out", 3, seed=5))
    found = held_out_baseline_predictions(training.maps, training.labels, held_out.maps, seed=0, progress=True)
    assert "baselines: 100%" in capsys.readouterr().err  # the fits take ~20 s on v5: a bar says what runs
    assert set(found) == {"rules", "logreg", "boosting", "boosting_profile"}
    assert all(predicted.shape == (len(held_out),) for predicted in found.values())
    np.testing.assert_array_equal(found["rules"], rule_class_indices(held_out.maps))
    np.testing.assert_array_equal(found["boosting_profile"], teacher_probabilities(
        prepare_maps(training.maps), training.labels, prepare_maps(held_out.maps)).argmax(1))
    # a fit on the training maps alone: the same predictions whatever else is evaluated beside these maps
    more = held_out_baseline_predictions(training.maps, training.labels, held_out.maps + training.maps[:5], seed=0)
    for name, predicted in found.items():
        np.testing.assert_array_equal(more[name][:len(held_out)], predicted)
    # logistic regression on the pre-annotator's features learns these clean synthetic classes
    assert f1_score(held_out.labels, found["logreg"], average="macro") > 0.6
    with pytest.raises(AttnpatError, match="need training and evaluated maps"):
        held_out_baseline_predictions(training.maps, training.labels, [])


def test_the_overlap_with_the_training_set_is_counted_and_warned(tiny, tmp_path, capsys):
    evaluated, training, _ = tiny
    labeled = load_labeled_set(evaluated)
    # trained on a set sharing 7 maps with the evaluated one
    mixed = write_labeled_folder(tmp_path / "mixed", [*labeled.rows[:7], *load_labeled_set(training).rows],
                                 {**dict(zip(labeled.map_ids, labeled.maps)),
                                  **dict(zip(load_labeled_set(training).map_ids, load_labeled_set(training).maps))},
                                 [], {})
    checkpoint = write_checkpoint(tmp_path / "mixed.safetensors", evaluated, trained_on=f"labeled set {mixed}",
                                  data_hash=load_labeled_set(mixed).data_hash)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err.splitlines() == [
        f"warning: 7 of these maps were in the training set: scores are not held out ({mixed})"]
    assert "held out" not in out and "changed" not in out

    # the training folder found no longer holds what the checkpoint was trained on
    checkpoint = write_checkpoint(tmp_path / "stale.safetensors", evaluated, trained_on=f"labeled set {mixed}",
                                  data_hash="0" * 64)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err.startswith("warning: 7 of these maps") and f"note: {mixed} has changed since" in out
    # the baselines are not fitted on a set other than the one the CNN learned: the rules only, and said so
    versus = pd.read_csv(tmp_path / "classifier" / "panel" / "evaluation_vs_baselines.csv")
    assert list(versus.model) == ["rules"] and "compared with the rules only" in out

    # trained on this very set, found by its data hash although the folder it names is not here
    checkpoint = write_checkpoint(tmp_path / "same.safetensors", evaluated, trained_on="labeled set gone/v9",
                                  data_hash=labeled.data_hash)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err.splitlines() == ["warning: 30 of these maps were in the training set: scores are not held "
                                              "out (labeled set gone/v9, the same data hash)"]

    # a training set that cannot be found: said, not guessed
    checkpoint = write_checkpoint(tmp_path / "lost.safetensors", evaluated, trained_on="labeled set gone/v9",
                                  data_hash="0" * 64)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err == "" and "note: the classifier's training set (labeled set gone/v9) is not here" in out
    assert "compared with the rules only" in out and "CNN vs rules: " in out and "CNN vs logreg" not in out


def test_first_versions_of_two_pulled_samples_get_run_directories_of_their_own(tiny, tmp_path, capsys):
    assert labeled_set_name(REPO / "annotation" / "labeled" / "v5") == "v5"
    assert labeled_set_name(PANEL) == "panel-1"
    assert labeled_set_name(tmp_path / "workspace" / "annotation" / "labeled" / "my-panel" / "v1") == "my-panel-v1"
    evaluated, _, checkpoint = tiny
    for sample in ("one", "two"):  # as `annotate pull` writes them: labeled/<sample>/v1
        shutil.copytree(evaluated, tmp_path / "labeled" / sample / "v1")
        code, _, err = run_evaluate(capsys, "--data", tmp_path / "labeled" / sample / "v1", "--classifier",
                                    checkpoint, "--runs-dir", tmp_path / "runs")
        assert code == 0, err
    assert sorted(path.name for path in (tmp_path / "runs" / "classifier").iterdir()) == ["one-v1", "two-v1"]


def test_the_training_folder_is_found_relative_to_the_places_it_may_be(tmp_path):
    save_tiny_labeled_set(tmp_path / "sets" / "v1", 2)
    assert training_folder("labeled set sets/v1", (tmp_path / "elsewhere", tmp_path)) == tmp_path / "sets" / "v1"
    assert training_folder(f"labeled set {tmp_path / 'sets' / 'v1'}") == tmp_path / "sets" / "v1"
    assert training_folder("labeled set sets/v2", (tmp_path,)) is None
    assert training_folder("synthetic maps (classifier.synthetic, 4 per class, seed 0)", (tmp_path,)) is None


def test_of_several_folders_by_the_training_name_the_one_the_checkpoint_records_is_taken(tiny, tmp_path, capsys,
                                                                                      monkeypatch):
    """A checkpoint trained on sets/v1 (a relative name), evaluated from a folder holding a merged copy of sets/v1
    while the workspace holds the one it was trained on: the recorded data hash picks the workspace's (before, the
    first found, the merged copy in the current folder: its overlap was counted, it was called changed, and the
    baselines were compared as rules only). Two copies, neither the one recorded, are named in one note line."""
    evaluated, training, _ = tiny
    labeled, original = load_labeled_set(evaluated), load_labeled_set(training)
    home, here = tmp_path / "home", tmp_path / "here"
    shutil.copytree(training, home / "sets" / "v1")
    # merged: the training maps plus 7 of the evaluated ones
    write_labeled_folder(here / "sets" / "v1", [*original.rows, *labeled.rows[:7]],
                         {**dict(zip(original.map_ids, original.maps)), **dict(zip(labeled.map_ids, labeled.maps))},
                         [], {})
    monkeypatch.chdir(here)
    monkeypatch.setenv("ATTNPAT_HOME", str(home))
    checkpoint = write_checkpoint(tmp_path / "v1.safetensors", evaluated, trained_on="labeled set sets/v1",
                                  data_hash=original.data_hash)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err == "", err
    assert f"held out: none of these maps is in the training set ({home / 'sets' / 'v1'})" in out
    assert "changed" not in out and "rules only" not in out and "CNN vs logreg" in out

    # neither copy is the one trained on: both named, nothing counted on a guess
    write_labeled_folder(home / "sets" / "v1", original.rows[:10], dict(zip(original.map_ids, original.maps)), [], {})
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err == "", err
    notes = [line for line in out.splitlines() if "cannot be told apart" in line]
    assert notes == [f"note: the classifier's training set cannot be told apart: the folders {here / 'sets' / 'v1'}, "
                     f"{home / 'sets' / 'v1'} go by the name it was trained on (labeled set sets/v1), differ, and none "
                     "holds the maps and labels it records (data hash); whether these maps are held out is unchecked"]
    assert "held out:" not in out and "has changed" not in out


def test_bad_inputs_are_one_error_line_and_write_nothing(tiny, tmp_path, capsys):
    evaluated, _, checkpoint = tiny
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.safetensors").write_bytes(b"not a checkpoint")
    unlabeled = shutil.copytree(evaluated, tmp_path / "unlabeled")  # labels.csv with its header only
    (unlabeled / "labels.csv").write_text((unlabeled / "labels.csv").read_text().splitlines()[0] + "\n")
    doubled = shutil.copytree(evaluated, tmp_path / "doubled")  # one map id twice in maps.npz, other values
    first = load_labeled_set(evaluated)
    write_maps(doubled / "maps.npz", [single_map(map_id, attn) for map_id, attn in zip(first.map_ids, first.maps)]
               + [single_map(first.map_ids[0], first.maps[0] + 0.5)])
    cases = [(["--data", tmp_path / "missing"], "missing does not exist"),
             (["--data", tmp_path / "empty"], "is not a labeled set"),
             (["--data", unlabeled, "--classifier", checkpoint], "labels.csv lists no maps; there is nothing to"),
             (["--data", doubled, "--classifier", checkpoint], f"holds map '{first.map_ids[0]}' twice with different"),
             (["--data", evaluated, "--classifier", tmp_path / "broken.safetensors"], "not a readable safetensors"),
             (["--data", evaluated, "--classifier", tmp_path / "absent.safetensors"], "not found"),
             (["--data", evaluated, "--classifier", checkpoint, "--panel-size", 0], "--panel-size must be at least 1")]
    for argv, message in cases:
        code, out, err = run_evaluate(capsys, *argv, "--runs-dir", tmp_path / "runs")
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "runs").exists()


def test_one_labeled_map_gives_no_interval_not_a_certain_one(tiny, tmp_path, capsys):
    """One map resampled is the same map in every draw: the bootstrap showed '95% CI 1.000-1.000' and paired
    intervals of zero width, a certainty one map cannot give. Now the bounds are empty, as every mean over one
    example is (analysis.uncertainty.MIN_RESAMPLED), and the lines say why."""
    evaluated, _, checkpoint = tiny
    labeled = load_labeled_set(evaluated)
    one = write_labeled_folder(tmp_path / "one", labeled.rows[:1], dict(zip(labeled.map_ids, labeled.maps)), [], {})
    code, out, err = run_evaluate(capsys, "--data", one, "--classifier", checkpoint, "--runs-dir", tmp_path,
                                  "--paired-with", one)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("macro-F1 ") and "(no 95% CI: one map) on 1 maps" in lines[0]
    assert lines[1].endswith("(no 95% CI: one map)") and "CI 1.000-1.000" not in out
    run = tmp_path / "classifier" / "one"
    scores = pd.read_csv(run / "evaluation_scores.csv")
    assert scores[["low", "high"]].isna().all().all()
    versus = pd.read_csv(run / "evaluation_vs_baselines.csv")
    assert versus[["ci_low", "ci_high"]].isna().all().all() and (versus.verdict == "level").all()
    compared = [line for line in lines if line.startswith("CNN vs ")]
    assert len(compared) == len(versus) and all("no 95% paired bootstrap interval from one map" in line
                                                for line in compared)
    # --paired-with words its missing interval as the baseline comparisons do (one helper, paired_interval_text)
    paired = [line for line in lines if " minus against " in line]
    assert len(paired) == 2 and all(line.endswith("(no 95% paired bootstrap interval from one map)") for line in paired)
    assert pd.read_csv(run / "evaluation_paired.csv")[["ci_low", "ci_high"]].isna().all().all()


def test_a_panel_size_above_the_labeled_maps_is_refused_before_any_work(tiny, tmp_path, capsys):
    """A fresh panel is drawn from the evaluated maps: more maps than they are would claim a spread narrower than
    the maps themselves support (before, a panel of 100 drawn from 15 maps read 0.13-0.21 in 90% of draws, beside
    the 15 maps' own 95% interval of 0.04-0.30)."""
    evaluated, _, checkpoint = tiny
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--panel-size", 31,
                                  "--runs-dir", tmp_path / "runs")
    assert code == 2 and err.splitlines() == [
        "error: --panel-size 31 is above the 30 labeled maps: a fresh panel is drawn from them, so it can hold at "
        "most 30"], err
    assert not (tmp_path / "runs").exists()
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--panel-size", 30,
                                  "--runs-dir", tmp_path / "runs")
    assert code == 0 and "a fresh panel of 30 maps drawn like these" in out, err


def test_a_runs_folder_that_cannot_be_written_is_one_error_line_before_any_map_is_classified(tiny, tmp_path, capsys,
                                                                                              monkeypatch):
    """Before, every map was classified and only then did the run folder turn out unwritable (RunDir.record's
    check came after the classification); now RunDir.check_writable runs first and the classifier is never
    called."""
    evaluated, _, checkpoint = tiny

    def never(*args, **kwargs):
        raise AssertionError("the maps were classified before the run folder was checked")

    monkeypatch.setattr("classifier.agreement.predict_in_batches", never)
    (tmp_path / "a-file").write_text("not a folder")
    unwritable = {tmp_path / "a-file" / "runs": "a-file is a file, not a folder"}
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if not os.access(read_only, os.W_OK):  # root writes a read-only folder all the same: only the file case there
        unwritable[read_only] = f"permission denied on {read_only}"
    try:
        for runs, reason in unwritable.items():
            code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", runs)
            assert code == 2 and len(err.splitlines()) == 1, err
            assert err.startswith("error: cannot write ") and reason in err, err
    finally:
        read_only.chmod(0o755)
    assert list(read_only.iterdir()) == []


def test_a_map_trained_on_under_another_id_counts_as_in_the_training_set(tiny, tmp_path, capsys):
    """The same map sampled again under another id (another model name, another sample's naming) was trained on
    all the same: the overlap is counted by the map itself too, not by its id alone."""
    evaluated, training, _ = tiny
    labeled, trained = load_labeled_set(evaluated), load_labeled_set(training)
    renamed = {f"other:{map_id}": attn for map_id, attn in zip(labeled.map_ids[:4], labeled.maps[:4])}
    rows = [*trained.rows, *({"map_id": map_id, "label": CLASSES[label]}
                             for map_id, label in zip(renamed, labeled.labels[:4]))]
    mixed = write_labeled_folder(tmp_path / "renamed", rows, {**dict(zip(trained.map_ids, trained.maps)), **renamed},
                                 [], {})
    checkpoint = write_checkpoint(tmp_path / "renamed.safetensors", evaluated, trained_on=f"labeled set {mixed}",
                                  data_hash=load_labeled_set(mixed).data_hash)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err.splitlines() == [
        f"warning: 4 of these maps were in the training set: scores are not held out ({mixed})"], err
    assert "held out: none" not in out
    manifest = json.loads((tmp_path / "classifier" / "panel" / "manifest.json").read_text())
    assert manifest["analyses"]["evaluate"]["maps_in_training"] == 4


def test_a_panel_of_another_models_maps_is_named_as_such(tiny, tmp_path, capsys):
    """The checkpoint learned from maps of one model ('tiny' here, MiniLM for the shipped one); a panel of another
    model's maps is a fair test of transfer (docs/results.md), but its scores are for heads the classifier never
    saw. Before, nothing said so: the output read as a held-out score of the classifier's own kind."""
    evaluated, _, checkpoint = tiny
    labeled = load_labeled_set(evaluated)
    renamed = {map_id.replace("tiny:", "bert:", 1): attn for map_id, attn in zip(labeled.map_ids, labeled.maps)}
    rows = [{"map_id": map_id, "label": CLASSES[label]} for map_id, label in zip(renamed, labeled.labels)]
    other = write_labeled_folder(tmp_path / "bert-panel", rows, renamed, [], {})
    note = ("note: maps of bert, a model the classifier learned from no map of: these scores are for heads it never "
            "saw (docs/results.md: about 0.11 below its own model's)")
    code, out, err = run_evaluate(capsys, "--data", other, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0, err
    assert note in out.splitlines()
    manifest = json.loads((tmp_path / "classifier" / "bert-panel" / "manifest.json").read_text())
    assert manifest["analyses"]["evaluate"]["other_models"] == ["bert"]
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and "note: maps of" not in out, err


def test_held_out_does_not_claim_the_unlabeled_pool_it_never_checked(tiny, tmp_path, capsys):
    """A checkpoint trained with teacher-labeled unlabeled maps (train's default --pool 2000) also learned from maps
    no labeled set holds, and their ids are not recorded: the shipped checkpoint's pool holds 37 maps of panels 1-7.
    Evaluate says its check covers the labeled training set only."""
    evaluated, training, _ = tiny
    pool = {"model": "minilm", "size": 2000, "tasks": ["sst2"], "seed": 777, "pool_hash": "0" * 64}
    checkpoint = write_checkpoint(tmp_path / "pooled.safetensors", evaluated, trained_on=f"labeled set {training}",
                                  data_hash=load_labeled_set(training).data_hash, unlabeled_pool=pool)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0 and err == "", err
    assert (f"held out: none of these maps is in the labeled training set ({training}); the 2000 unlabeled maps the "
            "classifier also learned from (teacher labels) are not checked and may hold some of them"
            ) in out.splitlines()
    assert "held out: none of these maps is in the training set" not in out


def test_maps_of_a_recorded_unlabeled_pool_are_counted_and_named(tiny, tmp_path, capsys):
    """A checkpoint that records its pool's map ids (train does): evaluate counts the evaluated maps the CNN learned
    with its teacher's labels, and says the rest are held out from the pool too."""
    evaluated, training, _ = tiny
    panel_ids = load_labeled_set(evaluated).map_ids
    lines = {}
    for name, pool_ids in (("shared", [*panel_ids[:3], "other:sst2:1:L0H0"]), ("apart", ["other:sst2:1:L0H0"])):
        pool = {"model": "minilm", "size": len(pool_ids), "seed": 777, "pool_hash": "0" * 64, "map_ids": pool_ids}
        checkpoint = write_checkpoint(tmp_path / f"{name}.safetensors", evaluated, trained_on=f"labeled set {training}",
                                      data_hash=load_labeled_set(training).data_hash, unlabeled_pool=pool)
        code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir",
                                      tmp_path / name)
        assert code == 0 and err == "", err
        lines[name] = out.splitlines()
        entry = json.loads((tmp_path / name / "classifier" / evaluated.name / "manifest.json").read_text())
        assert entry["analyses"]["evaluate"]["maps_in_unlabeled_pool"] == (3 if name == "shared" else 0)
    assert (f"held out from the labeled training set ({training}); 3 of these maps were among the 4 unlabeled maps "
            "the classifier also learned from, with its teacher's labels, not these") in lines["shared"]
    assert (f"held out: none of these maps is in the training set ({training}) or in the 1 unlabeled maps the "
            "classifier also learned from") in lines["apart"]
    assert not any("not checked" in line for line in lines["shared"] + lines["apart"])


def test_the_shipped_classifier_on_the_held_out_panel(tmp_path, capsys):
    code, out, err = run_evaluate(capsys, "--data", PANEL, "--runs-dir", tmp_path)
    assert code == 0, err
    run = tmp_path / "classifier" / PANEL.name
    predictions = pd.read_csv(run / "evaluation_predictions.csv")
    assert len(predictions) == len(load_labeled_set(PANEL))
    scores = pd.read_csv(run / "evaluation_scores.csv").fillna({"class": ""})
    macro = scores[scores.metric == "macro_f1"].value.iloc[0]
    assert macro == pytest.approx(f1_score(predictions.label, predictions.predicted, average="macro"))
    assert out.startswith(f"macro-F1 {macro:.3f} (95% CI ")


def test_the_held_out_sets_share_no_map_with_a_training_set_or_with_each_other():
    labeled = REPO / "annotation" / "labeled"
    training = set().union(*(load_labeled_set(labeled / name).map_ids for name in ("v2", "v3", "v4", "v5")))
    panels = tuple(f"panel-{number}" for number in range(1, 8))
    relabeled = ("panel-5", "panel-7")  # each also labeled again from the images alone, as <panel>-images-only
    held_out = {name: set(load_labeled_set(labeled / name).map_ids) for name in (*panels, "boundary-2")}
    for name, map_ids in held_out.items():
        assert map_ids and not map_ids & training, name
    names = list(held_out)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            assert not held_out[first] & held_out[second], (first, second)
    # a panel's maps labeled again from the images alone: the same maps, other annotators
    for panel_name in relabeled:
        images_only = f"{panel_name}-images-only"
        assert set(load_labeled_set(labeled / images_only).map_ids) == held_out[panel_name]
        first_panel, second_panel = (set(pd.read_csv(labeled / name / "annotations.csv").annotator)
                                     for name in (panel_name, images_only))
        assert not first_panel & second_panel
    # three annotators per map, four where the first three split three ways (the report's ties); the label is
    # their strict majority
    for name in (*panels, *(f"{panel_name}-images-only" for panel_name in relabeled)):
        annotations = pd.read_csv(labeled / name / "annotations.csv")
        panel = load_labeled_set(labeled / name)
        settled = json.loads((labeled / name / "pull_report.json").read_text()).get("ties") or []
        expected = np.where(np.isin(panel.map_ids, settled), 4, 3)
        annotators = annotations.groupby("map_id").annotator.nunique().reindex(panel.map_ids)
        counts = annotations.groupby("map_id").label.value_counts().unstack(fill_value=0).reindex(panel.map_ids)
        assert (annotators.to_numpy() == expected).all() and (counts.sum(axis=1).to_numpy() == expected).all(), name
        top_two = np.sort(counts.to_numpy(), axis=1)[:, -2:]
        assert (top_two[:, 1] >= 2).all() and (top_two[:, 1] > top_two[:, 0]).all(), name
        assert [CLASSES[label] for label in panel.labels] == counts.idxmax(axis=1).tolist(), name


def test_a_panel_without_a_rare_class_is_evaluated_and_merged(tiny, tmp_path, capsys):
    """Natural proportions can leave a class out of a test panel: loading, merging and scoring still work, and
    training on such a set is what refuses (it needs every class)."""
    evaluated, _, checkpoint = tiny
    full = load_labeled_set(evaluated)
    keep = [i for i, label in enumerate(full.labels) if CLASSES[label] != "heterogeneous"]
    rows = [{"map_id": full.map_ids[i], "label": CLASSES[full.labels[i]]} for i in keep]
    panel = write_labeled_folder(tmp_path / "no-het", rows, {full.map_ids[i]: full.maps[i] for i in keep}, [], {})
    assert "heterogeneous" not in {CLASSES[label] for label in load_labeled_set(panel).labels}
    assert main(["annotate", "merge", str(panel), str(evaluated), "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    assert len(load_labeled_set(tmp_path / "merged")) == len(full)  # the shared maps are kept once
    code, out, err = run_evaluate(capsys, "--data", panel, "--classifier", checkpoint, "--runs-dir", tmp_path / "runs")
    assert code == 0, err
    assert out.startswith("macro-F1 ") and f"on {len(keep)} maps of {panel}" in out
    code = main(["train", "--data", str(panel), "--pool", "0", "--no-baselines", "--runs-dir", str(tmp_path / "t"),
                 "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "heterogeneous (0)" in err


# ---------------------------------------------------------------- single annotators, and two label sets

def annotated_copy(source: Path, folder: Path) -> tuple[Path, dict[str, list[str]]]:
    """``source`` with an annotations.csv: a labels every map as labels.csv does; b the first 20 maps, a third of
    them otherwise; c every map, a fifth otherwise; on map 0 the three split three ways and d settles the tie
    after them (a fourth label, not of the first round). Returns the folder and each annotator's map ids."""
    labeled = load_labeled_set(source)
    labels = [CLASSES[i] for i in labeled.labels]
    shifted = [CLASSES[(i + 1) % len(CLASSES)] for i in labeled.labels]
    votes = {"a": labels, "b": [shifted[i] if i % 3 == 0 else labels[i] for i in range(20)],
             "c": [shifted[i] if i % 5 == 0 else labels[i] for i in range(len(labels))]}
    votes["c"][0] = CLASSES[(labeled.labels[0] + 2) % len(CLASSES)]  # a, b, c differ on map 0: a tie
    rows = [{"map_id": labeled.map_ids[i], "label": label, "annotator": who, "labeled_at": f"t{i:03d}"}
            for i in range(len(labels)) for who in "abc" if i < len(votes[who]) for label in [votes[who][i]]]
    rows.append({"map_id": labeled.map_ids[0], "label": labels[0], "annotator": "d", "labeled_at": "t999"})
    folder = shutil.copytree(source, folder)
    pd.DataFrame(rows).to_csv(folder / "annotations.csv", index=False)
    return folder, votes


def test_one_annotators_first_round_labels_are_scored_in_a_run_of_their_own(tiny, tmp_path, capsys):
    evaluated, _, checkpoint = tiny
    panel, votes = annotated_copy(evaluated, tmp_path / "panel")
    labeled = load_labeled_set(panel)
    code, out, err = run_evaluate(capsys, "--data", panel, "--classifier", checkpoint, "--runs-dir", tmp_path / "runs",
                                  "--annotator", "b")
    assert code == 0, err
    run = tmp_path / "runs" / "classifier" / "panel-by-b"
    predictions = pd.read_csv(run / "evaluation_predictions.csv")
    assert list(predictions.map_id) == labeled.map_ids[:20] and list(predictions.label) == votes["b"]
    scores = pd.read_csv(run / "evaluation_scores.csv").fillna({"class": ""})
    overall = scores[scores["class"] == ""].set_index("metric").value
    assert overall.macro_f1 == pytest.approx(f1_score(votes["b"], predictions.predicted, average="macro"))
    assert f"on 20 maps of {panel} labeled by b (first round)" in out
    manifest = json.loads((run / "manifest.json").read_text())["analyses"]["evaluate"]
    assert manifest["annotator"] == "b" and manifest["n_maps"] == 20

    # the annotators against each other, in the first round: d's tie-settling label is in no pair
    code, out, err = run_evaluate(capsys, "--data", panel, "--classifier", checkpoint, "--runs-dir", tmp_path / "runs")
    assert code == 0, err
    pairs = pd.read_csv(tmp_path / "runs" / "classifier" / "panel" / "evaluation_annotator_pairs.csv")
    assert [tuple(pair) for pair in pairs[["annotator_a", "annotator_b"]].to_numpy()] == [("a", "b"), ("a", "c"),
                                                                                         ("b", "c")]
    for row in pairs.to_dict("records"):
        first, second = votes[row["annotator_a"]], votes[row["annotator_b"]]
        shared = min(len(first), len(second))
        assert row["maps"] == shared
        assert row["macro_f1"] == pytest.approx(f1_score(first[:shared], second[:shared], average="macro"))
        assert row["agreement"] == pytest.approx(accuracy_score(first[:shared], second[:shared]))
        assert row["macro_f1_low"] <= row["macro_f1"] <= row["macro_f1_high"]
        low, high = f"{row['macro_f1_low']:.3f}", f"{row['macro_f1_high']:.3f}"
        assert row["agreement_low"] <= row["agreement"] <= row["agreement_high"]
        agreed_low, agreed_high = f"{row['agreement_low']:.3f}", f"{row['agreement_high']:.3f}"
        # Cohen's kappa of the pair, with its interval (it was not given)
        assert row["kappa"] == pytest.approx(cohen_kappa_score(first[:shared], second[:shared]))
        assert row["kappa_low"] <= row["kappa"] <= row["kappa_high"]
        kappa_low, kappa_high = f"{row['kappa_low']:.3f}", f"{row['kappa_high']:.3f}"
        # the agreement carries its interval too (it was printed as a bare share)
        assert (f"annotators {row['annotator_a']} vs {row['annotator_b']} ({shared} maps, first round): macro-F1 "
                f"{row['macro_f1']:.3f} (95% CI {low}-{high}), agreement {row['agreement']:.3f} "
                f"(95% CI {agreed_low}-{agreed_high}), Cohen's kappa {row['kappa']:.3f} "
                f"(95% CI {kappa_low}-{kappa_high})") in out.splitlines()


def test_an_annotator_unknown_or_without_first_round_labels_is_one_error_line(tiny, tmp_path, capsys):
    evaluated, _, checkpoint = tiny
    panel, _ = annotated_copy(evaluated, tmp_path / "panel")
    cases = [(panel, "nobody", f"{panel}: no annotator 'nobody'; its annotators are a, b, c, d"),
             (panel, "d", "d only settled ties (no first-round label); the first-round annotators are a, b, c"),
             (evaluated, "a", "no annotations.csv, so its single annotators' labels are unknown")]
    (evaluated_copy := shutil.copytree(evaluated, tmp_path / "bare")).joinpath("annotations.csv").unlink()
    cases[2] = (evaluated_copy, "a", cases[2][1])
    twice = shutil.copytree(panel, tmp_path / "twice")  # a labels map 1 a second time
    annotations = pd.read_csv(twice / "annotations.csv")
    pd.concat([annotations, annotations[annotations.annotator == "a"].iloc[[1]]]).to_csv(twice / "annotations.csv",
                                                                                        index=False)
    map_id = load_labeled_set(panel).map_ids[1]
    cases.append((twice, "b", f"annotator 'a' labeled map '{map_id}' twice; an annotator may label a map once"))
    for folder, annotator, message in cases:
        code, _, err = run_evaluate(capsys, "--data", folder, "--classifier", checkpoint, "--annotator", annotator,
                                    "--runs-dir", tmp_path / "runs")
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "runs").exists()



def test_annotators_are_told_apart_by_user_id_and_named_by_their_email_or_id(tiny, tmp_path, capsys):
    """Annotators were told apart by the email shown for them: two users showing one email were one annotator
    (read as labeling each map twice: an error), and one who changed their email between pulls was two. Now the
    user id (annotator_id) tells them apart where known, each is shown by their latest email (with the id where two
    show one), and --annotator takes either the id or a name, one error line when a name is several users'."""
    evaluated, _, checkpoint = tiny
    panel, votes = annotated_copy(evaluated, tmp_path / "panel")
    annotations = pd.read_csv(panel / "annotations.csv", dtype=str)
    annotations["annotator_id"] = annotations.annotator.map({"a": "7", "b": "8", "c": "9", "d": "10"})
    annotations["annotator"] = annotations.annotator.map({"a": "ann@old.org", "b": "lab@x.org", "c": "lab@x.org",
                                                          "d": "dee@x.org"})
    annotations.loc[(annotations.annotator_id == "7") & (annotations.labeled_at >= "t010"), "annotator"] = "ann@new.org"
    annotations.to_csv(panel / "annotations.csv", index=False)
    labeled = load_labeled_set(panel)

    for named in ("8", "9", "7", "ann@old.org"):
        code, out, err = run_evaluate(capsys, "--data", panel, "--classifier", checkpoint, "--runs-dir",
                                      tmp_path / "runs", "--annotator", named)
        assert code == 0, err
        who = {"8": "b", "9": "c"}.get(named, "a")
        shown = {"8": "lab@x.org (id 8)", "9": "lab@x.org (id 9)"}.get(named, "ann@new.org")
        run = tmp_path / "runs" / "classifier" / ("panel-by-" + {"8": "lab-x.org-id-8-", "9": "lab-x.org-id-9-"}
                                                  .get(named, "ann-new.org"))
        predictions = pd.read_csv(run / "evaluation_predictions.csv")
        assert list(predictions.label) == votes[who]
        assert list(predictions.map_id) == labeled.map_ids[:len(votes[who])]
        assert f"of {panel} labeled by {shown} (first round)" in out

    code, _, err = run_evaluate(capsys, "--data", panel, "--classifier", checkpoint, "--annotator", "lab@x.org",
                                "--runs-dir", tmp_path / "runs")
    assert code == 2 and err.splitlines() == [
        f"error: {panel}: 'lab@x.org' is shown for 2 annotators; name one by its user id: ann@new.org (id 7), "
        "dee@x.org (id 10), lab@x.org (id 8), lab@x.org (id 9)"]

    code, out, err = run_evaluate(capsys, "--data", panel, "--classifier", checkpoint, "--runs-dir", tmp_path / "runs")
    assert code == 0, err
    pairs = pd.read_csv(tmp_path / "runs" / "classifier" / "panel" / "evaluation_annotator_pairs.csv")
    assert [tuple(pair) for pair in pairs[["annotator_a", "annotator_b", "maps"]].to_numpy()] == [
        ("ann@new.org", "lab@x.org (id 8)", 20), ("ann@new.org", "lab@x.org (id 9)", len(labeled)),
        ("lab@x.org (id 8)", "lab@x.org (id 9)", 20)]
    assert pairs.agreement.iloc[2] == pytest.approx(accuracy_score(votes["b"], votes["c"][:20]))


def relabeled_copy(source: Path, folder: Path, every: int) -> Path:
    """``source`` with every ``every``-th map's label moved to the next class, its rows in reverse order."""
    labeled = load_labeled_set(source)
    rows = [{**row, "label": CLASSES[(label + (i % every == 0)) % len(CLASSES)]}
            for i, (row, label) in enumerate(zip(labeled.rows, labeled.labels, strict=True))]
    return save_labeled_set(folder, rows[::-1], dict(zip(labeled.map_ids, labeled.maps, strict=True)))


def test_paired_with_scores_the_difference_between_two_label_sets_of_the_same_maps(tiny, tmp_path, capsys):
    evaluated, _, checkpoint = tiny
    other = relabeled_copy(evaluated, tmp_path / "other", every=3)
    code, out, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path,
                                  "--paired-with", other)
    assert code == 0, err
    run = tmp_path / "classifier" / "panel"
    predictions = pd.read_csv(run / "evaluation_predictions.csv")
    theirs = pd.read_csv(other / "labels.csv").set_index("map_id").label[predictions.map_id]
    assert (theirs.to_numpy() != predictions.label.to_numpy()).sum() == 10  # the labels differ, on maps aligned by id
    paired = pd.read_csv(run / "evaluation_paired.csv").set_index("metric")
    y, p = predictions.label, predictions.predicted
    assert paired.value.accuracy == pytest.approx(accuracy_score(y, p))
    assert paired.paired_value.accuracy == pytest.approx(accuracy_score(theirs, p))
    assert paired.paired_value.macro_f1 == pytest.approx(f1_score(theirs, p, average="macro"))
    np.testing.assert_allclose(paired.difference, paired.value - paired.paired_value)
    assert ((paired.ci_low <= paired.difference + 1e-12) & (paired.difference <= paired.ci_high + 1e-12)).all()
    assert paired.ci_low.accuracy < paired.ci_high.accuracy  # maps differ in whether each label is met: a spread
    row = paired.loc["accuracy"]
    assert (f"accuracy against {evaluated} minus against {other} on the same maps: {row.value:.3f} - "
            f"{row.paired_value:.3f} = {row.difference:+.3f}") in out
    assert json.loads((run / "manifest.json").read_text())["analyses"]["evaluate"]["paired_with"] == str(other)

    # a rerun without it takes the table away
    code, _, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--runs-dir", tmp_path)
    assert code == 0, err
    assert not (run / "evaluation_paired.csv").exists()


def test_paired_with_a_set_of_other_maps_is_one_error_line_before_any_work(tiny, tmp_path, capsys):
    evaluated, training, checkpoint = tiny
    labeled = load_labeled_set(evaluated)
    fewer = save_labeled_set(tmp_path / "fewer", labeled.rows[1:], dict(zip(labeled.map_ids, labeled.maps)))
    changed = save_labeled_set(tmp_path / "changed", labeled.rows, {map_id: attn * 0.5 for map_id, attn
                                                                    in zip(labeled.map_ids, labeled.maps)})
    cases = [(fewer, f"must hold the same maps as --data {evaluated}: 1 missing, 0 more (first: "
                     f"'{labeled.map_ids[0]}' not in it)"),
             (training, "must hold the same maps"),
             (changed, f"holds map '{labeled.map_ids[0]}' with other values than --data"),
             (tmp_path / "missing", "missing does not exist")]
    for other, message in cases:
        code, _, err = run_evaluate(capsys, "--data", evaluated, "--classifier", checkpoint, "--paired-with", other,
                                    "--runs-dir", tmp_path / "runs")
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "runs").exists()
