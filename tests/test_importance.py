"""Head importance (Michel et al.) and pruning curves (analysis.importance)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AlbertConfig, AlbertForSequenceClassification

from analysis import importance, sweeps
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
    ranked_extremes,
)
from analysis.metrics import accuracy, confusion_metric
from analysis.rundir import RunDir
from analysis.stream import encode_examples, iter_batches
from analysis.sweeps import BASELINE, PERMUTATIONS, Variant, effect_statistics, naive_sweep
from analysis.uncertainty import bootstrap_mean_interval, confusion_permutation_p, holm_adjust
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


def test_importance_is_taken_with_dropout_off_whatever_mode_the_model_is_in():
    """Michel's importance is that of the model as it predicts. A model left in training mode (dropout on) gave
    each run other, noisier gradients; the model is now put in eval mode first."""
    bundle = make_bundle()
    batches = list(iter_batches(bundle, tiny_data(6).examples, batch_size=3))
    expected = head_importance(bundle, batches)
    bundle.model.train()
    assert np.allclose(head_importance(bundle, batches), expected, rtol=1e-6, atol=0)
    assert not bundle.model.training


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
        return example_importance(*args, **kwargs)

    monkeypatch.setattr(importance, "example_importance", spy)
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


def test_a_pruning_curve_of_an_f1_task_tests_the_f1_change_by_permutation():
    """On F1 (MRPC) each step's p is a permutation test of the F1 change, in a p_permutation column (before,
    McNemar's test of the accuracy change as p_mcnemar), Holm-corrected over the steps that prune."""
    labels = np.array([1] * 40 + [0] * 20)
    baseline = labels.copy()
    pruned = np.stack([labels, labels, labels, labels], 1)
    pruned[:8, 1] = 0  # 8 positives missed
    pruned[:20, 2] = 0  # 20 missed
    pruned[40:42, 3] = 1  # two false positives: a small change
    masks = [np.ones((1, 4))] + [keep_mask(1, 4, [(0, head) for head in range(k)]) for k in (1, 2, 3)]
    curve, unpruned = importance.curve_table(masks, baseline, pruned, labels, "f1")
    assert unpruned == 1.0 and "p_mcnemar" not in curve.columns
    assert list(curve.columns[4:8]) == ["ci_low", "ci_high", "p_permutation", "p_holm"]
    expected = confusion_permutation_p(confusion_metric("f1"), baseline, pruned, labels, n_perm=PERMUTATIONS)
    assert curve["p_permutation"].tolist() == expected.tolist()
    assert expected[0] == 1.0 and expected[2] < expected[1] < 0.05 < expected[3]
    assert curve["p_holm"].tolist() == pytest.approx([1.0, *holm_adjust(expected[1:])])


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
                                   "p_mcnemar", "p_holm", "ranked_on", "n_ranked", "scored_on", "n_scored"]
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


# ---------------------------------------------------------------- held-out scoring, resume, refusals

def mixed_data(n: int):
    """tiny_data with labels 0, 0, 1, 1, ...: both classes at even and at odd positions (tiny_data alternates)."""
    data = tiny_data(n)
    return dataclasses.replace(data, examples=[dataclasses.replace(example, label=(k // 2) % 2)
                                               for k, example in enumerate(data.examples)])


def test_prune_ranks_heads_on_the_even_examples_and_scores_the_curve_on_the_odd_ones(tmp_path):
    """The order is picked on examples 0, 2, ... and the curve measured on 1, 3, ... (before, both on every example:
    the order was chosen on the examples it was judged on, which flatters the curve)."""
    bundle = make_bundle(seed=3)
    data = mixed_data(13)
    run = RunDir("tiny", "sst2", tmp_path)
    result = prune_analysis(bundle, data, run, step=0.25, batch_size=4)
    even, odd = data.examples[0::2], data.examples[1::2]
    ranked = head_importance(bundle, list(iter_batches(bundle, even, batch_size=4)))
    masks = pruning_masks(normalized_importance(ranked), pruning_counts(12, 0.25))
    labels = np.array([example.label for example in odd], dtype=float)
    expected, baseline = pruning_curve(bundle, list(iter_batches(bundle, odd, batch_size=4)), masks, labels,
                                       "accuracy")
    curve = pd.read_csv(run.file("pruning.csv"))
    pd.testing.assert_frame_equal(curve[expected.columns], expected, rtol=1e-9)
    assert result["baseline"] == pytest.approx(baseline)
    assert set(curve["ranked_on"]) == {"even"} and set(curve["scored_on"]) == {"odd"}
    assert set(curve["n_ranked"]) == {7} and set(curve["n_scored"]) == {6}
    entry = run.manifest()["analyses"]["pruning"]
    assert (entry["ranked_on"], entry["n_ranked"], entry["scored_on"], entry["n_scored"]) == ("even", 7, "odd", 6)
    assert "even-numbered" in entry["held_out"] and "odd-numbered" in entry["held_out"]
    with pytest.raises(AttnpatError, match="at least 2 examples"):
        prune_analysis(bundle, tiny_data(1), RunDir("tiny", "sst2", tmp_path / "one"), step=0.25)
    assert not (tmp_path / "one").exists()


class Stop(Exception):
    """Stands for a kill: raised after a number of resume records are written."""


def stop_after(monkeypatch, count: int) -> None:
    """Make the count-th resume record written (a batch's gradients, a step's predictions) stop the run."""
    save, written = sweeps.SweepStore.save, []

    def stopping(store, name, record):
        save(store, name, record)
        written.append(name)
        if len(written) == count:
            raise Stop(name)

    monkeypatch.setattr(sweeps.SweepStore, "save", stopping)


def saves(monkeypatch) -> list[str]:
    """The names of the resume records written from now on."""
    save, written = sweeps.SweepStore.save, []

    def counting(store, name, record):
        written.append(name)
        save(store, name, record)

    monkeypatch.setattr(sweeps.SweepStore, "save", counting)
    return written


def half_written(folder) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if ".tmp" in path.name or path.name.startswith(".staging"))


@pytest.mark.parametrize("verb, stops", [("importance", [2]), ("prune", [3]), ("prune", [9, 12, 14])])
def test_importance_and_prune_stopped_and_rerun_resume_to_the_table_of_one_run(tmp_path, monkeypatch, verb, stops):
    """Stopped after some batches' gradients (importance, prune's ranking: 3 batches per ranking, 4 rankings with
    --iterative) or some steps' predictions (prune's curve, the records after the rankings), each rerun computes
    only what the stops had not kept, and the last gives the table of one uninterrupted run; a stopped run leaves
    no table, manifest entry or temporary file (before, both verbs started over)."""
    bundle = make_bundle(seed=4)
    data = mixed_data(20)
    analysis = (lambda run: importance_analysis(bundle, data, run, batch_size=4)) if verb == "importance" else (
        lambda run: prune_analysis(bundle, data, run, step=0.25, iterative=True, batch_size=4))
    table = "importance.csv" if verb == "importance" else "pruning.csv"
    whole = RunDir("tiny", "sst2", tmp_path / "whole")
    total = saves(monkeypatch)
    analysis(whole)
    assert len(total) == (5 if verb == "importance" else 4 * 3 + 5 + 1)  # batches; rankings x batches, steps, baseline
    stopped = RunDir("tiny", "sst2", tmp_path / "stopped")
    kept = 0
    for stop in stops:
        monkeypatch.undo()
        stop_after(monkeypatch, stop - kept)
        with pytest.raises(Stop):
            analysis(stopped)
        kept = stop
        assert not stopped.file(table).exists() and table[:-4] not in stopped.manifest().get("analyses", {})
        assert half_written(stopped.path) == []
    monkeypatch.undo()
    rerun = saves(monkeypatch)
    analysis(stopped)
    assert len(rerun) == len(total) - stops[-1] and set(rerun) <= set(total)
    assert stopped.file(table).read_bytes() == whole.file(table).read_bytes()
    assert half_written(stopped.path) == []


def test_importance_and_prune_refuse_an_ungateable_model_naming_what_they_need(tmp_path):
    """ALBERT: one line naming the verb and the head gating it needs (before, "head disabling is not supported",
    though neither verb disables heads), before the run folder is touched."""
    bundle = make_bundle(AlbertConfig, AlbertForSequenceClassification)
    run = RunDir("tiny", "sst2", tmp_path)
    with pytest.raises(AttnpatError, match="^importance needs head gating, which is not supported for albert models: "
                                           "ALBERT shares one attention module across all layers"):
        importance_analysis(bundle, tiny_data(4), run)
    with pytest.raises(AttnpatError, match="^prune needs head gating, which is not supported for albert models"):
        prune_analysis(bundle, tiny_data(4), run, step=0.5)
    assert list(tmp_path.rglob("*")) == []


def test_importance_on_workers_stores_each_batch_and_equals_one_process(tmp_path, monkeypatch):
    """--ray: the batches not yet stored go to the workers in one call, and each comes back as its own record, so
    the table equals one process's and a rerun (with workers or without) reads them back."""
    from analysis import distributed  # noqa: PLC0415 (the module whose function the workers' stand-in replaces)

    calls = []

    def on_workers(cluster, bundle, batches, *, keep=None, progress=False, per_example=False, on_batch=None):
        calls.append([batch.indices for batch in batches])
        assert per_example
        return example_importance(bundle, batches, keep=keep, on_batch=on_batch)

    class Workers:
        @staticmethod
        def manifest() -> dict:
            return {"workers": 2}

    monkeypatch.setattr(distributed, "distributed_importance", on_workers)
    bundle, data = make_bundle(), mixed_data(10)
    alone, spread = RunDir("tiny", "sst2", tmp_path / "alone"), RunDir("tiny", "sst2", tmp_path / "spread")
    importance_analysis(bundle, data, alone, batch_size=4)
    written = saves(monkeypatch)
    importance_analysis(bundle, data, spread, batch_size=4, cluster=Workers())
    assert len(calls) == 1 and sorted(index for batch in calls[0] for index in batch) == list(range(10))
    assert len(written) == 3 and spread.file("importance.csv").read_bytes() == alone.file("importance.csv").read_bytes()
    importance_analysis(bundle, data, spread, batch_size=4, cluster=Workers())
    importance_analysis(bundle, data, spread, batch_size=4)
    assert len(calls) == 1 and len(written) == 3


def test_importance_on_workers_keeps_each_returned_job_when_the_run_is_stopped(tmp_path, monkeypatch):
    """--ray stopped (Ctrl-C, or the run ended by a worker lost for good) after some jobs came back: their batches
    are kept, and the rerun sends only the batches that were in flight or queued (before, the batches were stored
    only once every job had returned, so a stopped run kept nothing and the rerun started over)."""
    from analysis import distributed  # noqa: PLC0415 (the module whose worker pool the stand-in replaces)

    class Pool:
        """Runs the jobs in this process, in the driver's order, as Ray's pool hands them back; stops after
        ``stop_after`` jobs when set."""
        actors = [0, 1]
        stop_after: int | None = None
        sent: list = []

        def run(self, jobs, *, progress=False, unit="jobs", on_result=None):
            results = {}
            for number, job in enumerate(jobs):
                if number == self.stop_after:
                    raise Stop(job.key)
                Pool.sent.extend(index for batch in job.args[0] for index in batch.indices)
                value = job.function(bundle, *job.args)
                results[job.key] = value if on_result is None else on_result(job.key, value)
            return results

    class Workers:
        @staticmethod
        def manifest() -> dict:
            return {"workers": 2}

    monkeypatch.setattr(distributed, "worker_pool", lambda cluster, bundle, kind="base": Pool())
    bundle, data = make_bundle(), mixed_data(20)
    alone, spread = RunDir("tiny", "sst2", tmp_path / "alone"), RunDir("tiny", "sst2", tmp_path / "spread")
    importance_analysis(bundle, data, alone, batch_size=2)  # 10 batches: 8 jobs on 2 workers, 2 of two batches
    Pool.stop_after = 3
    with pytest.raises(Stop):
        importance_analysis(bundle, data, spread, batch_size=2, cluster=Workers())
    kept = sorted(path.name for path in spread.file(".importance").glob("v-*.json"))
    first = sorted(Pool.sent)
    assert len(kept) == 4 and len(first) == 8  # the three jobs that came back: four batches of two examples
    Pool.stop_after, Pool.sent = None, []
    importance_analysis(bundle, data, spread, batch_size=2, cluster=Workers())
    assert sorted(Pool.sent + first) == list(range(20))  # only what was not kept went out again
    assert spread.file("importance.csv").read_bytes() == alone.file("importance.csv").read_bytes()


def test_a_pruned_head_scores_zero_before_the_normalisations_so_it_cannot_move_the_kept_heads_order():
    """A pruned head's gate still has a gradient; left in, it entered its layer's L2 norm and shrank its kept
    neighbours' scores. Here layer 0's pruned head (10) made head (0, 1) look least important; gone, (1, 0) is."""
    raw = np.array([[10.0, 1.0], [0.5, 0.6]])
    keep = np.array([[0.0, 1.0], [1.0, 1.0]])
    assert least_important(normalized_importance(raw), keep, 1) == [(0, 1)]  # what the ranking did before
    scores = normalized_importance(importance.kept_importance(raw, keep))
    assert least_important(scores, keep, 1) == [(1, 0)]
    assert scores[0, 0] == 0.0 and np.allclose(importance.kept_importance(raw, np.ones((2, 2))), raw)


@pytest.mark.parametrize("mode", ["zero", "uniform"])
def test_iterative_pruning_scores_the_pruned_heads_zero_under_the_current_mask(tmp_path, monkeypatch, mode):
    """prune --iterative: each step's scores are the normalised importance of the kept heads, the pruned ones 0
    (before, their gate gradients, nonzero in both modes, went into the per-layer norm and the global min-max)."""
    scorers = []

    def spy(score, counts, shape):
        scorers.append(score)
        return iterative_pruning_masks(score, counts, shape)

    monkeypatch.setattr(importance, "iterative_pruning_masks", spy)
    bundle, data = make_bundle(seed=5), mixed_data(12)
    prune_analysis(bundle, data, RunDir("tiny", "sst2", tmp_path), step=0.25, iterative=True, mode=mode,
                   batch_size=4)
    keep = keep_mask(3, 4, [(0, 1), (1, 2), (1, 3)])
    raw = head_importance(bundle, list(iter_batches(bundle, data.examples[0::2], batch_size=4)), keep=keep,
                          mode=mode)
    assert (raw[keep == 0] > 0).all()  # the pruned heads' gates do have gradients
    scores = scorers[0](keep)
    assert (scores[keep == 0] == 0).all()
    np.testing.assert_allclose(scores, normalized_importance(np.where(keep > 0, raw, 0.0)), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("verb, options, message", [
    ("importance", {"exponent": 0.0}, "normalisation exponent must be a positive number, got 0.0"),
    ("prune", {"exponent": -1.0}, "normalisation exponent must be a positive number, got -1.0"),
    ("prune", {"step": 0.01, "max_fraction": 0.04}, "a step of 0.01 up to 0.04 prunes no head of 12"),
    ("prune", {"step": 1.5}, "pruning step must be a share of heads in"),
])
def test_the_analyses_refuse_bad_options_before_any_gradient(tmp_path, monkeypatch, verb, options, message):
    """A Python caller's bad exponent (or a step pruning no head) is refused before the run folder is touched
    and before any gradient (before, the exponent only after every batch's gradients, as the CLI does not)."""
    monkeypatch.setattr(importance, "example_importance",
                        lambda *a, **k: pytest.fail("a gradient was computed before the check"))
    analysis = importance_analysis if verb == "importance" else prune_analysis
    with pytest.raises(AttnpatError, match=message):
        analysis(make_bundle(), mixed_data(6), RunDir("tiny", "sst2", tmp_path), **options)
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize("n_heads, n_least, n_most", [(1, 0, 1), (3, 1, 2), (8, 4, 4), (9, 4, 5), (10, 5, 5),
                                                      (48, 5, 5)])
def test_the_least_and_most_important_lists_never_share_a_head(n_heads, n_least, n_most):
    order = [(index // 4, index % 4) for index in range(n_heads)]  # least to most important
    least, most = ranked_extremes(order)
    assert (len(least), len(most)) == (n_least, n_most) and not set(least) & set(most)
    assert least == order[:n_least] and most == order[::-1][:n_most]
