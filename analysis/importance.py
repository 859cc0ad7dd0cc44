"""Head importance by gradients and pruning curves (Michel et al. 2019, with the HF bertology normalisations).

Importance of head h: I_h = E_x |dL(x)/d xi_h|, where xi_h is a gate multiplied into the head's context
output (zero-mode gates of analysis.disable) and L the task loss. Each example gets its own row of gates, so
one backward pass gives every example's own gradient (rows of a batch do not interact in eval mode).

Pruning: heads are masked (gate 0) in increasing importance order, a share of all heads per step, and the
task metric is measured after each step; ``iterative`` recomputes importance with the current mask before
each step (bertology's prune_heads loop), the pruned heads masked as the curve masks them. Metrics come from
the fast sweep engine (analysis.sweeps).

Shapes: ``L`` layers, ``H`` heads, ``B`` batch rows, ``N`` examples.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from analysis.disable import check_mode, gated, head_gates, keep_mask, mask_gates
from analysis.errors import AttnpatError
from analysis.figures import close, head_heatmap
from analysis.metrics import metric_name, task_metric
from analysis.progress import progress_bar
from analysis.rundir import long_table
from analysis.stream import DEFAULT_MAX_LENGTH, TokenBatch, iter_batches
from analysis.sweeps import (
    BASELINE,
    Variant,
    classifier_head_note,
    effect_statistics,
    fast_sweep,
    predictions,
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
                       progress: bool | str = False) -> np.ndarray:
    """|dL(x)/d gate_h| of every example x (N, L, H), in the batches' order: :func:`head_importance` is their mean,
    and a bootstrap over them gives its interval."""
    check_mode(mode)
    keep = keep_mask(bundle.num_layers, bundle.num_heads) if keep is None else np.asarray(keep, dtype=np.float32)
    parts = []
    bar = progress_bar(sum(len(batch.items) for batch in batches), progress, "importance")
    with gated(bundle.model):
        for batch in batches:
            parts.append(gate_gradients(bundle.model, batch, bundle.device, keep, mode).double().cpu().numpy())
            if bar is not None:
                bar.update(len(batch.items))
    if bar is not None:
        bar.close()
    if not parts:
        raise AttnpatError("no examples to compute head importance on")
    return np.concatenate(parts)


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
    for a score metric). baseline: (N,) predictions; pruned: (N, steps); prunes: (steps,) bool."""
    stats = effect_statistics(baseline, pruned, labels, metric)
    prunes = np.asarray(prunes, dtype=bool)
    p_holm = stats["p_mcnemar"].copy()
    if prunes.any():
        p_holm[prunes] = holm_adjust(p_holm[prunes])
    return {**stats, "p_holm": p_holm}


def pruning_curve(bundle, batches: Sequence[TokenBatch], masks: Sequence[np.ndarray], labels: np.ndarray,
                  metric: str, *, mode: str = "zero", progress: bool | str = False):
    """Task metric under each keep mask (fast engine), with the change from the unpruned model and how sure it
    is (:func:`curve_statistics` on the same examples; Holm's correction across the steps that prune a head).
    Returns (DataFrame fraction_pruned, n_pruned, metric, delta, ci_low, ci_high, p_mcnemar, p_holm; the
    unpruned metric)."""
    check_mode(mode)
    if not masks:
        raise AttnpatError("a pruning curve needs at least one keep mask")
    variants = [Variant(f"prune-{i}", mask) for i, mask in enumerate(masks)]
    logits = fast_sweep(bundle, batches, variants, mode, progress=progress)
    base = predictions(logits[BASELINE])
    pruned_predictions = np.stack([predictions(logits[variant.name]) for variant in variants], 1)  # (N, steps)
    baseline = task_metric(metric, base, labels)
    stats = curve_statistics(base, pruned_predictions, labels, metric,
                             np.array([(variant.keep == 0).any() for variant in variants]))
    total = masks[0].size
    rows = []
    for step, variant in enumerate(variants):
        pruned = int((variant.keep == 0).sum())
        value = task_metric(metric, pruned_predictions[:, step], labels)
        rows.append({"fraction_pruned": pruned / total, "n_pruned": pruned, "metric": value,
                     "delta": value - baseline,
                     **{column: float(stats[column][step]) for column in ("ci_low", "ci_high", "p_mcnemar", "p_holm")}})
    return pd.DataFrame(rows), baseline


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
    record the run (manifest entry importance). ``cluster`` (analysis.cluster.Cluster): runs of batches go to
    its workers (recorded in the manifest)."""
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
    importance = example_importance
    if cluster is not None:
        from analysis.distributed import distributed_importance  # noqa: PLC0415 (it builds on this module)

        importance = functools.partial(distributed_importance, cluster, per_example=True)
    per_example = importance(bundle, batches, progress="importance" if progress else False)  # (N, L, H)
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
    order = least_important(scores, np.ones_like(scores), scores.size)
    return {"normalisation": label, "scores": scores, "least": order[:5], "most": order[::-1][:5],
            "outputs": [str(run.file("importance.csv"))] + [str(p) for p in figures],
            "n_truncated": _truncated(batches)}


def prune_analysis(bundle, data, run, *, step: float = 0.1, max_fraction: float = 1.0, iterative: bool = False,
                   mode: str = "zero", by_layer: bool = True, exponent: float = 2.0, global_minmax: bool = True,
                   max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32, progress: bool = False) -> dict:
    """Prune heads in importance order; write pruning.csv and the curve and record the run (manifest entry
    pruning). Returns the curve and its baseline."""
    check_mode(mode)
    check_pruning_shares(step, max_fraction)
    with run.record("pruning", bundle, data, step=step, max_fraction=max_fraction, iterative=iterative, mode=mode,
                    normalize_layers=by_layer, exponent=exponent, normalize_global=global_minmax,
                    max_length=max_length, model_note=classifier_head_note(bundle, data.task)) as entry:
        result = _prune(bundle, data, run, step=step, max_fraction=max_fraction, iterative=iterative, mode=mode,
                        by_layer=by_layer, exponent=exponent, global_minmax=global_minmax, max_length=max_length,
                        batch_size=batch_size, progress=progress)
        entry.update(outputs=result["outputs"], baseline=result["baseline"], n_truncated=result["n_truncated"])
    return result


def _prune(bundle, data, run, *, step: float, max_fraction: float, iterative: bool, mode: str, by_layer: bool,
           exponent: float, global_minmax: bool, max_length: int, batch_size: int, progress: bool) -> dict:
    metric = metric_name(data.metric or data.task)
    batches, labels = _labelled_batches(bundle, data, max_length, batch_size)
    counts = pruning_counts(bundle.num_layers * bundle.num_heads, step, max_fraction)

    def score(keep: np.ndarray) -> np.ndarray:
        raw = head_importance(bundle, batches, keep=keep, mode=mode)  # pruned heads masked as the curve masks them
        return normalized_importance(raw, by_layer=by_layer, exponent=exponent, global_minmax=global_minmax)

    shape = (bundle.num_layers, bundle.num_heads)
    masks = iterative_pruning_masks(score, counts, shape) if iterative else pruning_masks(score(np.ones(shape)), counts)
    curve, baseline = pruning_curve(bundle, batches, masks, labels, metric, mode=mode,
                                    progress="pruning" if progress else False)
    run.write_table("pruning", curve)
    label = f"{'iterative' if iterative else 'one-shot'}, {mode} masking"
    fig = pruning_figure(curve, metric=metric, baseline=baseline, task=data.task, model=bundle.name, label=label)
    figures = run.write_figure("pruning", fig)
    close(fig)
    return {"curve": curve, "baseline": baseline, "metric_name": metric, "label": label,
            "outputs": [str(run.file("pruning.csv"))] + [str(p) for p in figures], "n_truncated": _truncated(batches)}
