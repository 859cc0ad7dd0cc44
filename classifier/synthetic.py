"""Synthetic attention maps of each pattern class, for tests and for training before labels exist.

Each map imitates a BERT head on a real input: token 0 is [CLS], the last token is [SEP] and,
for a sentence pair, a second [SEP] splits the input in two segments. A map is built as a
mixture of structured weight (columns, a diagonal band, blocks, scattered spikes) and a little
noise, then each row is normalised to sum to 1, like a softmax output.
"""
from __future__ import annotations

import numpy as np

from analysis.patterns import CLASSES


def _normalise_rows(scores: np.ndarray) -> np.ndarray:
    """scores: (n, n) non-negative -> (n, n) float32 with every row summing to 1."""
    scores = np.maximum(scores, 1e-9)
    return (scores / scores.sum(axis=1, keepdims=True)).astype(np.float32)


def _layout(n: int, rng: np.random.Generator) -> tuple[list[int], list[tuple[int, int]]]:
    """Special-token positions and segment spans of a plausible input of n tokens.

    Returns (sep positions, [(start, stop), ...] segments, stop exclusive). Token 0 is [CLS],
    token n-1 is the final [SEP]; half the inputs of length >= 10 are pairs with a middle [SEP].
    """
    if n >= 10 and rng.random() < 0.5:
        middle = int(rng.integers(n // 3, 2 * n // 3))
        return [middle, n - 1], [(0, middle + 1), (middle + 1, n)]
    return [n - 1], [(0, n)]


def _vertical(n: int, seps: list[int], rng: np.random.Generator) -> np.ndarray:
    """(n, n) column stripes on [CLS], [SEP] or punctuation-like positions."""
    candidates = [0, *seps]
    punctuation = rng.choice(np.arange(1, n - 1), size=min(2, n - 2), replace=False)
    candidates += [int(p) for p in punctuation]
    count = int(rng.integers(1, 3))
    columns = rng.choice(candidates, size=count, replace=False)
    scores = np.zeros((n, n))
    for column in columns:
        scores[:, column] += rng.uniform(0.5, 1.0)
    return scores


def _diagonal(n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, n) band at one small offset (self, previous or next token), slightly blurred."""
    offset = int(rng.choice([-1, 0, 1, -2, 2], p=[0.35, 0.2, 0.35, 0.05, 0.05]))
    scores = np.zeros((n, n))
    rows = np.arange(n)
    cols = np.clip(rows + offset, 0, n - 1)
    scores[rows, cols] = 1.0
    spread = rng.uniform(0.0, 0.25)
    scores[rows, np.clip(cols + 1, 0, n - 1)] += spread
    scores[rows, np.clip(cols - 1, 0, n - 1)] += spread
    return scores


def _block(n: int, segments: list[tuple[int, int]], rng: np.random.Generator) -> np.ndarray:
    """(n, n) broad weight inside each segment (or one big block over the whole input)."""
    scores = np.zeros((n, n))
    if len(segments) == 1 or rng.random() < 0.25:
        segments = [(0, n)]
    for start, stop in segments:
        scores[start:stop, start:stop] = rng.uniform(0.6, 1.0, size=(stop - start, stop - start))
    return scores


def _heterogeneous(n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, n) scattered, input-dependent spikes with no stripe, band or block."""
    scores = rng.gamma(0.3, 1.0, size=(n, n))
    spikes = rng.integers(0, n, size=(n, 2))
    scores[np.arange(n)[:, None], spikes] += rng.uniform(0.5, 2.0, size=(n, 2))
    return scores


def synthetic_map(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """One synthetic attention map of pattern ``kind`` (one of CLASSES) over n tokens.

    Returns (n, n) float32, rows summing to 1.
    """
    if kind not in CLASSES:
        raise ValueError(f"unknown pattern class {kind!r}; expected one of {', '.join(CLASSES)}")
    if n < 4:
        raise ValueError(f"a synthetic map needs at least 4 tokens, got {n}")
    seps, segments = _layout(n, rng)
    if kind == "vertical":
        scores = _vertical(n, seps, rng)
    elif kind == "diagonal":
        scores = _diagonal(n, rng)
    elif kind == "vertical+diagonal":
        share = rng.uniform(0.35, 0.65)
        vertical = _vertical(n, seps, rng)
        diagonal = _diagonal(n, rng)
        scores = (share * vertical / vertical.sum(1, keepdims=True)
                  + (1 - share) * diagonal / diagonal.sum(1, keepdims=True))
    elif kind == "block":
        scores = _block(n, segments, rng)
    else:
        scores = _heterogeneous(n, rng)
    scores = scores / scores.sum(axis=1, keepdims=True)
    # Faint background noise, as in real softmax outputs.
    noise = rng.uniform(0.0, 1.0, size=(n, n)) * rng.uniform(0.0, 0.08) / n
    return _normalise_rows(scores + noise)


def synthetic_dataset(n_per_class: int, rng: np.random.Generator,
                      lengths: tuple[int, int] = (8, 64)) -> tuple[list[np.ndarray], np.ndarray]:
    """n_per_class maps of every class with lengths drawn uniformly from [lengths[0], lengths[1]].

    Returns (maps: list of (n_i, n_i) float32, labels: (N,) int indices into CLASSES), shuffled.
    """
    low, high = lengths
    maps, labels = [], []
    for index, kind in enumerate(CLASSES):
        for _ in range(n_per_class):
            maps.append(synthetic_map(kind, int(rng.integers(low, high + 1)), rng))
            labels.append(index)
    order = rng.permutation(len(maps))
    return [maps[i] for i in order], np.asarray(labels, dtype=np.int64)[order]
