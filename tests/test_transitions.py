"""Pattern transitions after fine-tuning (classifier.transitions): every map of two models classified on the
same examples, counted base class -> fine-tuned class."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from analysis.rundir import RunDir
from classifier.checkpoint import save_checkpoint
from classifier.classify import head_class_counts
from classifier.model import CHANNELS, INPUT_SIZE, STRIDES, PatternCNN
from classifier.predict import load_classifier
from classifier.transitions import count_transitions, pattern_transitions, transition_table, write_transitions
from tests.tiny import tiny_bundle, tiny_mpnet_bundle

LAYERS, HEADS, N = 2, 3, 7


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("base"), layers=LAYERS, heads=HEADS, hidden=24, seed=0,
                       initializer_range=0.5)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tuned"), layers=LAYERS, heads=HEADS, hidden=24, seed=1,
                       initializer_range=0.5)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    torch.manual_seed(1)
    metadata = {"input_size": INPUT_SIZE, "channels": list(CHANNELS), "strides": list(STRIDES), "trained_on": "test"}
    model = PatternCNN().eval()
    with torch.no_grad():  # a random linear profile path would put every map in one class; without it they spread
        model.profile_logits.weight.zero_()
        model.profile_logits.bias.zero_()
    return load_classifier(save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "cnn.safetensors", metadata))


@pytest.fixture(scope="module")
def data():
    return load_data("sst2", n=N)


def test_count_transitions_by_hand():
    base = torch.tensor([[0, 1], [2, 2]])
    tuned = torch.tensor([[0, 3], [2, 4]])
    counts = count_transitions(base, tuned)
    expected = np.zeros((5, 5), dtype=int)
    expected[0, 0] = expected[1, 3] = expected[2, 2] = expected[2, 4] = 1
    assert (counts == expected).all()
    with pytest.raises(AttnpatError, match="differ in shape"):
        count_transitions(base, tuned[:1])


def test_rows_and_columns_are_each_models_own_classification(base, tuned, classifier, data):
    counts = pattern_transitions(base, tuned, data.examples, classifier, batch_size=3)
    assert counts.shape == (5, 5) and counts.sum() == N * LAYERS * HEADS
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()  # the caller's autograd state is back
    base_counts = head_class_counts(base, data.examples, classifier, batch_size=4, progress=False)
    tuned_counts = head_class_counts(tuned, data.examples, classifier, batch_size=4, progress=False)
    assert (counts.sum(1) == base_counts.sum((0, 1))).all()
    assert (counts.sum(0) == tuned_counts.sum((0, 1))).all()


def test_identical_models_give_a_diagonal_matrix(base, classifier, data, tmp_path):
    same = tiny_bundle(tmp_path / "same", layers=LAYERS, heads=HEADS, hidden=24, seed=0, initializer_range=0.5)
    counts = pattern_transitions(base, same, data.examples, classifier, batch_size=2)
    assert counts.sum() == N * LAYERS * HEADS
    assert (counts == np.diag(np.diag(counts))).all()
    assert (np.diag(counts) > 0).sum() >= 2  # several classes occur, so the diagonal says something


def test_the_table_figure_and_manifest(base, tuned, classifier, data, tmp_path):
    run = RunDir(tuned.slug, data.task, tmp_path)
    counts = write_transitions(base, tuned, data, run, classifier, batch_size=4)
    table = pd.read_csv(run.file("pattern_transitions.csv"))
    assert list(table.columns) == ["base_class", "finetuned_class", "count", "fraction", "fraction_of_base"]
    assert len(table) == 25 and table["count"].sum() == N * LAYERS * HEADS
    assert table["fraction"].sum() == pytest.approx(1.0)
    matrix = table.pivot(index="base_class", columns="finetuned_class", values="count").loc[list(CLASSES),
                                                                                            list(CLASSES)]
    assert (matrix.to_numpy() == counts).all()
    shares = table.groupby("base_class")["fraction_of_base"].sum()
    present = table.groupby("base_class")["count"].sum() > 0
    assert np.allclose(shares[present], 1.0) and np.allclose(shares[~present], 0.0)
    for suffix in ("png", "svg"):
        assert run.file(f"pattern_transitions.{suffix}").stat().st_size > 0
    entry = run.manifest()["analyses"]["pattern_transitions"]
    assert entry["n_maps"] == N * LAYERS * HEADS and entry["base_model"] == base.name
    assert entry["unchanged"] == pytest.approx(np.trace(counts) / counts.sum())


def test_models_with_other_tokenizers_are_refused(base, classifier, data, tmp_path):
    mpnet = tiny_mpnet_bundle(tmp_path / "mpnet", layers=LAYERS, heads=HEADS, hidden=24)
    with pytest.raises(AttnpatError, match="different tokenizers"):
        pattern_transitions(base, mpnet, data.examples, classifier)


def test_transition_table_of_a_class_the_base_never_shows():
    counts = np.zeros((5, 5), dtype=int)
    counts[0, 1] = 3
    table = transition_table(counts)
    assert table["fraction_of_base"].max() == 1.0 and table["fraction"].sum() == pytest.approx(1.0)
    # the classes the base model never shows get 0, not NaN (max() above skips NaN)
    assert table["fraction_of_base"].notna().all()
    absent = table[table["base_class"] != table["base_class"].iloc[1]]
    assert (absent["fraction_of_base"] == 0).all() and len(absent) == 20


def test_the_manifest_counts_the_inputs_max_length_cut(base, tuned, classifier, data, tmp_path):
    """As compare's cosine entry and every other verb's do: how many inputs --max-length cut before classifying."""
    from analysis.stream import encode_examples  # noqa: PLC0415

    run = RunDir(tuned.slug, data.task, tmp_path)
    write_transitions(base, tuned, data, run, classifier, max_length=8, batch_size=4)
    cut = sum(item.truncated for item in encode_examples(base.tokenizer, data.examples, 8))
    assert cut > 0
    assert run.manifest()["analyses"]["pattern_transitions"]["n_truncated"] == cut
