"""The sweep engine (analysis.sweeps): fast equals naive, exact baseline, resume after an interruption."""
from __future__ import annotations

import dataclasses
import json

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import binomtest
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from analysis import disable, sweeps
from analysis.data import Example, TaskData
from analysis.disable import keep_mask
from analysis.errors import AttnpatError
from analysis.importance import importance_analysis, prune_analysis
from analysis.metrics import accuracy, confusion_metric, task_metric
from analysis.rundir import RunDir, long_table, table_to_array
from analysis.stream import encode_examples, iter_batches
from analysis.sweeps import (
    BASELINE,
    PERMUTATIONS,
    TABLE_INPUTS,
    SweepStore,
    Variant,
    disable_analysis,
    effect_statistics,
    extreme_heads,
    fast_sweep,
    forward_from,
    head_delta_figure,
    head_variants,
    layer_delta_figure,
    layer_variants,
    merge_mode_rows,
    naive_sweep,
    recompute_share,
    run_sweep,
    significance_lines,
    significant_effects,
    sweep_fingerprint,
)
from analysis.uncertainty import (
    bootstrap_difference_interval,
    bootstrap_mean_interval,
    confusion_permutation_p,
    holm_adjust,
    paired_permutation_p,
)
from tests.test_disable import make_bundle
from tests.tiny import tiny_mpnet_bundle

TEXTS = ["a fine movie , truly .", "bad", "what a long and winding road it was , and yet i loved it",
         "no", "the acting is superb but the plot is thin .", "meh .", "an utter waste of two hours",
         "funny", "i laughed , i cried , i went home", "not good , not bad"]


def tiny_data(n: int = len(TEXTS)) -> TaskData:
    examples = [Example(f"ex-{i}", TEXTS[i % len(TEXTS)] + " x" * (i // len(TEXTS)), None, i % 2) for i in range(n)]
    return TaskData("sst2", "validation", "test", examples, num_labels=2, metric="accuracy")


def max_difference(fast: dict, naive: dict) -> float:
    assert set(fast) == set(naive)
    return max(float((fast[name] - naive[name]).abs().max()) for name in naive)


def largest_change(logits: dict) -> float:
    return max(float((logits[name] - logits[BASELINE]).abs().max()) for name in logits)


def smallest_change(logits: dict) -> float:
    return min(float((logits[name] - logits[BASELINE]).abs().max()) for name in logits if name != BASELINE)


# ---------------------------------------------------------------- fast equals naive

@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_fast_equals_naive_for_every_single_head_and_layer(mode):
    bundle = make_bundle()
    data = tiny_data()
    variants = head_variants(3, 4) + layer_variants(3, 4)
    batches = list(iter_batches(bundle, data.examples, batch_size=4))
    assert len({batch.input_ids.shape[1] for batch in batches}) > 1  # really dynamic padding
    fast = fast_sweep(bundle, batches, variants, mode)
    naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples), variants, mode, batch_size=4)
    assert max_difference(fast, naive) < 1e-5
    assert smallest_change(naive) > 1e-3  # every variant really changes the logits


def test_fast_equals_naive_for_multi_layer_masks_and_small_passes():
    bundle = make_bundle(layers=4)
    data = tiny_data()
    rng = np.random.default_rng(0)
    variants = [Variant(f"random-{i}", (rng.random((4, 4)) > 0.4).astype(np.float32)) for i in range(6)]
    variants.append(Variant("nothing", keep_mask(4, 4)))
    batches = list(iter_batches(bundle, data.examples, batch_size=3))
    fast = fast_sweep(bundle, batches, variants, "zero", variants_per_pass=2)
    naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples), variants, "zero", batch_size=5)
    assert max_difference(fast, naive) < 1e-5
    assert torch.equal(fast["nothing"], fast[BASELINE])


@pytest.mark.parametrize("family", ["distilbert", "roberta"])
def test_fast_equals_naive_for_other_encoder_families(family):
    classes = {"distilbert": (DistilBertConfig, DistilBertForSequenceClassification),
               "roberta": (RobertaConfig, RobertaForSequenceClassification)}[family]
    bundle = make_bundle(*classes)
    data = tiny_data()
    variants = head_variants(3, 4)[::3] + layer_variants(3, 4)
    batches = list(iter_batches(bundle, data.examples, batch_size=4))
    for mode in ("uniform", "zero"):
        fast = fast_sweep(bundle, batches, variants, mode)
        naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples), variants, mode)
        assert max_difference(fast, naive) < 1e-5
        assert smallest_change(naive) > 1e-4


def test_disabling_nothing_reproduces_the_plain_model_exactly():
    bundle = make_bundle()
    data = tiny_data()
    batches = list(iter_batches(bundle, data.examples, batch_size=4))
    fast = fast_sweep(bundle, batches, [Variant("nothing", keep_mask(3, 4))], "uniform")
    plain = torch.empty_like(fast[BASELINE])
    with torch.no_grad():
        for batch in batches:
            plain[batch.indices] = bundle.model(**batch.model_inputs()).logits
    assert torch.equal(fast[BASELINE], plain) and torch.equal(fast["nothing"], plain)
    assert bundle.model.config._attn_implementation == "eager"
    assert len(bundle.model.bert.encoder.layer) == 3  # the layer list is restored


def test_forward_from_captures_the_hidden_states_between_layers():
    bundle = make_bundle()
    batch = next(iter(iter_batches(bundle, tiny_data().examples, batch_size=4)))
    inputs = batch.model_inputs()
    with torch.no_grad():
        reference = bundle.model(**inputs, output_hidden_states=True)
        after_one = forward_from(bundle.model, inputs, stop=1)
        after_all = forward_from(bundle.model, inputs, start=1, hidden=after_one, stop=3)
        logits = forward_from(bundle.model, inputs, start=2, hidden=reference.hidden_states[2])
    assert torch.allclose(after_one, reference.hidden_states[1], atol=1e-6)
    assert torch.allclose(after_all, reference.hidden_states[3], atol=1e-5)
    assert torch.allclose(logits, reference.logits, atol=1e-5)
    with pytest.raises(AttnpatError, match="hidden states are needed"):
        forward_from(bundle.model, inputs, start=1)


def test_recompute_share_counts_layer_evaluations():
    layers, heads = 6, 12
    share = recompute_share(head_variants(layers, heads), layers)
    assert share == pytest.approx((heads * layers * (layers + 1) / 2 + layers) / (layers * (layers * heads + 1)))
    assert share == pytest.approx((layers + 1) / (2 * layers), abs=0.01)
    assert recompute_share([Variant("last", keep_mask(6, 12, [(5, 0)]))], 6) == pytest.approx(7 / 12)


def test_extreme_heads_ranks_best_and_worst():
    deltas = np.array([[0.01, -0.2], [0.05, 0.0]])
    ranked = extreme_heads(deltas, k=2)
    assert [(row["layer"], row["head"]) for row in ranked["best"]] == [(1, 0), (0, 0)]
    assert [(row["layer"], row["head"]) for row in ranked["worst"]] == [(0, 1), (1, 1)]


def test_extreme_heads_leaves_heads_without_a_change_out_of_the_rankings():
    """A head whose change is NaN (a correlation of constant predictions, STS-B) is ranked neither best nor worst
    but listed as unranked (before, NaN compared false with everything and the sort put it among the ranks)."""
    deltas = np.array([[np.nan, 0.03, -0.2], [0.05, np.nan, 0.0]])
    ranked = extreme_heads(deltas, k=2)
    assert [(row["layer"], row["head"]) for row in ranked["best"]] == [(1, 0), (0, 1)]
    assert [(row["layer"], row["head"]) for row in ranked["worst"]] == [(0, 2), (1, 2)]
    assert ranked["unranked"] == [{"layer": 0, "head": 0}, {"layer": 1, "head": 1}]
    nothing = extreme_heads(np.full((1, 2), np.nan))
    assert nothing["best"] == nothing["worst"] == [] and len(nothing["unranked"]) == 2


# ---------------------------------------------------------------- resume

class Interrupt(Exception):
    pass


def test_interrupted_sweep_resumes_without_recomputing_and_gives_the_same_table(tmp_path):
    bundle = make_bundle()
    data = tiny_data()
    variants = head_variants(3, 4)
    fingerprint = sweep_fingerprint(bundle, data, "uniform", "head", 128)
    whole = run_sweep(bundle, data, variants, "uniform", SweepStore(tmp_path / "whole", fingerprint), batch_size=4)

    first = []

    def stop_after_five(name, value):
        first.append(name)
        if len(first) == 5:
            raise Interrupt()

    store = SweepStore(tmp_path / "resumed", fingerprint)
    with pytest.raises(Interrupt):
        run_sweep(bundle, data, variants, "uniform", store, batch_size=4, variants_per_pass=3,
                  on_variant=stop_after_five)
    assert len(store.results()) == 5
    second = []
    resumed = run_sweep(bundle, data, variants, "uniform", SweepStore(tmp_path / "resumed", fingerprint),
                        batch_size=4, variants_per_pass=3, on_variant=lambda name, value: second.append(name))
    assert not set(first) & set(second)
    assert len(first) + len(second) == len(variants) + 1
    assert resumed == whole
    third = []
    run_sweep(bundle, data, variants, "uniform", SweepStore(tmp_path / "resumed", fingerprint), batch_size=4,
              on_variant=lambda name, value: third.append(name))
    assert third == []


def test_changed_configuration_discards_stored_results(tmp_path):
    bundle = make_bundle()
    data = tiny_data()
    store = SweepStore(tmp_path, sweep_fingerprint(bundle, data, "zero", "layer", 128))
    run_sweep(bundle, data, layer_variants(3, 4), "zero", store, batch_size=4)
    assert len(SweepStore(tmp_path, sweep_fingerprint(bundle, data, "zero", "layer", 128)).results()) == 4
    other = SweepStore(tmp_path, sweep_fingerprint(bundle, tiny_data(6), "zero", "layer", 128))
    assert other.discarded == 4 and other.results() == {}
    # the same examples with other labels (a data file read with another --label-column): its results are others
    run_sweep(bundle, data, layer_variants(3, 4), "zero", SweepStore(tmp_path, sweep_fingerprint(
        bundle, data, "zero", "layer", 128)), batch_size=4)
    relabeled = dataclasses.replace(data, examples=[dataclasses.replace(example, label=1 - example.label)
                                                    for example in data.examples])
    assert [example.id for example in relabeled.examples] == [example.id for example in data.examples]
    again = SweepStore(tmp_path, sweep_fingerprint(bundle, relabeled, "zero", "layer", 128))
    assert again.discarded == 4 and again.results() == {}



def test_records_of_another_example_count_are_recomputed_not_stacked(tmp_path):
    """A store mixed by two sweeps of different --n (an older attnpat ran them at once) repairs itself."""
    bundle = make_bundle()
    data = tiny_data()
    variants = layer_variants(3, 4)
    fingerprint = sweep_fingerprint(bundle, data, "zero", "layer", 128)
    clean = run_sweep(bundle, data, variants, "zero", SweepStore(tmp_path / "clean", fingerprint), batch_size=4)
    store = SweepStore(tmp_path / "mixed", fingerprint)
    store.save(variants[0].name, {"metric": 0.0, "metric_name": "accuracy", "n": 3, "predictions": [0, 1, 0]})
    recomputed = []
    mixed = run_sweep(bundle, data, variants, "zero", store, batch_size=4,
                      on_variant=lambda name, value: recomputed.append(name))
    assert mixed == clean and variants[0].name in recomputed
    assert store.predictions([variant.name for variant in variants]).shape == (len(data.examples), len(variants))

def test_sweep_metrics_match_predictions_of_the_naive_loop(tmp_path):
    bundle = make_bundle(seed=3)
    data = tiny_data(20)
    variants = layer_variants(3, 4)
    metrics = run_sweep(bundle, data, variants, "zero", SweepStore(tmp_path, {"t": 1}), batch_size=8)
    naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples), variants, "zero")
    labels = [example.label for example in data.examples]
    for name, logits in naive.items():
        assert metrics[name] == pytest.approx(accuracy(logits.argmax(-1).numpy(), labels))


def test_unlabelled_data_is_refused(tmp_path):
    bundle = make_bundle()
    data = TaskData("wiki", "validation", "test", [Example("w", "some text")])
    with pytest.raises(AttnpatError, match="without labels"):
        run_sweep(bundle, data, layer_variants(3, 4), "zero", SweepStore(tmp_path, {}))


@pytest.mark.parametrize("case, message", [
    ("albert", "not supported for albert"),
    ("max_length", "exceeds the model's limit"),
    ("no_token", "gives no token"),
])
def test_disable_refuses_bad_inputs_before_writing_anything(tmp_path, case, message):
    """An architecture that cannot be gated, a --max-length past the model's limit or a text with no token: one
    error before the run folder is touched (before, each left runs/<model>/<task>/.sweep-<mode>-head/sweep.json)."""
    bundle = make_bundle(AlbertConfig, AlbertForSequenceClassification) if case == "albert" else make_bundle()
    data = tiny_data(4)
    if case == "no_token":
        data = dataclasses.replace(data, examples=[*data.examples, Example("zw", "\u200b", None, 0)])
    run = RunDir("tiny", "sst2", tmp_path)
    with pytest.raises(AttnpatError, match=message):
        disable_analysis(bundle, data, run, mode="uniform", units=["head", "layer"], batch_size=4,
                         max_length=100_000 if case == "max_length" else 128)
    assert list(tmp_path.rglob("*")) == []


def test_disable_records_how_many_inputs_max_length_cut(tmp_path):
    """As every other verb's manifest does: a sweep over inputs cut to --max-length says how many were cut."""
    bundle = make_bundle()
    data = tiny_data()
    run = RunDir("tiny", "sst2", tmp_path)
    disable_analysis(bundle, data, run, mode="zero", units=["layer"], batch_size=4, max_length=8)
    longer = sum(len(bundle.tokenizer(example.text)["input_ids"]) > 8 for example in data.examples)
    assert run.manifest()["analyses"]["disable_zero"]["n_truncated"] == longer > 0


def test_disable_analysis_writes_tables_and_figures_for_both_modes(tmp_path):
    bundle = make_bundle()
    data = tiny_data()
    run = RunDir("tiny", "sst2", tmp_path)
    for mode in ("uniform", "zero"):
        summary = disable_analysis(bundle, data, run, mode=mode, units=["head", "layer"], batch_size=4)
        assert len(summary["best"]) == 5 and summary["best"][0]["delta"] >= summary["worst"][0]["delta"]
        assert len(summary["outputs"]) == len(set(summary["outputs"])) == 7  # 2 tables, 4 figure files, 1 sidecar
    heads = pd.read_csv(run.file("disable_heads.csv"))
    assert set(heads["metric"]) == {f"{mode}_{name}" for mode in ("uniform", "zero") for name in
                                    ("delta", "metric", "delta_ci_low", "delta_ci_high", "p_mcnemar", "p_holm")}
    assert len(heads) == 12 * 12 and list(heads.columns) == ["layer", "head", "metric", "value"]
    layers = pd.read_csv(run.file("disable_layers.csv"))
    assert list(layers.columns) == ["layer", "mode", "metric", "delta", "ci_low", "ci_high", "p_mcnemar",
                                    "p_holm"] and len(layers) == 6
    for stem in ("disable_heads", "disable_layers"):
        assert run.file(f"{stem}.png").stat().st_size > 0 and run.file(f"{stem}.svg").stat().st_size > 0
    uniform = heads[heads.metric == "uniform_delta"].value.to_numpy()
    uniform_abs = heads[heads.metric == "uniform_metric"].value.to_numpy()
    baseline = summary["baseline"]
    assert np.allclose(uniform_abs - uniform, baseline)
    # the heads figure draws both modes of the merged table, not only the last mode run
    figure = head_delta_figure(heads, metric="accuracy", task="sst2", model="tiny")
    panels = figure.axes[:2]
    assert [ax.get_title().split(" (")[0] for ax in panels] == ["uniform", "zero"]
    for ax, mode in zip(panels, ("uniform", "zero")):
        assert np.allclose(ax.images[0].get_array(), table_to_array(heads, f"{mode}_delta") * 100)
    plt.close(figure)


def test_modes_share_the_tables_only_when_run_on_the_same_inputs(tmp_path):
    """A zero sweep on 8 examples next to a uniform one on 6: the tables would compare the two modes on other
    data, so the uniform rows leave them (and the run says so); rerunning uniform on the 8 brings them back."""
    bundle = make_bundle()
    run = RunDir("tiny", "sst2", tmp_path)
    disable_analysis(bundle, tiny_data(6), run, mode="uniform", units=["head", "layer"], batch_size=4)
    summary = disable_analysis(bundle, tiny_data(8), run, mode="zero", units=["head", "layer"], batch_size=4)
    assert summary["dropped_modes"] == {"head": ["uniform"], "layer": ["uniform"]}
    assert run.manifest()["analyses"]["disable_zero"]["dropped_modes"] == summary["dropped_modes"]
    heads, layers = pd.read_csv(run.file("disable_heads.csv")), pd.read_csv(run.file("disable_layers.csv"))
    assert {name.split("_")[0] for name in heads["metric"]} == {"zero"} and set(layers["mode"]) == {"zero"}
    summary = disable_analysis(bundle, tiny_data(8), run, mode="uniform", units=["head", "layer"], batch_size=4)
    assert "dropped_modes" not in summary
    heads, layers = pd.read_csv(run.file("disable_heads.csv")), pd.read_csv(run.file("disable_layers.csv"))
    assert {name.split("_")[0] for name in heads["metric"]} == {"uniform", "zero"}
    assert set(layers["mode"]) == {"uniform", "zero"}


def test_each_unit_keeps_the_inputs_its_rows_were_computed_on(tmp_path):
    """uniform heads on 6 examples, uniform layers on 8, then zero heads on 8: the uniform head rows were made
    on 6 and leave disable_heads; the uniform layer rows (8) stay beside zero's layers when those run on 8."""
    bundle = make_bundle()
    run = RunDir("tiny", "sst2", tmp_path)
    disable_analysis(bundle, tiny_data(6), run, mode="uniform", units=["head"], batch_size=4)
    disable_analysis(bundle, tiny_data(8), run, mode="uniform", units=["layer"], batch_size=4)
    recorded = run.manifest()["analyses"]["disable_uniform"]["inputs"]
    assert recorded["head"]["data"]["n_examples"] == 6 and recorded["layer"]["data"]["n_examples"] == 8
    summary = disable_analysis(bundle, tiny_data(8), run, mode="zero", units=["head"], batch_size=4)
    assert summary["dropped_modes"] == {"head": ["uniform"]}
    assert {name.split("_")[0] for name in pd.read_csv(run.file("disable_heads.csv"))["metric"]} == {"zero"}
    summary = disable_analysis(bundle, tiny_data(8), run, mode="zero", units=["layer"], batch_size=4)
    assert "dropped_modes" not in summary
    assert set(pd.read_csv(run.file("disable_layers.csv"))["mode"]) == {"uniform", "zero"}


def test_the_heads_figure_stars_each_modes_surviving_heads_in_its_own_panel():
    rng = np.random.default_rng(0)
    p_holm = {"uniform": np.full((3, 4), 0.5), "zero": np.full((3, 4), 0.5)}
    p_holm["uniform"][0, 1] = p_holm["uniform"][2, 3] = 0.01
    p_holm["zero"][1, 0] = 0.001
    table = merge_mode_rows(long_table({"uniform_delta": rng.normal(size=(3, 4)), "uniform_metric": np.ones((3, 4)),
                                        "uniform_p_holm": p_holm["uniform"]}),
                            long_table({"zero_delta": rng.normal(size=(3, 4)), "zero_metric": np.ones((3, 4)),
                                        "zero_p_holm": p_holm["zero"]}), "metric",
                            ["zero_delta", "zero_metric", "zero_p_holm"])
    figure = head_delta_figure(table, metric="accuracy", task="sst2", model="m")
    for ax, mode in zip(figure.axes[:2], ("uniform", "zero")):
        starred = {(round(text.get_position()[1]), round(text.get_position()[0])) for text in ax.texts
                   if text.get_text() == "*"}
        assert starred == {tuple(int(i) for i in cell) for cell in np.argwhere(p_holm[mode] < 0.05)}
    plt.close(figure)


@pytest.mark.parametrize("metric, criterion", [
    ("accuracy", "*: Holm-adjusted p < 0.05"),
    ("f1", "*: f1 change, permutation test, Holm-adjusted p < 0.05"),
    ("matthews", "*: matthews change, permutation test, Holm-adjusted p < 0.05"),
])
def test_the_figures_say_what_their_stars_test(metric, criterion):
    """The stars come from McNemar's test on accuracy tasks and from a permutation test of the change drawn on F1
    or Matthews tasks, and both figures' titles say which (before, the stars of an F1 task were McNemar's test of
    the accuracy change, beside the F1 change drawn)."""
    heads = long_table({"zero_delta": np.full((2, 3), 0.1), "zero_metric": np.ones((2, 3)),
                        "zero_p_holm": np.full((2, 3), 0.01)})
    layers = pd.DataFrame({"layer": [0, 1], "mode": "zero", "metric": [0.9, 0.8], "delta": [-0.1, -0.2],
                           "ci_low": [-0.2, -0.3], "ci_high": [0.0, -0.1], "p_holm": [0.5, 0.01]})
    head_figure = head_delta_figure(heads, metric=metric, task="t", model="m")
    layer_figure = layer_delta_figure(layers, metric=metric, baseline={"zero": 1.0}, task="t", model="m")
    assert f"(outlined {criterion})" in head_figure.texts[0].get_text()  # the suptitle
    assert layer_figure.axes[0].get_title().endswith(f"intervals; {criterion})")
    plt.close(head_figure)
    plt.close(layer_figure)


@pytest.mark.parametrize("metric", ["f1", "matthews"])
def test_figures_of_modes_tested_differently_name_each_modes_test(metric):
    """A table merged from an older run's uniform rows (p_mcnemar: McNemar's test of the accuracy change) and a
    newer run's zero rows (p_permutation of the metric's change): each panel, or legend entry, names its own
    mode's test (before, the title named the permutation test for both); modes of one test keep one title."""
    mcnemar = "accuracy change, McNemar test, Holm-adjusted p < 0.05"
    permutation = f"{metric} change, permutation test, Holm-adjusted p < 0.05"
    heads = long_table({"uniform_delta": np.full((2, 3), -0.1), "uniform_metric": np.full((2, 3), 0.8),
                        "uniform_p_mcnemar": np.full((2, 3), 0.001), "uniform_p_holm": np.full((2, 3), 0.006),
                        "zero_delta": np.full((2, 3), 0.1), "zero_metric": np.ones((2, 3)),
                        "zero_p_permutation": np.full((2, 3), 0.3), "zero_p_holm": np.full((2, 3), 0.6)})
    layers = pd.DataFrame({"layer": [0, 1, 0, 1], "mode": ["uniform", "uniform", "zero", "zero"],
                           "metric": [0.9, 0.8, 0.9, 0.8], "delta": [-0.1, -0.2, -0.1, -0.2],
                           "ci_low": [-0.2, -0.3, -0.2, -0.3], "ci_high": [0.0, -0.1, 0.0, -0.1],
                           "p_mcnemar": [0.5, 0.01, np.nan, np.nan], "p_permutation": [np.nan, np.nan, 0.4, 0.02],
                           "p_holm": [0.5, 0.02, 0.4, 0.04]})
    head_figure = head_delta_figure(heads, metric=metric, task="t", model="m")
    layer_figure = layer_delta_figure(layers, metric=metric, baseline={"uniform": 1.0, "zero": 1.0}, task="t",
                                      model="m")
    panels = {ax.get_title().split(" ")[0]: ax.get_title() for ax in head_figure.axes if ax.get_title()}
    assert panels["uniform"].endswith(f"*: {mcnemar}") and panels["zero"].endswith(f"*: {permutation}")
    suptitle = head_figure.texts[0].get_text()
    assert "the modes differ in test" in suptitle and permutation not in suptitle
    legend = {text.get_text().split(" ")[0]: text.get_text() for text in layer_figure.axes[0].get_legend().get_texts()}
    assert legend["uniform"].endswith(f"*: {mcnemar}") and legend["zero"].endswith(f"*: {permutation}")
    assert layer_figure.axes[0].get_title().endswith("*: Holm-adjusted p < 0.05, each mode's test in the legend)")
    plt.close(head_figure)
    plt.close(layer_figure)
    # only older rows: one test, named once, in the titles
    old_heads = heads[~heads["metric"].str.startswith("zero_")]
    old_layers = layers[layers["mode"] == "uniform"].drop(columns="p_permutation")
    head_figure = head_delta_figure(old_heads, metric=metric, task="t", model="m")
    layer_figure = layer_delta_figure(old_layers, metric=metric, baseline={"uniform": 1.0}, task="t", model="m")
    assert f"(outlined *: {mcnemar})" in head_figure.texts[0].get_text()
    assert head_figure.axes[0].get_title() == "uniform (baseline 0.900)"
    assert layer_figure.axes[0].get_title().endswith(f"intervals; *: {mcnemar})")
    plt.close(head_figure)
    plt.close(layer_figure)


def test_interrupted_disable_analysis_writes_the_same_tables_as_an_uninterrupted_one(tmp_path):
    bundle = make_bundle()
    data = tiny_data()
    whole = RunDir("tiny", "sst2", tmp_path / "whole")
    disable_analysis(bundle, data, whole, mode="zero", units=["head", "layer"], batch_size=4)

    resumed = RunDir("tiny", "sst2", tmp_path / "resumed")
    finished = []

    def stop_in_the_layer_sweep(name, value):
        finished.append(name)
        if name.startswith("layer-"):
            raise Interrupt()

    with pytest.raises(Interrupt):
        disable_analysis(bundle, data, resumed, mode="zero", units=["head", "layer"], batch_size=4,
                         on_variant=stop_in_the_layer_sweep)
    assert not resumed.file("disable_layers.csv").exists()  # nothing half written
    disable_analysis(bundle, data, resumed, mode="zero", units=["head", "layer"], batch_size=4,
                     on_variant=lambda name, value: finished.append(name))
    # no variant computed twice (each unit's sweep has its own baseline)
    assert sorted(finished) == sorted([BASELINE, BASELINE]
                                      + [f"head-{layer}-{h}" for layer in range(3) for h in range(4)]
                                      + [f"layer-{layer}" for layer in range(3)])
    for name in ("disable_heads", "disable_layers"):
        assert pd.read_csv(resumed.file(f"{name}.csv")).equals(pd.read_csv(whole.file(f"{name}.csv")))


def test_disable_tables_carry_mcnemar_and_bootstrap_numbers_of_the_naive_loop(tmp_path):
    """The intervals and p-values in the tables, recomputed from the naive loop's per-example correctness:
    McNemar with scipy's binomial test, Holm by hand, the bootstrap over the same correctness differences."""
    bundle = make_bundle(seed=3)
    data = tiny_data(40)
    run = RunDir("tiny", "sst2", tmp_path)
    summary = disable_analysis(bundle, data, run, mode="zero", units=["head", "layer"], batch_size=8)
    variants = head_variants(3, 4) + layer_variants(3, 4)
    naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples), variants, "zero")
    labels = np.array([example.label for example in data.examples])
    right = {name: logits.argmax(-1).numpy() == labels for name, logits in naive.items()}
    heads = pd.read_csv(run.file("disable_heads.csv"))
    layers = pd.read_csv(run.file("disable_layers.csv"))
    for family, table_p, table_ci in (
            ("head", lambda v: table_to_array(heads, f"zero_{v}").ravel(),
             lambda: np.stack([table_to_array(heads, "zero_delta_ci_low").ravel(),
                               table_to_array(heads, "zero_delta_ci_high").ravel()], 1)),
            ("layer", lambda v: layers[v].to_numpy(), lambda: layers[["ci_low", "ci_high"]].to_numpy())):
        names = [variant.name for variant in variants if variant.name.startswith(family)]
        expected = []
        for name in names:
            lost = int((right[BASELINE] & ~right[name]).sum())
            gained = int((~right[BASELINE] & right[name]).sum())
            expected.append(binomtest(min(lost, gained), lost + gained, 0.5).pvalue if lost + gained else 1.0)
        assert table_p("p_mcnemar") == pytest.approx(expected)
        order = np.argsort(expected, kind="stable")
        holm, running = np.empty(len(expected)), 0.0
        for rank, index in enumerate(order):
            running = max(running, min(1.0, (len(expected) - rank) * expected[index]))
            holm[index] = running
        assert table_p("p_holm") == pytest.approx(holm)
        change = np.stack([right[name].astype(float) - right[BASELINE] for name in names], 1)
        assert table_ci() == pytest.approx(bootstrap_mean_interval(change))
        assert np.all(table_ci()[:, 0] <= change.mean(0) + 1e-12) and np.all(change.mean(0) <= table_ci()[:, 1] + 1e-12)
    assert "McNemar" in run.manifest()["analyses"]["disable_zero"]["tests"]
    assert set(summary["significant"]) == {"heads", "layers"}


@pytest.mark.parametrize("metric", ["f1", "matthews"])
def test_disable_tables_of_an_f1_or_matthews_task_carry_a_permutation_test_of_that_metric(metric, tmp_path):
    """On F1 and Matthews tasks the tables' p is a permutation test of the metric's own change (p_permutation, its
    20,000 swaps recomputed here from the naive loop's predictions), Holm-corrected per family; no p_mcnemar column
    (before, McNemar's test of the accuracy change stood beside the F1 change)."""
    bundle = make_bundle(seed=3)
    examples = [Example(f"ex-{i}", TEXTS[i % len(TEXTS)] + " x" * (i // len(TEXTS)), None, int(i % 3 == 0))
                for i in range(30)]
    data = TaskData("mrpc" if metric == "f1" else "cola", "validation", "test", examples, num_labels=2,
                    metric=metric)
    run = RunDir("tiny", data.task, tmp_path)
    summary = disable_analysis(bundle, data, run, mode="zero", units=["head", "layer"], batch_size=8)
    variants = head_variants(3, 4) + layer_variants(3, 4)
    naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples), variants, "zero")
    labels = np.array([example.label for example in data.examples])
    predicted = {name: logits.argmax(-1).numpy() for name, logits in naive.items()}
    heads = pd.read_csv(run.file("disable_heads.csv"))
    layers = pd.read_csv(run.file("disable_layers.csv"))
    assert "zero_p_permutation" in set(heads["metric"]) and "zero_p_mcnemar" not in set(heads["metric"])
    assert list(layers.columns) == ["layer", "mode", "metric", "delta", "ci_low", "ci_high", "p_permutation",
                                    "p_holm"]
    for family, table_p in (("head", lambda v: table_to_array(heads, f"zero_{v}").ravel()),
                            ("layer", lambda v: layers[v].to_numpy())):
        names = [variant.name for variant in variants if variant.name.startswith(family)]
        expected = confusion_permutation_p(confusion_metric(metric), predicted[BASELINE],
                                           np.stack([predicted[name] for name in names], 1), labels,
                                           n_perm=PERMUTATIONS, seed=0)
        assert table_p("p_permutation") == pytest.approx(expected) and (expected < 1).any()  # some change tested
        assert table_p("p_holm") == pytest.approx(holm_adjust(expected))
    tests = run.manifest()["analyses"]["disable_zero"]["tests"]
    assert f"p_permutation: two-sided paired permutation test of the {metric} change" in tests
    assert "McNemar" not in tests and set(summary["significant"]) == {"heads", "layers"}


@pytest.mark.parametrize("metric, classes", [("f1", 2), ("matthews", 3)])
def test_effect_statistics_bound_f1_and_matthews_changes_without_the_loop_over_draws(metric, classes, monkeypatch):
    """F1 and Matthews intervals come from the draws' confusion counts (vectorised; before, a Python loop over
    1,000 draws x every variant): the same bounds as the loop's, which is not called for them."""
    rng = np.random.default_rng(classes)
    labels = rng.integers(0, classes, 60)
    baseline = np.where(rng.random(60) < 0.8, labels, rng.integers(0, classes, 60))
    variants = np.stack([np.where(rng.random(60) < share, rng.integers(0, classes, 60), baseline)
                         for share in (0.0, 0.2, 0.5)], 1)
    expected = bootstrap_difference_interval(lambda predicted, gold: task_metric(metric, predicted, gold), baseline,
                                             variants, labels, seed=3)

    def loop_not_expected(*args, **kwargs):
        raise AssertionError("the loop over draws ran for a metric of confusion counts")

    monkeypatch.setattr(sweeps, "bootstrap_difference_interval", loop_not_expected)
    stats = effect_statistics(baseline, variants, labels, metric, seed=3, n_perm=20)
    assert np.stack([stats["ci_low"], stats["ci_high"]], 1).tolist() == expected.tolist()


def test_effect_statistics_by_hand():
    labels = np.array([1] * 30 + [0] * 10)
    baseline = labels.copy()
    baseline[30:32] = 1  # two baseline errors
    worse = baseline.copy()
    worse[:12] = 0  # twelve more errors, none fixed: McNemar b = 12, c = 0
    stats = effect_statistics(baseline, np.stack([baseline, worse], 1), labels, "accuracy")
    assert stats["p_mcnemar"] == pytest.approx([1.0, 2 * 0.5 ** 12])
    assert stats["p_holm"] == pytest.approx([1.0, 2 * 2 * 0.5 ** 12])
    assert stats["ci_low"][0] == stats["ci_high"][0] == 0.0
    assert stats["ci_low"][1] <= -12 / 40 <= stats["ci_high"][1] < 0
    significant = significant_effects([(0, 0), (0, 1)], np.array([0.0, -12 / 40]), stats)
    assert [(row["layer"], row["head"]) for row in significant] == [(0, 1)]
    # F1 gets a permutation test of the F1 change (before, McNemar's of the accuracy change): the p-values of the
    # loop over permutations, with the same swaps; Holm over the two variants
    f1 = effect_statistics(baseline, np.stack([baseline, worse], 1), labels, "f1", n_perm=2000)
    assert "p_mcnemar" not in f1
    assert f1["p_permutation"].tolist() == paired_permutation_p(
        lambda predicted, gold: task_metric("f1", predicted, gold), baseline, np.stack([baseline, worse], 1), labels,
        n_perm=2000).tolist()
    assert f1["p_permutation"][0] == 1.0 and f1["p_permutation"][1] == pytest.approx(1 / 2001)  # no swap reaches it
    assert f1["p_holm"].tolist() == holm_adjust(f1["p_permutation"]).tolist()
    assert f1["ci_low"][0] == f1["ci_high"][0] == 0.0 and f1["ci_high"][1] < 0
    significant = significant_effects([(0, 0), (0, 1)], np.array([0.0, -0.2]), f1)
    assert [set(row) for row in significant] == [{"layer", "head", "delta", "ci_low", "ci_high", "p_permutation",
                                                  "p_holm"}]
    scores = effect_statistics(labels + 0.1, np.stack([labels + 0.2, labels[::-1] * 1.0], 1), labels.astype(float),
                               "pearson_spearman")
    assert np.isnan(scores["p_mcnemar"]).all() and np.isnan(scores["p_holm"]).all()
    assert scores["ci_low"][0] == pytest.approx(0.0) and scores["ci_high"][1] < 0


def test_significance_lines_name_what_survives_holm(tmp_path):
    heads = long_table({"zero_delta": np.array([[0.0, -0.3]]), "zero_delta_ci_low": np.array([[-0.1, -0.45]]),
                        "zero_delta_ci_high": np.array([[0.1, -0.15]]), "zero_p_holm": np.array([[1.0, 0.001]])})
    heads.to_csv(tmp_path / "disable_heads.csv", index=False)
    pd.DataFrame({"layer": [0, 1], "mode": "zero", "metric": [0.5, 0.6], "delta": [-0.1, 0.0],
                  "ci_low": [-0.2, -0.05], "ci_high": [0.0, 0.05], "p_mcnemar": [0.06, 1.0], "p_holm": [0.12, 1.0]}
                 ).to_csv(tmp_path / "disable_layers.csv", index=False)
    heads_line, layers_line = significance_lines(tmp_path)
    assert heads_line.startswith("zero, single heads (1 of 2 survive Holm") and "L1-H2 -0.3000" in heads_line
    assert "L1-H1" not in heads_line
    assert layers_line.endswith("(0 of 2 survive Holm, p < 0.05): none")
    # tables written before the permutation test: an F1 task's lines say that McNemar tested the accuracy change
    (tmp_path / "manifest.json").write_text(json.dumps({"analyses": {"disable_zero": {"metric_name": "f1"}}}))
    heads_line, layers_line = significance_lines(tmp_path)
    assert heads_line.startswith("zero, single heads (1 of 2 survive Holm, p < 0.05; McNemar tests the accuracy "
                                 "change, the f1 change is shown): L1-H2 -0.3000")
    assert layers_line.endswith("(0 of 2 survive Holm, p < 0.05; McNemar tests the accuracy change, the f1 change "
                                "is shown): none")
    # tables with the permutation test's p: the lines name it, and the metric whose change it tests
    heads_now = long_table({"zero_delta": np.array([[0.0, -0.3]]), "zero_delta_ci_low": np.array([[-0.1, -0.45]]),
                            "zero_delta_ci_high": np.array([[0.1, -0.15]]),
                            "zero_p_permutation": np.array([[1.0, 0.0005]]), "zero_p_holm": np.array([[1.0, 0.001]])})
    heads_now.to_csv(tmp_path / "disable_heads.csv", index=False)
    layers_now = pd.read_csv(tmp_path / "disable_layers.csv").rename(columns={"p_mcnemar": "p_permutation"})
    layers_now.to_csv(tmp_path / "disable_layers.csv", index=False)
    heads_line, layers_line = significance_lines(tmp_path)
    assert heads_line.startswith("zero, single heads (1 of 2 survive Holm, p < 0.05; permutation test of the f1 "
                                 "change): L1-H2 -0.3000")
    assert layers_line.endswith("(0 of 2 survive Holm, p < 0.05; permutation test of the f1 change): none")
    (tmp_path / "manifest.json").write_text("{damaged")
    assert significance_lines(tmp_path)[1].endswith("(0 of 2 survive Holm, p < 0.05; permutation test of the metric "
                                                    "change): none")
    heads.to_csv(tmp_path / "disable_heads.csv", index=False)
    layers_now.rename(columns={"p_permutation": "p_mcnemar"}).to_csv(tmp_path / "disable_layers.csv", index=False)
    assert significance_lines(tmp_path)[1].endswith("(0 of 2 survive Holm, p < 0.05): none")
    assert significance_lines(tmp_path / "nothing") == []
    (tmp_path / "disable_layers.csv").unlink()
    heads.loc[heads.metric == "zero_p_holm", "value"] = np.nan  # a score metric: intervals, no test
    heads.to_csv(tmp_path / "disable_heads.csv", index=False)
    assert significance_lines(tmp_path) == []


def test_a_score_metric_gets_intervals_but_no_test(tmp_path):
    bundle = make_bundle(num_labels=1)
    examples = [Example(f"s-{i}", TEXTS[i], None, float(i % 5)) for i in range(len(TEXTS))]
    data = TaskData("stsb", "validation", "test", examples, num_labels=1, metric="pearson_spearman")
    run = RunDir("tiny", "stsb", tmp_path)
    summary = disable_analysis(bundle, data, run, mode="zero", units=["layer"], batch_size=4)
    assert "significant" not in summary and "no McNemar test" in summary["tests"]
    layers = pd.read_csv(run.file("disable_layers.csv"))
    assert layers["p_mcnemar"].isna().all() and layers["p_holm"].isna().all()
    assert (layers["ci_low"] <= layers["delta"] + 1e-9).all() and (layers["delta"] <= layers["ci_high"] + 1e-9).all()
    assert significance_lines(run.path) == []
    # the figure names no test the table does not hold (before, its title promised Holm stars that never come)
    figure = layer_delta_figure(layers, metric="pearson_spearman", baseline={"zero": 0.0}, task="stsb", model="tiny")
    assert "bootstrap intervals)" in figure.axes[0].get_title() and "Holm" not in figure.axes[0].get_title()
    plt.close(figure)
    tested = layer_delta_figure(layers.assign(p_holm=0.5), metric="pearson_spearman", baseline={"zero": 0.0},
                                task="stsb", model="tiny")
    assert "Holm-adjusted p < 0.05" in tested.axes[0].get_title()
    plt.close(tested)


@pytest.mark.parametrize("first, landing, kept", [(6, 8, {"uniform", "zero"}), (8, 6, {"zero"})])
def test_a_mode_that_lands_during_another_modes_sweep_is_judged_as_it_landed(tmp_path, first, landing, kept):
    """uniform on ``first`` examples, then zero on 8; while zero sweeps, uniform reruns on ``landing`` examples
    and lands. Zero's merge judges uniform's rows by what they are computed on when it merges, not by what the
    run folder said when zero started: rows rerun on zero's 8 stay in both tables (before, they were dropped),
    rows rerun on 6 leave them (before, they were kept beside zero's)."""
    bundle = make_bundle()
    run = RunDir("tiny", "sst2", tmp_path)
    disable_analysis(bundle, tiny_data(first), run, mode="uniform", units=["head", "layer"], batch_size=4)
    landed = []

    def land_uniform_once(name, value):
        if not landed:
            landed.append(disable_analysis(bundle, tiny_data(landing), run, mode="uniform",
                                           units=["head", "layer"], batch_size=4))

    summary = disable_analysis(bundle, tiny_data(8), run, mode="zero", units=["head", "layer"], batch_size=4,
                               on_variant=land_uniform_once)
    assert landed
    dropped = {} if "uniform" in kept else {"head": ["uniform"], "layer": ["uniform"]}
    assert summary.get("dropped_modes", {}) == dropped
    heads, layers = pd.read_csv(run.file("disable_heads.csv")), pd.read_csv(run.file("disable_layers.csv"))
    assert {name.split("_")[0] for name in heads["metric"]} == kept and set(layers["mode"]) == kept


def test_a_folder_without_the_table_inputs_file_falls_back_to_the_manifest(tmp_path):
    """Run folders written before .disable-inputs.json was kept: each mode's manifest entry says what its rows
    were made on (uniform on 8 stays beside zero on 8; in another folder, uniform on 6 leaves)."""
    bundle = make_bundle()
    for n_uniform, stays in ((8, True), (6, False)):
        run = RunDir("tiny", "sst2", tmp_path / str(n_uniform))
        disable_analysis(bundle, tiny_data(n_uniform), run, mode="uniform", units=["layer"], batch_size=4)
        recorded = json.loads(run.file(TABLE_INPUTS).read_text())
        assert recorded["uniform"]["layer"] == run.manifest()["analyses"]["disable_uniform"]["inputs"]["layer"]
        run.file(TABLE_INPUTS).unlink()
        summary = disable_analysis(bundle, tiny_data(8), run, mode="zero", units=["layer"], batch_size=4)
        assert ("dropped_modes" not in summary) == stays
        assert set(pd.read_csv(run.file("disable_layers.csv"))["mode"]) == ({"uniform", "zero"} if stays else {"zero"})
        assert set(json.loads(run.file(TABLE_INPUTS).read_text())) == {"uniform", "zero"}
        assert ("layer" in json.loads(run.file(TABLE_INPUTS).read_text())["uniform"]) == stays


def test_a_run_stopped_between_its_table_and_its_figure_leaves_rows_other_modes_drop(tmp_path, monkeypatch):
    """The merged table is written in place before its figure is drawn: a run stopped in between (Ctrl-C, a full
    disk) has its new rows in the table. Those rows count as made on unknown inputs until the run records them,
    so the next mode's merge drops them instead of keeping rows of other data beside its own."""
    bundle = make_bundle()
    run = RunDir("tiny", "sst2", tmp_path)
    disable_analysis(bundle, tiny_data(6), run, mode="uniform", units=["layer"], batch_size=4)
    disable_analysis(bundle, tiny_data(6), run, mode="zero", units=["layer"], batch_size=4)
    real_write_figure = RunDir.write_figure

    def full_disk(self, name, fig, merged=False):
        raise AttnpatError(f"cannot write {name}.png: no space left on device")

    monkeypatch.setattr(RunDir, "write_figure", full_disk)
    with pytest.raises(AttnpatError, match="no space left"):
        disable_analysis(bundle, tiny_data(8), run, mode="uniform", units=["layer"], batch_size=4)
    monkeypatch.setattr(RunDir, "write_figure", real_write_figure)
    assert set(pd.read_csv(run.file("disable_layers.csv"))["mode"]) == {"uniform"}  # zero's rows left (6 vs 8)
    summary = disable_analysis(bundle, tiny_data(6), run, mode="zero", units=["layer"], batch_size=4)
    assert summary["dropped_modes"] == {"layer": ["uniform"]}
    assert set(pd.read_csv(run.file("disable_layers.csv"))["mode"]) == {"zero"}


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_the_model_is_as_before_after_every_sweep(family, tmp_path):
    """disable, importance and prune (iterative, uniform masking: gates of both modes nested) on one loaded model,
    as the test session or a long-lived process would: afterwards a plain forward gives bit-identical logits and
    attentions, with no gate, hook, patched forward or other attention function left behind."""
    bundle = (tiny_mpnet_bundle(tmp_path / "mpnet", kind="classifier", layers=3, heads=4, initializer_range=0.3)
              if family == "mpnet" else make_bundle())
    model = bundle.model
    inputs = next(iter(iter_batches(bundle, tiny_data(3).examples, batch_size=3))).model_inputs()

    def leftovers() -> tuple:
        return (model.config._attn_implementation, len(disable._GATES), len(list(model.modules())),
                sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
                sum("forward" in vars(m) for m in model.modules()))

    with torch.no_grad():
        before = model(**inputs, output_attentions=True)
    state = leftovers()
    data, run = tiny_data(6), RunDir("tiny", "sst2", tmp_path / "runs")
    for mode in ("uniform", "zero"):
        disable_analysis(bundle, data, run, mode=mode, units=["head", "layer"], batch_size=4)
    importance_analysis(bundle, data, run, batch_size=4)
    prune_analysis(bundle, data, run, step=0.25, iterative=True, mode="uniform", batch_size=4)
    with torch.no_grad():
        after = model(**inputs, output_attentions=True)
    assert leftovers() == state and state[:2] == ("eager", 0) and state[4] == 0
    assert torch.equal(before.logits, after.logits)
    assert all(torch.equal(a, b) for a, b in zip(before.attentions, after.attentions, strict=True))
    assert not model.training and all(parameter.grad is None for parameter in model.parameters())
