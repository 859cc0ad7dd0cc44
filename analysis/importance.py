"""Head importance by gradients and pruning curves (Michel et al. 2019, with the HF bertology normalisations).

Importance of head h: I_h = E_x |dL(x)/d xi_h|, where xi_h is a gate multiplied into the head's context
output (zero-mode gates of analysis.disable) and L the task loss. Each example gets its own row of gates, so
one backward pass gives every example's own gradient (rows of a batch do not interact in eval mode).

Pruning: heads are masked (gate 0) in increasing importance order, a share of all heads per step, and the
task metric is measured after each step; ``iterative`` recomputes importance with the current mask before
each step (bertology's prune_heads loop), the pruned heads masked as the curve masks them. Metrics come from
the fast sweep engine (analysis.sweeps). The order is picked on the even-numbered examples and the curve
scored on the odd-numbered ones (as analysis.probing splits sentences): ranked and scored on the same examples,
the curve would flatter the order. Gradients (per batch) and each step's predictions are kept in the run folder
as soon as they are known (analysis.sweeps.SweepStore), so a stopped run resumes.

Shapes: ``L`` layers, ``H`` heads, ``B`` batch rows, ``N`` examples.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from analysis.disable import check_mode, check_supported, gated, head_gates, keep_mask, mask_gates
from analysis.errors import AttnpatError
from analysis.figures import close, head_heatmap
from analysis.metrics import metric_name, task_metric
from analysis.probing import HELD_OUT, SELECTION, sentence_half
from analysis.progress import progress_bar
from analysis.rundir import long_table
from analysis.stream import DEFAULT_MAX_LENGTH, TokenBatch, encode_examples, iter_batches
from analysis.sweeps import (
    BASELINE,
    SweepStore,
    Variant,
    classifier_head_note,
    effect_statistics,
    fast_sweep,
    predictions,
    raw_p_column,
    run_sweep,
    sweep_fingerprint,
    task_labels,
)
from analysis.uncertainty import bootstrap_mean_interval, holm_adjust

# ---------------------------------------------------------------- importance

def example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-example task loss: cross-entropy for classes, squared error for one regression output. (B, C) -> (B,)."""
    if logits.shape[-1] == 1:
        return (logits[:, 0] - labels.float()) ** 2
    return torch.nn.functional.cross_entropy(logits, labels.long(), reduction="none")


def gate_gradients(model: torch.nn.Module, batch: TokenBatch, device: torch.device,
                   keep: np.ndarray, mode: str = "zero") -> torch.Tensor:
    """|dL(x)/d gate| for every example x of the batch: (B, L, H).

    Gates start at ``keep`` (L, H) (1 = head on, 0 = pruned), one row per example. With ``mode`` uniform the
    pruned heads are uniform-masked, as the pruning curve masks them, and every gate starts at 1 (a pruned
    head's gate scales its uniform output).
    """
    if batch.labels is None:
        raise AttnpatError("head importance needs labelled examples")
    rows = len(batch.items)
    start = keep if mode == "zero" else np.ones_like(keep)
    gates = torch.tensor(start, dtype=torch.float32, device=device).expand(rows, -1, -1).clone().requires_grad_(True)
    pruned = mask_gates(keep) if mode == "uniform" else {}
    with (torch.enable_grad(), head_gates(model, pruned, "uniform"),
          head_gates(model, {layer: gates[:, layer] for layer in range(keep.shape[0])}, "zero")):
        logits = model(**batch.model_inputs(device)).logits
        loss = example_losses(logits, batch.labels.to(device)).sum()
        (gradient,) = torch.autograd.grad(loss, gates)
    return gradient.abs().detach()


def head_importance(bundle, batches: Sequence[TokenBatch], *, keep: np.ndarray | None = None, mode: str = "zero",
                    progress: bool | str = False) -> np.ndarray:
    """Raw importance (L, H): the mean over examples of |dL(x)/d gate_h| (Michel et al. eq. 2), with the heads
    ``keep`` prunes masked in ``mode`` (analysis.disable)."""
    return example_importance(bundle, batches, keep=keep, mode=mode, progress=progress).mean(0)


def example_importance(bundle, batches: Sequence[TokenBatch], *, keep: np.ndarray | None = None, mode: str = "zero",
                       progress: bool | str = False,
                       on_batch: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
    """|dL(x)/d gate_h| of every example x (N, L, H), in the batches' order: :func:`head_importance` is their mean,
    and a bootstrap over them gives its interval. ``on_batch(position, gradients (B, L, H))`` is called as soon
    as a batch's gradients are known (to persist them: :func:`stored_example_importance`). The model is put in
    eval mode first (dropout off)."""
    check_mode(mode)
    keep = keep_mask(bundle.num_layers, bundle.num_heads) if keep is None else np.asarray(keep, dtype=np.float32)
    bundle.model.eval()  # dropout off: the importance of the model as it predicts, the same on every run
    parts = []
    bar = progress_bar(sum(len(batch.items) for batch in batches), progress, "importance")
    with gated(bundle.model):
        for position, batch in enumerate(batches):
            parts.append(gate_gradients(bundle.model, batch, bundle.device, keep, mode).double().cpu().numpy())
            if on_batch is not None:
                on_batch(position, parts[-1])
            if bar is not None:
                bar.update(len(batch.items))
    if bar is not None:
        bar.close()
    if not parts:
        raise AttnpatError("no examples to compute head importance on")
    return np.concatenate(parts)


def mask_tag(keep: np.ndarray) -> str:
    """A short name of a keep mask (L, H), for the resume records made under it."""
    pruned = (np.asarray(keep) == 0).astype(np.uint8)
    return hashlib.sha256(f"{pruned.shape}".encode() + pruned.tobytes()).hexdigest()[:16]


def importance_fingerprint(bundle, data, mode: str, purpose: str, max_length: int, batch_size: int) -> dict:
    """What stored per-batch gradients depend on: the sweep's fingerprint (model revision, every example, mode,
    length limit) and the batch size, since the records are per batch (another size groups other examples)."""
    return {**sweep_fingerprint(bundle, data, mode, purpose, max_length), "batch_size": batch_size}


def stored_example_importance(bundle, batches: Sequence[TokenBatch], store: SweepStore, *,
                              keep: np.ndarray | None = None, mode: str = "zero", progress: bool | str = False,
                              cluster=None) -> np.ndarray:
    """:func:`example_importance` (N, L, H) resumed from ``store``: each batch's gradients are saved there (one
    record per keep mask and batch, written atomically) as soon as they are known, and a rerun computes only the
    batches it lacks. The gradients are stored as float64 of float32 values, so read back they are bit-equal.
    ``cluster`` (analysis.cluster.Cluster, zero mode with no pruned head only): the missing batches go to its
    workers, each run of batches stored as soon as its job returns."""
    if not batches:
        raise AttnpatError("no examples to compute head importance on")
    keep = keep_mask(bundle.num_layers, bundle.num_heads) if keep is None else np.asarray(keep, dtype=np.float32)
    tag, stored = mask_tag(keep), store.results()
    names = [f"grad-{tag}-{position}" for position in range(len(batches))]
    known: dict[int, np.ndarray] = {}
    for position, (name, batch) in enumerate(zip(names, batches)):
        record = stored.get(name, {})
        if record.get("indices") == batch.indices and record.get("keep") == keep.tolist():
            known[position] = np.asarray(record["gradients"], dtype=np.float64).reshape(len(batch.items), *keep.shape)
    missing = [position for position in range(len(batches)) if position not in known]

    def save(position: int, gradients: np.ndarray) -> None:
        store.save(names[position], {"indices": batches[position].indices, "keep": keep.tolist(), "mode": mode,
                                     "gradients": gradients.tolist()})
        known[position] = gradients

    todo = [batches[position] for position in missing]
    if cluster is not None and mode != "zero":
        raise AttnpatError("head importance on workers takes zero-mode gates only")
    if todo and cluster is not None:
        from analysis.distributed import distributed_importance  # noqa: PLC0415 (it builds on this module)

        # each run of batches is kept as soon as its job returns: a stopped run, or one a lost worker ends, keeps
        # what came back, and the batches still in flight are computed again on the rerun
        distributed_importance(cluster, bundle, todo, keep=keep, progress=progress, per_example=True,
                               on_batch=lambda i, gradients: save(missing[i], gradients))
    elif todo:
        example_importance(bundle, todo, keep=keep, mode=mode, progress=progress,
                           on_batch=lambda i, gradients: save(missing[i], gradients))
    return np.concatenate([known[position] for position in range(len(batches))])


def check_exponent(exponent: float) -> None:
    """The per-layer norm's exponent: callers check it before the gradients are computed, not after."""
    if not 0 < exponent < float("inf"):  # also refuses NaN, for which every comparison is false
        raise AttnpatError(f"the normalisation exponent must be a positive number, got {exponent}")


def normalize_by_layer(importance: np.ndarray, exponent: float = 2.0) -> np.ndarray:
    """Divide each layer's scores by their L-``exponent`` norm (bertology's default exponent 2). (L, H) -> (L, H)."""
    check_exponent(exponent)
    norms = np.power(np.power(np.abs(importance), exponent).sum(-1, keepdims=True), 1.0 / exponent)
    return importance / (norms + 1e-20)


def normalize_global(importance: np.ndarray) -> np.ndarray:
    """Min-max scale all scores to [0, 1] (bertology's global normalisation). (L, H) -> (L, H)."""
    low, high = float(np.min(importance)), float(np.max(importance))
    return (importance - low) / (high - low) if high > low else np.zeros_like(importance)


def normalized_importance(raw: np.ndarray, *, by_layer: bool = True, exponent: float = 2.0,
                          global_minmax: bool = True) -> np.ndarray:
    """The options applied in bertology's order: per-layer norm, then global min-max."""
    scores = normalize_by_layer(raw, exponent) if by_layer else raw
    return normalize_global(scores) if global_minmax else scores


def kept_importance(raw: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Raw importance (L, H) with the heads ``keep`` (L, H) prunes set to 0. A pruned head's gate still has a
    gradient (at 0 in zero mode, scaling its uniform output in uniform mode), but the head is gone: left in, it
    would enter its layer's norm and the global min-max, and move the kept heads' normalised scores."""
    return np.where(np.asarray(keep) > 0, raw, 0.0)


# ---------------------------------------------------------------- pruning

def check_pruning_shares(step: float, max_fraction: float) -> None:
    if not 0 < step <= 1:
        raise AttnpatError(f"the pruning step must be a share of heads in (0, 1], got {step}")
    if not 0 < max_fraction <= 1:
        raise AttnpatError(f"the largest pruned share must be in (0, 1], got {max_fraction}")
    if max_fraction < step:  # no step fits under the cap: the curve would hold the unpruned model alone
        raise AttnpatError(f"the largest pruned share ({max_fraction}) must be at least one step ({step})")


def pruning_counts(total_heads: int, step: float, max_fraction: float = 1.0) -> list[int]:
    """Numbers of heads pruned at each step: 0, round(step * total), ... up to max_fraction (distinct, ascending)."""
    check_pruning_shares(step, max_fraction)
    steps = int(np.floor(max_fraction / step + 1e-9))
    counts = [count for count in sorted({int(round(k * step * total_heads)) for k in range(steps + 1)})
              if count <= total_heads]
    if counts[-1] == 0:  # every step rounds to no head: the curve would hold the unpruned model alone
        raise AttnpatError(f"a step of {step} up to {max_fraction} prunes no head of {total_heads}; "
                           f"use --step {1 / total_heads:.3g} or more")
    return counts


def least_important(importance: np.ndarray, keep: np.ndarray, count: int) -> list[tuple[int, int]]:
    """The ``count`` still-kept heads with the lowest importance (ties: lower layer, then head, first)."""
    candidates = [(float(importance[layer, head]), layer, head) for layer in range(keep.shape[0])
                  for head in range(keep.shape[1]) if keep[layer, head] > 0]
    return [(layer, head) for _, layer, head in sorted(candidates)[:count]]


def ranked_extremes(order: Sequence[tuple[int, int]], per_list: int = 5
                    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(least, most) important heads of ``order`` ((layer, head) from least to most important): up to ``per_list``
    in each (least from the least important up, most from the most important down), never one head in both. With
    fewer than 2 x per_list heads the two lists share them out, the extra head of an odd count going to most."""
    most = list(order[::-1][:min(per_list, (len(order) + 1) // 2)])
    return list(order[:min(per_list, len(order) - len(most))]), most


def pruning_masks(importance: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """One-shot pruning: for each count, the (L, H) keep mask with that many least important heads off."""
    full = np.ones(importance.shape, dtype=np.float32)
    return [keep_mask(*importance.shape, least_important(importance, full, count)) for count in counts]


def iterative_pruning_masks(score, counts: Sequence[int], shape: tuple[int, int]) -> list[np.ndarray]:
    """Iterative pruning: before each step, ``score(keep)`` gives (L, H) importance under the current mask,
    and the least important kept heads are added to the pruned set."""
    keep = np.ones(shape, dtype=np.float32)
    masks = []
    for count in counts:
        already = int((keep == 0).sum())
        if count > already:
            for layer, head in least_important(score(keep), keep, count - already):
                keep[layer, head] = 0.0
        masks.append(keep.copy())
    return masks


def curve_statistics(baseline: np.ndarray, pruned: np.ndarray, labels: np.ndarray, metric: str,
                     prunes: np.ndarray) -> dict[str, np.ndarray]:
    """analysis.sweeps.effect_statistics of each step of a pruning curve, with Holm's correction across the steps
    that prune a head only: the unpruned step (``prunes`` False) is the baseline itself, no hypothesis, and
    counting it would make every other step's correction one test stricter. Its p_holm is its raw p (1, or NaN
    for a score metric; the raw p is McNemar's on accuracy, a permutation test's on F1 and Matthews, named by
    analysis.sweeps.raw_p_column). baseline: (N,) predictions; pruned: (N, steps); prunes: (steps,) bool."""
    stats = effect_statistics(baseline, pruned, labels, metric)
    prunes = np.asarray(prunes, dtype=bool)
    p_holm = stats[raw_p_column(metric)].copy()
    if prunes.any():
        p_holm[prunes] = holm_adjust(p_holm[prunes])
    return {**stats, "p_holm": p_holm}


def curve_table(masks: Sequence[np.ndarray], base: np.ndarray, pruned: np.ndarray, labels: np.ndarray,
                metric: str):
    """The curve's rows from predictions: base (N,) of the unpruned model, pruned (N, steps) under each keep mask
    (L, H) of ``masks``; :func:`curve_statistics` on the same examples. Returns (DataFrame fraction_pruned,
    n_pruned, metric, delta, ci_low, ci_high, p_mcnemar or p_permutation (analysis.sweeps.raw_p_column), p_holm;
    the unpruned metric)."""
    baseline = task_metric(metric, base, labels)
    stats = curve_statistics(base, pruned, labels, metric, np.array([(mask == 0).any() for mask in masks]))
    rows = []
    for step, mask in enumerate(masks):
        value = task_metric(metric, pruned[:, step], labels)
        rows.append({"fraction_pruned": int((mask == 0).sum()) / mask.size, "n_pruned": int((mask == 0).sum()),
                     "metric": value, "delta": value - baseline,
                     **{column: float(values[step]) for column, values in stats.items()}})
    return pd.DataFrame(rows), baseline


def pruning_curve(bundle, batches: Sequence[TokenBatch], masks: Sequence[np.ndarray], labels: np.ndarray,
                  metric: str, *, mode: str = "zero", progress: bool | str = False):
    """Task metric under each keep mask (fast engine), with the change from the unpruned model and how sure it
    is (:func:`curve_table`; Holm's correction across the steps that prune a head). labels: (N,) in example order.
    Returns (DataFrame fraction_pruned, n_pruned, metric, delta, ci_low, ci_high, p_mcnemar or p_permutation,
    p_holm; the unpruned metric)."""
    check_mode(mode)
    if not masks:
        raise AttnpatError("a pruning curve needs at least one keep mask")
    variants = [Variant(f"prune-{i}", mask) for i, mask in enumerate(masks)]
    logits = fast_sweep(bundle, batches, variants, mode, progress=progress)
    pruned = np.stack([predictions(logits[variant.name]) for variant in variants], 1)  # (N, steps)
    return curve_table(masks, predictions(logits[BASELINE]), pruned, labels, metric)


# ---------------------------------------------------------------- figures

def importance_figure(scores: np.ndarray, *, task: str, model: str, normalisation: str):
    return head_heatmap(scores, title=f"{model} on {task}: head importance ({normalisation})", cmap="viridis",
                        label="importance")


def pruning_figure(curve, *, metric: str, baseline: float, task: str, model: str, label: str):
    """The metric against the share of heads pruned; with ci_low/ci_high (intervals of the change from the
    unpruned model), error bars around each point."""
    fig, ax = plt.subplots(figsize=(4.8, 3.2))
    x = curve["fraction_pruned"] * 100
    ax.plot(x, curve["metric"], marker="o", ms=3, label=label)
    if {"ci_low", "ci_high", "delta"} <= set(curve.columns):
        ax.errorbar(x, curve["metric"], yerr=[curve["delta"] - curve["ci_low"], curve["ci_high"] - curve["delta"]],
                    fmt="none", ecolor="C0", elinewidth=0.8, capsize=2, label="95% paired bootstrap interval")
    ax.axhline(baseline, color="gray", lw=0.8, ls="--", label=f"unpruned {baseline:.3f}")
    ax.set_xlabel("heads pruned (%)")
    ax.set_ylabel(metric)
    ax.set_title(f"{model} on {task}: pruning in importance order", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- the analyses behind the CLI verbs

def _labelled_batches(bundle, data, max_length: int, batch_size: int) -> tuple[list[TokenBatch], np.ndarray]:
    labels = task_labels(data)
    return list(iter_batches(bundle, data.examples, max_length=max_length, batch_size=batch_size)), labels


def _truncated(batches: Sequence[TokenBatch]) -> int:
    """How many of the batches' inputs --max-length cut (recorded in the manifest, as every verb does)."""
    return sum(item.truncated for batch in batches for item in batch.items)


def _normalisation_label(by_layer: bool, exponent: float, global_minmax: bool) -> str:
    parts = [f"per-layer L{exponent:g} norm" if by_layer else "", "global min-max" if global_minmax else ""]
    return ", ".join(part for part in parts if part) or "raw"


def importance_analysis(bundle, data, run, *, by_layer: bool = True, exponent: float = 2.0,
                        global_minmax: bool = True, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                        progress: bool = False, cluster=None) -> dict:
    """Compute and write importance.csv (metric importance = normalised, importance_raw) and the heatmap, and
    record the run (manifest entry importance). Each batch's gradients are kept in the run folder's
    ``.importance/`` as soon as they are known, so a stopped run resumes. ``cluster``
    (analysis.cluster.Cluster): runs of batches go to its workers (recorded in the manifest)."""
    check_supported(bundle.model, "importance")  # before the record and the resume store touch the run folder
    check_exponent(exponent)  # used only once every gradient is known
    task_labels(data)
    with run.record("importance", bundle, data, normalize_layers=by_layer, exponent=exponent,
                    normalize_global=global_minmax, max_length=max_length,
                    model_note=classifier_head_note(bundle, data.task)) as entry:
        if cluster is not None:
            entry["cluster"] = cluster.manifest()
        summary = _importance(bundle, data, run, by_layer=by_layer, exponent=exponent, global_minmax=global_minmax,
                              max_length=max_length, batch_size=batch_size, progress=progress, cluster=cluster)
        entry.update(outputs=summary["outputs"], n_truncated=summary["n_truncated"])
    return summary


def _importance(bundle, data, run, *, by_layer: bool, exponent: float, global_minmax: bool, max_length: int,
                batch_size: int, progress: bool, cluster=None) -> dict:
    batches, _ = _labelled_batches(bundle, data, max_length, batch_size)
    store = SweepStore(run.file(".importance"),
                       importance_fingerprint(bundle, data, "zero", "importance", max_length, batch_size))
    per_example = stored_example_importance(bundle, batches, store, progress="importance" if progress else False,
                                            cluster=cluster)  # (N, L, H)
    raw = per_example.mean(0)
    interval = bootstrap_mean_interval(per_example)  # (L, H, 2): how sure each head's raw score is
    scores = normalized_importance(raw, by_layer=by_layer, exponent=exponent, global_minmax=global_minmax)
    run.write_table("importance", long_table({"importance": scores, "importance_raw": raw,
                                              "importance_raw_ci_low": interval[..., 0],
                                              "importance_raw_ci_high": interval[..., 1]}))
    label = _normalisation_label(by_layer, exponent, global_minmax)
    fig = importance_figure(scores, task=data.task, model=bundle.name, normalisation=label)
    figures = run.write_figure("importance", fig)
    close(fig)
    least, most = ranked_extremes(least_important(scores, np.ones_like(scores), scores.size))
    return {"normalisation": label, "scores": scores, "least": least, "most": most,
            "outputs": [str(run.file("importance.csv"))] + [str(p) for p in figures],
            "n_truncated": _truncated(batches)}


RANKED_ON, SCORED_ON = "even", "odd"  # the halves of the data: one ranks the heads, the other scores the curve
SPLIT_NOTE = ("importance ranks the heads on the even-numbered examples (0, 2, ...) and the curve (metric, change, "
              "interval, p) is scored on the odd-numbered ones, so the order is not picked on the examples it is "
              "judged on")


def check_split_size(count: int) -> None:
    """Each half needs an example (the CLI checks --n before the model loads)."""
    if count < 2:
        raise AttnpatError(f"prune needs at least 2 examples, got {count}: {SPLIT_NOTE}")


def ranking_and_scoring_halves(data):
    """(ranking, scoring): copies of ``data`` holding its examples at even positions (they rank the heads) and at
    odd positions (they score the curve), split as analysis.probing splits sentences; alternating spreads both
    over the whole file. A clear error when a half would be empty."""
    check_split_size(len(data.examples))
    halves = ([example for position, example in enumerate(data.examples) if sentence_half(position) == half]
              for half in (SELECTION, HELD_OUT))
    return tuple(dataclasses.replace(data, examples=examples) for examples in halves)


def prune_analysis(bundle, data, run, *, step: float = 0.1, max_fraction: float = 1.0, iterative: bool = False,
                   mode: str = "zero", by_layer: bool = True, exponent: float = 2.0, global_minmax: bool = True,
                   max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32, progress: bool = False) -> dict:
    """Prune heads in importance order (ranked on the even-numbered examples, scored on the odd-numbered ones);
    write pruning.csv and the curve and record the run (manifest entry pruning). The gradients of each ranking
    and the predictions of each step are kept in the run folder (``.prune-rank-<mode>/``,
    ``.prune-curve-<mode>/``) as soon as they are known, so a stopped run resumes. Returns the curve and its
    baseline."""
    check_mode(mode)
    check_supported(bundle.model, "prune")  # before the record and the resume stores touch the run folder
    check_exponent(exponent)  # used only once the ranking's gradients are known
    pruning_counts(bundle.num_layers * bundle.num_heads, step, max_fraction)  # also checks the shares
    task_labels(data)
    ranking, scoring = ranking_and_scoring_halves(data)
    with run.record("pruning", bundle, data, step=step, max_fraction=max_fraction, iterative=iterative, mode=mode,
                    normalize_layers=by_layer, exponent=exponent, normalize_global=global_minmax,
                    max_length=max_length, model_note=classifier_head_note(bundle, data.task), held_out=SPLIT_NOTE,
                    ranked_on=RANKED_ON, scored_on=SCORED_ON, n_ranked=len(ranking.examples),
                    n_scored=len(scoring.examples)) as entry:
        result = _prune(bundle, ranking, scoring, run, step=step, max_fraction=max_fraction, iterative=iterative,
                        mode=mode, by_layer=by_layer, exponent=exponent, global_minmax=global_minmax,
                        max_length=max_length, batch_size=batch_size, progress=progress)
        entry.update(outputs=result["outputs"], baseline=result["baseline"], n_truncated=result["n_truncated"])
    return result


def _prune(bundle, ranking, scoring, run, *, step: float, max_fraction: float, iterative: bool, mode: str,
           by_layer: bool, exponent: float, global_minmax: bool, max_length: int, batch_size: int,
           progress: bool) -> dict:
    """ranking, scoring: the halves of the data (:func:`ranking_and_scoring_halves`)."""
    metric = metric_name(scoring.metric or scoring.task)
    rank_batches, _ = _labelled_batches(bundle, ranking, max_length, batch_size)
    labels = task_labels(scoring)
    scored = encode_examples(bundle.tokenizer, scoring.examples, max_length)  # a bad input fails before any work
    counts = pruning_counts(bundle.num_layers * bundle.num_heads, step, max_fraction)
    rank_store = SweepStore(run.file(f".prune-rank-{mode}"),
                            importance_fingerprint(bundle, ranking, mode, "prune-rank", max_length, batch_size))

    def score(keep: np.ndarray) -> np.ndarray:
        # pruned heads masked as the curve masks them, and scored 0 (gone) before the normalisations
        raw = stored_example_importance(bundle, rank_batches, rank_store, keep=keep, mode=mode).mean(0)
        return normalized_importance(kept_importance(raw, keep), by_layer=by_layer, exponent=exponent,
                                     global_minmax=global_minmax)

    shape = (bundle.num_layers, bundle.num_heads)
    masks = iterative_pruning_masks(score, counts, shape) if iterative else pruning_masks(score(np.ones(shape)), counts)
    # one variant per mask, named by it: a rerun with another --step reuses the steps it shares
    variants = [Variant(f"prune-{mask_tag(mask)}", mask) for mask in masks]
    curve_store = SweepStore(run.file(f".prune-curve-{mode}"),
                             sweep_fingerprint(bundle, scoring, mode, "prune", max_length))
    run_sweep(bundle, scoring, variants, mode, curve_store, max_length=max_length, batch_size=batch_size,
              progress="pruning" if progress else False, encoded=scored)
    predicted = curve_store.predictions([BASELINE] + [variant.name for variant in variants])  # (N, 1 + steps)
    curve, baseline = curve_table(masks, predicted[:, 0], predicted[:, 1:], labels, metric)
    curve = curve.assign(ranked_on=RANKED_ON, n_ranked=len(ranking.examples), scored_on=SCORED_ON,
                         n_scored=len(scoring.examples))
    run.write_table("pruning", curve)
    label = f"{'iterative' if iterative else 'one-shot'}, {mode} masking"
    fig = pruning_figure(curve, metric=metric, baseline=baseline, task=scoring.task, model=bundle.name, label=label)
    figures = run.write_figure("pruning", fig)
    close(fig)
    return {"curve": curve, "baseline": baseline, "metric_name": metric, "label": label,
            "n_ranked": len(ranking.examples), "n_scored": len(scoring.examples),
            "outputs": [str(run.file("pruning.csv"))] + [str(p) for p in figures],
            "n_truncated": _truncated(rank_batches) + sum(item.truncated for item in scored)}
