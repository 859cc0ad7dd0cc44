"""Uncertainty of reported effects: bootstrap intervals and classifier-adjusted class ratios.

Pure numpy functions over small arrays; shapes are in each docstring.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.stats import binom, norm

from analysis.errors import AttnpatError

DEFAULT_BOOTSTRAP = 1000
# A bootstrap interval needs this many resampled units (examples, inputs): every draw of a single one is that one, so
# its interval would be [v, v], which reads as certainty; with fewer the bounds are NaN (a blank cell, no interval)
MIN_RESAMPLED = 2
# How the per-head and per-layer means of HeadMeans (overview, special, surface) and grad-importance are bounded,
# as their manifest entries say it
EXAMPLE_INTERVAL = f"percentile bootstrap 95% interval over the examples ({DEFAULT_BOOTSTRAP} draws, seed 0)"


def bootstrap_ratio_draws(counts: np.ndarray, *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                          chunk: int = 50) -> np.ndarray:
    """Class ratios of ``n_boot`` bootstrap samples of the examples.

    counts: (E, K) how many maps of example e fall in class k (each example contributes all its heads, so the
    maps of one example move together). Returns (n_boot, K): each draw's share of all its maps per class. The
    draws are made ``chunk`` at a time (the same draws as all at once), so memory stays about chunk x E x K values.
    """
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] == 0:
        raise AttnpatError(f"bootstrap needs (examples, classes) counts, got shape {counts.shape}")
    rng = np.random.default_rng(seed)
    totals = np.concatenate([  # (n_boot, K)
        counts[rng.integers(0, counts.shape[0], size=(min(chunk, n_boot - start), counts.shape[0]))].sum(1)
        for start in range(0, n_boot, chunk)])
    return totals / np.maximum(totals.sum(1, keepdims=True), 1)


def bootstrap_ratio_interval(counts: np.ndarray, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                             seed: int = 0, chunk: int = 50) -> np.ndarray:
    """Percentile bootstrap interval of class ratios, resampling examples.

    counts: (E, K) as :func:`bootstrap_ratio_draws` takes them. Returns (K, 2) lower and upper bounds of each
    class's share of all maps; NaN when fewer than MIN_RESAMPLED examples hold any map.
    """
    bounds = percentile_bounds(bootstrap_ratio_draws(counts, n_boot=n_boot, seed=seed, chunk=chunk), level)
    if (np.asarray(counts, dtype=np.float64).sum(1) > 0).sum() < MIN_RESAMPLED:
        bounds[:] = np.nan
    return bounds


def adjusted_ratio_interval(counts: np.ndarray, confusion: np.ndarray, *, level: float = 0.95,
                            n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, chunk: int = 50) -> np.ndarray:
    """Bootstrap interval of the adjusted class ratios (:func:`adjusted_ratios`).

    counts: (E, K) per-example class counts, resampled as :func:`bootstrap_ratio_interval` resamples them (the
    same draws); confusion: (K, K) counts, rows = true class, columns = predicted. Each draw also redraws every
    row of the confusion matrix (multinomial with the row's total and rates: the labeled maps resampled within
    their true class), so the interval carries the error of the estimated misclassification rates too.

    The bounds are percentiles of the draws' exact (unprojected) solutions, cut to [0, 1] by
    :func:`bounded_share_interval`. Projecting each draw onto the simplex instead piled every draw below 0 on 0
    and, through the projection's shift, pulled other small shares down with it, so a class adjusted to 0 got
    [0, 0] or nearly; cutting a percentile interval to the shares that can be true never lowers its coverage.
    Returns (K, 2), holding the point estimate; NaN, as :func:`bootstrap_ratio_interval`'s, when fewer than
    MIN_RESAMPLED examples hold any map (the confusion redraws alone would give a narrow interval that leaves out
    the examples' sampling error).
    """
    counts = np.asarray(counts, dtype=np.float64)
    shares = bootstrap_ratio_draws(counts, n_boot=n_boot, seed=seed, chunk=chunk)
    bounds = bounded_share_interval(percentile_bounds(adjusted_ratio_draws(shares, confusion, seed=seed), level))
    estimate = adjusted_ratios(counts.sum(0) / max(counts.sum(), 1), confusion)  # (K,)
    bounds = np.stack([np.minimum(bounds[:, 0], estimate), np.maximum(bounds[:, 1], estimate)], axis=1)
    if (counts.sum(1) > 0).sum() < MIN_RESAMPLED:
        bounds[:] = np.nan
    return bounds


def bounded_share_interval(bounds: np.ndarray) -> np.ndarray:
    """(K, 2) percentile bounds of unconstrained share estimates -> (K, 2) bounds within [0, 1].

    Each bound is cut to [0, 1]. Where the whole interval lies below 0 (or above 1) the cut alone would leave
    [0, 0] (or [1, 1]): the estimate is outside what the confusion rates allow, a misfit of those rates rather
    than certainty, so the far bound is kept at least half the interval's width from the edge, the bound an
    estimate of exactly 0 (or 1) with that spread would get. Only draws that all agree give one point.
    """
    low, high = bounds[:, 0], bounds[:, 1]
    half_width = (high - low) / 2
    return np.stack([np.clip(np.minimum(low, 1 - half_width), 0, 1),
                     np.clip(np.maximum(high, half_width), 0, 1)], axis=1)


def adjusted_ratio_draws(shares: np.ndarray, confusion: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """Adjust each of D drawn class-share vectors with its own redrawn confusion matrix.

    shares: (D, K) observed (predicted) class shares; confusion: (K, K) counts, rows = true class. Row i of
    draw d's matrix is multinomial(n_i, rates_i) (n_i: the row's total, rounded); a draw whose matrix cannot be
    inverted (possible only with few labeled maps) gets the least-squares solution. Returns (D, K) exact
    solutions, unprojected (as :func:`adjusted_solution`): each sums to 1 but may hold negative shares, so
    their percentiles are not piled on 0 (:func:`adjusted_ratio_interval`).
    """
    shares = np.asarray(shares, dtype=np.float64)
    invertible_rates(confusion)
    # a stream of its own: the example draws stay those of the ratios
    drawn = redrawn_confusions(confusion, len(shares), np.random.default_rng([seed, 1]))  # (D, K true, K predicted)
    drawn_rates = drawn / drawn.sum(2, keepdims=True)
    solutions = np.linalg.pinv(np.swapaxes(drawn_rates, 1, 2)) @ shares[:, :, None]  # (D, K, 1)
    return solutions[:, :, 0]


def redrawn_confusions(confusion: np.ndarray, n_draws: int, rng: np.random.Generator) -> np.ndarray:
    """``n_draws`` redraws of a confusion matrix, its labeled maps resampled within their true class.

    confusion: (K, K) counts, rows = true class, columns = predicted. Row i of each draw is
    multinomial(n_i, rates_i) (n_i: the row's total, rounded, at least 1), so each true class keeps its number of
    labeled maps. Returns (n_draws, K, K) integer counts.
    """
    rates = confusion_rates(confusion)
    totals = np.maximum(np.rint(np.asarray(confusion, dtype=np.float64).sum(1)), 1).astype(np.int64)  # (K,)
    return rng.multinomial(totals, rates, size=(n_draws, len(rates)))


def confusion_scores(confusion: np.ndarray) -> np.ndarray:
    """Macro-F1 and accuracy of (..., K, K) confusion counts (rows = true class, columns = predicted).

    A class's F1 is 2 TP / (2 TP + FP + FN); macro-F1 their unweighted mean over the K classes (a class with no map
    true or predicted has NaN F1 and makes macro-F1 NaN). Returns (..., 2): macro-F1, accuracy.
    """
    counts = np.asarray(confusion, dtype=np.float64)
    hits = np.diagonal(counts, axis1=-2, axis2=-1)  # (..., K)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: no map at all
        accuracy = hits.sum(-1) / counts.sum((-2, -1))
    return np.stack([confusion_class_f1(counts).mean(-1), accuracy], axis=-1)


def confusion_class_f1(confusion: np.ndarray) -> np.ndarray:
    """Each class's F1, 2 TP / (2 TP + FP + FN), of (..., K, K) confusion counts (rows = true class, columns =
    predicted) -> (..., K); NaN for a class with no map true or predicted."""
    counts = np.asarray(confusion, dtype=np.float64)
    hits = np.diagonal(counts, axis1=-2, axis2=-1)  # (..., K)
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: a class with no map, its F1 undefined
        return 2 * hits / (counts.sum(-1) + counts.sum(-2))


def confusion_score_interval(confusion: np.ndarray, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                             seed: int = 0) -> np.ndarray:
    """Percentile bootstrap interval of the macro-F1 and accuracy of (K, K) confusion counts (e.g. a classifier's
    cross-validated confusion matrix, when no per-map predictions are kept), resampling the labeled maps.

    Each draw redraws the matrix as :func:`redrawn_confusions` does (the maps resampled within their true class:
    the labeled set's class mix was chosen when labeling, not sampled) and scores it with :func:`confusion_scores`.
    The maps are treated as independent, but maps of one head or one example are alike (they share the head's
    habits or the sentence), so the real spread is wider: the interval is a lower bound on it. The folds'
    training is not redone either. Returns (2, 2): rows macro-F1, accuracy; columns lower, upper bound; NaN when
    the matrix holds fewer than MIN_RESAMPLED maps (one map resampled shows no spread, not a certain score).
    """
    drawn = redrawn_confusions(confusion, n_boot, np.random.default_rng(seed))
    bounds = percentile_bounds(confusion_scores(drawn), level)
    if np.asarray(confusion, dtype=np.float64).sum() < MIN_RESAMPLED:
        bounds[:] = np.nan
    return bounds


def confusion_class_f1_interval(confusion: np.ndarray, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                                seed: int = 0) -> np.ndarray:
    """Percentile bootstrap interval of each class's F1 of (K, K) confusion counts, from the same redraws as
    :func:`confusion_score_interval` (same ``seed``, same draws; the same caveats: a lower bound on the spread).
    Returns (K, 2): lower, upper bound per class; NaN when the matrix holds fewer than MIN_RESAMPLED maps."""
    drawn = redrawn_confusions(confusion, n_boot, np.random.default_rng(seed))
    bounds = percentile_bounds(confusion_class_f1(drawn), level)
    if np.asarray(confusion, dtype=np.float64).sum() < MIN_RESAMPLED:
        bounds[:] = np.nan
    return bounds


def wilson_interval(successes: int, n: int, *, level: float = 0.95) -> np.ndarray:
    """Wilson's score interval of a proportion, successes of n (e.g. correct predictions of n examples).

    Returns (2,) lower and upper bounds. Unlike a percentile bootstrap it does not shrink to [1, 1] when every
    example is right, and it keeps its coverage on the ~100-example held-out sets of --split-dev.
    """
    if n < 1:
        raise AttnpatError(f"an interval of a proportion needs at least one example, got {n}")
    return wilson_intervals(np.asarray(successes), np.asarray(n), level=level)


def wilson_intervals(successes: np.ndarray, n: np.ndarray, *, level: float = 0.95) -> np.ndarray:
    """:func:`wilson_interval` of many proportions at once: successes (...) of n (broadcast with successes, every
    n at least 1). Returns (..., 2)."""
    successes, n = np.broadcast_arrays(np.asarray(successes, dtype=np.float64), np.asarray(n, dtype=np.float64))
    z = float(norm.ppf(1 - (1 - level) / 2))
    share = successes / n
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n successes the bounds are exactly 0 or 1; clamping to the share keeps rounding (1e-17) from
    # leaving the estimate outside its own interval
    return np.stack([np.maximum(np.minimum(centre - half, share), 0.0),
                     np.minimum(np.maximum(centre + half, share), 1.0)], axis=-1)


def project_to_simplex(values: np.ndarray) -> np.ndarray:
    """Euclidean projection of (..., K) vectors onto the probability simplex (non-negative, sums to 1): each the
    nearest such vector, equal to itself when it is one already. Returns (..., K)."""
    values = np.asarray(values, dtype=np.float64)
    ordered = -np.sort(-values, axis=-1)
    cumulative = np.cumsum(ordered, axis=-1) - 1
    index = np.arange(1, values.shape[-1] + 1)
    kept = (ordered - cumulative / index > 0).sum(-1, keepdims=True)  # the condition holds on a prefix, never empty
    threshold = np.take_along_axis(cumulative, kept - 1, axis=-1) / kept
    return np.maximum(values - threshold, 0)


def confusion_counts(confusion: np.ndarray) -> np.ndarray:
    """(K, K) counts as float64, rows = true class, columns = predicted. Refuses (one-line AttnpatError) a table that
    is not square, or negative or not finite counts; a true class with no map passes (:func:`confusion_rates`
    refuses it)."""
    try:
        counts = np.asarray(confusion, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise AttnpatError("a confusion matrix must be a square table of counts") from exc
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1] or counts.shape[0] == 0:
        raise AttnpatError(f"a confusion matrix must be square, got shape {counts.shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise AttnpatError("a confusion matrix must hold finite non-negative counts")
    return counts


def confusion_rates(confusion: np.ndarray) -> np.ndarray:
    """(K, K) counts, rows = true class, columns = predicted -> (K, K) rates M[i, j] = P(predicted j | true i).

    Refuses (one-line AttnpatError) what :func:`confusion_counts` refuses, and a true class with no map (its rates
    are unknown). Whether M can be inverted is :func:`singular_reason`'s question.
    """
    counts = confusion_counts(confusion)
    rows = counts.sum(1, keepdims=True)
    if (rows <= 0).any():
        raise AttnpatError("every true class needs at least one map in the confusion matrix (row "
                           f"{', '.join(str(i) for i in np.flatnonzero(rows[:, 0] <= 0))} is empty)")
    return counts / rows


def singular_reason(rates: np.ndarray, names: Sequence[str] | None = None) -> str | None:
    """Why rates (K, K, P(predicted | true)) cannot be inverted, or None when they can: a class never predicted,
    or linearly dependent rows (two mixtures of true classes giving the same predictions), so the observed shares
    do not determine the true ones. ``names``: the K class names for the message (default: their indices)."""
    names = [str(i) for i in range(len(rates))] if names is None else list(names)
    never = [names[j] for j in np.flatnonzero(rates.sum(0) == 0)]
    if never:
        return f"the classifier never predicted {', '.join(never)} in cross-validation"
    if np.linalg.matrix_rank(rates) < len(rates):
        return "its rows are linearly dependent (different true ratios would give the same predictions)"
    return None


def adjusted_ratios(observed: np.ndarray, confusion: np.ndarray) -> np.ndarray:
    """Adjusted classify-and-count: the true class ratios that explain the classifier's observed ratios.

    observed: (K,) predicted class shares (sum 1); confusion: (K, K) counts, rows = true class, columns =
    predicted (e.g. the classifier's cross-validated confusion matrix; :func:`invertible_rates` refuses one that
    cannot be inverted). With M[i, j] = P(predicted j | true i), observed = M.T @ true; the solution is projected
    onto the simplex (the nearest shares, in Euclidean distance, that are non-negative and sum to 1; equal to the
    solution when none of it is negative). Returns (K,) estimated true shares.
    """
    return project_to_simplex(adjusted_solution(observed, confusion))


def adjusted_solution(observed: np.ndarray, confusion: np.ndarray) -> np.ndarray:
    """The exact solution of observed = M.T @ true that :func:`adjusted_ratios` projects: (K,), summing to 1 but
    negative for a class whose observed share is below what the other classes' misclassification alone would
    put there (the rates do not hold for these maps, or the class is rare and its share noisy)."""
    observed = np.asarray(observed, dtype=np.float64)
    rates = invertible_rates(confusion)
    if rates.shape != (len(observed),) * 2:
        raise AttnpatError(f"confusion matrix must be ({len(observed)}, {len(observed)}), got {rates.shape}")
    return np.linalg.solve(rates.T, observed)


def invertible_rates(confusion: np.ndarray) -> np.ndarray:
    """:func:`confusion_rates`, refusing (one-line AttnpatError) rates that no adjustment can invert."""
    rates = confusion_rates(confusion)
    reason = singular_reason(rates)
    if reason:
        raise AttnpatError(f"the confusion matrix cannot be inverted: {reason}")
    return rates


def bootstrap_mean_interval(values: np.ndarray, *, level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP,
                            seed: int = 0, chunk: int = 200) -> np.ndarray:
    """Percentile bootstrap interval of a mean over examples, for every cell at once.

    values: (E, ...) one value per example (e.g. (E, L, H) per-head cosine, or (E, V) per-variant accuracy
    change 0/±1). Every cell is resampled with the same example draws (paired). Returns (..., 2).
    """
    return bootstrap_weighted_mean_interval(values, level=level, n_boot=n_boot, seed=seed, chunk=chunk)


def bootstrap_weighted_mean_interval(values: np.ndarray, weights: np.ndarray | None = None, *, level: float = 0.95,
                                     n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, chunk: int = 200) -> np.ndarray:
    """Percentile bootstrap interval of a weighted mean over examples, sum_e w_e v_e / sum_e w_e, for every cell.

    values: (E, ...) one value per example; weights: None (all 1: the plain mean) or (E, ...) non-negative, a
    leading part of values' shape (e.g. (E, S) for values (E, S, L, H)), broadcast over the rest. 0/1 weights count
    only some examples (those that have a feature): each draw resamples all E examples and takes the ratio of the
    resampled sums, so uncounted examples add nothing and how many counted ones a draw holds varies as in a fresh
    sample; values of uncounted examples are never read. Every cell uses the same draws (paired), those of
    ``np.random.default_rng(seed).integers(0, E, (n_boot, E))``. Draws with no counted example are left out of that
    cell's interval; a cell with fewer than MIN_RESAMPLED counted examples (one example resampled shows no spread,
    and [v, v] would read as certainty), or a NaN among its counted values, gets NaN bounds.
    Returns (..., 2).
    """
    values = np.asarray(values, dtype=np.float64)
    if values.ndim == 0 or values.shape[0] == 0:
        raise AttnpatError(f"a bootstrap needs at least one example, got shape {values.shape}")
    n = values.shape[0]
    weights = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    if weights.ndim == 0 or weights.shape != values.shape[:weights.ndim]:
        raise AttnpatError(f"bootstrap weights of shape {weights.shape} do not lead values of shape {values.shape}")
    if not (np.isfinite(weights) & (weights >= 0)).all():
        raise AttnpatError("bootstrap weights must be finite and non-negative")
    # (E, G, C): the G weight groups, each with C cells that share its weights
    spread = weights.reshape(weights.shape + (1,) * (values.ndim - weights.ndim))
    weighted = (np.where(spread > 0, values, 0.0) * spread).reshape(n, weights[0].size, -1)
    group_weights = weights.reshape(n, -1)
    rng = np.random.default_rng(seed)
    means = np.empty((n_boot, *weighted.shape[1:]))
    for start in range(0, n_boot, chunk):  # chunks bound the memory of the (draws, E) count matrix
        stop = min(start + chunk, n_boot)
        counts = draw_counts(rng, n, stop - start)
        sums = (counts @ weighted.reshape(n, -1)).reshape(stop - start, *weighted.shape[1:])
        with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: no counted example drawn
            means[start:stop] = sums / (counts @ group_weights)[:, :, None]
    bounds = percentile_bounds(means.reshape(n_boot, -1), level)  # (cells, 2)
    counted = (group_weights > 0).sum(0)  # (G,) examples each weight group counts
    too_few = np.broadcast_to((counted < MIN_RESAMPLED)[:, None], weighted.shape[1:]).ravel()
    bounds[np.isnan(weighted).any(0).ravel() | too_few] = np.nan
    return bounds.reshape(*values.shape[1:], 2)


def bootstrap_sparse_ratio_interval(numerators, denominators, *, level: float = 0.95,
                                    n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, chunk: int = 200,
                                    block: int = 4096) -> np.ndarray:
    """Percentile bootstrap interval of ratios of sums over examples, sum_e n_em / sum_e d_em, for many sparse cells.

    numerators, denominators: (E, M) scipy.sparse (or dense) matrices, e.g. per input the summed attention a token
    receives and how often it occurs (most inputs hold few of the M tokens). The same interval as
    :func:`bootstrap_weighted_mean_interval` of values n/d with weights d, the same draws (seed ``seed``, all E
    examples resampled in each), without a dense (E, M) copy: cells go ``block`` at a time, each block with the
    same draws. Draws with zero denominator are left out of a cell; a cell with fewer than MIN_RESAMPLED examples of
    nonzero denominator (e.g. a token of one input) gets NaN bounds. Returns (M, 2).
    """
    numerators, denominators = sparse.csc_matrix(numerators, dtype=np.float64), sparse.csc_matrix(denominators,
                                                                                                 dtype=np.float64)
    if numerators.shape != denominators.shape or numerators.shape[0] == 0:
        raise AttnpatError(f"a ratio bootstrap needs equal (examples, cells) shapes with at least one example, got "
                           f"{numerators.shape} and {denominators.shape}")
    n, cells = numerators.shape
    bounds = np.empty((cells, 2))
    for first in range(0, cells, block):  # a block's draws are (n_boot, block) values
        last = min(first + block, cells)
        rng = np.random.default_rng(seed)  # every block sees the same draws
        ratios = np.empty((n_boot, last - first))
        for start in range(0, n_boot, chunk):
            stop = min(start + chunk, n_boot)
            counts = draw_counts(rng, n, stop - start)  # (draws, E)
            sums = (numerators[:, first:last].T @ counts.T).T  # (draws, block)
            with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0: the cell's examples not drawn
                ratios[start:stop] = sums / (denominators[:, first:last].T @ counts.T).T
        bounds[first:last] = percentile_bounds(ratios, level)
    bounds[np.asarray((denominators != 0).sum(0)).ravel() < MIN_RESAMPLED] = np.nan
    return bounds


def draw_counts(rng: np.random.Generator, n: int, n_draws: int) -> np.ndarray:
    """(n_draws, n) float: how often each of n items is picked in each of n_draws draws of n with replacement
    (the draws of ``rng.integers(0, n, (n_draws, n))``, row by row)."""
    picks = rng.integers(0, n, size=(n_draws, n)) + n * np.arange(n_draws)[:, None]
    return np.bincount(picks.ravel(), minlength=n_draws * n).reshape(n_draws, n).astype(np.float64)


def percentile_bounds(draws: np.ndarray, level: float) -> np.ndarray:
    """draws: (n_boot, M) a statistic per draw, NaN where undefined -> (M, 2) percentile bounds over the defined
    draws (NaN where none is)."""
    tail = (1 - level) / 2 * 100
    bounds = np.percentile(draws, [tail, 100 - tail], axis=0).T
    partly = np.isnan(draws).any(0) & ~np.isnan(draws).all(0)
    if partly.any():  # nanpercentile is slow over many cells: only where some draws are undefined
        bounds[partly] = np.nanpercentile(draws[:, partly], [tail, 100 - tail], axis=0).T
    return bounds


def paired_inputs(baseline: np.ndarray, variants: np.ndarray, labels: np.ndarray,
                  what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """baseline (E,), variants (E, V) or (E,), labels (E,) as arrays, variants as (E, V); refuses unequal E."""
    baseline, variants, labels = np.asarray(baseline), np.asarray(variants), np.asarray(labels)
    variants = variants[:, None] if variants.ndim == 1 else variants
    if not len(baseline) or variants.shape[0] != len(baseline) or len(labels) != len(baseline):
        raise AttnpatError(f"{what} needs equal example counts, got {len(baseline)} baseline, "
                           f"{variants.shape[0]} variant and {len(labels)} label rows")
    return baseline, variants, labels


def mcnemar_exact(baseline_correct: np.ndarray, variant_correct: np.ndarray) -> np.ndarray:
    """Exact two-sided McNemar test of paired correctness, per variant.

    baseline_correct: (E,) bool; variant_correct: (E, V) or (E,) bool. Returns (V,) or scalar p-values:
    with b examples only the baseline gets right and c only the variant gets right, p = min(1, 2 P(X <= min(b, c)))
    for X ~ Binomial(b + c, 1/2); p = 1 when b + c = 0.
    """
    baseline = np.asarray(baseline_correct, dtype=bool)
    variant = np.asarray(variant_correct, dtype=bool)
    if variant.shape[0] != baseline.shape[0]:
        raise AttnpatError(f"{baseline.shape[0]} baseline examples but {variant.shape[0]} variant rows")
    column = variant.ndim == 1
    variant = variant[:, None] if column else variant
    only_baseline = (baseline[:, None] & ~variant).sum(0)
    only_variant = (~baseline[:, None] & variant).sum(0)
    discordant = only_baseline + only_variant
    p = np.minimum(1.0, 2 * binom.cdf(np.minimum(only_baseline, only_variant), discordant, 0.5))
    p = np.where(discordant == 0, 1.0, p)
    return p[0] if column else p


def paired_permutation_p(statistic: Callable[[np.ndarray, np.ndarray], float], baseline: np.ndarray,
                         variants: np.ndarray, labels: np.ndarray, *, n_perm: int = DEFAULT_BOOTSTRAP,
                         seed: int = 0) -> np.ndarray:
    """Two-sided paired permutation test (approximate randomization) of a metric's change, for metrics that are no
    mean over examples (macro-F1): under the null the two models are exchangeable on every example.

    statistic(predictions (E,), labels (E,)) -> float; baseline: (E,) predictions of the reference model;
    variants: (E, V) or (E,) predictions of each variant; labels: (E,). Each permutation swaps the two models'
    predictions on a random half of the examples (the same swaps for every variant). Returns (V,) p-values,
    (1 + permutations whose |change| reaches the observed one) / (1 + n_perm); 1 where the two never differ.
    """
    baseline, variants, labels = paired_inputs(baseline, variants, labels, "a paired permutation test")
    rng = np.random.default_rng(seed)
    swaps = rng.random((n_perm, len(baseline))) < 0.5  # one set of swaps serves every variant
    p = np.ones(variants.shape[1])
    for v in range(variants.shape[1]):
        variant = variants[:, v]
        if (variant == baseline).all():
            continue
        observed = abs(statistic(variant, labels) - statistic(baseline, labels))
        reached = sum(abs(statistic(np.where(swap, baseline, variant), labels)
                          - statistic(np.where(swap, variant, baseline), labels)) >= observed - 1e-12
                      for swap in swaps)  # ties count as reaching it: float noise must not make p smaller
        p[v] = (1 + reached) / (1 + n_perm)
    return p


@dataclass(frozen=True)
class ConfusionCells:
    """Each example's confusion cell as a one-hot row, for metrics of confusion counts computed by matrix products.

    classes: (K,) every class that occurs in the labels or predictions, sorted; baseline: (E, K*K) one-hot of
    example e's cell (true class * K + predicted class) under the baseline; variants: (E, V, K*K) the same per
    variant. Summed over examples, a row set gives that model's (K, K) confusion counts, flattened."""

    classes: np.ndarray
    baseline: np.ndarray
    variants: np.ndarray

    @classmethod
    def of(cls, baseline: np.ndarray, variants: np.ndarray, labels: np.ndarray) -> ConfusionCells:
        """baseline: (E,), variants: (E, V), labels: (E,) as paired_inputs returns them."""
        n, n_variants = variants.shape
        classes, codes = np.unique(np.concatenate([labels, baseline, variants.ravel()]), return_inverse=True)
        k = len(classes)
        gold, base, variant = codes[:n], codes[n:2 * n], codes[2 * n:].reshape(n, n_variants)
        one_hot = np.eye(k * k)
        return cls(classes, one_hot[gold * k + base], one_hot[gold[:, None] * k + variant])


def confusion_permutation_p(statistic: Callable[[np.ndarray, np.ndarray], np.ndarray], baseline: np.ndarray,
                            variants: np.ndarray, labels: np.ndarray, *, n_perm: int = DEFAULT_BOOTSTRAP,
                            seed: int = 0, chunk: int = 1000) -> np.ndarray:
    """:func:`paired_permutation_p` for metrics of the confusion counts (accuracy, F1, Matthews correlation),
    vectorised: the same swaps (same seed) and the same p-values, without a Python loop per permutation and variant.

    statistic(counts (..., K, K) rows = true class, columns = predicted, classes (K,) in that order) -> (...);
    baseline: (E,) class predictions of the reference model; variants: (E, V) or (E,); labels: (E,).
    Swapping example e moves its one count from the variant's cell to the baseline's cell in one model and back in
    the other, so with shift (E, V, K*K) = baseline one-hot - variant one-hot per example, the swapped models'
    counts are variant + swaps @ shift and baseline - swaps @ shift (swaps: (n_perm, E) 0/1). Only examples where
    some variant differs from the baseline enter the product; permutations go ``chunk`` at a time, fewer when V*K*K
    is large, to bound memory near 2M values per chunk. Returns (V,) p-values as paired_permutation_p's.
    """
    baseline, variants, labels = paired_inputs(baseline, variants, labels, "a paired permutation test")
    n, n_variants = variants.shape
    cells = ConfusionCells.of(baseline, variants, labels)
    classes, k, base_cells, variant_cells = cells.classes, len(cells.classes), cells.baseline, cells.variants
    shift = base_cells[:, None, :] - variant_cells  # (E, V, K*K)
    moved_examples = np.flatnonzero((variants != baseline[:, None]).any(1))
    shift = shift[moved_examples].reshape(len(moved_examples), n_variants * k * k)  # (A, V*K*K); A may be 0
    base_counts = base_cells.sum(0).reshape(k, k)
    variant_counts = variant_cells.sum(0).reshape(n_variants, k, k)
    observed = np.abs(statistic(variant_counts, classes) - statistic(base_counts, classes))  # (V,)
    rng = np.random.default_rng(seed)
    chunk = max(1, min(chunk, 2 ** 21 // (n_variants * k * k)))
    reached = np.zeros(n_variants, dtype=np.int64)
    for start in range(0, n_perm, chunk):
        # row by row the draws of paired_permutation_p's single (n_perm, E) call
        swaps = rng.random((min(chunk, n_perm - start), n)) < 0.5
        moved = (swaps[:, moved_examples].astype(np.float64) @ shift).reshape(-1, n_variants, k, k)
        change = statistic(variant_counts + moved, classes) - statistic(base_counts - moved, classes)  # (chunk, V)
        reached += (np.abs(change) >= observed - 1e-12).sum(0)  # ties reach it, as in paired_permutation_p
    return (1 + reached) / (1 + n_perm)


def holm_adjust(p_values: np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (family-wise error control), same shape as the input."""
    p = np.asarray(p_values, dtype=np.float64)
    flat = p.ravel()
    order = np.argsort(flat, kind="stable")
    m = len(flat)
    adjusted_sorted = np.maximum.accumulate((m - np.arange(m)) * flat[order])
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(adjusted_sorted, 1.0)
    return adjusted.reshape(p.shape)


def bootstrap_draws(statistic: Callable[[np.ndarray], float | np.ndarray], n: int, *, size: int | None = None,
                    n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """A statistic of ``n`` items at ``n_boot`` draws of ``size`` items (default n) with replacement.

    statistic(draw) -> float or (M,) values, draw: a (size,) int index array with repeats. Returns (n_boot,) or
    (n_boot, M). size < n is an m-out-of-n bootstrap: what a fresh sample of that size would show.
    """
    if n < 1:
        raise AttnpatError(f"a bootstrap needs at least one item, got {n}")
    if size is not None and size < 1:
        raise AttnpatError(f"a bootstrap draw needs at least one item, got {size}")
    rng = np.random.default_rng(seed)
    return np.asarray([np.asarray(statistic(rng.integers(0, n, size=n if size is None else size)), dtype=np.float64)
                       for _ in range(n_boot)])


def bootstrap_statistic_interval(statistic: Callable[[np.ndarray], float | np.ndarray], n: int, *,
                                 level: float = 0.95, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """Percentile bootstrap interval of any statistic of ``n`` items (examples, maps), resampling the items.

    statistic(draw) -> float or (M,) values: the statistic of the items at ``draw``, an (n,) int index array with
    repeats. Every value is computed on the same draws. Returns (2,) lower and upper bounds for a scalar
    statistic, (M, 2) for M values; draws where a value is undefined (NaN, e.g. a class absent from the draw)
    are left out of that value's interval, and a value undefined in every draw gets NaN bounds. Fewer than
    MIN_RESAMPLED items give NaN bounds too: one item resampled shows no spread, not a certain value.
    """
    values = bootstrap_draws(statistic, n, n_boot=n_boot, seed=seed)  # (n_boot,) or (n_boot, M)
    return defined_percentile_bounds(values, n, level)


def defined_percentile_bounds(values: np.ndarray, n: int, level: float) -> np.ndarray:
    """values: (n_boot,) or (n_boot, M) a statistic of ``n`` resampled items per draw, NaN where undefined ->
    (2,) or (M, 2) percentile bounds over the defined draws; NaN where none is, and everywhere when n is below
    MIN_RESAMPLED."""
    tail = (1 - level) / 2 * 100
    with warnings.catch_warnings():  # an all-NaN value warns; its NaN bounds say it
        warnings.simplefilter("ignore", RuntimeWarning)
        bounds = np.nanpercentile(values, [tail, 100 - tail], axis=0).T
    return np.full_like(bounds, np.nan) if n < MIN_RESAMPLED else bounds


def bootstrap_difference_interval(statistic: Callable[[np.ndarray, np.ndarray], float], baseline: np.ndarray,
                                  variants: np.ndarray, labels: np.ndarray, *, level: float = 0.95,
                                  n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """Paired percentile bootstrap interval of a metric's change, for metrics that are no mean over examples
    (F1, Matthews correlation, Pearson/Spearman).

    statistic(predictions (E,), labels (E,)) -> float; baseline: (E,) predictions of the reference model;
    variants: (E, V) predictions of each variant; labels: (E,). Every draw resamples the examples once, for the
    baseline and all variants alike. Returns (V, 2) bounds of statistic(variant) - statistic(baseline); draws
    where the statistic is undefined (NaN, e.g. a constant correlation) are left out. A loop per draw and variant:
    for metrics of confusion counts :func:`confusion_difference_interval` gives the same bounds far faster.
    """
    baseline, variants, labels = paired_inputs(baseline, variants, labels, "paired bootstrap")

    def changes(draw: np.ndarray) -> list[float]:
        reference = statistic(baseline[draw], labels[draw])
        return [statistic(variants[draw, v], labels[draw]) - reference for v in range(variants.shape[1])]

    return bootstrap_statistic_interval(changes, len(baseline), level=level, n_boot=n_boot, seed=seed).reshape(-1, 2)


def confusion_difference_interval(statistic: Callable[[np.ndarray, np.ndarray], np.ndarray], baseline: np.ndarray,
                                  variants: np.ndarray, labels: np.ndarray, *, level: float = 0.95,
                                  n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0, chunk: int = 200) -> np.ndarray:
    """:func:`bootstrap_difference_interval` for metrics of the confusion counts (accuracy, F1, Matthews
    correlation), vectorised: the same draws (same seed) and the same bounds, without a Python loop per draw and
    variant.

    statistic(counts (..., K, K) rows = true class, columns = predicted, classes (K,) in that order) -> (...), as
    analysis.metrics.confusion_metric gives it; baseline: (E,) class predictions of the reference model; variants:
    (E, V) or (E,); labels: (E,). A draw that picks example e c_e times adds c_e to e's confusion cell, so with
    draw counts (n_boot, E) (:func:`draw_counts`: the draws of bootstrap_draws, row by row) each model's counts are
    one matrix product with its per-example one-hot cells (E, K*K). Draws go ``chunk`` at a time, fewer when
    V*K*K is large, to bound memory near 2M values per chunk. Returns (V, 2) bounds of statistic(variant) -
    statistic(baseline).
    """
    baseline, variants, labels = paired_inputs(baseline, variants, labels, "paired bootstrap")
    n, n_variants = variants.shape
    cells = ConfusionCells.of(baseline, variants, labels)
    classes, k, base_cells = cells.classes, len(cells.classes), cells.baseline
    variant_cells = cells.variants.reshape(n, n_variants * k * k)  # (E, V*K*K)
    rng = np.random.default_rng(seed)
    chunk = max(1, min(chunk, 2 ** 21 // (n_variants * k * k)))
    changes = np.empty((n_boot, n_variants))
    for start in range(0, n_boot, chunk):
        stop = min(start + chunk, n_boot)
        counts = draw_counts(rng, n, stop - start)  # (draws, E); integer sums, so the products are exact
        reference = statistic((counts @ base_cells).reshape(-1, k, k), classes)  # (draws,)
        scored = statistic((counts @ variant_cells).reshape(-1, n_variants, k, k), classes)  # (draws, V)
        changes[start:stop] = scored - reference[:, None]
    return defined_percentile_bounds(changes, n, level).reshape(-1, 2)
