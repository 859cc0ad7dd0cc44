"""Head importance (Michel et al.) and pruning curves (analysis.importance)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from analysis import importance
from analysis.disable import gated, head_gates, keep_mask, mask_gates
from analysis.errors import AttnpatError
from analysis.importance import (
    example_importance,
    example_losses,
    head_importance,
    importance_analysis,
    iterative_pruning_masks,
    least_important,
    normalize_by_layer,
    normalize_global,
    normalized_importance,
    prune_analysis,
    pruning_counts,
    pruning_curve,
    pruning_masks,
)
from analysis.metrics import accuracy
from analysis.rundir import RunDir
from analysis.stream import encode_examples, iter_batches
from analysis.sweeps import BASELINE, Variant, effect_statistics, naive_sweep
from analysis.uncertainty import bootstrap_mean_interval, holm_adjust
from tests.test_disable import make_bundle
from tests.test_sweeps import tiny_data


def loss_with_gate(bundle, batch, layer: int, head: int, value: float) -> float:
    gate = torch.ones(4)
    gate[head] = value
    with torch.no_grad(), gated(bundle.model), head_gates(bundle.model, {layer: gate}, "zero"):
        logits = bundle.model(**batch.model_inputs()).logits
    return float(example_losses(logits, batch.labels).sum())


def test_importance_is_the_mean_absolute_per_example_gradient():
    bundle = make_bundle()
    data = tiny_data(6)
    batched = list(iter_batches(bundle, data.examples, batch_size=6))
    singles = list(iter_batches(bundle, data.examples, batch_size=1))
    together = head_importance(bundle, batched)
    # Each example alone, finite differences of its loss in the gate of two heads.
    for layer, head in [(0, 1), (2, 3)]:
        step = 1e-3
        per_example = [abs(loss_with_gate(bundle, single, layer, head, 1 + step)
                           - loss_with_gate(bundle, single, layer, head, 1 - step)) / (2 * step) for single in singles]
        assert together[layer, head] == pytest.approx(np.mean(per_example), rel=2e-2, abs=1e-4)
    assert np.allclose(together, head_importance(bundle, singles), rtol=1e-4, atol=1e-7)
    assert together.shape == (3, 4) and (together > 0).all()


def test_importance_under_a_mask_differs_and_needs_labels():
    bundle = make_bundle()
    data = tiny_data(6)
    batches = list(iter_batches(bundle, data.examples, batch_size=3))
    keep = keep_mask(3, 4, [(0, 0), (1, 2)])
    assert not np.allclose(head_importance(bundle, batches), head_importance(bundle, batches, keep=keep))
    batches[0].labels = None
    with pytest.raises(AttnpatError, match="labelled"):
        head_importance(bundle, batches)


def loss_with_scaled_head(bundle, batch, keep, layer: int, head: int, value: float) -> float:
    """The loss with ``keep``'s pruned heads uniform-masked and head (layer, head)'s context output scaled by
    ``value`` through a forward hook (not the zero-mode gate under test)."""
    size = 32 // 4
    attention = bundle.model.bert.encoder.layer[layer].attention.self

    def scale(module, args, out):
        context = out[0].clone()
        context[..., head * size:(head + 1) * size] *= value
        return (context, *out[1:])

    handle = attention.register_forward_hook(scale)
    try:
        with torch.no_grad(), gated(bundle.model), head_gates(bundle.model, mask_gates(keep), "uniform"):
            logits = bundle.model(**batch.model_inputs()).logits
    finally:
        handle.remove()
    return float(example_losses(logits, batch.labels).sum())


def test_importance_under_uniform_pruning_is_the_gradient_of_the_uniform_masked_model(monkeypatch, tmp_path):
    bundle = make_bundle()
    data = tiny_data(6)
    batches = list(iter_batches(bundle, data.examples, batch_size=3))
    singles = list(iter_batches(bundle, data.examples, batch_size=1))
    keep = keep_mask(3, 4, [(0, 1), (1, 2)])
    uniform = head_importance(bundle, batches, keep=keep, mode="uniform")
    # kept heads, one after a pruned head in its layer, and a pruned head (its gate scales its uniform output)
    for layer, head in [(1, 0), (2, 3), (0, 1)]:
        step = 1e-3
        per_example = [abs(loss_with_scaled_head(bundle, single, keep, layer, head, 1 + step)
                           - loss_with_scaled_head(bundle, single, keep, layer, head, 1 - step)) / (2 * step)
                       for single in singles]
        assert uniform[layer, head] == pytest.approx(np.mean(per_example), rel=2e-2, abs=1e-4)
    zero = head_importance(bundle, batches, keep=keep, mode="zero")
    assert not np.allclose(uniform[keep > 0], zero[keep > 0], rtol=1e-2)
    # iterative pruning under uniform masking scores every step with the pruned heads uniform-masked
    modes = []

    def spy(*args, **kwargs):
        modes.append(kwargs.get("mode"))
        return head_importance(*args, **kwargs)

    monkeypatch.setattr(importance, "head_importance", spy)
    prune_analysis(bundle, data, RunDir("tiny", "sst2", tmp_path), step=0.25, iterative=True,
                   mode="uniform", batch_size=4)
    assert modes == ["uniform"] * 4


def test_normalisations():
    raw = np.array([[3.0, 4.0], [1.0, 0.0], [0.5, 0.5]])
    by_layer = normalize_by_layer(raw)
    assert np.allclose(np.linalg.norm(by_layer, axis=1), 1.0)
    assert np.allclose(by_layer[0], [0.6, 0.8])
    scaled = normalize_global(raw)
    assert scaled.min() == 0.0 and scaled.max() == 1.0 and scaled[0, 1] == 1.0 and scaled[1, 1] == 0.0
    assert np.allclose(normalized_importance(raw, by_layer=False, global_minmax=False), raw)
    assert np.allclose(normalized_importance(raw), normalize_global(by_layer))
    with pytest.raises(AttnpatError):
        normalize_by_layer(raw, exponent=0)


def test_pruning_counts_and_order():
    assert pruning_counts(72, 0.1) == [0, 7, 14, 22, 29, 36, 43, 50, 58, 65, 72]
    assert pruning_counts(12, 0.25, max_fraction=0.5) == [0, 3, 6]
    with pytest.raises(AttnpatError):
        pruning_counts(12, 0.0)
    assert pruning_counts(72, 0.005, max_fraction=0.01) == [0, 1]  # steps below one head still reach one
    with pytest.raises(AttnpatError, match="prunes no head of 72"):  # a curve of the unpruned model alone
        pruning_counts(72, 0.005, max_fraction=0.005)
    importance = np.array([[0.5, 0.1], [0.3, 0.9]])
    assert least_important(importance, np.ones((2, 2)), 3) == [(0, 1), (1, 0), (0, 0)]
    masks = pruning_masks(importance, [0, 1, 3])
    assert [int((mask == 0).sum()) for mask in masks] == [0, 1, 3]
    assert masks[2][1, 1] == 1 and masks[1][0, 1] == 0


def test_iterative_pruning_rescores_with_the_current_mask():
    seen = []

    def score(keep):
        seen.append(keep.copy())
        # a head's score rises once its neighbour is pruned: the order differs from one-shot pruning
        scores = np.array([[1.0, 2.0, 3.0, 4.0]])
        return scores + 10 * np.roll(1 - keep, 1, axis=1)

    masks = iterative_pruning_masks(score, [0, 1, 2, 3], (1, 4))
    assert [int((mask == 0).sum()) for mask in masks] == [0, 1, 2, 3]
    assert masks[1][0].tolist() == [0, 1, 1, 1]
    assert masks[2][0].tolist() == [0, 1, 0, 1]  # head 1 became important after head 0 went
    assert len(seen) == 3 and all((a >= b).all() for a, b in zip(masks, masks[1:]))


def test_pruning_curve_matches_the_naive_loop():
    bundle = make_bundle(seed=2)
    data = tiny_data(12)
    batches = list(iter_batches(bundle, data.examples, batch_size=5))
    labels = np.array([example.label for example in data.examples], dtype=float)
    importance = np.arange(12, dtype=float).reshape(3, 4)[:, ::-1]
    masks = pruning_masks(importance, [0, 4, 12])
    curve, baseline = pruning_curve(bundle, batches, masks, labels, "accuracy")
    naive = naive_sweep(bundle, encode_examples(bundle.tokenizer, data.examples),
                        [Variant(f"m{i}", mask) for i, mask in enumerate(masks)], "zero")
    assert curve["n_pruned"].tolist() == [0, 4, 12]
    assert curve["fraction_pruned"].tolist() == [0.0, 4 / 12, 1.0]
    for i in range(3):
        assert curve["metric"][i] == pytest.approx(accuracy(naive[f"m{i}"].argmax(-1).numpy(), labels))
    assert curve["metric"][0] == pytest.approx(baseline)
    # each step's change from the unpruned model carries a paired interval and a test on the same examples
    base = naive[BASELINE].argmax(-1).numpy()
    pruned = np.stack([naive[f"m{i}"].argmax(-1).numpy() for i in range(3)], 1)
    stats = effect_statistics(base, pruned, labels, "accuracy")
    assert curve["delta"].to_numpy() == pytest.approx(curve["metric"].to_numpy() - baseline)
    for column in ("ci_low", "ci_high", "p_mcnemar"):
        assert curve[column].to_numpy() == pytest.approx(stats[column])
    assert curve["p_holm"].to_numpy() == pytest.approx([1.0, *holm_adjust(stats["p_mcnemar"][1:])])
    assert (curve["ci_low"] <= curve["delta"] + 1e-12).all() and (curve["delta"] <= curve["ci_high"] + 1e-12).all()
    assert curve["ci_low"][0] == curve["ci_high"][0] == 0.0 and curve["p_mcnemar"][0] == 1.0  # nothing pruned


def test_holm_on_a_pruning_curve_counts_only_the_steps_that_prune():
    """The unpruned step is the baseline itself: Holm's correction runs over the other steps alone (before, it
    counted as one more test, and every step's p_holm was one test stricter: 7x instead of 6x for the 60% step of
    the README's curve)."""
    labels = np.zeros(60)
    baseline = np.zeros(60)  # right on every example
    pruned = np.zeros((60, 3))
    pruned[:10, 1] = 1  # 10 examples lost: McNemar p = 2 / 2**10
    pruned[:20, 2] = 1  # 20 lost
    stats = importance.curve_statistics(baseline, pruned, labels, "accuracy", np.array([False, True, True]))
    p = stats["p_mcnemar"]
    assert p[0] == 1.0 and p[1] == pytest.approx(2 / 2**10) and p[2] < p[1]
    assert stats["p_holm"].tolist() == pytest.approx([1.0, p[1], 2 * p[2]])  # two tests, not three
    assert stats["ci_low"][0] == stats["ci_high"][0] == 0.0
    scores = importance.curve_statistics(baseline + 0.5, pruned + np.arange(60)[:, None], np.arange(60.0),
                                         "pearson", np.array([False, True, True]))
    assert np.isnan(scores["p_holm"]).all()  # a score metric: intervals, no test


def test_importance_and_prune_analyses_write_the_run_directory(tmp_path):
    bundle = make_bundle()
    data = tiny_data()
    run = RunDir("tiny", "sst2", tmp_path)
    summary = importance_analysis(bundle, data, run, batch_size=4)
    table = pd.read_csv(run.file("importance.csv"))
    assert set(table["metric"]) == {"importance", "importance_raw", "importance_raw_ci_low",
                                    "importance_raw_ci_high"} and len(table) == 48
    # each head's raw score carries a bootstrap 95% interval over the examples' own gradients
    wide = table.pivot_table(index=["layer", "head"], columns="metric", values="value")
    batches = list(iter_batches(bundle, data.examples, batch_size=4))
    expected = bootstrap_mean_interval(example_importance(bundle, batches))
    np.testing.assert_allclose(wide["importance_raw_ci_low"].to_numpy().reshape(3, 4), expected[..., 0], rtol=1e-5)
    np.testing.assert_allclose(wide["importance_raw_ci_high"].to_numpy().reshape(3, 4), expected[..., 1], rtol=1e-5)
    assert (wide.importance_raw_ci_low <= wide.importance_raw + 1e-12).all()
    assert (wide.importance_raw <= wide.importance_raw_ci_high + 1e-12).all()
    assert (wide.importance_raw_ci_high > wide.importance_raw_ci_low).any()
    scores = table[table.metric == "importance"].value
    assert scores.min() == 0.0 and scores.max() == 1.0
    assert len(summary["least"]) == 5
    result = prune_analysis(bundle, data, run, step=0.25, iterative=True, batch_size=4)
    curve = pd.read_csv(run.file("pruning.csv"))
    assert list(curve.columns) == ["fraction_pruned", "n_pruned", "metric", "delta", "ci_low", "ci_high",
                                   "p_mcnemar", "p_holm"]
    assert curve["n_pruned"].tolist() == [0, 3, 6, 9, 12]
    assert curve["metric"][0] == pytest.approx(result["baseline"])
    analyses = run.manifest()["analyses"]
    assert analyses["importance"]["n_truncated"] == analyses["pruning"]["n_truncated"] == 0
    # the manifest says how many inputs --max-length cut, as every verb's does
    short = RunDir("tiny", "sst2", tmp_path / "short")
    cut = sum(item.truncated for item in encode_examples(bundle.tokenizer, data.examples, 6))
    importance_analysis(bundle, data, short, batch_size=4, max_length=6)
    prune_analysis(bundle, data, short, step=0.5, batch_size=4, max_length=6)
    analyses = short.manifest()["analyses"]
    assert cut > 0 and analyses["importance"]["n_truncated"] == analyses["pruning"]["n_truncated"] == cut
    for stem in ("importance", "pruning"):
        assert run.file(f"{stem}.png").stat().st_size > 0 and run.file(f"{stem}.svg").stat().st_size > 0
