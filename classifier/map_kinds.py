"""Weight against norm maps side by side (Kobayashi et al. 2020): per-task pattern ratios and attention to
[CLS], [SEP] and punctuation under each map kind.

For every kind the task is classified into that kind's own run folder (runs/<model>@<kind>/<task>/, reused
when current) and one more pass over the maps averages the attention to the special tokens. The joined table,
runs/<model>/<task>/map_kinds.csv, has one row per measure: the five pattern ratios (share of all the task's
maps in each class, as the CNN classifies them) and the mean attention to [CLS], [SEP] and punctuation, over all
heads ("all") and per layer. Every figure has its 95% interval over the examples, and with weight and norm the
change norm minus weight has a paired bootstrap interval: each example's two values are differenced before the
examples are resampled (the ratios' from each kind's example_patterns.csv). Norm maps are rows renormalised to
sum 1 (analysis.mapkinds), so both kinds are shares of one row; the CNN was trained on weight maps, so its
classes of norm maps are read as "what the weight-map classifier sees", not a separate ground truth.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from analysis.data import TaskData
from analysis.errors import AttnpatError
from analysis.figures import close  # importing analysis.figures selects the Agg backend
from analysis.mapkinds import KIND_NOTES, check_map_kind
from analysis.models import with_map_kind
from analysis.patterns import CLASSES
from analysis.rundir import RunDir
from analysis.stats import HeadMeans, attention_to
from analysis.stream import DEFAULT_MAX_LENGTH, check_marks_cls_and_sep, encode_examples, stream_maps, token_roles
from analysis.uncertainty import DEFAULT_BOOTSTRAP, EXAMPLE_INTERVAL, bootstrap_weighted_mean_interval
from classifier.classify import classification_is_current, classify_settings, classify_task
from classifier.predict import PatternClassifier

TABLE = "map_kinds"
# measure name -> token role of analysis.stream.token_roles
TOKEN_MEASURES = {"to_cls": "cls", "to_sep": "sep", "to_punct": "punct"}
DEFAULT_KINDS = ("weight", "norm")
CHANGE = "norm_minus_weight"
KEYS = ["task", "group", "measure", "layer"]
INTERVALS = {"ratio": "each kind's pattern_ratios.csv interval (percentile bootstrap 95% over the examples, all heads' "
                      "maps of an example drawn together)",
             "attention": EXAMPLE_INTERVAL,
             "change": "paired percentile bootstrap 95% interval of norm minus weight over the examples (each draw "
                       f"takes the same examples for both kinds; {DEFAULT_BOOTSTRAP} draws, seed 0)"}


def special_attention(bundle, examples, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                      progress: bool | str = False, encoded=None) -> tuple[dict[str, np.ndarray], int]:
    """({"to_cls"|"to_sep"|"to_punct": (E, L, H)}, n_truncated): each example's mean over its real query rows of the
    map mass on those tokens, for the maps of the bundle's kind, in data order (row e is examples[e], whatever the
    stream's length-sorted order), so two kinds' values pair example by example; and how many examples were cut
    to ``max_length`` tokens (their maps are of the part kept). encoded: the examples' :func:`encode_examples`,
    when the caller has them already."""
    means, order, n_truncated = HeadMeans(), [], 0
    for map_batch in stream_maps(bundle, examples, max_length=max_length, batch_size=batch_size, progress=progress,
                                 encoded=encoded):
        roles = token_roles(bundle.tokenizer, map_batch.batch.input_ids, map_batch.batch.attention_mask)
        order += [item.index for item in map_batch.batch.items]
        n_truncated += sum(item.truncated for item in map_batch.batch.items)
        for measure, role in TOKEN_MEASURES.items():
            means.add(measure, attention_to(map_batch.attentions, roles[role], roles["real"]))
    in_data_order = np.argsort(order, kind="stable")
    return {measure: means.per_example(measure)[0][in_data_order] for measure in TOKEN_MEASURES}, n_truncated


def attention_cells(per_example: dict[str, np.ndarray]) -> tuple[list[tuple[str, str]], np.ndarray]:
    """The table's attention cells and their per-example values: [(measure, layer)] with layer "all" (every head)
    then "0".."L-1" (that layer's heads), and (E, cells) each example's mean over those heads.
    per_example: {measure: (E, L, H)}."""
    cells, columns = [], []
    for measure, values in per_example.items():
        cells.append((measure, "all"))
        columns.append(values.mean((1, 2), dtype=np.float64))
        for layer in range(values.shape[1]):
            cells.append((measure, str(layer)))
            columns.append(values[:, layer].mean(-1, dtype=np.float64))
    return cells, np.stack(columns, 1)


def mean_rows(task: str, group: str, cells: Sequence[tuple[str, str]], values: np.ndarray,
              weights: np.ndarray | None = None) -> pd.DataFrame:
    """Rows task, group, measure, layer, value, ci_low, ci_high: each cell's weighted mean over the examples with
    its percentile bootstrap 95% interval (analysis.uncertainty, seed 0: every call over the same examples makes
    the same draws). values: (E, cells); weights: (E,) or None (all 1)."""
    weights = np.ones(len(values)) if weights is None else np.asarray(weights, dtype=np.float64)
    means = weights @ values / weights.sum()
    bounds = bootstrap_weighted_mean_interval(values, weights)  # (cells, 2)
    return pd.DataFrame({"task": task, "group": group, "measure": [measure for measure, _ in cells],
                         "layer": [layer for _, layer in cells], "value": means, "ci_low": bounds[:, 0],
                         "ci_high": bounds[:, 1]})


def ratio_rows(task: str, ratios: pd.DataFrame) -> pd.DataFrame:
    """One kind's pattern_ratios.csv (class, fraction[, ci_low, ci_high]) as rows task, group, measure, layer,
    value, ci_low, ci_high (NaN bounds for a table without intervals)."""
    bounds = {column: ratios[column] if column in ratios else np.nan for column in ("ci_low", "ci_high")}
    return pd.DataFrame({"task": task, "group": "pattern_ratio", "measure": ratios["class"], "layer": "all",
                         "value": ratios["fraction"], **bounds})


def paired_pattern_shares(weight_patterns: pd.DataFrame, norm_patterns: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per example, the change in its share of maps per class and its number of maps, from two kinds'
    example_patterns.csv (index, example_id, <class> counts) of the same examples: ((E, 5) norm minus weight
    count / maps, (E,) maps). The weighted mean of the first with the second as weights is the change of the
    task's pattern ratios."""
    weight_patterns, norm_patterns = (frame.sort_values("index").reset_index(drop=True)
                                      for frame in (weight_patterns, norm_patterns))
    if list(weight_patterns["example_id"].astype(str)) != list(norm_patterns["example_id"].astype(str)):
        raise AttnpatError("the weight and norm classifications hold different examples; classify both kinds of "
                           "the same data again")
    weight_counts = weight_patterns[list(CLASSES)].to_numpy(np.float64)
    norm_counts = norm_patterns[list(CLASSES)].to_numpy(np.float64)
    maps = weight_counts.sum(1)
    if not np.array_equal(maps, norm_counts.sum(1)) or not (maps > 0).all():
        raise AttnpatError("the weight and norm classifications count different maps per example")
    return (norm_counts - weight_counts) / maps[:, None], maps


def change_rows(task: str, cells: Sequence[tuple[str, str]], weight_values: np.ndarray, norm_values: np.ndarray,
                weight_patterns: pd.DataFrame, norm_patterns: pd.DataFrame) -> pd.DataFrame:
    """Rows task, group, measure, layer, norm_minus_weight, norm_minus_weight_ci_low, _ci_high: the paired change
    of every attention cell (values (E, cells) per kind, the same examples in the same order) and of every
    pattern ratio (each kind's example_patterns.csv), each example's two values differenced before resampling."""
    shares, maps = paired_pattern_shares(weight_patterns, norm_patterns)
    rows = pd.concat([mean_rows(task, "pattern_ratio", [(name, "all") for name in CLASSES], shares, maps),
                      mean_rows(task, "attention", cells, norm_values - weight_values)], ignore_index=True)
    return rows.rename(columns={"value": CHANGE, "ci_low": f"{CHANGE}_ci_low", "ci_high": f"{CHANGE}_ci_high"})


def side_by_side(long: pd.DataFrame, kinds: Sequence[str], change: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per cell (task, group, measure, layer) with <kind>, <kind>_ci_low, <kind>_ci_high per kind, from
    long rows (KEYS, kind, value, ci_low, ci_high); ``change``: :func:`change_rows`, joined on the cell."""
    wide = long[KEYS].drop_duplicates().reset_index(drop=True)
    for kind in kinds:
        part = long[long["kind"] == kind].rename(columns={"value": kind, "ci_low": f"{kind}_ci_low",
                                                          "ci_high": f"{kind}_ci_high"}).drop(columns="kind")
        wide = wide.merge(part, on=KEYS, how="left")
    return wide if change is None else wide.merge(change, on=KEYS, how="left")


def compare_map_kinds(bundle, data: TaskData, classifier: PatternClassifier, *, kinds: Sequence[str] = DEFAULT_KINDS,
                      max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32, root: str | Path | None = None,
                      progress: bool = True) -> pd.DataFrame:
    """Classify ``data`` under each map kind (into each kind's run folder, skipped when already current), average
    the attention to special tokens, and write map_kinds.csv/png/svg into the weight run folder. Returns the
    side-by-side table: every figure with its 95% interval over the examples and, with weight and norm, their
    paired change (:func:`change_rows`)."""
    kinds = list(dict.fromkeys(check_map_kind(kind) for kind in kinds))
    if len(kinds) < 2:
        raise AttnpatError(f"compare at least two map kinds, got {', '.join(kinds)}")
    if not data.examples:
        raise AttnpatError(f"task {data.task} has no examples")
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)  # every kind's maps share the tokenizer
    check_marks_cls_and_sep(bundle.tokenizer, encoded, "compare-kinds")  # before any map is classified
    viewed_bundles = {kind: with_map_kind(bundle, kind) for kind in kinds}  # a kind the model lacks: before any work
    weight_bundle = with_map_kind(bundle, "weight")
    run = RunDir(weight_bundle.slug, data.task, root)
    parts, attention, patterns = [], {}, {}
    with run.record(TABLE, weight_bundle, data, kinds=kinds, max_length=max_length,
                    kind_notes={kind: KIND_NOTES[kind] for kind in kinds}, intervals=INTERVALS) as entry:
        for kind, viewed in viewed_bundles.items():
            kind_run = RunDir(viewed.slug, data.task, root)
            if not classification_is_current(kind_run, classify_settings(viewed, data, classifier, max_length)):
                classify_task(viewed, data, classifier, kind_run, batch_size=batch_size, progress=progress,
                              max_length=max_length)
            per_example, n_truncated = special_attention(viewed, data.examples, max_length=max_length,
                                                         batch_size=batch_size, encoded=encoded,
                                                         progress=f"{kind} maps" if progress else False)
            cells, attention[kind] = attention_cells(per_example)
            patterns[kind] = kind_run.read_table("example_patterns")
            parts += [ratio_rows(data.task, kind_run.read_table("pattern_ratios")).assign(kind=kind),
                      mean_rows(data.task, "attention", cells, attention[kind]).assign(kind=kind)]
        change = (change_rows(data.task, cells, attention["weight"], attention["norm"], patterns["weight"],
                              patterns["norm"]) if {"weight", "norm"} <= set(kinds) else None)
        table = side_by_side(pd.concat(parts, ignore_index=True), kinds, change)
        run.write_table(TABLE, table)
        fig = map_kinds_figure(table, kinds, f"{bundle.name} on {data.task}: {' vs '.join(kinds)} maps")
        run.write_figure(TABLE, fig)
        close(fig)
        entry.update(n_truncated=n_truncated,  # the same inputs under every kind
                     run_folders={kind: str(RunDir(viewed.slug, data.task, root).path)
                                  for kind, viewed in viewed_bundles.items()})
    return table


def map_kinds_figure(table: pd.DataFrame, kinds: Sequence[str], title: str):
    """Left: per-layer attention to [CLS], [SEP] and punctuation, one line style per kind (Kobayashi Fig. 3's
    comparison). Right: the pattern ratios, one bar per kind. Error bars: each figure's 95% interval over the
    examples (the table's <kind>_ci_low, <kind>_ci_high)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.6))
    styles = ["-", "--", ":"]
    colours = {"to_cls": "#1f77b4", "to_sep": "#d62728", "to_punct": "#2ca02c"}
    per_layer = table[(table["group"] == "attention") & (table["layer"] != "all")]
    for k, kind in enumerate(kinds):
        for measure, colour in colours.items():
            rows = per_layer[per_layer["measure"] == measure]
            left.errorbar(rows["layer"].astype(int) + 1, rows[kind], yerr=interval_lengths(rows, kind),
                          linestyle=styles[k % len(styles)], color=colour, marker="o", markersize=3, capsize=2,
                          elinewidth=0.8, label=f"{measure.removeprefix('to_')} ({kind})")
    left.set_xlabel("layer (1-indexed)")
    left.set_ylabel("mean share of a row")
    left.set_ylim(0, 1)
    left.legend(fontsize=6, ncol=len(kinds))
    left.set_title("attention to [CLS], [SEP], punctuation (95% intervals)", fontsize=9)
    ratios = table[table["group"] == "pattern_ratio"].set_index("measure").reindex(list(CLASSES))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        right.bar(np.arange(len(CLASSES)) - 0.4 + width * (k + 0.5), ratios[kind], width * 0.92, label=kind,
                  yerr=interval_lengths(ratios, kind), capsize=2, error_kw={"elinewidth": 0.8})
    right.set_xticks(range(len(CLASSES)), list(CLASSES), fontsize=7)
    right.set_ylim(0, 1)
    right.set_ylabel("fraction of maps")
    right.set_title("pattern ratios (CNN trained on weight maps; 95% intervals)", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(title + " (norm rows renormalised to sum 1)", fontsize=10)
    fig.tight_layout()
    return fig


def interval_lengths(rows: pd.DataFrame, kind: str) -> np.ndarray:
    """(2, rows) distances from each value of column ``kind`` down to its ci_low and up to its ci_high (matplotlib's
    yerr; 0 where a bound is missing)."""
    values = rows[kind].to_numpy(np.float64)
    return np.nan_to_num(np.stack([values - rows[f"{kind}_ci_low"].to_numpy(np.float64),
                                   rows[f"{kind}_ci_high"].to_numpy(np.float64) - values]))
