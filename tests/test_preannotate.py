"""The rule-based pre-annotator on hand-built maps (exact feature values) and on synthetic maps of every class."""
from __future__ import annotations

import importlib.util
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from analysis.rendering import map_cues
from annotation.preannotate import (
    BAND_OFFSETS,
    CLEARLY_DARKER,
    FEATURE_NAMES,
    GUIDELINE_CUES,
    RULE_FUNCTIONS,
    RULES_VERSION,
    RulePreannotator,
    classify_cues,
    darker_than_background,
    feature_matrix,
    map_features,
    preannotate,
    rules_version,
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
    # a uniform map is one big block at any length: its band (3/n on a short map) does not count when broad
    assert preannotate(np.full((40, 40), 1.0 / 40))[0] == "block"
    assert preannotate(np.full((8, 8), 1.0 / 8))[0] == "block"


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


def test_a_pair_joined_by_two_separators_has_two_segments():
    """RoBERTa and MPNet join a pair as <s> a </s></s> b </s>: the first </s> closes the first sentence and the
    second opens the next, so attention kept inside each sentence is all within its segment (before, the second
    </s> was a segment of its own, and the second sentence's rows lost their weight on it)."""
    tokens = ["<s>", "the", "cat", "sat", ".", "</s>", "</s>", "it", "slept", "</s>"]
    attn = np.zeros((10, 10), np.float32)
    attn[:6, :6] = 1 / 6
    attn[6:, 6:] = 1 / 4
    assert map_features(attn, tokens)["within_segment"] == pytest.approx(1.0)
    assert map_features(attn, [t.replace("<s>", "[CLS]").replace("</s>", "[SEP]") for t in tokens])[
        "within_segment"] == pytest.approx(1.0)  # MPNet's tokenizer over a BERT vocabulary: [CLS] a [SEP] [SEP] b


# Known limit of the rules, kept on purpose: broadness is over the whole input (entropy / log n), so short
# per-segment blocks fall below BROAD. Cues measured per segment (rows keeping >= BROAD of their weight in
# their own segment, broadness and band against that segment) turn this map into block, but on v5, panel-4 and
# panels 1-3 the broadness alone changed 3 real maps, none to its label, and the band too moved 26 maps labeled
# vertical+diagonal to vertical: MiniLM's real segment blocks are broad over the whole input as well
# (broadness 0.87-0.93). Strict, so a rule that handles this map says so.
@pytest.mark.xfail(strict=True, reason="known limit: the block rule's broadness is over the whole input; see above")
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
    cues = map_cues(attn)
    assert cues["band"] < GUIDELINE_CUES["BAND"] and cues["top_column"] < GUIDELINE_CUES["COLUMN"]
    assert cues["broadness"] < GUIDELINE_CUES["BROAD"]
    assert preannotate(attn)[0] == "heterogeneous"


LONG = GUIDELINE_CUES["SHORT_MAP"]  # a length where rule 9 does not apply


@pytest.mark.parametrize("cues,expected", [
    ({"top_column": "COLUMN", "band": "BAND", "broadness": 0.0}, "vertical+diagonal"),
    ({"top_column": 0.0, "band": "BAND", "broadness": 0.0}, "diagonal"),
    ({"top_column": "COLUMN", "band": 0.0, "broadness": 1.0}, "vertical"),
    ({"top_column": 0.0, "band": 0.0, "broadness": "BROAD"}, "block"),
    ({"top_column": 0.0, "band": 0.0, "broadness": 0.0}, "heterogeneous"),
])
def test_rules_fire_at_the_guideline_thresholds(cues, expected):
    """A cue exactly at the guideline's threshold takes the rule; just below it does not (read from GUIDELINE_CUES)."""
    at = {k: GUIDELINE_CUES[v] if isinstance(v, str) else v for k, v in cues.items()} | {"rows_on_top_column": 1.0}
    assert classify_cues(at, LONG)[0] == expected
    assert classify_cues(at, LONG)[1] == pytest.approx(0.5) or expected == "heterogeneous"
    if expected != "heterogeneous":
        below = {k: GUIDELINE_CUES[v] - 1e-3 if isinstance(v, str) else v for k, v in cues.items()}
        assert classify_cues(below | {"rows_on_top_column": 1.0}, LONG)[0] != expected


def test_a_band_on_a_broad_map_does_not_count():
    """The guideline's diagonal has broadness under about 0.85: the 3/n of a near-uniform short map is no line."""
    cues = {"top_column": 0.0, "rows_on_top_column": 0.0, "band": 0.3, "broadness": GUIDELINE_CUES["BROAD"]}
    assert classify_cues(cues, LONG)[0] == "block"
    assert classify_cues(cues | {"broadness": GUIDELINE_CUES["BROAD"] - 1e-3}, LONG)[0] == "diagonal"


def test_the_guideline_states_the_thresholds_the_rules_use():
    """The rules are the guideline's cues; if the guideline's numbers change, GUIDELINE_CUES must follow."""
    text = (Path(__file__).resolve().parents[1] / "annotation" / "guideline.md").read_text(encoding="utf-8")
    t = GUIDELINE_CUES
    for phrase in (f"top column about {t['COLUMN']:.2f} or more", f"band about {t['BAND']:.2f} or more",
                   f"broadness about {t['BROAD']:.2f}", f"map under {t['SHORT_MAP']} tokens",
                   f"top column under {t['DARK_COLUMN']:.2f}", f"{t['MOST_ROWS']:.0%} or more"):
        assert phrase in " ".join(text.split()), phrase


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
    few, most = map_cues(short_map_with_column(5)), map_cues(short_map_with_column(9))
    n = len(short_map_with_column(5))
    for cues in (few, most):
        assert GUIDELINE_CUES["COLUMN"] <= cues["top_column"] < GUIDELINE_CUES["DARK_COLUMN"]
    assert few["rows_on_top_column"] < GUIDELINE_CUES["MOST_ROWS"] <= most["rows_on_top_column"]
    assert preannotate(short_map_with_column(9))[0] == "vertical"
    assert preannotate(short_map_with_column(5))[0] != "vertical"
    # a dark column counts on any share of rows, and on 25 tokens or more rules 1-8 decide
    assert classify_cues(few | {"top_column": GUIDELINE_CUES["DARK_COLUMN"]}, n)[0] == "vertical"
    assert classify_cues(few, GUIDELINE_CUES["SHORT_MAP"])[0] == "vertical"


@pytest.mark.parametrize("n", range(2, 13))
def test_near_uniform_short_maps_are_block_not_vertical(n):
    """Guideline rule 3: a near-uniform map is block, and a column counts only when it is clearly darker than the
    background. On a map under 7 tokens every column of a uniform map holds 1/n >= COLUMN (0.15), and the rules
    called such maps vertical (before: vertical for the uniform map of 2-6 tokens and for a quarter to all of the
    near-uniform ones); a column must now hold CLEARLY_DARKER times the mean weight of the row's other keys."""
    rng = np.random.default_rng(n)
    near_uniform = np.exp(rng.normal(0.0, 0.05, (20, n, n)))
    near_uniform /= near_uniform.sum(-1, keepdims=True)
    for attn in (np.full((n, n), 1.0 / n), *near_uniform):
        assert preannotate(attn)[0] == "block"
    # the same short map with a column twice as dark as the rest of each row is vertical (rules 1 and 9)
    with_column = np.full((n, n), 1.0)
    with_column[:, 0] = CLEARLY_DARKER
    assert preannotate(with_column / with_column.sum(1, keepdims=True))[0] == "vertical"
    assert darker_than_background(CLEARLY_DARKER / (CLEARLY_DARKER + n - 1), n)
    assert not darker_than_background(0.99 * CLEARLY_DARKER / (CLEARLY_DARKER + n - 1), n)


def test_a_panel_hides_the_pre_annotations_unless_asked_to_show_them():
    """Annotators of a panel label independently: the rules' label pre-filled for each of them would pull their
    labels (and their agreement) towards it. Before, a new panel project showed it unless --blind was given."""
    from annotation.labelstudio import PanelSettings  # noqa: PLC0415 (the Label Studio SDK loads slowly)

    assert PanelSettings(annotators=3).project_fields()["show_collab_predictions"] is False
    assert PanelSettings(annotators=3, blind=False).project_fields()["show_collab_predictions"] is True
    assert "show_collab_predictions" not in PanelSettings(annotators=1).project_fields()
    assert "show_collab_predictions" not in PanelSettings().project_fields()  # a later push keeps the setting


def test_the_rules_version_follows_their_thresholds():
    """Pushed pre-annotations name the rules that made them; the name stayed 'attnpat-rules-v1' through rule 9 and
    CLEARLY_DARKER, so labels pulled from tasks of older rules could not be told apart. It now follows the
    thresholds."""
    assert RULES_VERSION == rules_version(GUIDELINE_CUES, CLEARLY_DARKER, BAND_OFFSETS) != "attnpat-rules-v1"
    assert rules_version(GUIDELINE_CUES | {"BAND": 0.2}, CLEARLY_DARKER, BAND_OFFSETS) != RULES_VERSION
    assert rules_version(GUIDELINE_CUES, 1.5, BAND_OFFSETS) != RULES_VERSION


def _rules_version_of(source: str, folder: Path, name: str) -> str:
    """RULES_VERSION of the pre-annotator module written as ``source`` (imported under another name)."""
    path = folder / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RULES_VERSION


def test_the_rules_version_follows_the_rule_code_not_its_comments(tmp_path):
    """A change to the code that decides a pre-annotation changes the version pushed with it, so pre-annotations of
    older rules are noticed at pull (before, the version digested the thresholds only: the same name for other
    rules); a reworded comment or docstring keeps it."""
    import annotation.preannotate as rules  # noqa: PLC0415

    source = Path(rules.__file__).read_text(encoding="utf-8")
    assert _rules_version_of(source, tmp_path, "rules_as_shipped") == RULES_VERSION
    decision = 'return "heterogeneous", _margin(t["BROAD"] - broadness)'
    assert source.count(decision) == 1
    changed = source.replace(decision, 'return "block", _margin(t["BROAD"] - broadness)')
    assert _rules_version_of(changed, tmp_path, "rules_changed") != RULES_VERSION
    reworded = source.replace('"""The pre-annotation of one map', '"""The label of one map', 1).replace(
        "# a line two tokens off", "# note: a line two tokens off", 1)
    assert reworded != source and _rules_version_of(reworded, tmp_path, "rules_reworded") == RULES_VERSION
    # the cues the rules read are theirs too: another profile function is another version
    assert rules_version(GUIDELINE_CUES, CLEARLY_DARKER, BAND_OFFSETS,
                         (*RULE_FUNCTIONS[:-1], darker_than_background)) != RULES_VERSION
