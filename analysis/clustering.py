"""Clark et al. (2019) section 6: distances between heads and their 2-D embedding.

The distance between heads i and j is the Jensen-Shannon divergence (nats) between their attention
distributions for the same query token, averaged over an example's real query rows and then over
examples. Like Clark's head_distances.py, every row is smoothed first, p' = (1 - 0.001) p + 0.001 / n
(n = the example's real length), so no log sees a zero. Clark sums over tokens and documents instead, which
weighs long inputs more: a mere rescaling only when every input has one length. On wiki inputs of 50-128 tokens
the two matrices correlate at Pearson 0.9994 (16 inputs). The matrix is embedded in 2-D with metric MDS
(scikit-learn) and each head is coloured by its surface-statistics label (analysis.surface.head_labels).
"""
from __future__ import annotations

from dataclasses import asdict

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from sklearn.manifold import MDS

from analysis.data import TaskData
from analysis.errors import AttnpatError
from analysis.figures import close
from analysis.rundir import RunDir
from analysis.stream import DEFAULT_MAX_LENGTH, encode_examples, stream_maps
from analysis.surface import LABEL_COLOURS, LABEL_NAMES, LabelThresholds, SurfaceAccumulator, head_labels

SMOOTHING = 0.001
DEFAULT_THRESHOLDS = LabelThresholds()


# ---------------------------------------------------------------- pure functions

def smooth(attn: torch.Tensor, smoothing: float = SMOOTHING) -> torch.Tensor:
    """Clark's smoothing of attention rows. attn: (..., n) rows summing to 1 -> same shape, no zeros."""
    return (1.0 - smoothing) * attn + smoothing / attn.shape[-1]


def js_divergence(p: torch.Tensor, q: torch.Tensor, smoothing: float = SMOOTHING) -> torch.Tensor:
    """Jensen-Shannon divergence (nats) between distributions along the last axis. p, q: (..., n) -> (...)."""
    p, q = smooth(p, smoothing), smooth(q, smoothing)
    m = (p + q) / 2
    return 0.5 * (torch.xlogy(p, p / m).sum(-1) + torch.xlogy(q, q / m).sum(-1))


def head_js_divergences(maps: torch.Tensor, smoothing: float = SMOOTHING) -> torch.Tensor:
    """Mean over query rows of the JS divergence between every pair of heads, for one example.

    maps: (K, n, n) with K = layers * heads, cropped to the real tokens. Returns (K, K), symmetric, zero diagonal.
    Uses JS(p, q) = (sum p log p + sum q log q) / 2 - sum m log m, so only the m term is pairwise.
    """
    probs = smooth(maps.float(), smoothing)  # float32: 4x faster, errors ~1e-7 nats
    neg_entropy = (probs * probs.log()).sum(-1)  # (K, n); smoothing keeps every probability > 0
    heads = probs.shape[0]
    out = torch.zeros((heads, heads), dtype=torch.float64)
    for i in range(heads):
        mixture = probs[i:].add(probs[i]).mul_(0.5)  # (K - i, n, n)
        rows = 0.5 * (neg_entropy[i] + neg_entropy[i:]) - mixture.log().mul_(mixture).sum(-1)
        out[i, i:] = rows.clamp(min=0).mean(-1).double()  # clamp: rounding can make ~0 slightly negative
    upper = torch.triu(out, diagonal=1)
    return upper + upper.T


def mds_embedding(distances: np.ndarray, seed: int = 0) -> np.ndarray:
    """2-D metric MDS of a (K, K) symmetric distance matrix -> (K, 2)."""
    distances = np.asarray(distances, dtype=float)
    if distances.ndim != 2 or distances.shape[0] != distances.shape[1] or not np.isfinite(distances).all():
        raise AttnpatError(f"MDS needs a finite square distance matrix, got shape {distances.shape}")
    mds = MDS(n_components=2, metric="precomputed", metric_mds=True, n_init=4, init="random", max_iter=1000,
              eps=1e-9, random_state=seed, normalized_stress="auto")
    return mds.fit_transform((distances + distances.T) / 2)


# ---------------------------------------------------------------- the pass over a data set

def compute_head_distances(bundle, data: TaskData, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                           progress: bool = True, thresholds: LabelThresholds = DEFAULT_THRESHOLDS):
    """One pass: (JS divergences (K, K), head labels (L, H), number of truncated examples)."""
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)
    surface = SurfaceAccumulator(bundle.tokenizer)
    heads = bundle.num_layers * bundle.num_heads
    total = torch.zeros((heads, heads), dtype=torch.float64)
    for map_batch in stream_maps(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                 progress="head distances" if progress else False, encoded=encoded):
        surface.add(map_batch)
        for i in range(len(map_batch)):
            maps = map_batch.example_maps(i)
            total += head_js_divergences(maps.reshape(heads, *maps.shape[-2:]))
    values, _ = surface.result()
    return (total / max(len(encoded), 1)).numpy(), head_labels(values, thresholds), sum(e.truncated for e in encoded)


def head_clusters(bundle, data: TaskData, run: RunDir, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                  progress: bool = True, thresholds: LabelThresholds = DEFAULT_THRESHOLDS, seed: int = 0):
    """Write clusters.csv (layer, head, x, y, behaviour), head_distances.csv and clusters.png/svg; return clusters."""
    layers, heads = bundle.num_layers, bundle.num_heads
    with run.record("clusters", bundle, data, max_length=max_length, smoothing=SMOOTHING, seed=seed,
                    thresholds=asdict(thresholds)) as entry:
        distances, labels, n_truncated = compute_head_distances(
            bundle, data, max_length=max_length, batch_size=batch_size, progress=progress, thresholds=thresholds)
        points = mds_embedding(distances, seed)
        layer_of, head_of = np.divmod(np.arange(layers * heads), heads)
        clusters = pd.DataFrame({"layer": layer_of, "head": head_of, "x": points[:, 0], "y": points[:, 1],
                                 "behaviour": labels.ravel()})
        pairs = pd.DataFrame({"layer": np.repeat(layer_of, layers * heads), "head": np.repeat(head_of, layers * heads),
                              "other_layer": np.tile(layer_of, layers * heads),
                              "other_head": np.tile(head_of, layers * heads), "value": distances.ravel()})
        run.write_table("clusters", clusters)
        run.write_table("head_distances", pairs)
        fig = cluster_figure(clusters)
        run.write_figure("clusters", fig)
        close(fig)
        entry.update(n_truncated=n_truncated)
    return clusters


def cluster_figure(clusters):
    """Clark's Figure 6: the MDS embedding coloured by behaviour (left) and by layer (right)."""
    fig, (by_behaviour, by_layer) = plt.subplots(1, 2, figsize=(11, 5))
    for label, rows in clusters.groupby("behaviour", sort=False):
        by_behaviour.scatter(rows.x, rows.y, s=22, color=LABEL_COLOURS.get(label, "k"),
                             label=LABEL_NAMES.get(label, label))
    by_behaviour.legend(fontsize=8, loc="best")
    by_behaviour.set_title("Behaviours", fontsize=10)
    layers = int(clusters.layer.max()) + 1
    colours = plt.get_cmap("seismic")(np.linspace(0, 1, layers))
    for layer, rows in clusters.groupby("layer"):
        by_layer.scatter(rows.x, rows.y, s=22, color=colours[int(layer)], label=str(int(layer) + 1))
    by_layer.legend(title="layer (1-indexed)", fontsize=7, title_fontsize=8, loc="best", ncol=2)
    by_layer.set_title("Coloured by layer", fontsize=10)
    for ax in (by_behaviour, by_layer):
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_facecolor((0.96, 0.96, 0.96))
    fig.suptitle("Attention heads embedded by Jensen-Shannon divergence (MDS)")
    fig.tight_layout()
    return fig
