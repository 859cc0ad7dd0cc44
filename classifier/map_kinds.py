"""Weight against norm maps side by side (Kobayashi et al. 2020): per-task pattern ratios and attention to
[CLS], [SEP] and punctuation under each map kind.

For every kind the task is classified into that kind's own run folder (runs/<model>@<kind>/<task>/, reused
when current) and one more pass over the maps averages the attention to the special tokens. The joined table,
runs/<model>/<task>/map_kinds.csv, has one row per measure: the five pattern ratios (share of all the task's
maps in each class, as the CNN classifies them) and the mean attention to [CLS], [SEP] and punctuation, over all
heads ("all") and per layer. Norm maps are rows renormalised to sum 1 (analysis.mapkinds), so both kinds are
shares of one row; the CNN was trained on weight maps, so its classes of norm maps are read as "what the
weight-map classifier sees", not a separate ground truth.
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
from analysis.stream import DEFAULT_MAX_LENGTH, stream_maps, token_roles
from classifier.classify import classification_is_current, classify_settings, classify_task
from classifier.predict import PatternClassifier

TABLE = "map_kinds"
# measure name -> token role of analysis.stream.token_roles
TOKEN_MEASURES = {"to_cls": "cls", "to_sep": "sep", "to_punct": "punct"}
DEFAULT_KINDS = ("weight", "norm")


def special_attention(bundle, examples, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                      progress: bool | str = False) -> dict[str, np.ndarray]:
    """{"to_cls"|"to_sep"|"to_punct": (L, H)} mean over examples and real query rows of the map mass on those
    tokens, for the maps of the bundle's kind."""
    means = HeadMeans()
    for map_batch in stream_maps(bundle, examples, max_length=max_length, batch_size=batch_size, progress=progress):
        roles = token_roles(bundle.tokenizer, map_batch.batch.input_ids, map_batch.batch.attention_mask)
        for measure, role in TOKEN_MEASURES.items():
            means.add(measure, attention_to(map_batch.attentions, roles[role], roles["real"]))
    return means.result()


def kind_rows(task: str, kind: str, ratios: pd.DataFrame, attention: dict[str, np.ndarray]) -> pd.DataFrame:
    """Long rows task, group, measure, layer, kind, value for one kind: ratios (class, fraction) and the
    attention arrays (L, H) as an all-heads mean and per-layer means."""
    rows = [{"task": task, "group": "pattern_ratio", "measure": row["class"], "layer": "all", "kind": kind,
             "value": float(row["fraction"])} for _, row in ratios.iterrows()]
    for measure, values in attention.items():
        rows.append({"task": task, "group": "attention", "measure": measure, "layer": "all", "kind": kind,
                     "value": float(np.mean(values))})
        rows += [{"task": task, "group": "attention", "measure": measure, "layer": str(layer), "kind": kind,
                  "value": float(values[layer].mean())} for layer in range(values.shape[0])]
    return pd.DataFrame(rows)


def side_by_side(long: pd.DataFrame, kinds: Sequence[str]) -> pd.DataFrame:
    """One column per kind (task, group, measure, layer, <kind>...) and, with weight and norm, their change."""
    wide = long.pivot_table(index=["task", "group", "measure", "layer"], columns="kind", values="value",
                            sort=False).reset_index()
    wide.columns.name = None
    wide = wide[["task", "group", "measure", "layer", *kinds]]
    if {"weight", "norm"} <= set(kinds):
        wide["norm_minus_weight"] = wide["norm"] - wide["weight"]
    return wide


def compare_map_kinds(bundle, data: TaskData, classifier: PatternClassifier, *, kinds: Sequence[str] = DEFAULT_KINDS,
                      max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32, root: str | Path | None = None,
                      progress: bool = True) -> pd.DataFrame:
    """Classify ``data`` under each map kind (into each kind's run folder, skipped when already current), average
    the attention to special tokens, and write map_kinds.csv/png/svg into the weight run folder. Returns the
    side-by-side table."""
    kinds = list(dict.fromkeys(check_map_kind(kind) for kind in kinds))
    if len(kinds) < 2:
        raise AttnpatError(f"compare at least two map kinds, got {', '.join(kinds)}")
    if not data.examples:
        raise AttnpatError(f"task {data.task} has no examples")
    viewed_bundles = {kind: with_map_kind(bundle, kind) for kind in kinds}  # a kind the model lacks: before any work
    weight_bundle = with_map_kind(bundle, "weight")
    run = RunDir(weight_bundle.slug, data.task, root)
    parts = []
    with run.record(TABLE, weight_bundle, data, kinds=kinds, max_length=max_length,
                    kind_notes={kind: KIND_NOTES[kind] for kind in kinds}) as entry:
        for kind, viewed in viewed_bundles.items():
            kind_run = RunDir(viewed.slug, data.task, root)
            if not classification_is_current(kind_run, classify_settings(viewed, data, classifier, max_length)):
                classify_task(viewed, data, classifier, kind_run, batch_size=batch_size, progress=progress,
                              max_length=max_length)
            attention = special_attention(viewed, data.examples, max_length=max_length, batch_size=batch_size,
                                          progress=f"{kind} maps" if progress else False)
            parts.append(kind_rows(data.task, kind, kind_run.read_table("pattern_ratios"), attention))
        table = side_by_side(pd.concat(parts, ignore_index=True), kinds)
        run.write_table(TABLE, table)
        fig = map_kinds_figure(table, kinds, f"{bundle.name} on {data.task}: {' vs '.join(kinds)} maps")
        run.write_figure(TABLE, fig)
        close(fig)
        entry.update(run_folders={kind: str(RunDir(viewed.slug, data.task, root).path)
                                  for kind, viewed in viewed_bundles.items()})
    return table


def map_kinds_figure(table: pd.DataFrame, kinds: Sequence[str], title: str):
    """Left: per-layer attention to [CLS], [SEP] and punctuation, one line style per kind (Kobayashi Fig. 3's
    comparison). Right: the pattern ratios, one bar per kind."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.6))
    styles = ["-", "--", ":"]
    colours = {"to_cls": "#1f77b4", "to_sep": "#d62728", "to_punct": "#2ca02c"}
    per_layer = table[(table["group"] == "attention") & (table["layer"] != "all")]
    for k, kind in enumerate(kinds):
        for measure, colour in colours.items():
            rows = per_layer[per_layer["measure"] == measure]
            left.plot(rows["layer"].astype(int) + 1, rows[kind], styles[k % len(styles)], color=colour, marker="o",
                      markersize=3, label=f"{measure.removeprefix('to_')} ({kind})")
    left.set_xlabel("layer (1-indexed)")
    left.set_ylabel("mean share of a row")
    left.set_ylim(0, 1)
    left.legend(fontsize=6, ncol=len(kinds))
    left.set_title("attention to [CLS], [SEP], punctuation", fontsize=9)
    ratios = table[table["group"] == "pattern_ratio"].set_index("measure").reindex(list(CLASSES))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        right.bar(np.arange(len(CLASSES)) - 0.4 + width * (k + 0.5), ratios[kind], width * 0.92, label=kind)
    right.set_xticks(range(len(CLASSES)), list(CLASSES), fontsize=7)
    right.set_ylim(0, 1)
    right.set_ylabel("fraction of maps")
    right.set_title("pattern ratios (CNN trained on weight maps)", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(title + " (norm rows renormalised to sum 1)", fontsize=10)
    fig.tight_layout()
    return fig
