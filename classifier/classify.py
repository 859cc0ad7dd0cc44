"""Classify every head's attention map on every example of a task (Kovaleva et al. Figure 2).

Maps come from analysis.stream.stream_maps one batch at a time; each example's maps are cropped to
its real length, resized (all examples of one length together) and classified, and only the
(layers, heads, classes) counts are kept, so memory does not grow with the number of examples.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib.colors import ListedColormap, to_rgba
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from analysis.data import GLUE_TASKS, TaskData, check_split, load_data, offline_splits
from analysis.errors import AttnpatError
from analysis.figures import close, label_head_axes  # importing analysis.figures selects the Agg backend
from analysis.mapstore import MapGroup, read_maps, shard_files
from analysis.models import hub_reachable
from analysis.patterns import CLASS_COLOURS, CLASSES
from analysis.progress import progress_bar
from analysis.rundir import RunDir, list_runs, save_table
from analysis.stream import (
    DEFAULT_MAX_LENGTH,
    Encoded,
    MapBatch,
    check_has_text,
    encode_examples,
    length_sorted_batches,
    stream_maps,
)
from analysis.uncertainty import (
    DEFAULT_BOOTSTRAP,
    MIN_RESAMPLED,
    adjusted_ratio_interval,
    adjusted_ratios,
    adjusted_solution,
    bootstrap_ratio_interval,
    confusion_rates,
    singular_reason,
    wilson_intervals,
)
from classifier.model import IMAGE_CHANNELS, PROFILE_FEATURES, resize_maps, write_inputs
from classifier.predict import PatternClassifier

ALL_TASKS_DIR = "all"
# The layout of the tables and figures classify writes, part of its settings: a run written by a version with
# another layout (e.g. before the adjusted ratios had intervals) is classified again on resume, and is not joined
# into the per-task comparison. Raise it when a column or a figure changes (3: the adjusted intervals are
# percentiles of unprojected draws, not of draws projected onto the simplex).
TABLE_FORMAT = 3


def classify_batch(map_batch: MapBatch, classifier: PatternClassifier) -> torch.Tensor:
    """(B, L, H) predicted class indices for every example and head of a batch."""
    attentions, lengths = map_batch.attentions, map_batch.batch.lengths
    batch, layers, heads = attentions.shape[:3]
    size, per_example = classifier.input_size, layers * heads
    # The batch's whole input, written once: pictures in the network's dtype and channels-last layout (its
    # own, so the first convolution copies nothing) and the profile scalars in float32.
    pictures = torch.empty((batch * per_example, size, size, IMAGE_CHANNELS), dtype=classifier.input_dtype
                           ).permute(0, 3, 1, 2)
    profile = torch.empty((batch * per_example, PROFILE_FEATURES), dtype=torch.float32)
    for n in torch.unique(lengths).tolist():  # examples of one length share one resize
        rows = torch.nonzero(lengths == n).flatten()
        maps = attentions[rows, :, :, :n, :n].reshape(-1, n, n)  # (b * L * H, n, n)
        first, count = int(rows[0]), len(rows)
        if bool((rows == torch.arange(first, first + count)).all()):  # a length-sorted batch: one slice, no copy
            span = slice(first * per_example, (first + count) * per_example)
            write_inputs(maps, pictures[span], profile[span])
        else:
            index = (rows[:, None] * per_example + torch.arange(per_example)).flatten()
            part_pictures = torch.empty((len(index), IMAGE_CHANNELS, size, size), dtype=pictures.dtype)
            part_profile = torch.empty((len(index), PROFILE_FEATURES), dtype=torch.float32)
            write_inputs(maps, part_pictures, part_profile)
            pictures[index], profile[index] = part_pictures, part_profile
    predicted = classifier.proba_parts(pictures, profile).argmax(1)
    return predicted.reshape(batch, layers, heads)


def head_class_counts(bundle, examples, classifier: PatternClassifier, *, batch_size: int = 32,
                      max_length: int = DEFAULT_MAX_LENGTH, progress: bool = True, encoded=None,
                      per_example: bool = False):
    """(L, H, 5) number of examples whose map at (layer, head) falls in each class.

    With ``per_example`` also returns (E, 5): each example's maps per class, summed over heads, in stream
    order (what a bootstrap over examples resamples).
    """
    encoded = encoded if encoded is not None else encode_examples(bundle.tokenizer, examples, max_length)
    counts = torch.zeros((bundle.num_layers, bundle.num_heads, len(CLASSES)), dtype=torch.long)
    example_counts = []
    bar = progress_bar(len(encoded) * bundle.num_layers * bundle.num_heads, bool(progress), "classify", unit="maps",
                       unit_scale=True)
    for map_batch in stream_maps(bundle, examples, max_length=max_length, batch_size=batch_size, encoded=encoded):
        predicted = classify_batch(map_batch, classifier)
        one_hot = torch.nn.functional.one_hot(predicted, len(CLASSES))  # (B, L, H, 5)
        counts += one_hot.sum(0)
        if per_example:
            example_counts.append(one_hot.sum((1, 2)))
        if bar is not None:
            bar.update(predicted.numel())
    if bar is not None:
        bar.close()
    if per_example:
        stacked = torch.cat(example_counts) if example_counts else torch.zeros((0, len(CLASSES)), dtype=torch.long)
        return counts.numpy(), stacked.numpy()
    return counts.numpy()


def pattern_table(counts: np.ndarray):
    """(L, H, 5) counts -> long frame layer, head, class, count, fraction (fraction of that head's maps), ci_low,
    ci_high (Wilson 95% interval of the fraction: a head has one map per example, so its count of a class is
    binomial over the examples; NaN for a head with no map)."""
    layers, heads, classes = counts.shape
    totals = counts.sum(axis=2, keepdims=True)
    fractions = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)
    interval = np.where((totals > 0)[..., None], wilson_intervals(counts, np.maximum(totals, 1)), np.nan)
    layer, head, cls = np.meshgrid(np.arange(layers), np.arange(heads), np.arange(classes), indexing="ij")
    return pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "class": np.asarray(CLASSES)[cls.ravel()],
                         "count": counts.ravel().astype(np.int64), "fraction": fractions.ravel(),
                         "ci_low": interval[..., 0].ravel(), "ci_high": interval[..., 1].ravel()})


def ratio_table(counts: np.ndarray, per_example: np.ndarray | None = None, confusion: np.ndarray | None = None,
                *, level: float = 0.95, seed: int = 0):
    """Kovaleva's per-task class ratios, three ways.

    counts: (L, H, 5) -> class, count, fraction (share of all the task's maps, as classified); with
    per_example (E, 5) also ci_low, ci_high (percentile bootstrap over examples, ``level``); with confusion
    (5, 5, the classifier's cross-validated true x predicted counts) also adjusted (adjusted classify-and-count,
    projected onto the simplex), and with both adjusted_ci_low, adjusted_ci_high (the same example draws, each
    adjusted with a redrawn confusion matrix, unprojected, cut to [0, 1]:
    analysis.uncertainty.adjusted_ratio_interval); no adjusted columns when the confusion matrix cannot be
    inverted (:func:`adjustment_problem`).
    """
    per_class = counts.reshape(-1, counts.shape[-1]).sum(0)
    total = max(int(per_class.sum()), 1)
    frame = pd.DataFrame({"class": list(CLASSES), "count": per_class.astype(np.int64), "fraction": per_class / total})
    drawn = per_example is not None and len(per_example) > 0
    if drawn:
        interval = bootstrap_ratio_interval(per_example, level=level, seed=seed)
        frame["ci_low"], frame["ci_high"] = interval[:, 0], interval[:, 1]
    if adjustment_problem(confusion) is None:
        frame["adjusted"] = adjusted_ratios(frame["fraction"].to_numpy(), np.asarray(confusion))
        if drawn:
            interval = adjusted_ratio_interval(per_example, confusion, level=level, seed=seed)
            frame["adjusted_ci_low"], frame["adjusted_ci_high"] = interval[:, 0], interval[:, 1]
    return frame


def example_pattern_table(encoded: Sequence[Encoded], per_example: np.ndarray) -> pd.DataFrame:
    """index (position in the data), example_id, <class>... (how many of the example's maps fall in each class,
    summed over its heads), in data order. per_example: (E, 5) in stream order (length-sorted, as
    :func:`head_class_counts` returns it). A paired comparison of two classifications of the same examples
    (compare-kinds) resamples these rows."""
    in_stream = [item for batch in length_sorted_batches(encoded, max(len(encoded), 1)) for item in batch]
    frame = pd.DataFrame(np.asarray(per_example, dtype=np.int64), columns=list(CLASSES))
    frame.insert(0, "example_id", [item.example_id for item in in_stream])
    frame.insert(0, "index", [item.index for item in in_stream])
    return frame.sort_values("index", kind="stable").reset_index(drop=True)


def ratio_uncertainty(n_examples: int, confusion: np.ndarray | None, ratios: pd.DataFrame) -> dict:
    """How pattern_ratios.csv's intervals and adjusted shares were made, and what they leave out (the manifest's
    ratio_uncertainty); ``clipped`` names the classes whose exact adjustment was negative (set to 0 by the
    projection: their observed share is below what the cross-validated error rates allow)."""
    draws = f"{DEFAULT_BOOTSTRAP} draws, seed 0"
    too_few = too_few_to_resample(n_examples)
    record = {"interval": (f"none ({too_few}): ci_low and ci_high are blank" if too_few else
                           f"95% percentile bootstrap over {n_examples} examples ({draws}; all heads' maps of an "
                           "example drawn together)"),
              "per_head": "patterns.csv: Wilson 95% interval over the examples, per head and class"}
    problem = adjustment_problem(confusion)
    if problem:
        record["adjusted"] = f"unavailable: {problem}"
        return record
    record["adjusted"] = ("adjusted classify-and-count with the classifier's cross-validated confusion matrix "
                          "(P(predicted | true), rows normalised), projected onto the simplex (Euclidean)")
    record["adjusted_interval"] = (f"none ({too_few}): adjusted_ci_low and adjusted_ci_high are blank" if too_few else
                                   f"95% percentile bootstrap: the same example draws, each adjusted with the "
                                   f"confusion matrix's rows redrawn from their {int(np.sum(confusion))} labeled "
                                   "maps (multinomial per true class), percentiles of the exact (unprojected) "
                                   "solutions cut to [0, 1] (a bound pushed past 0 or 1 keeps half the interval's "
                                   "width); it does not cover a difference between the "
                                   "labeled maps' error rates and this model's and task's, label noise, or the "
                                   "final fit erring otherwise than the cross-validation folds")
    solution = adjusted_solution(ratios["fraction"].to_numpy(), confusion)
    record["clipped"] = [name for name, value in zip(CLASSES, solution) if value < 0]
    return record


def too_few_to_resample(n_examples: int) -> str | None:
    """Why the ratio intervals, which resample examples, are left blank for ``n_examples`` examples holding maps
    (fewer than MIN_RESAMPLED: one example resampled shows no spread, not a certain value), or None."""
    if n_examples >= MIN_RESAMPLED:
        return None
    return (f"{n_examples} example{'' if n_examples == 1 else 's'} with maps; a bootstrap over examples needs at "
            f"least {MIN_RESAMPLED}, as fewer resampled show no spread, not a certain value")


def adjustment_problem(confusion: np.ndarray | None) -> str | None:
    """Why no adjusted ratios can be made with ``confusion`` ((5, 5) counts or None), or None when they can."""
    if confusion is None:
        return "the checkpoint records no confusion matrix"
    reason = singular_reason(confusion_rates(confusion), CLASSES)
    return None if reason is None else f"the checkpoint's cross-validated confusion matrix cannot be inverted: {reason}"


def classifier_confusion(classifier: PatternClassifier) -> np.ndarray | None:
    """(5, 5) cross-validated confusion (true x predicted) recorded in the checkpoint, or None."""
    confusion = classifier.metadata.get("cross_validation", {}).get("confusion")
    return None if confusion is None else np.asarray(confusion, dtype=np.float64)


def classify_task(bundle, data: TaskData, classifier: PatternClassifier, run: RunDir, batch_size: int = 32,
                  progress: bool = True, max_length: int = DEFAULT_MAX_LENGTH, cluster=None, *, encoded=None,
                  count=None):
    """Classify every head on every example of ``data``; write patterns.csv, pattern_ratios.csv and their
    figures (PNG + SVG) to ``run``. Returns the per-head frame (layer, head, class, count, fraction).
    ``cluster`` (analysis.cluster.Cluster): classify the batches on its workers (same counts), recorded in the
    manifest. ``encoded``: the examples already encoded (analysis.stream.encode_examples); ``count``: what
    computes the counts instead, called as :func:`head_class_counts` (:func:`classify_tasks` passes one that
    works a task ahead on the cluster)."""
    if not data.examples:
        raise AttnpatError(f"task {data.task} has no examples to classify")
    encoded = encoded if encoded is not None else encode_examples(bundle.tokenizer, data.examples, max_length)
    # a text such as "[SEP]" is the special tokens themselves: its maps would count as a pattern of no text
    check_has_text(bundle.tokenizer, encoded)
    with run.record("classify", bundle, data, max_length=max_length, classifier=classifier.path or "default",
                    classifier_trained_on=classifier.trained_on,
                    settings=classify_settings(bundle, data, classifier, max_length)) as entry:
        if cluster is not None:
            entry["cluster"] = cluster.manifest()
            if count is None:
                from classifier.distributed import distributed_class_counts  # noqa: PLC0415 (it builds on this module)

                count = functools.partial(distributed_class_counts, cluster)
        count = count or head_class_counts
        counts, per_example = count(bundle, data.examples, classifier, batch_size=batch_size, max_length=max_length,
                                    progress=progress, encoded=encoded, per_example=True)
        confusion = classifier_confusion(classifier)
        patterns, ratios = pattern_table(counts), ratio_table(counts, per_example, confusion)
        with_maps = int((np.asarray(per_example).sum(1) > 0).sum())  # the examples the intervals resample
        entry.update(ratio_uncertainty=ratio_uncertainty(with_maps, confusion, ratios))
        run.write_table("patterns", patterns)
        run.write_table("pattern_ratios", ratios)
        run.write_table("example_patterns", example_pattern_table(encoded, per_example))
        _save(run, "patterns",
              head_class_figure(counts, f"{bundle.name} on {data.task}: most frequent pattern per head"))
        _save(run, "pattern_ratios", ratio_figure({data.task: ratios}, f"{bundle.name}: pattern ratios"))
        entry.update(n_truncated=sum(item.truncated for item in encoded), n_maps=int(counts.sum()),
                     table_digests={name: _file_digest(run.current(name)) for name in TABLES})
    return patterns


TABLES = ("patterns.csv", "pattern_ratios.csv", "example_patterns.csv")


def classify_settings(bundle, data: TaskData, classifier: PatternClassifier, max_length: int) -> dict:
    """Everything a task's classification depends on: model revision, data, length limit, the classifier
    (a digest of its weights and metadata, and whether it runs in bfloat16) and the tables' layout."""
    digest = hashlib.sha256(json.dumps(classifier.metadata, sort_keys=True, default=str).encode())
    for name, tensor in sorted(classifier.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return {"model_revision": bundle.revision, "data": data.manifest(), "max_length": max_length,
            "classifier_digest": digest.hexdigest(), "bf16": bool(classifier.bf16), "table_format": TABLE_FORMAT}


def classification_is_current(run: RunDir, settings: dict) -> bool:
    """True when ``run`` holds a finished classification made with ``settings`` whose tables are the ones it
    wrote (a killed later run may have replaced a table without recording itself)."""
    entry = run.manifest().get("analyses", {}).get("classify") or {}
    return entry.get("settings") == settings and tables_as_recorded(run, entry)


def tables_as_recorded(run: RunDir, entry: dict) -> bool:
    """Whether ``run``'s tables are those its classify manifest ``entry`` recorded (their digests)."""
    digests = entry.get("table_digests") or {}
    return set(digests) == set(TABLES) and all(
        run.file(name).is_file() and _file_digest(run.file(name)) == digests[name] for name in TABLES)


def _file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def compare_tasks(bundle, ratios: dict, settings: dict, root: str | Path | None = None):
    """Write runs/<model>/all/pattern_ratios_by_task.csv (task, class, count, fraction [, ci_low, ci_high,
    adjusted, adjusted_ci_low, adjusted_ci_high]) over ``ratios`` ({task: pattern_ratios frame}) and the model's
    other tasks classified with the same ``settings`` (their data aside), and its grouped bars with intervals, with
    a manifest naming the tasks and those settings. Two commands classifying tasks of one model update it in turn,
    each joining the other's."""
    run = RunDir(bundle.slug, ALL_TASKS_DIR, root)
    with run.record("classify", bundle, wait=True, settings=shared_settings(settings)) as entry:
        # read under the folder's lock: a task another command finished meanwhile is joined, not lost
        ratios = {**classified_elsewhere(bundle.slug, settings, set(ratios), root), **ratios}
        entry["tasks"] = list(ratios)
        frame = pd.concat([table.assign(task=task) for task, table in ratios.items()], ignore_index=True)
        frame = frame[["task"] + [column for column in frame.columns if column != "task"]]
        run.write_table("pattern_ratios_by_task", frame)
        _save(run, "pattern_ratios_by_task", ratio_figure(ratios, f"{bundle.name}: pattern ratios per task"))
    return frame


def classify_saved_maps(path: str | Path, classifier: PatternClassifier, progress: bool = True,
                        batch_maps: int = 4096) -> pd.DataFrame:
    """Classify every single-head map in map files (one .npz or a folder): `attnpat extract` output, an
    annotation sample or a labeled set.

    Returns a frame with one row per map: map_id (analysis.mapstore.make_map_id, so it joins a labeled set's
    labels.csv), predicted, p_<class>...
    """
    frames, images, map_ids = [], [], []
    files = shard_files(path)  # a missing or empty path: one error line before a progress bar is drawn
    check_copies_agree(files, progress)  # two differing copies of a map: one error line before any is classified
    bar = progress_bar(None, bool(progress), "classify", unit="maps", unit_scale=True)

    def flush() -> None:
        probabilities = classifier.proba_images(torch.cat(images)).numpy()
        frame = pd.DataFrame(probabilities, columns=[f"p_{cls}" for cls in CLASSES])
        frame.insert(0, "predicted", np.asarray(CLASSES)[probabilities.argmax(1)])
        frame.insert(0, "map_id", list(map_ids))
        frames.append(frame)
        if bar is not None:
            bar.update(len(frame))
        images.clear()
        map_ids.clear()

    classified: set[str] = set()
    for file in files:
        for group in read_maps(file):
            new = not_yet_classified(group.map_ids, classified)
            if new.any():
                images.append(resize_maps(torch.from_numpy(group.attn[new]), classifier.input_size))
                map_ids.extend(map_id for map_id, keep in zip(group.map_ids, new) if keep)
            if len(map_ids) >= batch_maps:
                flush()
    if map_ids:
        flush()
    if bar is not None:
        bar.close()
    if not frames:
        raise AttnpatError(f"{path} holds no maps")
    return pd.concat(frames, ignore_index=True)


def check_copies_agree(files: Sequence[Path], progress: bool = True) -> None:
    """Read every map of ``files`` once, before any is classified: a map id met again with other values is an
    AttnpatError naming the id and both files (first_occurrences), raised before any work is done on the maps."""
    seen: dict[str, tuple[Path, bytes]] = {}
    bar = progress_bar(None, bool(progress), "check map copies", unit="maps", unit_scale=True)
    for file in files:
        for group in read_maps(file):
            first_occurrences(group, file, seen)
            if bar is not None:
                bar.update(len(group.map_ids))
    if bar is not None:
        bar.close()


def not_yet_classified(map_ids: Sequence[str], classified: set[str]) -> np.ndarray:
    """(k,) bool: which of k map ids ``classified`` does not hold yet (the first of a repeated one); adds them."""
    new = np.zeros(len(map_ids), dtype=bool)
    for k, map_id in enumerate(map_ids):
        if map_id not in classified:
            classified.add(map_id)
            new[k] = True
    return new


def first_occurrences(group: MapGroup, file: Path, seen: dict[str, tuple[Path, bytes]]) -> np.ndarray:
    """(k,) bool: which of ``group``'s k maps (read from ``file``) ``seen`` (map id -> the file it was first read
    from and a digest of its values) does not hold yet; records them there. A map id met again with the same values
    is the same map in two files (in a folder without an extraction index: a sample beside the extraction it was
    drawn from, a file copied twice): classified once, one row, as read_single_maps keeps it once. With other values
    neither row could be told right: AttnpatError naming the id and both files."""
    new = np.zeros(len(group.map_ids), dtype=bool)
    for k, (map_id, attn) in enumerate(zip(group.map_ids, group.attn, strict=True)):
        digest = hashlib.blake2b(np.ascontiguousarray(attn).tobytes(), digest_size=16).digest()
        if map_id not in seen:
            seen[map_id] = (file, digest)
            new[k] = True
        elif seen[map_id][1] != digest:
            first = seen[map_id][0]
            where = f"twice in {file}" if first == file else f"in {first} and in {file}"
            raise AttnpatError(f"map {map_id} is {where} with different values; remove the file that holds the "
                               "wrong one")
    return new


def write_map_classes(frame, path: str | Path) -> Path:
    return save_table(frame, path)


# ---------------------------------------------------------------- figures

def head_class_figure(counts: np.ndarray, title: str):
    """Layer x head grid coloured by each head's most frequent class, annotated with its fraction."""
    layers, heads, _ = counts.shape
    totals = np.maximum(counts.sum(2), 1)
    dominant = counts.argmax(2)
    share = counts.max(2) / totals
    fig, ax = plt.subplots(figsize=(max(4.5, 0.45 * heads + 2.5), max(2.8, 0.42 * layers + 1.4)))
    ax.imshow(dominant, cmap=ListedColormap(CLASS_COLOURS), vmin=-0.5, vmax=len(CLASSES) - 0.5, aspect="auto")
    for layer in range(layers):
        for head in range(heads):
            ax.text(head, layer, f"{share[layer, head]:.2f}", ha="center", va="center", fontsize=6, color="white")
    label_head_axes(ax, layers, heads)
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=c, label=cls) for c, cls in zip(CLASS_COLOURS, CLASSES)], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), title="class (share)", title_fontsize=7)
    fig.tight_layout()
    return fig


ADJUSTED_COLOUR = "#b2182b"


def ratio_figure(ratios: dict, title: str):
    """Grouped bars: per class, one bar per task = its share of all the task's maps as classified, with the
    95% bootstrap interval (when the table has ci_low/ci_high), and beside it the confusion-adjusted share as a
    diamond with its own interval (adjusted_ci_low/adjusted_ci_high)."""
    tasks = list(ratios)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(CLASSES) * max(1, len(tasks)) ** 0.5 + 2.5), 4.0))
    width = 0.8 / max(len(tasks), 1)
    x = np.arange(len(CLASSES))
    shades = np.linspace(1.0, 0.45, max(len(tasks), 1))
    handles = []
    for k, task in enumerate(tasks):
        table = ratios[task].set_index("class").loc[list(CLASSES)]
        offset = x - 0.4 + width * (k + 0.5)
        colours = [to_rgba(c, alpha=float(shades[k])) for c in CLASS_COLOURS]
        ax.bar(offset, table["fraction"], width=width * 0.92, color=colours, edgecolor="black", linewidth=0.3)
        _interval_bars(ax, offset - width * 0.12, table, "fraction", "ci_low", "ci_high", "black")
        if "adjusted" in table.columns:
            # beside the bar's own interval, so that the two never hide each other
            beside = offset + width * 0.18
            ax.scatter(beside, table["adjusted"], marker="D", s=14, color=ADJUSTED_COLOUR, zorder=3)
            _interval_bars(ax, beside, table, "adjusted", "adjusted_ci_low", "adjusted_ci_high", ADJUSTED_COLOUR)
        if len(tasks) > 1:
            for xpos in offset:
                ax.text(xpos, -0.02, task, rotation=90, ha="center", va="top", fontsize=6)
    any_table = pd.concat(list(ratios.values())) if ratios else pd.DataFrame()
    interval = " with 95% bootstrap interval" if "ci_low" in any_table.columns else ""
    handles.append(Patch(facecolor="lightgrey", edgecolor="black", linewidth=0.3, label=f"as classified{interval}"))
    if "adjusted" in any_table.columns:
        interval = " with 95% interval" if "adjusted_ci_low" in any_table.columns else ""
        handles.append(Line2D([], [], marker="D", markersize=4, color=ADJUSTED_COLOUR, linestyle="none",
                              label=f"adjusted for the classifier's confusion{interval}"))
    ax.set_xticks(x, list(CLASSES), fontsize=8)
    ax.tick_params(axis="x", pad=28 if len(tasks) > 1 else 4)
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of the task's maps", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(handles=handles, fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _interval_bars(ax, xpos: np.ndarray, table: pd.DataFrame, estimate: str, low: str, high: str, colour: str):
    """Error bars of ``table[estimate]`` from its ``low`` to its ``high`` column (none when it lacks them, e.g. a
    table joined from a run that wrote no intervals)."""
    if not {low, high} <= set(table.columns):
        return
    ax.errorbar(xpos, table[estimate], yerr=[table[estimate] - table[low], table[high] - table[estimate]],
                fmt="none", ecolor=colour, elinewidth=0.8, capsize=2)


def _save(run: RunDir, name: str, fig) -> None:
    run.write_figure(name, fig)
    close(fig)


def classify_tasks(bundle, tasks: Sequence[str], classifier: PatternClassifier, *, n: int | None = None,
                   split: str = "validation", batch_size: int = 32, max_length: int = DEFAULT_MAX_LENGTH,
                   root: str | Path | None = None, progress: bool = True, resume: bool | None = None,
                   columns: dict | None = None, cluster=None) -> dict:
    """classify_task for each task, then the per-task comparison. Returns {task: ratio frame}.
    ``cluster``: see :func:`classify_task` (its workers load the model once for all tasks).

    columns: a data file's text_column, pair_column and label_column (analysis.data.load_data).
    resume (default: when there are several tasks, as with ``--task all``): a task whose run directory
    already holds a current classification (:func:`classification_is_current`) is not classified again,
    so a killed run continues with the task it was on. On a cluster every task's batches go through one queue of
    the workers, which classify the next tasks while this process writes each task's tables and figures, in task
    order (classifier.distributed.TasksAhead)."""
    if not tasks:
        raise AttnpatError("no task to classify")
    resume = len(tasks) > 1 if resume is None else resume
    runs = []
    for task in tasks:
        data = load_data(task, split, n, **(columns or {}))
        run = RunDir(bundle.slug, data.task, root)
        current = resume and classification_is_current(run, classify_settings(bundle, data, classifier, max_length))
        runs.append((data, run, current))
    ratios = {}
    with _tasks_ahead(cluster, bundle, classifier, [data for data, _, current in runs if not current],
                      batch_size=batch_size, max_length=max_length, progress=progress) as ahead:
        for data, run, current in runs:
            if not current:
                computed = {} if ahead is None else {"encoded": ahead.encoded(data), "count": ahead.count}
                classify_task(bundle, data, classifier, run, batch_size=batch_size, progress=progress,
                              max_length=max_length, cluster=cluster, **computed)
            ratios[data.task] = run.read_table("pattern_ratios")
    settings = classify_settings(bundle, runs[0][0], classifier, max_length)
    compare_tasks(bundle, ratios, settings, root)
    return ratios


def shared_settings(settings: dict) -> dict:
    """The :func:`classify_settings` that tasks compared side by side share: all but their data, save its split
    (the comparison names tasks only, so a task's training examples must not stand beside others' validation
    ones)."""
    shared = {key: value for key, value in settings.items() if key != "data"}
    shared["split"] = (settings.get("data") or {}).get("split")
    return shared


def classified_elsewhere(model_slug: str, settings: dict, skip: set[str], root: str | Path | None = None) -> dict:
    """{task: pattern_ratios frame} of the model's other run folders classified with these ``settings`` (model
    revision, length limit, classifier, split; any examples of it), so that classifying one task keeps the others
    in the per-task comparison, and a table made otherwise never joins it."""
    wanted = shared_settings(settings)
    found = {}
    for run_folder in list_runs(root):
        classify = ((run_folder["manifest"].get("analyses") or {}).get("classify") or {})
        made = classify.get("settings") if isinstance(classify, dict) else None
        task = run_folder["task"]
        if (run_folder["model"] != model_slug or task in skip or task == ALL_TASKS_DIR or not isinstance(made, dict)
                or shared_settings(made) != wanted):
            continue
        run = RunDir(model_slug, task, root)
        try:
            # tables a killed later run (of other settings) landed without its manifest entry are not these settings'
            if tables_as_recorded(run, classify):
                found[task] = run.read_table("pattern_ratios")
        except (AttnpatError, OSError, ValueError):  # removed or damaged since: left out of the comparison
            continue
    return dict(sorted(found.items()))


def _tasks_ahead(cluster, bundle, classifier: PatternClassifier, datas: list[TaskData], **options):
    """On a cluster, classifier.distributed.TasksAhead over ``datas``; in one process a context yielding None."""
    if cluster is None:
        return contextlib.nullcontext(None)
    from classifier.distributed import TasksAhead  # noqa: PLC0415 (it builds on this module)

    return TasksAhead(cluster, bundle, classifier, datas, **options)


def available_glue_tasks(split: str = "validation") -> list[str]:
    """GLUE tasks whose ``split`` can be loaded now (offline files, or any split with the hub)."""
    check_split(split)  # a misspelt split is named as such, not "no task to classify"
    hub = hub_reachable()
    return [task for task in GLUE_TASKS if hub or split in offline_splits(task)]
