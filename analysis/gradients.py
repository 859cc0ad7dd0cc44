"""Clark et al. (2019) Figure 5: how much the loss depends on attention to [SEP], '.'/',' and other tokens.

For each layer, the mean magnitude |dLoss/d alpha| of the attention weights alpha whose key is a [SEP], a
period or comma ("punct"), or any other real token (including [CLS]), over every head, real query row
and example. The loss is the masked-language-model loss (BERT's pre-training objective) when the model
has an MLM head; otherwise the task loss of a fine-tuned classifier. Each example's loss is its own (mean
over its masked tokens), summed over the batch, so the gradients do not depend on the batch size.

MLM masking: 15% of each example's real non-special tokens (at least one; [UNK] counts as text) are replaced by
[MASK], drawn from the example's own generator (seeded by the seed and the example's position in the data, so the
same tokens are masked whatever the batch size); BERT's 80/10/10 mask/random/keep split is not used (every chosen
token is [MASK]). Key types are those of the masked input the model sees: a masked '.' counts as "other". An example
of special tokens only (text such as "[SEP]") has no token to mask and is refused before any work.
With eager attention the returned attention tensors are the ones used in the forward pass (dropout is
the identity in eval mode), so their gradients are exact; tests check this against a perturbation.
"""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from analysis.data import TaskData
from analysis.errors import AttnpatError, check_choice
from analysis.figures import close
from analysis.models import check_head_labels, load_config, load_model, resolve_model
from analysis.progress import progress_bar
from analysis.rundir import RunDir
from analysis.stream import (
    DEFAULT_MAX_LENGTH,
    TokenBatch,
    check_has_text,
    encode_examples,
    forward_attentions,
    iter_batches,
    text_tokens,
    token_roles,
)
from analysis.uncertainty import EXAMPLE_INTERVAL, bootstrap_weighted_mean_interval

GRAD_TARGETS = ("sep", "punct", "other")
OBJECTIVES = {"mlm": "masked-language-model loss", "task": "task loss of the fine-tuned classifier"}


# ---------------------------------------------------------------- model and objective

def load_gradient_model(name: str, device=None):
    """(bundle, objective): an MLM model when the checkpoint has an MLM head ("mlm"), else a fine-tuned
    sequence classifier ("task"); anything else raises AttnpatError saying the analysis is unavailable."""
    try:
        return load_model(name, kind="mlm", device=device), "mlm"
    except AttnpatError as mlm_error:
        config = load_config(resolve_model(name))
        architectures = getattr(config, "architectures", None) or []
        if any(arch.endswith("ForSequenceClassification") for arch in architectures):
            return load_model(name, kind="classifier", device=device), "task"
        raise AttnpatError(
            f"gradient importance is unavailable for '{name}': it has no masked-language-model head and is not a "
            "fine-tuned sequence classifier; use a model with an MLM head or a fine-tuned classifier from the "
            "model store"
        ) from mlm_error


def example_generator(seed: int, index: int) -> torch.Generator:
    """The random generator of the example at position ``index`` of the data: the same in any batch."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))


def check_mask_probability(probability: float) -> None:
    """Refuse a share of tokens to mask outside (0, 1] (NaN included), before any work."""
    if not 0 < probability <= 1:
        raise AttnpatError("--mask-probability is the share of tokens masked, above 0 and at most 1; "
                           f"got {probability}")


def mask_tokens(input_ids: torch.Tensor, maskable: torch.Tensor, mask_id: int, probability: float,
                generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose MLM targets: each maskable token with ``probability``, at least one per example.

    input_ids: (B, T) long; maskable: (B, T) bool (real, non-special); generators: one per row
    (:func:`example_generator`), each drawing over its row up to the last maskable token only, so that the padded
    width does not change the draw. Returns (masked input_ids (B, T), labels (B, T) with -100 where not masked).
    """
    check_mask_probability(probability)
    if len(generators) != input_ids.shape[0]:
        raise ValueError(f"{len(generators)} generators for {input_ids.shape[0]} rows")
    chosen = torch.zeros_like(maskable)
    for row, generator in enumerate(generators):
        candidates = torch.nonzero(maskable[row]).flatten()
        if len(candidates) == 0:
            continue
        width = int(candidates[-1]) + 1
        chosen[row, :width] = (torch.rand(width, generator=generator) < probability) & maskable[row, :width]
        if not chosen[row].any():
            chosen[row, candidates[torch.randint(len(candidates), (1,), generator=generator)]] = True
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    return torch.where(chosen, torch.full_like(input_ids, mask_id), input_ids), labels


def per_example_mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits: (B, T, V); labels: (B, T) with -100 = ignore. Returns (B,) mean cross-entropy over masked tokens."""
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    counts = (labels != -100).sum(1).clamp(min=1)
    return losses.sum(1) / counts


def per_example_task_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits: (B, C); labels: (B,). Cross-entropy per example, or squared error for regression (C == 1)."""
    if logits.shape[-1] == 1:
        return (logits.squeeze(-1) - labels.to(logits.dtype)) ** 2
    return torch.nn.functional.cross_entropy(logits, labels.long(), reduction="none")


# ---------------------------------------------------------------- gradients

def attention_gradients(model: torch.nn.Module, batch: TokenBatch, objective: str, device: torch.device,
                        mlm_labels: torch.Tensor | None = None) -> torch.Tensor:
    """d(sum of per-example losses)/d(attention weights): (B, L, H, T, T) on the CPU.

    For "mlm", ``batch.input_ids`` must already be masked and ``mlm_labels`` (B, T) given; for "task",
    ``batch.labels`` must be set.
    """
    with torch.enable_grad():
        _, outputs = forward_attentions(model, batch, device)
        if objective == "mlm":
            losses = per_example_mlm_loss(outputs.logits, mlm_labels.to(device))
        else:
            if batch.labels is None:
                raise AttnpatError("the task loss needs labelled examples; this data has examples without labels")
            losses = per_example_task_loss(outputs.logits, batch.labels.to(device))
        grads = torch.autograd.grad(losses.sum(), outputs.attentions)
    return torch.stack(grads, dim=1).float().cpu()


def gradient_by_key_type(grads: torch.Tensor, key_masks: dict[str, torch.Tensor],
                         query_mask: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each example's sum of |gradient| per layer over the attention weights of each key type, and how many weights.

    grads: (B, L, H, T, T); key_masks: {target: (B, T) bool}; query_mask: (B, T) bool real rows.
    Returns {target: ((B, L) sum, (B,) count per layer)}; the count covers all heads of a layer.
    """
    magnitude = grads.abs()
    heads = grads.shape[2]
    out = {}
    for target, key_mask in key_masks.items():
        pairs = (query_mask[:, :, None] & key_mask[:, None, :]).to(magnitude.dtype)  # (B, T, T)
        total = torch.einsum("blhqk,bqk->bl", magnitude, pairs)
        out[target] = (total, pairs.sum((1, 2)) * heads)
    return out


def key_types(roles: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clark's three key types from token_roles masks: [SEP], '.' or ',', and every other real token."""
    punct = roles["period"] | roles["comma"]
    return {"sep": roles["sep"], "punct": punct, "other": roles["real"] & ~roles["sep"] & ~punct}


def compute_grad_importance(bundle, data: TaskData, objective: str, *, max_length: int = DEFAULT_MAX_LENGTH,
                            batch_size: int = 8, progress: bool = True, mask_probability: float = 0.15,
                            seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """({target: (L,) mean |dLoss/d alpha|}, {target: (L, 2) its bootstrap 95% interval over the examples},
    number of truncated examples)."""
    check_choice(objective, OBJECTIVES, "objective")
    check_mask_probability(mask_probability)
    tokenizer = bundle.tokenizer
    if objective == "mlm" and tokenizer.mask_token_id is None:
        raise AttnpatError(f"model '{bundle.name}' has no [MASK] token, so the MLM loss is unavailable")
    encoded = encode_examples(tokenizer, data.examples, max_length)
    check_has_text(tokenizer, encoded)  # before any work: an example of special tokens only has nothing to mask
    sums: dict[str, list[np.ndarray]] = {target: [] for target in GRAD_TARGETS}  # per batch: (B, L)
    counts: dict[str, list[np.ndarray]] = {target: [] for target in GRAD_TARGETS}  # per batch: (B,)
    bar = progress_bar(len(encoded), progress, "gradients")
    bundle.model.eval()
    for batch in iter_batches(bundle, data.examples, max_length=max_length, batch_size=batch_size, encoded=encoded):
        mlm_labels = None
        if objective == "mlm":
            maskable = batch.attention_mask.bool() & text_tokens(tokenizer, batch.input_ids)
            masked_ids, mlm_labels = mask_tokens(batch.input_ids, maskable, tokenizer.mask_token_id,
                                                 mask_probability, [example_generator(seed, i) for i in batch.indices])
            batch = replace(batch, input_ids=masked_ids)
        # the key types of the tokens the model sees: a masked '.' is a [MASK], an "other" key
        roles = token_roles(tokenizer, batch.input_ids, batch.attention_mask)
        grads = attention_gradients(bundle.model, batch, objective, bundle.device, mlm_labels)
        for target, (total, count) in gradient_by_key_type(grads, key_types(roles), roles["real"]).items():
            sums[target].append(total.double().numpy())
            counts[target].append(count.double().numpy())
        if bar is not None:
            bar.update(len(batch.items))
    if bar is not None:
        bar.close()
    values, intervals = key_type_means({t: np.concatenate(sums[t]) for t in GRAD_TARGETS},
                                       {t: np.concatenate(counts[t]) for t in GRAD_TARGETS})
    return values, intervals, sum(item.truncated for item in encoded)


def key_type_means(sums: dict[str, np.ndarray], counts: dict[str, np.ndarray]
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-example sums {target: (E, L)} of |gradient| over counts {target: (E,)} weights -> ({target: (L,)} the
    ratio of the sums over all examples (NaN without any weight), {target: (L, 2)} its percentile bootstrap 95%
    interval over the examples: the ratio of the resampled sums, all targets on the same draws)."""
    targets = list(sums)
    totals = np.stack([sums[t] for t in targets], 1)  # (E, K, L)
    weights = np.stack([counts[t] for t in targets], 1)  # (E, K)
    count = weights.sum(0)  # (K,)
    with np.errstate(invalid="ignore", divide="ignore"):  # a target no example has: NaN
        means = totals.sum(0) / count[:, None]
        per_example = np.where(weights[..., None] > 0, totals / weights[..., None], 0.0)  # sum / count = mean
    bounds = bootstrap_weighted_mean_interval(per_example, weights)  # weighted by count: the ratio of sums
    return dict(zip(targets, means)), dict(zip(targets, bounds))


def grad_importance(bundle, data: TaskData, run: RunDir, objective: str, *, max_length: int = DEFAULT_MAX_LENGTH,
                    batch_size: int = 8, progress: bool = True, mask_probability: float = 0.15, seed: int = 0):
    """Compute and write grad_importance.csv (layer, target, value, ci_low, ci_high: bootstrap 95% interval over the
    examples) and grad_importance.png/svg."""
    check_mask_probability(mask_probability)
    if objective == "task":
        if data.num_labels is None or any(example.label is None for example in data.examples):
            # before any work: the MLM loss is not available, and the default task (wiki) has no labels
            raise AttnpatError(f"'{bundle.name}' has no masked-language-model head, so its gradients are taken on its "
                               f"task loss, which needs labelled examples; {data.task} has examples without labels: "
                               "use the labelled task the model was fine-tuned on (e.g. --task sst2)")
        check_head_labels(bundle.name, data.num_labels, int(bundle.model.config.num_labels), data.label_names,
                          bundle.model.config)
    with run.record("grad_importance", bundle, data, objective=OBJECTIVES[objective], max_length=max_length,
                    mask_probability=mask_probability if objective == "mlm" else None, seed=seed) as entry:
        values, intervals, n_truncated = compute_grad_importance(
            bundle, data, objective, max_length=max_length, batch_size=batch_size, progress=progress,
            mask_probability=mask_probability, seed=seed)
        table = pd.DataFrame([{"layer": layer, "target": target, "value": float(values[target][layer]),
                               "ci_low": float(intervals[target][layer, 0]),
                               "ci_high": float(intervals[target][layer, 1])}
                              for target in GRAD_TARGETS for layer in range(bundle.num_layers)])
        run.write_table("grad_importance", table)
        fig = grad_figure(values, OBJECTIVES[objective], intervals)
        run.write_figure("grad_importance", fig)
        close(fig)
        entry.update(n_truncated=n_truncated, interval=EXAMPLE_INTERVAL)
    return table


def grad_figure(values: dict[str, np.ndarray], objective_name: str, intervals: dict[str, np.ndarray] | None = None):
    """Clark's Figure 5: mean gradient magnitude per layer for each key type; intervals {target: (L, 2)}, when
    given, are drawn as a shaded band around each line."""
    names = {"sep": "[SEP]", "punct": ". or ,", "other": "other"}
    colours = {"sep": "#59d98e", "punct": "#159d82", "other": "#95a5a6"}
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for target in GRAD_TARGETS:
        layers = np.arange(1, len(values[target]) + 1)
        ax.plot(layers, values[target], "o-", color=colours[target], label=names[target])
        if intervals is not None:
            ax.fill_between(layers, intervals[target][:, 0], intervals[target][:, 1], color=colours[target],
                            alpha=0.25, linewidth=0)
    ax.set_xlabel("layer (1-indexed)")
    ax.set_ylabel("avg. |gradient| per attention weight")
    band = "\n(bands: bootstrap 95% intervals over the examples)" if intervals is not None else ""
    ax.set_title(f"Gradient of the {objective_name} w.r.t. attention{band}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
