"""Clark et al. (2019) section 6: distances between heads and their 2-D embedding.

The distance between heads i and j is the Jensen-Shannon divergence (nats) between their attention
distributions for the same query token, averaged over an example's real query rows and then over
examples. Like Clark's head_distances.py, every row is smoothed first, p' = (1 - 0.001) p + 0.001 / n
(n = the example's real length), so no log sees a zero. Clark sums over tokens and documents instead, which
weighs long inputs more: a mere rescaling only when every input has one length. On wiki inputs of 50-128 tokens
the two matrices correlate at Pearson 0.9994 (16 inputs). The matrix is embedded in 2-D with metric MDS
(scikit-learn, seeded) and each head is coloured by its surface-statistics label (analysis.surface.label_evidence).
How much of the distances the 2-D layout keeps is its Kruskal stress-1 (:func:`kruskal_stress`, in the manifest
and the printout, with its interval over the position draws below; Clark reports none): two heads close in the
figure are close in divergence only when it is small.

Stability (Clark reports none): each pair's divergence carries a percentile bootstrap 95% interval over the
examples, and the run records the split-half correlation, Pearson's r between the distance matrices of the
even- and odd-numbered examples over the pairs of distinct heads. Both need at least 2 examples (NaN below).
The 2-D positions carry their own stability (Clark reports none): the MDS is refitted, starting from the
full-data positions, on the mean distances of MDS_BOOTSTRAP bootstrap draws over the examples (the first of the
draws behind the pair intervals), each draw's positions are aligned to the full-data positions by orthogonal
Procrustes (rotation or reflection plus translation, no scaling: metric MDS keeps the distances' scale), and each
head's radius is the 95th percentile of its aligned positions' distances from its full-data position. 100 draws,
not 1,000: each refit takes ~0.3 s at 72 heads. Started from random points instead, the refits land in other
local optima of the stress, which moves the heads even on unchanged data (on MiniLM's wiki distances, 5 other
seeds move the median head by 43% of the plot's spread): that is the layout's own ambiguity, reported apart as
the median layout radius (:func:`layout_radii`).
A model with one head, or whose heads all attend alike (every distance below IDENTICAL_NATS), embeds every head
at the origin: that is the exact embedding, and MDS would divide by a zero total distance.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.patches import Circle
from scipy.linalg import orthogonal_procrustes
from sklearn.manifold import MDS

from analysis.data import TaskData
from analysis.errors import AttnpatError
from analysis.figures import close
from analysis.progress import progress_bar
from analysis.rundir import RunDir
from analysis.stream import (
    DEFAULT_MAX_LENGTH,
    check_has_text,
    encode_examples,
    length_sorted_batches,
    stream_maps,
)
from analysis.surface import (
    LABEL_COLOURS,
    LABEL_NAMES,
    LabelThresholds,
    SurfaceAccumulator,
    label_counts,
    statistics_from_record,
    statistics_record,
)
from analysis.sweeps import SweepStore, sweep_fingerprint
from analysis.uncertainty import EXAMPLE_INTERVAL, bootstrap_mean_interval, draw_counts, percentile_bounds

SMOOTHING = 0.001
RESUME_FOLDER = ".clusters"  # in the run folder: each batch's divergences and statistics, for a stopped run's rerun
EVIDENCE_COLUMNS = ("statistic", "value", "ci_low", "ci_high", "threshold", "certain")  # see label_evidence
IDENTICAL_NATS = 1e-6  # float32 rounding leaves ~1e-7 nats between identical heads
DEFAULT_THRESHOLDS = LabelThresholds()
MDS_BOOTSTRAP = 100  # MDS refits for the position radii (~0.3 s each at 72 heads)
LAYOUT_SEED_OFFSETS = tuple(range(1, 6))  # seed + these: other random starts of the full-data MDS (layout_radii)
RADIUS_LEVEL = 0.95
POSITION_INTERVAL = (f"95th percentile of the distance from the full-data position over {MDS_BOOTSTRAP} bootstrap "
                     "draws over the examples (seed 0), each draw's MDS started from the full-data positions and "
                     "aligned by orthogonal Procrustes (rotation/reflection + translation, no scaling)")
LAYOUT_NOTE = (f"largest distance from the full-data position over {len(LAYOUT_SEED_OFFSETS)} refits of the full-data "
               "distances from other random starts, aligned the same way: large values mean other layouts fit "
               "about as well")


# ---------------------------------------------------------------- pure functions

def smooth(attn: torch.Tensor, smoothing: float = SMOOTHING) -> torch.Tensor:
    """Clark's smoothing of attention rows. attn: (..., n) rows summing to 1 -> same shape, no zeros."""
    return (1.0 - smoothing) * attn + smoothing / attn.shape[-1]


def js_divergence(p: torch.Tensor, q: torch.Tensor, smoothing: float = SMOOTHING) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) between distributions along the last axis. p, q: (..., n) -> (...).
    Finite without smoothing too: 0 log 0 = 0, also where p and q are both 0 (0 / 0 would be NaN)."""
    p, q = smooth(p, smoothing), smooth(q, smoothing)
    m = (p + q) / 2
    return 0.5 * (torch.xlogy(p, p).sum(-1) + torch.xlogy(q, q).sum(-1)) - torch.xlogy(m, m).sum(-1)


def head_js_divergences(maps: torch.Tensor, smoothing: float = SMOOTHING) -> torch.Tensor:
    """Mean over query rows of the JS divergence between every pair of heads, for one example.

    maps: (K, n, n) with K = layers * heads, cropped to the real tokens. Returns (K, K), symmetric, zero diagonal.
    Uses JS(p, q) = (sum p log p + sum q log q) / 2 - sum m log m, so only the m term is pairwise; xlogy makes
    0 log 0 = 0, so rows with zeros stay finite when ``smoothing`` is 0.
    """
    probs = smooth(maps.float(), smoothing)  # float32: 4x faster, errors ~1e-7 nats
    neg_entropy = torch.xlogy(probs, probs).sum(-1)  # (K, n)
    heads = probs.shape[0]
    out = torch.zeros((heads, heads), dtype=torch.float64)
    for i in range(heads):
        mixture = probs[i:].add(probs[i]).mul_(0.5)  # (K - i, n, n)
        rows = 0.5 * (neg_entropy[i] + neg_entropy[i:]) - torch.xlogy(mixture, mixture).sum(-1)
        out[i, i:] = rows.clamp(min=0).mean(-1).double()  # clamp: rounding can make ~0 slightly negative
    upper = torch.triu(out, diagonal=1)
    return upper + upper.T


def all_identical(distances: np.ndarray) -> bool:
    """Whether a (K, K) distance matrix puts every head at one point (one head, or all distances ~0)."""
    return distances.shape[0] < 2 or float(np.abs(distances).max()) < IDENTICAL_NATS


def mds_embedding(distances: np.ndarray, seed: int = 0, start: np.ndarray | None = None) -> np.ndarray:
    """2-D metric MDS of a (K, K) symmetric distance matrix -> (K, 2); all zeros when :func:`all_identical`.
    The best of 4 random starts drawn with ``seed``, or one fit from ``start`` (K, 2) when given."""
    distances = np.asarray(distances, dtype=float)
    if distances.ndim != 2 or distances.shape[0] != distances.shape[1] or not np.isfinite(distances).all():
        raise AttnpatError(f"MDS needs a finite square distance matrix, got shape {distances.shape}")
    if all_identical(distances):
        return np.zeros((distances.shape[0], 2))
    mds = MDS(n_components=2, metric="precomputed", metric_mds=True, n_init=4 if start is None else 1,
              init="random", max_iter=1000, eps=1e-9, random_state=seed, normalized_stress="auto")
    return mds.fit_transform((distances + distances.T) / 2, init=start)


def kruskal_stress(distances: np.ndarray, points: np.ndarray) -> float:
    """How much of a (K, K) distance matrix a (K, 2) embedding misses: Kruskal's stress-1,
    sqrt(sum (d_ij - |x_i - x_j|)^2 / sum d_ij^2) over the pairs i < j. 0 when the layout is exact (also when
    :func:`all_identical`); :func:`kruskal_reading` gives Kruskal's words for it."""
    if all_identical(distances):  # every head at one point is the exact embedding (rounding leaves ~1e-7 nats)
        return 0.0
    rows, cols = np.triu_indices(distances.shape[0], k=1)
    wanted = ((np.asarray(distances) + np.asarray(distances).T) / 2)[rows, cols]
    total = float((wanted ** 2).sum())
    drawn = np.linalg.norm(points[rows] - points[cols], axis=-1)
    return float(np.sqrt(((wanted - drawn) ** 2).sum() / total))


# Kruskal's (1964) benchmarks for stress-1, read as bands between them: (upper bound, reading), best first.
KRUSKAL_BANDS = ((0.0, "perfect"), (0.025, "excellent"), (0.05, "excellent to good"), (0.1, "good to fair"),
                 (0.2, "fair to poor"))
KRUSKAL_GUIDE = "0 perfect, 0.025 excellent, 0.05 good, 0.1 fair, 0.2 poor"


def kruskal_reading(stress: float) -> str:
    """A stress-1 value (:func:`kruskal_stress`) as Kruskal's guide reads it: 0 perfect, up to 0.025 excellent, then
    excellent to good up to 0.05, good to fair up to 0.1, fair to poor up to 0.2, poor above (the guide names the
    points 0.025, 0.05, 0.1, 0.2 only)."""
    return next((reading for bound, reading in KRUSKAL_BANDS if stress <= bound), "poor")


def kruskal_points_within(low: float, high: float) -> tuple[float, ...]:
    """The guide's points (0.025, 0.05, 0.1, 0.2) that a stress interval [low, high] straddles, so that its ends read
    in different bands of :func:`kruskal_reading` (p counts when low <= p < high: p itself reads the band below)."""
    return tuple(point for point, _ in KRUSKAL_BANDS[1:] if low <= point < high)


def stress_reading(stress: float, bounds=None) -> str:
    """The words the CLI and the web app print after a stress-1 value: "fair to poor by Kruskal's guide (0 perfect,
    ..., 0.2 poor)", adding "; its interval straddles 0.2" when ``bounds`` (low, high), if given, reach across a
    point of the guide (:func:`kruskal_points_within`)."""
    straddled = kruskal_points_within(*bounds) if bounds is not None else ()
    across = f"; its interval straddles {' and '.join(f'{point:g}' for point in straddled)}" if straddled else ""
    return f"{kruskal_reading(stress)} by Kruskal's guide ({KRUSKAL_GUIDE}{across})"


def procrustes_align(points: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``points`` (K, 2) rotated or reflected and translated (not scaled) to lie closest to ``reference`` (K, 2) in
    the least-squares sense -> (K, 2). MDS fixes positions only up to such a motion."""
    centre = reference.mean(0)
    rotation, _ = orthogonal_procrustes(points - points.mean(0), reference - centre)
    return (points - points.mean(0)) @ rotation + centre


def bootstrap_pair_means(per_example: np.ndarray, n_boot: int = MDS_BOOTSTRAP) -> np.ndarray:
    """(E, P) per-example pair divergences -> (n_boot, P) their means at the first ``n_boot`` bootstrap draws over
    the examples of ``np.random.default_rng(0)``, the draws behind :func:`distance_intervals` too."""
    examples = per_example.shape[0]
    return draw_counts(np.random.default_rng(0), examples, n_boot) @ per_example.astype(np.float64) / examples


def bootstrap_positions(per_example: np.ndarray, reference: np.ndarray, *, n_boot: int = MDS_BOOTSTRAP,
                        seed: int = 0, progress: bool | str = False) -> np.ndarray:
    """MDS positions at bootstrap draws over the examples, each aligned to ``reference`` by :func:`procrustes_align`.

    per_example: (E, P) divergences of the P head pairs; reference: (K, 2) the full-data MDS positions, fitted
    with ``seed``. The draws are the first ``n_boot`` of ``np.random.default_rng(0)``'s, as in
    :func:`distance_intervals`. Every refit starts from ``reference``: MDS has many near-equal local optima, and
    refits from random starts would measure which one a start falls into (:func:`layout_radii`), not how the
    data move the positions. Returns (n_boot, K, 2).
    """
    heads = reference.shape[0]
    means = bootstrap_pair_means(per_example, n_boot)
    bar = progress_bar(n_boot, progress, "MDS bootstrap", unit="draws")
    aligned = np.empty((n_boot, heads, 2))
    for draw, pairs in enumerate(means):
        aligned[draw] = procrustes_align(mds_embedding(pair_matrix(pairs, heads), seed, start=reference), reference)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return aligned


def position_radii(draws: np.ndarray, reference: np.ndarray, level: float = RADIUS_LEVEL) -> np.ndarray:
    """(B, K, 2) aligned positions at B draws, (K, 2) full-data positions -> (K,) each head's ``level`` quantile
    of its distance from its full-data position."""
    return np.quantile(np.linalg.norm(draws - reference, axis=-1), level, axis=0)


def layout_radii(distances: np.ndarray, reference: np.ndarray, seed: int = 0,
                 offsets=LAYOUT_SEED_OFFSETS) -> np.ndarray:
    """How unique the layout is, apart from the data: the full-data distances (K, K) embedded again from the random
    starts of each of ``seed + offsets`` (``reference`` (K, 2) was fitted with ``seed``, so none of them repeats
    its starts), aligned to ``reference`` by :func:`procrustes_align` -> (K,) each head's largest distance from
    its reference position. Large radii mean other layouts fit the distances about as well, so where a head sits
    in the figure, beyond what its distances say, is not to be read."""
    if all_identical(distances):
        return np.zeros(reference.shape[0])
    moved = [np.linalg.norm(procrustes_align(mds_embedding(distances, seed + offset), reference) - reference, axis=1)
             for offset in offsets]
    return np.max(moved, axis=0)


def plot_spread(points: np.ndarray) -> float:
    """The spread of an embedding (K, 2): root-mean-square distance of the heads from their centre."""
    return float(np.sqrt(((points - points.mean(0)) ** 2).sum(-1).mean()))


def stress_interval(per_example: np.ndarray, draws: np.ndarray, level: float = 0.95) -> np.ndarray:
    """(E, P) per-example pair divergences, (B, K, 2) the positions :func:`bootstrap_positions` fitted at B draws
    -> (2,) percentile bootstrap interval of the layout's :func:`kruskal_stress` (each draw's stress between its
    mean divergences and its positions; the alignment moves the points rigidly and keeps the stress)."""
    heads = draws.shape[1]
    stresses = [kruskal_stress(pair_matrix(pairs, heads), points)
                for pairs, points in zip(bootstrap_pair_means(per_example, len(draws)), draws)]
    return percentile_bounds(np.asarray(stresses)[:, None], level)[0]


def layout_stability(per_example: np.ndarray, reference: np.ndarray, *, n_boot: int = MDS_BOOTSTRAP,
                     seed: int = 0, progress: bool | str = False) -> tuple[np.ndarray, np.ndarray]:
    """(E, P) per-example pair divergences, (K, 2) full-data positions -> ((K,) position radii, (2,) the stress's
    :func:`stress_interval`), from one set of MDS refits; NaN with fewer than 2 examples (no resampling to speak
    of)."""
    if per_example.shape[0] < 2:
        return np.full(reference.shape[0], np.nan), np.full(2, np.nan)
    draws = bootstrap_positions(per_example, reference, n_boot=n_boot, seed=seed, progress=progress)
    return position_radii(draws, reference), stress_interval(per_example, draws)


def position_stability(per_example: np.ndarray, reference: np.ndarray, **options) -> np.ndarray:
    """(E, P) per-example pair divergences, (K, 2) full-data positions -> (K,) position radii (options and NaN as
    :func:`layout_stability`)."""
    return layout_stability(per_example, reference, **options)[0]


def pair_values(matrix: torch.Tensor) -> torch.Tensor:
    """(K, K) symmetric -> (K * (K - 1) / 2,) its entries above the diagonal, row by row."""
    rows, cols = torch.triu_indices(matrix.shape[0], matrix.shape[1], offset=1)
    return matrix[rows, cols]


def pair_matrix(pairs: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of :func:`pair_values` for (P, ...) values: (K, K, ...) symmetric, zero diagonal."""
    rows, cols = np.triu_indices(heads, k=1)
    out = np.zeros((heads, heads, *pairs.shape[1:]))
    out[rows, cols] = out[cols, rows] = pairs
    return out


def distance_intervals(per_example: np.ndarray, heads: int) -> np.ndarray:
    """(E, P) per-example divergences of the P head pairs -> (K, K, 2) percentile bootstrap 95% interval of
    each pair's mean over the examples (zero diagonal; NaN off it with fewer than 2 examples)."""
    if per_example.shape[0] < 2:
        bounds = np.full((per_example.shape[1], 2), np.nan)
    else:
        bounds = bootstrap_mean_interval(per_example)
    return pair_matrix(bounds, heads)


def split_half_correlation(per_example: np.ndarray) -> float:
    """Pearson's r over the P head pairs between the mean divergences of the even- and odd-numbered examples.
    per_example: (E, P), the examples in stream order (length-sorted: the two halves match in length).
    NaN with fewer than 2 examples or 2 pairs, or when a half's divergences are all equal."""
    if per_example.shape[0] < 2 or per_example.shape[1] < 2:
        return float("nan")
    even, odd = per_example[0::2].mean(0), per_example[1::2].mean(0)
    if even.std() == 0 or odd.std() == 0:
        return float("nan")
    return float(np.corrcoef(even, odd)[0, 1])


@dataclass
class HeadDistances:
    """What one pass measures: mean divergences (K, K), their intervals (K, K, 2), the per-example divergences of
    the P head pairs (E, P) that the bootstrap resamples, the split-half correlation, the label evidence of
    analysis.surface.label_evidence (one row per head), uniform attention's mean entropy (nats), the numbers of
    examples and of truncated ones."""

    mean: np.ndarray
    intervals: np.ndarray
    per_example: np.ndarray
    split_half_r: float
    labels: pd.DataFrame
    uniform_entropy: float
    n_examples: int
    n_truncated: int
    n_resumed: int = 0


# ---------------------------------------------------------------- the pass over a data set

def resume_fingerprint(bundle, data: TaskData, max_length: int, batch_size: int) -> dict:
    """What stored per-example pair divergences depend on: the model and its revision, every example's id and
    texts, the length limit, the map kind, the smoothing and the batch size (records are per batch, and padding
    moves float32 rounding, so another size could change the tables' last digits)."""
    return {**sweep_fingerprint(bundle, data, "js-divergence", "head-pairs", max_length),
            "map_kind": getattr(bundle, "map_kind", None), "smoothing": SMOOTHING, "batch_size": batch_size}


def kept_pairs(record: dict, indices: list[int], n_pairs: int) -> np.ndarray | None:
    """A kept batch record's (B, P) float32 divergences when it holds the batch of examples ``indices`` with
    ``n_pairs`` pairs each; None otherwise (another batch, or a damaged record: computed again)."""
    if record.get("indices") != indices:
        return None
    try:
        pairs = np.asarray(record["pairs"], dtype=np.float32)
    except (KeyError, TypeError, ValueError):
        return None
    return pairs if pairs.shape == (len(indices), n_pairs) else None


def kept_batch(record: dict, indices: list[int], n_pairs: int, layers: int, heads: int) -> tuple | None:
    """A kept batch record of the examples ``indices`` as ((B, P) float32 pair divergences, the batch's surface
    statistics of analysis.surface.SurfaceAccumulator.batch_statistics); None when either is missing or damaged
    (a record of an attnpat that kept the divergences only, too): the batch is streamed again."""
    pairs = kept_pairs(record, indices, n_pairs)
    surface = statistics_from_record(record.get("surface"), len(indices), layers, heads)
    return None if pairs is None or surface is None else (pairs, surface)


def batch_pairs(map_batch, heads: int) -> np.ndarray:
    """One MapBatch's (B, P) float32 divergences of the P head pairs (:func:`head_js_divergences`), K = ``heads``
    layers x heads."""
    return torch.stack([pair_values(head_js_divergences(maps.reshape(heads, *maps.shape[-2:]))).float()
                        for maps in map(map_batch.example_maps, range(len(map_batch)))]).numpy()


def compute_head_distances(bundle, data: TaskData, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                           progress: bool = True, thresholds: LabelThresholds = DEFAULT_THRESHOLDS,
                           resume_folder: Path | None = None) -> HeadDistances:
    """One pass over ``data``: head divergences with their stability, and the surface labels of the heads.

    ``resume_folder``: each batch's (B, P) pair divergences and its surface statistics are kept there
    (analysis.sweeps.SweepStore, one record per batch, written atomically) as soon as they are known, so a
    stopped run resumes: a rerun reads them back bit-equal (through JSON) and streams the maps only of the
    batches it lacks. Records of other settings (:func:`resume_fingerprint`) are discarded."""
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)
    check_has_text(bundle.tokenizer, encoded)
    # made after the checks, so bad input writes nothing
    store = None if resume_folder is None else SweepStore(resume_folder,
                                                          resume_fingerprint(bundle, data, max_length, batch_size))
    stored = store.results() if store is not None else {}  # {batch-<position>: what a stopped run kept}
    surface = SurfaceAccumulator(bundle.tokenizer)
    layers, heads = bundle.num_layers, bundle.num_layers * bundle.num_heads
    n_pairs = heads * (heads - 1) // 2
    batches = length_sorted_batches(encoded, batch_size)
    kept = [kept_batch(stored.get(f"batch-{position}", {}), [item.index for item in items], n_pairs, layers,
                       bundle.num_heads) for position, items in enumerate(batches)]
    # The batches still needed, streamed alone: every batch but the last is full, so sorting and cutting their
    # examples again yields the very same batches (same padding, same float32 rounding) in the same order.
    needed = [item for items, batch_kept in zip(batches, kept) if batch_kept is None for item in items]
    streamed = stream_maps(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                           progress="head distances" if progress and needed else False, encoded=needed)
    # (B, P) float32 per batch (41 kB an example at 144 heads): what the bootstrap resamples
    per_example, resumed = [], 0
    for position, (items, batch_kept) in enumerate(zip(batches, kept)):
        if batch_kept is not None:
            pairs, statistics = batch_kept
            resumed += len(items)
        else:
            map_batch = next(streamed)
            if map_batch.batch.indices != [item.index for item in items]:  # cannot happen: see `needed`
                raise RuntimeError(f"batch {position} streamed as other examples than planned")
            pairs, statistics = batch_pairs(map_batch, heads), surface.batch_statistics(map_batch)
            if store is not None:
                store.save(f"batch-{position}", {"indices": map_batch.batch.indices, "pairs": pairs.tolist(),
                                                 "surface": statistics_record(statistics)})
        surface.add_statistics(statistics)
        per_example.append(pairs)
    next(streamed, None)  # the stream runs to its end: its progress bar closes
    pairs = np.concatenate(per_example) if per_example else np.zeros((0, n_pairs), np.float32)
    mean = pair_matrix(pairs.astype(np.float64).mean(0), heads) if len(pairs) else np.zeros((heads, heads))
    return HeadDistances(mean=mean, intervals=distance_intervals(pairs, heads), per_example=pairs,
                         split_half_r=split_half_correlation(pairs), labels=surface.label_table(thresholds),
                         uniform_entropy=surface.result()[1],
                         n_examples=len(encoded), n_truncated=sum(e.truncated for e in encoded), n_resumed=resumed)


def head_clusters(bundle, data: TaskData, run: RunDir, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                  progress: bool = True, thresholds: LabelThresholds = DEFAULT_THRESHOLDS, seed: int = 0):
    """Write clusters.csv (layer, head, x, y, position_radius, behaviour and the label's evidence),
    head_distances.csv (every ordered pair's divergence with its interval) and clusters.png/svg; return clusters.
    Each batch's divergences are kept in the run folder's ``.clusters/`` as soon as they are known, so a stopped
    run resumes (:func:`compute_head_distances`); a finished run removes it when its tables and figure land."""
    layers, heads = bundle.num_layers, bundle.num_heads
    with run.record("clusters", bundle, data, max_length=max_length, smoothing=SMOOTHING, seed=seed,
                    thresholds=asdict(thresholds)) as entry:
        measured = compute_head_distances(bundle, data, max_length=max_length, batch_size=batch_size,
                                          progress=progress, thresholds=thresholds,
                                          resume_folder=run.file(RESUME_FOLDER))
        distances = measured.mean
        points = mds_embedding(distances, seed)
        radii, stress_bounds = layout_stability(measured.per_example, points, seed=seed,
                                                progress="MDS bootstrap" if progress else False)
        spread = plot_spread(points)
        layout = layout_radii(distances, points, seed)
        evidence = measured.labels
        clusters = pd.DataFrame({"layer": evidence.layer, "head": evidence["head"], "x": points[:, 0],
                                 "y": points[:, 1], "position_radius": radii, "behaviour": evidence.label,
                                 **{column: evidence[column] for column in EVIDENCE_COLUMNS}})
        layer_of, head_of = np.divmod(np.arange(layers * heads), heads)
        pairs = pd.DataFrame({"layer": np.repeat(layer_of, layers * heads), "head": np.repeat(head_of, layers * heads),
                              "other_layer": np.tile(layer_of, layers * heads),
                              "other_head": np.tile(head_of, layers * heads), "value": distances.ravel(),
                              "ci_low": measured.intervals[..., 0].ravel(),
                              "ci_high": measured.intervals[..., 1].ravel()})
        run.write_table("clusters", clusters)
        run.write_table("head_distances", pairs)
        stress = kruskal_stress(distances, points)
        fig = cluster_figure(clusters, stress)
        run.write_figure("clusters", fig)
        close(fig)
        run.retire(RESUME_FOLDER)  # removed once the tables and figure have landed; a stopped run keeps it
        counts = label_counts(evidence)
        entry.update(n_truncated=measured.n_truncated, resumed_examples=measured.n_resumed, interval=EXAMPLE_INTERVAL,
                     uniform_entropy=measured.uniform_entropy,
                     split_half_correlation=None if np.isnan(measured.split_half_r) else measured.split_half_r,
                     all_identical=all_identical(distances), mds_stress=stress,
                     mds_stress_interval=None if np.isnan(stress_bounds).any() else stress_bounds.tolist(),
                     position_interval=POSITION_INTERVAL,
                     **position_summary(radii, spread), layout_note=LAYOUT_NOTE,
                     median_layout_radius=float(np.median(layout)),
                     median_layout_radius_to_spread=float(np.median(layout)) / spread if spread > 0 else None,
                     label_counts={label: count["heads"] for label, count in counts.items()},
                     certain_label_counts={label: count["certain"] for label, count in counts.items()})
    return clusters


def position_summary(radii: np.ndarray, spread: float) -> dict:
    """The manifest's summary of (K,) position radii: their median, the plot's spread (:func:`plot_spread`) and
    the median relative to it; None where undefined (fewer than 2 examples, or every head at one point)."""
    median = float(np.median(radii)) if np.isfinite(radii).all() else None
    relative = median / spread if median is not None and spread > 0 else None
    return {"median_position_radius": median, "plot_spread": spread, "median_radius_to_spread": relative}


def draw_radii(ax, rows: pd.DataFrame, colour) -> None:
    """A light circle of each head's position radius around its point (none where the radius is NaN)."""
    for x, y, radius in zip(rows.x, rows.y, rows.position_radius):
        if np.isfinite(radius) and radius > 0:
            ax.add_patch(Circle((x, y), radius, color=colour, alpha=0.12, linewidth=0))


def cluster_figure(clusters, stress: float | None = None):
    """Clark's Figure 6: the MDS embedding coloured by behaviour (left) and by layer (right); a light circle
    around each head shows its position radius (95% over bootstrap draws); the title gives the layout's Kruskal
    stress-1 when ``stress`` is given."""
    fig, (by_behaviour, by_layer) = plt.subplots(1, 2, figsize=(11, 5))
    for label, rows in clusters.groupby("behaviour", sort=False):
        draw_radii(by_behaviour, rows, LABEL_COLOURS.get(label, "k"))
        by_behaviour.scatter(rows.x, rows.y, s=22, color=LABEL_COLOURS.get(label, "k"),
                             label=LABEL_NAMES.get(label, label))
    by_behaviour.legend(fontsize=8, loc="best")
    by_behaviour.set_title("Behaviours", fontsize=10)
    layers = int(clusters.layer.max()) + 1
    colours = plt.get_cmap("seismic")(np.linspace(0, 1, layers))
    for layer, rows in clusters.groupby("layer"):
        draw_radii(by_layer, rows, colours[int(layer)])
        by_layer.scatter(rows.x, rows.y, s=22, color=colours[int(layer)], label=str(int(layer) + 1))
    by_layer.legend(title="layer (1-indexed)", fontsize=7, title_fontsize=8, loc="best", ncol=2)
    by_layer.set_title("Coloured by layer", fontsize=10)
    for ax in (by_behaviour, by_layer):
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_facecolor((0.96, 0.96, 0.96))
        ax.set_aspect("equal", adjustable="datalim")  # circles stay round
    title = "Attention heads embedded by Jensen-Shannon divergence (MDS)"
    if stress is not None:
        title += f", Kruskal stress-1 {stress:.3f}"
    if clusters.position_radius.notna().all():
        title += "\ncircles: each head's 95% position radius over bootstrap draws"
    fig.suptitle(title)
    fig.tight_layout()
    return fig
