"""Rule-based pre-annotator: the guideline's cues and thresholds over one attention map, and the map features
of the learned baselines.

It gives annotators a starting point in Label Studio (a prediction, never the answer) and is the
baseline the CNN must beat. The rules are annotation/guideline.md's cues with the guideline's own thresholds
(GUIDELINE_CUES), applied literally: the cues are analysis.rendering's, the ones printed beside each map
(the band also counts a line two tokens off the diagonal, a line beside it, which the cue's -1..+1 misses).

  a column counts  top column >= COLUMN, and on a map under SHORT_MAP tokens a mid-grey one (under
                   DARK_COLUMN) only where it is the heaviest key on at least MOST_ROWS of the rows (rule 9);
                   and it is clearly darker than the background: at least CLEARLY_DARKER times the mean weight
                   of the row's other keys (only short maps can fail this once past COLUMN: under 13 tokens)
  a band counts    band (offsets -1..+1) >= BAND and broadness < BROAD

  column and band                                    -> vertical+diagonal
  band                                               -> diagonal
  column                                             -> vertical
  broadness >= BROAD                                 -> block
  otherwise                                          -> heterogeneous

The other features (map_features) feed the learned baselines of classifier.evaluate.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import json
import marshal
import math
import textwrap

import numpy as np
import torch

from analysis.figures import check_map
from analysis.patterns import CLASSES
from analysis.rendering import cues_of_profile
from analysis.stats import PROFILE_OFFSETS, map_profile, map_profile_batch_last, named_profile
from analysis.stream import PUNCTUATION

# Diagonals whose line is "along the main diagonal or beside it" (the guideline's diagonal class): -2..+2
BAND_OFFSETS = PROFILE_OFFSETS
# The thresholds annotation/guideline.md states for its cues ("about 0.15", "about 0.85", rule 9's numbers);
# tests/test_preannotate.py checks that the guideline still says them.
GUIDELINE_CUES = {"COLUMN": 0.15, "DARK_COLUMN": 0.35, "MOST_ROWS": 0.5, "SHORT_MAP": 25, "BAND": 0.15,
                  "BROAD": 0.85}
# "A column counts when it is ... clearly darker than the background" (guideline, vertical), measured as the
# guideline measures "clearly darker" elsewhere ("cells twice as dark as their neighbours"): the column's mean
# weight against the mean of the other keys. COLUMN alone is an absolute share, which every column of a uniform map
# under 7 tokens reaches (1/n): those near-uniform maps were called vertical, where rule 3 makes them block.
CLEARLY_DARKER = 2.0


FEATURE_NAMES = ("cls_mass", "sep_mass", "punct_mass", "top1_column", "top2_columns", "prev_mass", "self_mass",
                 "next_mass", "band", "within_segment", "entropy", "broadness")

_CLS = {"[CLS]", "<s>"}
_SEP = {"[SEP]", "</s>"}


def _column_mask(tokens: list[str] | None, n: int, members: set[str] | None = None, punct: bool = False) -> np.ndarray:
    if tokens is None:
        return np.zeros(n, bool)
    if punct:
        return np.asarray([bool(t) and all(ch in PUNCTUATION for ch in t) for t in tokens])
    return np.asarray([t in members for t in tokens])


def segment_ids(tokens: list[str] | None, n: int) -> np.ndarray:
    """Segment index of each token: a new segment starts after every [SEP] (the [SEP] closes its segment); a
    [SEP] right after one (RoBERTa/MPNet pairs: <s> a </s></s> b </s>) opens the next segment, as <s> opens
    the first."""
    if tokens is None:
        return np.zeros(n, int)
    ids, current = [], 0
    for k, token in enumerate(tokens):
        ids.append(current)
        if token in _SEP and not (k > 0 and tokens[k - 1] in _SEP):
            current += 1
    return np.asarray(ids)


def map_features(attn: np.ndarray, tokens: list[str] | None = None) -> dict[str, float]:
    """Features of one map. attn: (n, n) rows summing to 1; tokens: n strings (optional).

    Masses are means over query rows of the weight on the selected keys, so each lies in [0, 1].
    """
    attn = check_map(attn, tokens)
    n = attn.shape[0]
    column_means = attn.mean(0)
    off_diagonal = attn.copy()
    for offset in (-1, 0, 1):
        index = np.arange(max(0, -offset), min(n, n - offset))
        off_diagonal[index, index + offset] = 0.0
    top_columns = np.sort(off_diagonal.mean(0))[::-1]
    segments = segment_ids(tokens, n)
    same_segment = segments[:, None] == segments[None, :]
    profile = named_profile(torch.from_numpy(attn).to(torch.float64))
    band = strongest_band(profile)
    return {
        "cls_mass": float(column_means[_column_mask(tokens, n, _CLS)].sum()),
        "sep_mass": float(column_means[_column_mask(tokens, n, _SEP)].sum()),
        "punct_mass": float(column_means[_column_mask(tokens, n, punct=True)].sum()),
        "top1_column": float(top_columns[0]),
        "top2_columns": float(top_columns[:2].sum()),
        "prev_mass": profile["band-1"],
        "self_mass": profile["band+0"],
        "next_mass": profile["band+1"],
        "band": band,
        "within_segment": float((attn * same_segment).sum(1).mean()),
        "entropy": profile["broadness"] * math.log(n) if n > 1 else 0.0,
        "broadness": profile["broadness"],
    }


def feature_matrix(maps, tokens_list=None) -> np.ndarray:
    """(N, len(FEATURE_NAMES)) features for N maps (tokens_list: N token lists or None)."""
    tokens_list = tokens_list if tokens_list is not None else [None] * len(maps)
    return np.asarray([[map_features(m, t)[name] for name in FEATURE_NAMES] for m, t in zip(maps, tokens_list)])


def classify_cues(cues: dict[str, float], n: int, thresholds: dict[str, float] = GUIDELINE_CUES) -> tuple[str, float]:
    """The rules over one map's cues (analysis.rendering.map_cues) and its length n; returns (label, score in
    [0, 1]): how far past its threshold the deciding cue is (a rough confidence for Label Studio's prediction)."""
    t = thresholds
    column, band, broadness = cues["top_column"], cues["band"], cues["broadness"]
    column_counts = (column >= t["COLUMN"] and darker_than_background(column, n)
                     and (n >= t["SHORT_MAP"] or column >= t["DARK_COLUMN"]
                          or cues["rows_on_top_column"] >= t["MOST_ROWS"]))  # rule 9
    band_counts = band >= t["BAND"] and broadness < t["BROAD"]
    if column_counts and band_counts:
        return "vertical+diagonal", _margin(min(column - t["COLUMN"], band - t["BAND"]))
    if band_counts:
        return "diagonal", _margin(band - t["BAND"])
    if column_counts:
        return "vertical", _margin(column - t["COLUMN"])
    if broadness >= t["BROAD"]:
        return "block", _margin(broadness - t["BROAD"])
    return "heterogeneous", _margin(t["BROAD"] - broadness)


def darker_than_background(column: float, n: int) -> bool:
    """Whether a key column holding ``column`` of each row's weight on average (the top-column cue) is clearly
    darker than the background of an n-token map: at least CLEARLY_DARKER times the mean weight, (1 - column) /
    (n - 1), of the other keys. A uniform map's columns (1/n each) never are."""
    return column * (n - 1) >= CLEARLY_DARKER * (1.0 - column) - 1e-9  # tolerance: a column exactly at the ratio


def _margin(distance: float) -> float:
    return round(float(min(1.0, 0.5 + 2 * max(distance, 0.0))), 3)


def preannotate(attn: np.ndarray, tokens: list[str] | None = None) -> tuple[str, float]:
    """The pre-annotation of one map (n, n) with its n tokens (optional): (label, score)."""
    attn = check_map(attn, tokens)
    profile = named_profile(torch.from_numpy(attn).to(torch.float64))
    cues = cues_of_profile(profile)
    # a line two tokens off the diagonal is a line beside it too, which the cue's window (-1..+1) misses
    cues["band"] = max(cues["band"], strongest_band(profile))
    return classify_cues(cues, len(attn))


def strongest_band(profile: dict[str, float]) -> float:
    """The mean mass on the heaviest single diagonal of BAND_OFFSETS, from a map's named profile."""
    return max(profile[f"band{offset:+d}"] for offset in BAND_OFFSETS)


# Every function whose code decides a pre-annotation, from the map to the label and score: the rules and the cues
# they read (analysis.rendering, analysis.stats). Their code is part of the rules' version.
RULE_FUNCTIONS = (preannotate, classify_cues, darker_than_background, _margin, strongest_band, cues_of_profile,
                  named_profile, map_profile, map_profile_batch_last)


def code_digest(functions) -> str:
    """A sha256 of what ``functions`` compute: their code as its syntax tree writes it back, without docstrings,
    comments or layout, so a reworded comment keeps the digest and any change to the code changes it."""
    digest = hashlib.sha256()
    for function in functions:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError):  # no source shipped (bytecode only): the compiled code stands in for it
            digest.update(marshal.dumps(function.__code__))
            continue
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        # unparse, not dump: dump's text changes between Python versions, unparse's follows the code
        digest.update(f"{function.__qualname__}\n{ast.unparse(tree)}\n".encode())
    return digest.hexdigest()


def rules_version(cues: dict[str, float], clearly_darker: float, band_offsets, functions=None) -> str:
    """The rules' name on every pre-annotation pushed (Label Studio's model_version), from their thresholds and the
    code of the functions that apply them (RULE_FUNCTIONS unless given): labels pulled from tasks pushed under other
    rules can be told apart. The name stayed "attnpat-rules-v1" through rule 9 and CLEARLY_DARKER, and then followed
    the thresholds only, so a change to the rule code kept it."""
    settings = {"cues": cues, "clearly_darker": clearly_darker, "band_offsets": list(band_offsets),
                "code": code_digest(RULE_FUNCTIONS if functions is None else functions)}
    return "attnpat-rules-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


RULES_VERSION = rules_version(GUIDELINE_CUES, CLEARLY_DARKER, BAND_OFFSETS)


def rule_classes(maps, tokens: list[str] | None = None) -> list[str]:
    """The rules' class name for each (n, n) map of one example (``tokens``: its n tokens, or None); a
    predictor as analysis.sampling takes it."""
    return [preannotate(attn, tokens)[0] for attn in maps]


class RulePreannotator:
    """The rules as a scikit-learn-style estimator (fit is a no-op: thresholds are fixed and documented),
    so the classifier's evaluation treats it like any other baseline."""

    classes_ = None

    def fit(self, maps, labels=None, tokens_list=None):
        self.classes_ = np.asarray(CLASSES)
        return self

    def predict(self, maps, tokens_list=None) -> np.ndarray:
        tokens_list = tokens_list if tokens_list is not None else [None] * len(maps)
        return np.asarray([preannotate(m, t)[0] for m, t in zip(maps, tokens_list)])
