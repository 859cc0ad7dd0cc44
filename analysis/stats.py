"""Per-head attention statistics, written as 0/1 selector masks over maps (Clark et al.'s style).

All functions are pure over tensors: ``attn (B, L, H, T, T)`` rows summing to 1 on real query
positions (padding rows zero, as the map stream yields them), masks ``(B, T)`` bool.
Per-example results are ``(B, L, H)``; :class:`HeadMeans` averages them over a stream.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from analysis.uncertainty import DEFAULT_BOOTSTRAP, bootstrap_weighted_mean_interval

LOW_PRECISION = (torch.float16, torch.bfloat16)


def at_least_float32(maps: torch.Tensor) -> torch.Tensor:
    """``maps`` in float32 where they are float16 or bfloat16 (map shards are stored as float16), else as they are:
    sums over a row in half precision lose digits, and float16 flushes the 1e-30 floor of a logarithm to 0."""
    return maps.float() if maps.dtype in LOW_PRECISION else maps


def attention_to(attn: torch.Tensor, key_mask: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real query rows of the attention mass on the selected keys.

    attn: (B, L, H, T, T), float16/bfloat16 computed in float32; key_mask, query_mask: (B, T) bool.
    Returns (B, L, H).
    """
    attn = at_least_float32(attn)
    mass = (attn * key_mask[:, None, None, None, :].to(attn.dtype)).sum(-1)  # (B, L, H, T)
    return masked_mean_over_queries(mass, query_mask)


def masked_mean_over_queries(values: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """values: (B, L, H, T) per query row; query_mask: (B, T) bool. Returns (B, L, H) mean over selected rows
    (0 where an example has no selected row)."""
    weights = query_mask[:, None, None, :].to(values.dtype)
    return (values * weights).sum(-1) / weights.sum(-1).clamp(min=1)


def row_entropy(attn: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each attention row. attn: (..., T, T) -> (..., T), float16/bfloat16 computed in float32;
    zero rows give 0."""
    return torch.special.entr(at_least_float32(attn)).sum(-1)  # -a log a, with 0 log 0 = 0


def mean_entropy(attn: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """(B, L, H): mean row entropy over real query rows."""
    return masked_mean_over_queries(row_entropy(attn), query_mask)


def uniform_entropy(lengths: torch.Tensor) -> torch.Tensor:
    """(B,): entropy of uniform attention over each example's n real tokens, log(n)."""
    return torch.log(lengths.to(torch.float64).clamp(min=1))


class HeadMeans:
    """Means of per-example (B, L, H) statistics over a map stream, weighted per example, each with a percentile
    bootstrap interval over the examples.

    Each statistic keeps its per-example values (float32 maps stay float32: 10,000 examples of a 12 x 12 model
    take 6 MB a statistic) and weights batch by batch; means and intervals are computed at the end.

    >>> means = HeadMeans(); means.add("to_cls", per_example)  # per_example: (B, L, H)
    >>> means.result()["to_cls"]  # (L, H) numpy
    >>> means.intervals()["to_cls"]  # (L, H, 2) lower and upper bounds
    """

    def __init__(self):
        self.values: dict[str, list[np.ndarray]] = {}
        self.weights: dict[str, list[np.ndarray]] = {}

    def add(self, name: str, per_example: torch.Tensor, include: torch.Tensor | None = None) -> None:
        """per_example: (B, L, H); include: (B,) bool, examples to count (e.g. those that have the feature)."""
        values = per_example.detach().cpu()
        values = values if values.dtype in (torch.float32, torch.float64) else values.to(torch.float64)
        weights = np.ones(values.shape[0]) if include is None else include.detach().cpu().numpy().astype(np.float64)
        self.values.setdefault(name, []).append(values.numpy())
        self.weights.setdefault(name, []).append(weights)

    def per_example(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """One statistic's (values (E, L, H), weights (E,)), the examples in stream order."""
        return np.concatenate(self.values[name]), np.concatenate(self.weights[name])

    def result(self) -> dict[str, np.ndarray]:
        """{name: (L, H)} weighted means over the examples (NaN where no example counts)."""
        out = {}
        for name in self.values:
            values, weights = self.per_example(name)
            total = weights.sum()
            counted = np.where(weights[:, None, None] > 0, values, 0.0)  # an uncounted example's value is never read
            out[name] = (np.tensordot(weights, counted, 1) / total if total else np.full(values.shape[1:], math.nan))
        return out

    def intervals(self, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                  seed: int = 0) -> dict[str, np.ndarray]:
        """{name: (L, H, 2)} percentile bootstrap interval of each head's mean over the examples: the ratio of
        resampled weighted sums, so a statistic counted only on some examples resamples those alone. Statistics of
        the same examples share the draws."""
        return self._bootstrap(lambda values: values, level=level, n_boot=n_boot, seed=seed)

    def layer_intervals(self, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                        seed: int = 0) -> dict[str, np.ndarray]:
        """{name: (L, 2)} the same interval for each layer's mean over its heads (each example's mean over the
        heads, resampled with the draws :meth:`intervals` makes for the same seed)."""
        return self._bootstrap(lambda values: values.mean(-1), level=level, n_boot=n_boot, seed=seed)

    def model_intervals(self, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                        seed: int = 0) -> dict[str, np.ndarray]:
        """{name: (2,)} the same interval for the mean over every head of the model (each example's mean over its
        layers and heads)."""
        return self._bootstrap(lambda values: values.mean((-2, -1)), level=level, n_boot=n_boot, seed=seed)

    def layer_table(self, names: Sequence[str] | None = None) -> pd.DataFrame:
        """:func:`per_layer_table` of the statistics ``names`` (default: every one), with :meth:`layer_intervals`."""
        values = self.result()
        return per_layer_table({name: values[name] for name in (values if names is None else names)},
                               self.layer_intervals())

    def _bootstrap(self, reduce, **options) -> dict[str, np.ndarray]:
        """Every statistic's interval of reduce(values (E, L, H)), one bootstrap per set of equally many examples."""
        by_count: dict[int, list[str]] = {}
        for name, parts in self.values.items():
            by_count.setdefault(sum(len(part) for part in parts), []).append(name)
        out = {}
        for names in by_count.values():
            examples = [self.per_example(name) for name in names]
            values = np.stack([reduce(values) for values, _ in examples], 1)  # (E, S, ...)
            weights = np.stack([weights for _, weights in examples], 1)  # (E, S)
            out.update(zip(names, bootstrap_weighted_mean_interval(values, weights, **options)))
        return out


def per_layer_table(values: dict[str, np.ndarray], layer_intervals: dict[str, np.ndarray]) -> pd.DataFrame:
    """{name: (L, H)} head means and {name: (L, 2)} layer intervals -> one row per layer: layer, <name>,
    <name>_ci_low, <name>_ci_high (each layer's mean over its heads)."""
    columns = {"layer": np.arange(next(iter(values.values())).shape[0])}
    for name, array in values.items():
        columns.update({name: array.mean(1), f"{name}_ci_low": layer_intervals[name][:, 0],
                        f"{name}_ci_high": layer_intervals[name][:, 1]})
    return pd.DataFrame(columns)


# ---------------------------------------------------------------- selector masks (Clark et al.)
#
# A selector is a (B, T, T) bool mask over (query, key) pairs; ``attention_on`` averages, over the selected
# query rows, the attention mass a head puts on the selected keys of each row.

def offset_selector(lengths: torch.Tensor, width: int, offset: int) -> torch.Tensor:
    """(B, T, T) bool: query i -> key i + offset, both inside the example's real length.

    lengths: (B,) real lengths; width: T. offset -1 = previous token, +1 = next token, 0 = the token itself.
    """
    positions = torch.arange(width)
    real = positions[None, :] < lengths[:, None]  # (B, T)
    pairs = (positions[None, :] - positions[:, None]) == offset  # (T, T): key - query == offset
    return pairs[None] & real[:, :, None] & real[:, None, :]


def previous_token_selector(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T, T): each query's previous token."""
    return offset_selector(lengths, width, -1)


def next_token_selector(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T, T): each query's next token."""
    return offset_selector(lengths, width, 1)


def same_token_selector(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, T, T): each query itself (the diagonal)."""
    return offset_selector(lengths, width, 0)


def key_selector(key_mask: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, T): the selected keys for every selected query. key_mask, query_mask: (B, T) bool.

    key_selector(sep, sep) is Clark's [SEP]->[SEP] selector.
    """
    return query_mask[:, :, None] & key_mask[:, None, :]


def attention_on(attn: torch.Tensor, selector: torch.Tensor, query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over query rows of the attention mass on the keys the selector picks in that row.

    attn: (B, L, H, T, T), float16/bfloat16 computed in float32; selector: (B, T, T) bool; query_mask: (B, T) bool
    rows to average over (default: the rows where the selector picks at least one key). Returns (B, L, H); 0 for
    an example with no such row.
    """
    attn = at_least_float32(attn)
    mass = torch.einsum("blhqk,bqk->blhq", attn, selector.to(attn.dtype))
    if query_mask is None:
        query_mask = selector.any(-1)
    return masked_mean_over_queries(mass, query_mask)



# ---------------------------------------------------------------- the profile of single maps

PROFILE_OFFSETS = (-2, -1, 0, 1, 2)
PROFILE_NAMES = (*(f"band{offset:+d}" for offset in PROFILE_OFFSETS), "top1_column_all", "top2_columns_all",
                 "first_column", "last_column", "broadness", "peakedness", "log_length",
                 # texture: what separates a stripe (vertical) from speckle (heterogeneous) and an even grey (block)
                 "rows_on_top_column", "top3_columns_all", "row_peak_keys", "excess_over_uniform", "speckle",
                 "row_peak_spread",
                 # columns apart from the band: a stripe next to a diagonal (vertical+diagonal vs diagonal)
                 "top1_column_off_band", "top2_columns_off_band")


def map_profile(maps: torch.Tensor) -> torch.Tensor:
    """maps: (N, n, n) of one length, rows summing to 1 -> (N, len(PROFILE_NAMES)) scalars in [0, 1].

    Per map, in PROFILE_NAMES order: mean mass on each diagonal offset -2..+2 (band-1 = previous token) over all
    n rows, a row without that neighbour counting 0 (Clark's denominators; unlike analysis.surface's prev/next,
    which average over the rows that have one), so all mass on the previous token gives band-1 = (n - 1) / n;
    mean mass of the top-1 and top-2 key columns (diagonal included); of the first column ([CLS]) and the
    last ([SEP]); broadness = mean row entropy / log n; peakedness = mean row maximum; log n / log 512.
    Texture: the share of rows whose heaviest key is the heaviest column overall; mass of the top-3 columns;
    distinct row-peak keys / n; the distance from uniform attention (mean over rows of sum (a - 1/n)+);
    the share of cells above 4x uniform; the spread (std) of the row maxima. Last, the top-1 and top-2
    column masses with the band (offsets -1..+1) left out.
    Shared by the rule pre-annotator and the pattern CNN, so both see the same numbers.
    """
    return map_profile_batch_last(maps.permute(1, 2, 0).contiguous()).T


def named_profile(attn: torch.Tensor) -> dict[str, float]:
    """:func:`map_profile` of one map (n, n), as {PROFILE_NAMES name: value} (computed in attn's dtype, float16 and
    bfloat16 in float32)."""
    return dict(zip(PROFILE_NAMES, map_profile(attn[None])[0].tolist()))


def map_profile_batch_last(maps: torch.Tensor) -> torch.Tensor:
    """:func:`map_profile` of maps stored batch-last: (n, n, N) query x key x map -> (len(PROFILE_NAMES), N).

    Why batch-last: every reduction then runs over an outer axis with N contiguous values inside, which
    the CPU vectorises; over the last axis of (N, n, n) maps (n of 10-60) the same reductions run 5-10x
    slower. Element-wise passes reuse one scratch buffer and use float arithmetic (sign) instead of
    comparisons, which write slow bool tensors. float16/bfloat16 maps are computed in float32 (in float16 the
    entropy's 1e-30 floor is 0, and 0 log 0 made broadness NaN).
    """
    maps = at_least_float32(maps)
    n, count = int(maps.shape[0]), int(maps.shape[-1])
    bands = [maps.diagonal(offset, 0, 1).sum(1) / n for offset in PROFILE_OFFSETS]
    columns = maps.mean(0)  # (n keys, N): mean attention each key receives
    top = columns.T.topk(min(3, n), dim=-1).values  # (N, 3)
    work = torch.empty_like(maps)
    entropy = -torch.clamp_min(maps, 1e-30, out=work).log_().mul_(maps).sum((0, 1)) / n  # mean row entropy
    broadness = entropy / math.log(n) if n > 1 else torch.zeros_like(entropy)
    excess = (torch.clamp_min(maps, 1.0 / n, out=work).sum((0, 1)) - n) / n  # sum (a - 1/n)+ = sum max(a, 1/n) - 1
    speckle = torch.sub(maps, 4.0 / n, out=work).sign_().clamp_min_(0).sum((0, 1)) / (n * n)
    row_peaks = maps.amax(1)  # (n queries, N)
    is_peak = torch.sub(maps, row_peaks[:, None], out=work).sign_().add_(1)  # 1 on a row's maximum, else 0
    ranked = is_peak.mul_(torch.arange(n, 0, -1, dtype=maps.dtype)[:, None])  # n - key: ties go to the first
    row_peak_keys = n - ranked.amax(1)  # (n queries, N): each row's argmax
    rows_on_top_column = (row_peak_keys == columns.argmax(0).to(maps.dtype)).to(maps.dtype).mean(0)
    distinct_peaks = torch.zeros((n, count), dtype=maps.dtype).scatter_(0, row_peak_keys.long(), 1.0).sum(0) / n
    peakedness = row_peaks.mean(0)
    spread = (row_peaks.square().mean(0) - peakedness.square()).clamp_min(0).sqrt()
    # column means without the band cells: subtract each column's cells at offsets -1, 0, +1
    off_band = columns.T - maps.diagonal(0, 0, 1) / n
    off_band[:, 1:] -= maps.diagonal(1, 0, 1) / n   # a[j-1, j]
    off_band[:, :-1] -= maps.diagonal(-1, 0, 1) / n  # a[j+1, j]
    top_off_band = off_band.clamp_min(0).topk(min(2, n), dim=-1).values
    return torch.stack([*bands, top[:, 0], top[:, :2].sum(-1), columns[0], columns[-1], broadness, peakedness,
                        torch.full_like(entropy, math.log(n) / math.log(512)), rows_on_top_column, top.sum(-1),
                        distinct_peaks, excess, speckle, spread, top_off_band[:, 0], top_off_band.sum(-1)])
