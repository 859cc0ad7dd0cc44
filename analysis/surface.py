"""Clark et al. (2019) surface statistics: what each head attends to, how broadly, and a label per head.

Per head, averaged first over an example's query rows and then over examples (each example weighs the
same, as in Clark's notebook):

- ``prev`` / ``next`` / ``self``: attention to the previous / next / same token, over the rows that have
  such a token (Clark divides by all n rows; the first row has no previous token, the last no next one).
- ``cls`` / ``sep`` / ``period`` / ``comma``: attention mass on those tokens (matched by id: <s> and every </s> for
  RoBERTa/MPNet-style tokenizers, both [SEP]s of a pair), over all real rows, [CLS] and [SEP] rows included as in
  Clark's notebook; ``cls`` and ``sep`` over the examples that have such a token (NaN for a tokenizer with none).
- ``sep_sep``: attention from [SEP] rows to [SEP] keys (examples with a [SEP] only).
- ``entropy``: mean row entropy in nats; ``cls_entropy``: entropy of the [CLS] row (examples with a [CLS] only).
  The uniform-attention entropy log(n), n an example's real tokens, averaged over examples, is the reference both
  are compared with.

Head labels follow Clark's thresholds and precedence (a later rule overrides an earlier one): next, prev
(> 0.5), broad (entropy > 3.8 nats), [CLS], [SEP], '.'+',' (> 0.6); ``other`` when no rule fires. Each label
comes with the statistic that decided it, that statistic's bootstrap 95% interval over the examples, and
``certain``: whether every value inside the intervals of the rules' statistics gives the same label (the
deciding statistic's interval lies above its threshold, and no later rule's interval reaches its own).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from analysis.data import TaskData
from analysis.errors import AttnpatError
from analysis.figures import close
from analysis.rundir import RunDir, long_table
from analysis.stats import (
    HeadMeans,
    attention_on,
    attention_to,
    key_selector,
    masked_mean_over_queries,
    next_token_selector,
    previous_token_selector,
    row_entropy,
    same_token_selector,
    uniform_entropy,
)
from analysis.stream import (
    DEFAULT_MAX_LENGTH,
    MapBatch,
    check_has_text,
    encode_examples,
    stream_maps,
    token_roles,
)
from analysis.uncertainty import EXAMPLE_INTERVAL

SURFACE_METRICS = ("prev", "next", "self", "cls", "sep", "period", "comma", "sep_sep", "entropy", "cls_entropy")
# In Clark's precedence order: a later label overrides an earlier one.
HEAD_LABELS = ("next", "prev", "broad", "cls", "sep", "punct")
OTHER_LABEL = "other"
LABEL_NAMES = {"next": "attend to next", "prev": "attend to prev.", "broad": "attend broadly",
               "cls": "attend to [CLS]", "sep": "attend to [SEP]", "punct": "attend to . and ,", "other": "other"}
# The statistic each rule compares with its threshold ("punct": attention to '.' plus ',').
LABEL_STATISTICS = {"next": "next", "prev": "prev", "broad": "entropy", "cls": "cls", "sep": "sep", "punct": "punct"}
LABEL_COLOURS = {"next": "#e74c3c", "prev": "#3498db", "broad": "#f39c12", "cls": "#9b59b6", "sep": "#59d98e",
                 "punct": "#159d82", "other": "#95a5a6"}


@dataclass(frozen=True)
class LabelThresholds:
    """Clark's thresholds: entropy (nats) for 'broad', attention share for positions and special tokens."""

    broad: float = 3.8
    position: float = 0.5
    special: float = 0.6


# ---------------------------------------------------------------- pure statistics

def surface_batch(attn: torch.Tensor, roles: dict[str, torch.Tensor],
                  lengths: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Per-example surface statistics of one batch.

    attn: (B, L, H, T, T) with zero padding rows; roles: token_roles() masks (B, T); lengths: (B,).
    Returns {metric: ((B, L, H) values, (B,) bool examples that have the feature, or None for all)}.
    """
    width = attn.shape[-1]
    real, cls, sep = roles["real"], roles["cls"], roles["sep"]
    has_sep, has_cls = sep.any(1), cls.any(1)
    entropies = row_entropy(attn)  # (B, L, H, T), computed once for both entropy statistics
    return {
        "prev": (attention_on(attn, previous_token_selector(lengths, width)), lengths > 1),
        "next": (attention_on(attn, next_token_selector(lengths, width)), lengths > 1),
        "self": (attention_on(attn, same_token_selector(lengths, width)), None),
        "cls": (attention_to(attn, cls, real), has_cls),
        "sep": (attention_to(attn, sep, real), has_sep),
        "period": (attention_to(attn, roles["period"], real), None),
        "comma": (attention_to(attn, roles["comma"], real), None),
        "sep_sep": (attention_on(attn, key_selector(sep, sep)), has_sep),
        "entropy": (masked_mean_over_queries(entropies, real), None),
        "cls_entropy": (masked_mean_over_queries(entropies, cls), has_cls),
    }


def rule_thresholds(thresholds: LabelThresholds) -> dict[str, float]:
    """{label: the threshold its statistic (LABEL_STATISTICS) must exceed}."""
    return {"next": thresholds.position, "prev": thresholds.position, "broad": thresholds.broad,
            "cls": thresholds.special, "sep": thresholds.special, "punct": thresholds.special}


def _rule_statistic(values: dict[str, np.ndarray], label: str) -> np.ndarray:
    """(L, H) the statistic of one rule; punct from period and comma when no "punct" table is given."""
    if label == "punct" and "punct" not in values:
        return values["period"] + values["comma"]
    return values[LABEL_STATISTICS[label]]


def head_labels(values: dict[str, np.ndarray], thresholds: LabelThresholds = LabelThresholds()) -> np.ndarray:
    """(L, H) array of label strings from surface tables ``values[metric]: (L, H)`` (Clark's precedence)."""
    limits = rule_thresholds(thresholds)
    labels = np.full(values["entropy"].shape, OTHER_LABEL, dtype=object)
    for name in HEAD_LABELS:
        labels[np.nan_to_num(_rule_statistic(values, name) > limits[name], nan=False).astype(bool)] = name
    return labels


def label_evidence(values: dict[str, np.ndarray], intervals: dict[str, np.ndarray],
                   thresholds: LabelThresholds = LabelThresholds()) -> pd.DataFrame:
    """Each head's label with the statistic that decided it and whether its intervals settle it.

    values: {metric: (L, H)} and intervals: {metric: (L, H, 2)}, both with a "punct" entry (period + comma).
    Returns one row per head: layer, head, label, statistic, value, ci_low, ci_high, threshold (empty statistic
    and NaN for "other"), certain: the label is the same wherever each rule's statistic lies in its interval (a
    NaN bound, e.g. from fewer than 2 examples, is never certain; a statistic measured on no example never fires).
    """
    labels = head_labels(values, thresholds)
    limits = rule_thresholds(thresholds)
    shape = labels.shape
    fires_surely, may_fire = {}, {}
    for name in HEAD_LABELS:
        value, bounds = _rule_statistic(values, name), intervals[LABEL_STATISTICS[name]]
        fires_surely[name] = bounds[..., 0] > limits[name]
        may_fire[name] = np.where(np.isnan(value), False, ~(bounds[..., 1] <= limits[name]))
    statistic = np.full(shape, "", dtype=object)
    value, low, high, threshold = (np.full(shape, np.nan) for _ in range(4))
    certain = np.ones(shape, dtype=bool)
    for index, name in enumerate((*HEAD_LABELS, OTHER_LABEL)):
        mine = labels == name
        # a later rule that may fire could override this label; any rule that may fire undoes "other"
        for later in HEAD_LABELS if name == OTHER_LABEL else HEAD_LABELS[index + 1:]:
            certain &= ~(mine & may_fire[later])
        if name == OTHER_LABEL:
            continue
        certain &= ~mine | fires_surely[name]
        statistic[mine] = LABEL_STATISTICS[name]
        value[mine] = _rule_statistic(values, name)[mine]
        bounds = intervals[LABEL_STATISTICS[name]]
        low[mine], high[mine] = bounds[..., 0][mine], bounds[..., 1][mine]
        threshold[mine] = limits[name]
    layers, heads = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    return pd.DataFrame({"layer": layers.ravel(), "head": heads.ravel(), "label": labels.ravel(),
                         "statistic": statistic.ravel(), "value": value.ravel(), "ci_low": low.ravel(),
                         "ci_high": high.ravel(), "threshold": threshold.ravel(), "certain": certain.ravel()})


def measured_label_evidence(values: dict[str, np.ndarray], intervals: dict[str, np.ndarray], n_examples: int,
                            thresholds: LabelThresholds = LabelThresholds()) -> pd.DataFrame:
    """:func:`label_evidence` over ``n_examples`` examples; with fewer than 2 a bootstrap measures nothing (one
    example resampled is that example), so the bounds are NaN and no label is certain."""
    values = {**values, "punct": values["period"] + values["comma"]} if "punct" not in values else values
    if n_examples < 2:
        intervals = {name: np.full_like(bounds, np.nan) for name, bounds in intervals.items()}
    return label_evidence(values, intervals, thresholds)


def label_counts(evidence: pd.DataFrame) -> dict[str, dict[str, int]]:
    """{label: {"heads": n, "certain": n}} in precedence order, from a :func:`label_evidence` table."""
    return {label: {"heads": int((evidence.label == label).sum()),
                    "certain": int((evidence.certain & (evidence.label == label)).sum())}
            for label in (*HEAD_LABELS, OTHER_LABEL)}


class SurfaceAccumulator:
    """Streams map batches into per-head surface statistics (also used by the clustering pass)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.means = HeadMeans()
        self.uniform_sum = 0.0
        self.n_examples = 0

    def batch_statistics(self, map_batch: MapBatch) -> dict:
        """What one batch of B examples adds (:meth:`add_statistics`): {"means": {statistic: ((B, L, H) values,
        (B,) bool examples counted or None for all)}, "uniform_sum": float, "n_examples": B}."""
        batch = map_batch.batch
        roles = token_roles(self.tokenizer, batch.input_ids, batch.attention_mask)
        means = surface_batch(map_batch.attentions, roles, batch.lengths)
        # the punct label's statistic, kept per example so that its interval is that of the sum
        means["punct"] = (means["period"][0] + means["comma"][0], None)
        return {"means": means, "uniform_sum": float(uniform_entropy(batch.lengths).sum()),
                "n_examples": len(batch.items)}

    def add_statistics(self, statistics: dict) -> None:
        """Add one batch's :meth:`batch_statistics` (computed now, or read back by :func:`statistics_from_record`)."""
        for name, (values, include) in statistics["means"].items():
            self.means.add(name, values, include)
        self.uniform_sum += statistics["uniform_sum"]
        self.n_examples += statistics["n_examples"]

    def add(self, map_batch: MapBatch) -> None:
        self.add_statistics(self.batch_statistics(map_batch))

    def result(self) -> tuple[dict[str, np.ndarray], float]:
        """({metric: (L, H)}, mean uniform-attention entropy in nats)."""
        values = self.means.result()
        return {name: values[name] for name in SURFACE_METRICS}, self.uniform_sum / max(self.n_examples, 1)

    def intervals(self) -> dict[str, np.ndarray]:
        """{metric: (L, H, 2)} bootstrap 95% interval of each head's mean over the examples (a metric counted on
        some examples only, e.g. sep_sep, over those)."""
        return self.means.intervals()

    def label_table(self, thresholds: LabelThresholds = LabelThresholds()) -> pd.DataFrame:
        """:func:`measured_label_evidence` of the heads over the examples streamed so far."""
        return measured_label_evidence(self.means.result(), self.intervals(), self.n_examples, thresholds)

    def layer_table(self) -> pd.DataFrame:
        """One row per layer: layer, and for every metric its mean over the layer's heads with the bootstrap 95%
        interval over the examples (<metric>_ci_low, <metric>_ci_high)."""
        return self.means.layer_table(SURFACE_METRICS)


BATCH_STATISTICS = (*SURFACE_METRICS, "punct")  # the statistics of SurfaceAccumulator.batch_statistics
STORED_DTYPES = ("float32", "float64")


def statistics_record(statistics: dict) -> dict:
    """:meth:`SurfaceAccumulator.batch_statistics` as JSON values that :func:`statistics_from_record` reads back
    bit-equal (float32 and float64 both survive JSON's decimal text)."""
    means = {name: {"values": values.numpy().tolist(), "dtype": str(values.numpy().dtype),
                    "include": None if include is None else include.tolist()}
             for name, (values, include) in statistics["means"].items()}
    return {"means": means, "uniform_sum": statistics["uniform_sum"], "n_examples": statistics["n_examples"]}


def statistics_from_record(record, n_examples: int, layers: int, heads: int) -> dict | None:
    """A :func:`statistics_record` of ``n_examples`` examples of a ``layers`` x ``heads`` model back as
    :meth:`SurfaceAccumulator.batch_statistics`; None when it is missing or damaged (the batch is streamed
    again)."""
    try:
        if set(record["means"]) != set(BATCH_STATISTICS) or record["n_examples"] != n_examples:
            return None
        means = {}
        for name, kept in record["means"].items():
            if kept["dtype"] not in STORED_DTYPES:
                return None
            values = torch.from_numpy(np.asarray(kept["values"], dtype=kept["dtype"]))
            include = None if kept["include"] is None else torch.tensor(kept["include"], dtype=torch.bool)
            if values.shape != (n_examples, layers, heads) or (include is not None and include.shape != (n_examples,)):
                return None
            means[name] = (values, include)
        return {"means": means, "uniform_sum": float(record["uniform_sum"]), "n_examples": n_examples}
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- the pass over a data set

def compute_surface(bundle, data: TaskData, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                    progress: bool = True) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], pd.DataFrame,
                                                    float, int]:
    """Surface statistics over ``data``: ({metric: (L, H)}, {metric: (L, H, 2)} their bootstrap 95% intervals over
    the examples, the per-layer table of :meth:`SurfaceAccumulator.layer_table`, uniform entropy, number of
    truncated examples). No example is an error before any work (a mean over none is no statistic)."""
    if not data.examples:
        raise AttnpatError(f"no examples to compute surface statistics on ({data.task} {data.split} is empty)")
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)
    check_has_text(bundle.tokenizer, encoded)
    accumulator = SurfaceAccumulator(bundle.tokenizer)
    for map_batch in stream_maps(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                 progress="surface" if progress else False, encoded=encoded):
        accumulator.add(map_batch)
    values, uniform = accumulator.result()
    return (values, accumulator.intervals(), accumulator.layer_table(), uniform,
            sum(item.truncated for item in encoded))


def surface_statistics(bundle, data: TaskData, run: RunDir, max_length: int = DEFAULT_MAX_LENGTH,
                       batch_size: int = 32, progress: bool = True,
                       thresholds: LabelThresholds = LabelThresholds()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Compute the surface statistics and write surface.csv, head_labels.csv, surface.png/svg and
    surface_entropy.png/svg into ``run``. Returns the long surface table (layer, head, metric, value, and each
    head's bootstrap 95% interval over the examples: ci_low, ci_high) and the per-layer table
    (:meth:`SurfaceAccumulator.layer_table`: each layer's mean over its heads with its interval)."""
    with run.record("surface", bundle, data, max_length=max_length, thresholds=asdict(thresholds)) as entry:
        values, intervals, per_layer, uniform, n_truncated = compute_surface(
            bundle, data, max_length=max_length, batch_size=batch_size, progress=progress)
        evidence = measured_label_evidence(values, intervals, len(data.examples), thresholds)
        table = long_table(values, intervals=intervals)
        run.write_table("surface", table)
        run.write_table("head_labels", evidence)
        for name, fig in (("surface", surface_figure(values)), ("surface_entropy", entropy_figure(values, uniform))):
            run.write_figure(name, fig)
            close(fig)
        entry.update(n_truncated=n_truncated, uniform_entropy=uniform, interval=EXAMPLE_INTERVAL,
                     label_counts={label: count["heads"] for label, count in label_counts(evidence).items()},
                     certain_label_counts={label: count["certain"] for label, count in label_counts(evidence).items()})
    return table, per_layer


# ---------------------------------------------------------------- figures

def _layer_scatter(ax, array: np.ndarray, title: str, colour: str = "#3498db") -> None:
    """One panel of Clark's Figure 2: every head as a dot at its (1-indexed) layer, the layer mean as a line."""
    layers, heads = array.shape
    jitter = np.linspace(-0.15, 0.15, heads)
    for layer in range(layers):
        ax.plot(layer + 1 + jitter, array[layer], "o", color=colour, markersize=3, alpha=0.6)
    measured = np.isfinite(array)
    # a statistic measured on no example (no [CLS] in the tokenizer) is NaN: no line, and no "Mean of empty slice"
    layer_means = np.where(measured, array, 0.0).sum(1) / np.where(measured.any(1), measured.sum(1), np.nan)
    ax.plot(np.arange(1, layers + 1), layer_means, color="k", lw=1.2)
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(1, layers + 1))
    ax.set_xlabel("layer (1-indexed)", fontsize=8)


def surface_figure(values: dict[str, np.ndarray]):
    """Clark's Figure 2 layout: average attention per head to token types and positions, by layer."""
    panels = [("cls", "[CLS]"), ("sep", "[SEP]"), ("punct", ". or ,"), ("sep_sep", "[SEP] -> [SEP]"),
              ("prev", "previous token"), ("next", "next token"), ("self", "same token")]
    fig, axes = plt.subplots(2, 4, figsize=(13, 5.5), sharey=True)
    for ax, (name, title) in zip(axes.ravel(), panels):
        array = values["period"] + values["comma"] if name == "punct" else values[name]
        _layer_scatter(ax, array, title)
        ax.set_ylim(-0.02, 1.02)
    axes.ravel()[-1].axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("avg. attention")
    fig.suptitle("Average attention per head (dots) and per layer (line)")
    fig.tight_layout()
    return fig


def entropy_figure(values: dict[str, np.ndarray], uniform: float):
    """Clark's entropy plot: mean row entropy and [CLS]-row entropy per head, with uniform attention's."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, (name, title) in zip(axes, [("entropy", "entropy of attention rows"),
                                        ("cls_entropy", "entropy of the [CLS] row")]):
        _layer_scatter(ax, values[name], title, colour="#f39c12")
        ax.axhline(uniform, color="tab:red", ls="--", lw=1, label=f"uniform attention ({uniform:.2f})")
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("entropy (nats)")
    fig.tight_layout()
    return fig
