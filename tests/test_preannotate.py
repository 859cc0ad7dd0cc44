"""The rule-based pre-annotator on hand-built maps (exact feature values) and on synthetic maps of every class."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from annotation.preannotate import (
    FEATURE_NAMES,
    THRESHOLDS,
    RulePreannotator,
    classify_features,
    feature_matrix,
    map_features,
    preannotate,
)
from classifier.synthetic import synthetic_map

PAIR_TOKENS = ["[CLS]", "the", "cat", "sat", ",", "down", ".", "[SEP]", "it", "slept", ".", "[SEP]"]


def shifted(n: int, offset: int) -> np.ndarray:
    """(n, n): every row puts all its weight on token i + offset (clipped to the input)."""
    attn = np.zeros((n, n), np.float32)
    attn[np.arange(n), np.clip(np.arange(n) + offset, 0, n - 1)] = 1.0
    return attn


def column(n: int, key: int) -> np.ndarray:
    """(n, n): every row puts all its weight on one key column."""
    attn = np.zeros((n, n), np.float32)
    attn[:, key] = 1.0
    return attn


def test_features_of_a_uniform_map():
    n = len(PAIR_TOKENS)
    features = map_features(np.full((n, n), 1.0 / n, np.float32), PAIR_TOKENS)
    assert features["cls_mass"] == pytest.approx(1 / n)
    assert features["sep_mass"] == pytest.approx(2 / n)
    assert features["punct_mass"] == pytest.approx(3 / n)  # ',', '.', '.'
    assert features["entropy"] == pytest.approx(math.log(n), rel=1e-5)
    assert features["broadness"] == pytest.approx(1.0, rel=1e-5)
    assert features["band"] == pytest.approx(1 / n)
    # segment 0 = [CLS] .. first [SEP] (8 tokens), segment 1 = the 4 tokens after it
    assert features["within_segment"] == pytest.approx((8 * 8 / n + 4 * 4 / n) / n)
    # a uniform map of a typical length is one big block (at very short lengths 1/n alone can pass BAND)
    assert preannotate(np.full((40, 40), 1.0 / 40))[0] == "block"


@pytest.mark.parametrize("offset,name", [(-1, "prev_mass"), (0, "self_mass"), (1, "next_mass")])
def test_diagonal_masses_pick_the_offset(offset, name):
    n = 20
    features = map_features(shifted(n, offset))
    assert features[name] == pytest.approx((n - abs(offset)) / n)
    others = {"prev_mass", "self_mass", "next_mass"} - {name}
    assert all(features[o] <= 1 / n + 1e-6 for o in others)
    assert features["band"] == pytest.approx(features[name])
    assert preannotate(shifted(n, offset))[0] == "diagonal"


def test_a_band_two_tokens_away_is_still_diagonal():
    """The guideline: a band at 'another fixed small offset' is diagonal too."""
    attn = shifted(24, 2)
    assert map_features(attn)["band"] == pytest.approx(22 / 24)
    assert preannotate(attn)[0] == "diagonal"


def test_columns_ignore_the_diagonal_cells():
    n = 16
    features = map_features(column(n, 0), ["[CLS]"] + ["w"] * (n - 2) + ["[SEP]"])
    assert features["cls_mass"] == pytest.approx(1.0)
    assert features["sep_mass"] == pytest.approx(0.0)
    # rows 0 and 1 reach column 0 on the self / previous diagonal, which the column feature leaves out
    assert features["top1_column"] == pytest.approx((n - 2) / n)
    assert features["broadness"] == pytest.approx(0.0, abs=1e-6)
    assert preannotate(column(n, 0))[0] == "vertical"


def test_stripes_plus_band_are_vertical_plus_diagonal():
    n = 30
    attn = 0.5 * column(n, n - 1) + 0.5 * shifted(n, 1)
    label, score = preannotate(attn)
    assert label == "vertical+diagonal"
    assert 0.5 <= score <= 1.0


def segment_blocks() -> np.ndarray:
    """(12, 12) uniform weight inside each segment of PAIR_TOKENS ([CLS]..[SEP] = 8 tokens, then 4)."""
    attn = np.zeros((len(PAIR_TOKENS), len(PAIR_TOKENS)), np.float32)
    attn[:8, :8] = 1 / 8
    attn[8:, 8:] = 1 / 4
    return attn


def test_segment_blocks_keep_their_weight_inside_segments():
    features = map_features(segment_blocks(), PAIR_TOKENS)
    assert features["within_segment"] == pytest.approx(1.0)
    assert features["self_mass"] == pytest.approx((8 / 8 + 4 / 4) / 12)


@pytest.mark.xfail(strict=True, reason="known defect reported to the lead: the block rule uses broadness over the "
                   "whole input (entropy / log n) and ignores within_segment, so short per-segment blocks fall "
                   "below BROAD; strict, so it fails once the rule handles them")
def test_segment_blocks_are_block():
    assert preannotate(segment_blocks(), PAIR_TOKENS)[0] == "block"


def test_scattered_spikes_are_heterogeneous():
    rng = np.random.default_rng(3)
    n = 40
    attn = np.full((n, n), 1e-4)
    # each row: two random keys, none shared by many rows and none on a band
    for row in range(n):
        keys = rng.choice([k for k in range(n) if abs(k - row) > 2], size=2, replace=False)
        attn[row, keys] = [0.6, 0.4]
    attn /= attn.sum(1, keepdims=True)
    features = map_features(attn)
    assert features["band"] < THRESHOLDS["BAND"] and features["top2_columns"] < THRESHOLDS["COLUMNS"]
    assert preannotate(attn)[0] == "heterogeneous"


@pytest.mark.parametrize("features,expected", [
    ({"band": "BAND", "top2_columns": "COLUMNS_WITH_BAND", "broadness": 0.0}, "vertical+diagonal"),
    ({"band": "BAND", "top2_columns": 0.0, "broadness": 1.0}, "diagonal"),
    ({"band": 0.0, "top2_columns": "COLUMNS", "broadness": 1.0}, "vertical"),
    ({"band": 0.0, "top2_columns": 0.0, "broadness": "BROAD"}, "block"),
    ({"band": 0.0, "top2_columns": 0.0, "broadness": 0.0}, "heterogeneous"),
])
def test_rules_fire_at_their_documented_thresholds(features, expected):
    """A feature exactly at its threshold takes the rule; just below it does not (thresholds read from THRESHOLDS)."""
    at = {k: THRESHOLDS[v] if isinstance(v, str) else v for k, v in features.items()}
    assert classify_features(at)[0] == expected
    assert classify_features(at)[1] == pytest.approx(0.5) or expected == "heterogeneous"
    if expected != "heterogeneous":
        below = {k: THRESHOLDS[v] - 1e-3 if isinstance(v, str) else v for k, v in features.items()}
        assert classify_features(below)[0] != expected


def test_bad_maps_are_one_line_errors():
    with pytest.raises(AttnpatError, match="square"):
        map_features(np.ones((3, 4)) / 4)
    with pytest.raises(AttnpatError, match="non-negative"):
        map_features(np.array([[1.5, -0.5], [0.5, 0.5]]))
    with pytest.raises(AttnpatError, match="tokens"):
        map_features(np.eye(3), ["[CLS]", "[SEP]"])


def synthetic_predictions(per_class: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    maps, truth = [], []
    for kind in CLASSES:
        for _ in range(per_class):
            maps.append(synthetic_map(kind, int(rng.integers(8, 64)), rng))
            truth.append(kind)
    return maps, truth, list(RulePreannotator().fit(maps).predict(maps))


def test_synthetic_maps_of_each_class_are_mostly_recognised():
    maps, truth, predicted = synthetic_predictions()
    by_class = {kind: Counter(p for t, p in zip(truth, predicted) if t == kind) for kind in CLASSES}
    for kind, counts in by_class.items():
        assert counts.most_common(1)[0][0] == kind, (kind, counts)
    accuracy = np.mean([t == p for t, p in zip(truth, predicted)])
    assert accuracy >= 0.7, by_class


def test_feature_matrix_and_estimator_agree_with_single_maps():
    rng = np.random.default_rng(1)
    maps = [synthetic_map(kind, 12, rng) for kind in CLASSES]
    matrix = feature_matrix(maps)
    assert matrix.shape == (len(CLASSES), len(FEATURE_NAMES))
    for row, attn in zip(matrix, maps):
        assert row == pytest.approx([map_features(attn)[name] for name in FEATURE_NAMES])
    estimator = RulePreannotator().fit(maps)
    assert list(estimator.classes_) == list(CLASSES)
    assert list(estimator.predict(maps)) == [preannotate(m)[0] for m in maps]


def short_map_with_column(rows_on_column: int, n: int = 16, key: int = 5) -> np.ndarray:
    """(n, n) near-uniform map whose first ``rows_on_column`` rows put half their weight on one key column."""
    attn = np.full((n, n), 1.0)
    attn[:rows_on_column, key] = n - 1.0  # half of those rows' weight
    return attn / attn.sum(1, keepdims=True)


def test_rule_9_a_mid_grey_column_on_a_short_map_counts_only_on_half_the_rows():
    """Guideline rule 9: under 25 tokens, a top column of 0.15-0.35 makes the map vertical only where it is the
    heaviest key on at least half of the rows; on fewer rows the map is judged without it."""
    few, most = map_features(short_map_with_column(5)), map_features(short_map_with_column(9))
    for features in (few, most):
        assert 0.15 <= features["top1_column_all"] < 0.35 and features["top2_columns"] >= THRESHOLDS["COLUMNS"]
        assert features["band"] < THRESHOLDS["BAND"]
    assert few["rows_on_top_column"] < 0.5 <= most["rows_on_top_column"]
    assert classify_features(most)[0] == "vertical"
    assert classify_features(few)[0] != "vertical"
    # a dark column (0.35 or more) counts on any share of rows, and the same map on 25 tokens or more is rules 1-8's
    assert classify_features({**few, "top1_column_all": 0.35})[0] == "vertical"
    assert classify_features({**few, "length": 25.0})[0] == "vertical"
