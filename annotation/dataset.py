"""The labeled set: raw single-head maps joined to their labels. What the CNN classifier learns from.

A labeled set folder (e.g. annotation/labeled/v1/):
  maps.npz     the float32 single-head maps, with their tokens where known (the one map format of
               analysis.mapstore)
  labels.csv   map_id, label, annotator, labeled_at, task, example_id, layer, head, n, prediction
  CARD.md      how the labels were made, class counts, agreement
  annotations.csv  (optional) map_id, label, annotator, labeled_at, annotator_id: every single annotation
                   (attnpat annotate pull; annotator_id, the Label Studio user id, is blank in older sets)
  pull_report.json (optional) what the pull or merge that wrote the folder found
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.errors import AttnpatError
from analysis.mapstore import maps_digest, read_maps, write_single_maps
from analysis.paths import repo_root
from analysis.patterns import CLASSES
from analysis.rundir import atomic_write_text, locked, save_table, signals_held
from analysis.uncertainty import DEFAULT_BOOTSTRAP, bootstrap_statistic_interval

LABEL_COLUMNS = ("map_id", "label", "annotator", "labeled_at", "task", "example_id", "layer", "head", "n", "prediction")
# annotations.csv: one row per single label. annotator: the email shown for its author; annotator_id: the author's
# Label Studio user id (stable: an email can change between pulls), blank where unknown or in older sets
ANNOTATION_COLUMNS = ("map_id", "label", "annotator", "labeled_at", "annotator_id")


@dataclass
class LabeledSet:
    """maps: N maps (n_i, n_i) float32; labels: (N,) int indices into CLASSES; rows: the labels.csv rows;
    tokens: map_id -> its n_i tokens, for the maps stored with tokens."""

    maps: list[np.ndarray]
    labels: np.ndarray
    map_ids: list[str]
    rows: list[dict]
    path: Path | None = None
    tokens: dict[str, list[str]] = field(default_factory=dict)
    annotator: str | None = None  # whose first-round labels these are (annotator_labeled_set); None: the set's own

    @property
    def data_hash(self) -> str:
        """sha256 over map ids, labels and map bytes (analysis.mapstore.maps_digest): identifies exactly what a
        model was trained on."""
        return maps_digest(self.maps, self.map_ids, self.labels)

    def class_counts(self) -> dict[str, int]:
        return {name: int((self.labels == i).sum()) for i, name in enumerate(CLASSES)}

    def __len__(self) -> int:
        return len(self.map_ids)


def save_labeled_set(folder: str | Path, rows: list[dict], maps: dict[str, np.ndarray],
                     tokens: dict[str, list[str]] | None = None) -> Path:
    """Write maps.npz and labels.csv (atomically each). rows: dicts with LABEL_COLUMNS; maps: map_id -> (n, n);
    tokens: map_id -> its n tokens, where known."""
    folder = Path(folder)
    unknown = sorted({row["label"] for row in rows} - set(CLASSES))
    if unknown:
        raise AttnpatError(f"unknown labels {unknown}; the classes are {', '.join(CLASSES)}")
    missing = [row["map_id"] for row in rows if row["map_id"] not in maps]
    if missing:
        raise AttnpatError(f"{len(missing)} labels have no raw map (first: {missing[0]})")
    ids = [row["map_id"] for row in rows]
    tokens = tokens or {}
    write_single_maps(folder / "maps.npz", {i: maps[i] for i in ids}, {i: tokens[i] for i in ids if i in tokens})
    frame = pd.DataFrame(rows)
    for column in LABEL_COLUMNS:
        if column not in frame:
            frame[column] = None
    save_table(frame[list(LABEL_COLUMNS) + [c for c in frame.columns if c not in LABEL_COLUMNS]], folder / "labels.csv")
    return folder


def labeled_set_folder(folder: str | Path) -> Path:
    """``folder`` as given, or, when it is a relative path found neither here nor above here (no '..'), the set
    of that path shipped in the repository (the docs name them so: annotation/labeled/panel-4)."""
    folder = Path(folder)
    shipped = repo_root() / folder
    if (not folder.is_absolute() and ".." not in folder.parts and not folder.exists()
            and (shipped / "labels.csv").is_file()):
        return shipped
    return folder


def load_labeled_set(folder: str | Path) -> LabeledSet:
    """Read a labeled set; unknown labels and labels without maps raise AttnpatError. A class may be absent (a
    test panel in natural proportions can lack a rare class); training checks its classes itself (check_labels)."""
    folder = labeled_set_folder(folder)
    if not folder.exists():
        raise AttnpatError(f"{folder} does not exist (a labeled set is a folder with labels.csv and maps.npz)")
    if not (folder / "labels.csv").is_file() or not (folder / "maps.npz").is_file():
        raise AttnpatError(f"{folder} is not a labeled set (needs labels.csv and maps.npz)")
    try:
        # keep_default_na=False: an empty or "nan" cell stays that text (and is then an unknown label or map)
        frame = pd.read_csv(folder / "labels.csv", dtype={"map_id": str, "label": str}, keep_default_na=False)
    except Exception as exc:
        raise AttnpatError(f"{folder / 'labels.csv'} is not a readable CSV: {_first_line(exc)}") from exc
    if not {"map_id", "label"} <= set(frame.columns):
        raise AttnpatError(f"{folder / 'labels.csv'} needs map_id and label columns")
    frame = frame.astype({"map_id": str, "label": str})
    repeated = frame.map_id[frame.map_id.duplicated()]
    if len(repeated):
        raise AttnpatError(f"{folder.name}: labels.csv lists map {ascii(repeated.iloc[0][:80])} more than once")
    unknown = sorted(set(frame.label) - set(CLASSES))
    if unknown:
        raise AttnpatError(f"{folder.name}: unknown labels {unknown}; the classes are {', '.join(CLASSES)}")
    maps, tokens = {}, {}
    for group in read_maps(folder / "maps.npz"):
        for map_id, attn in zip(group.map_ids, group.attn, strict=True):
            if map_id in maps and not np.array_equal(maps[map_id], attn):  # before, the last one was taken silently
                raise AttnpatError(f"{folder.name}: maps.npz holds map {ascii(map_id[:80])} twice with different "
                                   "values; which one was labeled cannot be told")
            maps[map_id] = attn
            if group.tokens is not None:
                tokens[map_id] = group.tokens
    missing = [i for i in frame.map_id if i not in maps]
    if missing:
        raise AttnpatError(f"{folder.name}: {len(missing)} labels have no map in maps.npz (first: {missing[0]})")
    ids = list(frame.map_id)
    labels = np.asarray([CLASSES.index(label) for label in frame.label], dtype=np.int64)
    return LabeledSet([maps[i] for i in ids], labels, ids, frame.to_dict("records"), folder,
                      {i: tokens[i] for i in ids if i in tokens})


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:200]


def annotator_agreement(labeled: LabeledSet) -> np.ndarray | None:
    """(N,) float per map of ``labeled``: 1.0 where two or more annotators all gave the same label, 0.0 where
    they differed, NaN where fewer than two labeled it. None when the set has no annotations.csv."""
    path = labeled.path / "annotations.csv" if labeled.path is not None else None
    if path is None or not path.is_file():
        return None
    grouped = read_annotations(path).groupby("map_id")["label"].agg(["size", "nunique"])
    per_map = grouped.reindex(labeled.map_ids)  # maps nobody annotated: NaN counts
    return np.where(per_map["size"].to_numpy() >= 2, (per_map["nunique"].to_numpy() == 1).astype(float), np.nan)


def read_text_table(path: Path, columns: Sequence[str]) -> pd.DataFrame:
    """A CSV with every cell read as text, a blank one as "", holding at least ``columns``. An unreadable file
    (empty, binary, malformed) or a missing column is one AttnpatError naming the file."""
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except Exception as exc:  # pandas raises several kinds for a broken file: each is one line here
        raise AttnpatError(f"{path} is not a readable CSV: {_first_line(exc)}") from exc
    missing = [column for column in columns if column not in frame.columns]
    if missing:
        raise AttnpatError(f"{path} has no {' or '.join(missing)} column (it needs {', '.join(columns)})")
    return frame


def read_annotations(path: Path) -> pd.DataFrame:
    """A labeled set's annotations.csv: one row per single annotation, with at least map_id and label. Every
    cell is read as text, a blank one as "": an annotator id reads the same whatever the other rows hold, so the
    same annotation read from two sets compares equal."""
    return read_text_table(path, ("map_id", "label"))


def version_number(name: str) -> int | None:
    """N for the folder name of a labeled-set version, v<N> (ASCII digits); None for any other name."""
    # str.isdigit alone also takes '²' (which int() refuses) and other scripts' digits
    digits = name[1:]
    return int(digits) if name[:1] == "v" and digits.isascii() and digits.isdigit() else None


def next_version(base: str | Path) -> Path:
    """The folder for a new version of a labeled set: ``base``/v<N+1>, N the highest version there (v1 first)."""
    base = Path(base)
    versions = [number for path in base.glob("v*") if (number := version_number(path.name)) is not None]
    return base / f"v{1 + max(versions, default=0)}"


def write_new_version(base: str | Path, rows: list[dict], maps: dict[str, np.ndarray], annotations: list[dict],
                      summary: dict, tokens: dict[str, list[str]] | None = None) -> Path:
    """Write the labeled set as a new version of ``base`` (:func:`next_version`) and return its folder. The version
    is chosen, and the set renamed into place, under ``base``'s lock, so two pulls at once write two versions."""
    base = Path(base)
    with locked(base / ".pull.lock", f"a new version of the labeled set {base}", wait=True):
        return write_labeled_folder(next_version(base), rows, maps, annotations, summary, tokens)


def labeled_set_name(folder: str | Path) -> str:
    """The name a labeled set's runs go under (runs/classifier/<name>/): its folder's name, with the sample's name
    in front for a version that `annotate pull` wrote (workspace/annotation/labeled/<sample>/v1 -> '<sample>-v1'),
    so the first versions of two samples do not share one run directory; the repository's sets keep their name."""
    folder = Path(folder).resolve()
    if version_number(folder.name) is not None and folder.parent.name not in ("", "labeled"):
        return f"{folder.parent.name}-{folder.name}"
    return folder.name


def merge_labeled_sets(folders: list[str | Path], out: str | Path) -> LabeledSet:
    """One labeled set from several (e.g. the shipped set plus a new round of labels), written to ``out``.

    Rows keep their order (set by set) and gain a ``source`` column ("<parent>/<folder>" of the set they came
    from). annotations.csv files are concatenated too. A map labeled in two sets is an error unless map and
    label agree (then it is kept once).
    The folder is written whole or not at all.
    """
    if len(folders) < 2:
        raise AttnpatError("merging needs at least two labeled sets")
    folders = [labeled_set_folder(folder) for folder in folders]  # the folders read, also shipped sets
    resolved = [folder.resolve() for folder in folders]
    if len(set(resolved)) < len(resolved):
        raise AttnpatError("a labeled set is named twice; each map's annotations would count twice")
    check_labeled_out(Path(out), inputs=folders)
    rows, maps, tokens, annotations, seen = [], {}, {}, [], {}
    for folder in map(Path, folders):
        labeled = load_labeled_set(folder)
        check_same_tokens(tokens, labeled.tokens, folder)
        tokens.update(labeled.tokens)
        for row, map_id, attn in zip(labeled.rows, labeled.map_ids, labeled.maps):
            if map_id in seen:
                same = seen[map_id] == row["label"] and np.array_equal(maps[map_id], attn)
                if not same:
                    raise AttnpatError(f"map {map_id} is in two sets with a different label or map; fix one first")
                continue
            seen[map_id] = row["label"]
            maps[map_id] = attn
            source = row.get("source") if isinstance(row.get("source"), str) else f"{folder.parent.name}/{folder.name}"
            rows.append({**row, "source": source})
        if (labeled.path / "annotations.csv").is_file():
            annotations.extend(read_annotations(labeled.path / "annotations.csv").to_dict("records"))
    # the same annotation reached through two sets (one merged from the other) counts once
    annotations = _distinct_annotations(annotations)
    summary = {"merged_from": [str(folder) for folder in folders], "labeled": len(rows),
               "class_counts": {name: sum(r["label"] == name for r in rows) for name in CLASSES}}
    write_labeled_folder(Path(out), rows, maps, annotations, summary, tokens)
    return load_labeled_set(out)


def check_same_tokens(kept: dict[str, list[str]], incoming: dict[str, list[str]], folder: Path) -> None:
    """AttnpatError when ``incoming`` (map_id -> tokens, of the set in ``folder``) gives a map other tokens than
    ``kept`` (the sets merged before it): which text the map was made from cannot be told, and keeping the later
    set's would change the earlier's in silence."""
    for map_id, words in incoming.items():
        if map_id in kept and list(kept[map_id]) != list(words):
            raise AttnpatError(f"map {ascii(map_id[:80])} has other tokens in {folder} than in a set before it; "
                               "fix one first")


def _distinct_annotations(records: list[dict]) -> list[dict]:
    """annotations.csv rows of several sets with each annotation once, where the first row that holds it stood:
    that row, or a later copy that carries the annotator's user id where the first carries none (a set pulled
    before annotator_id was kept), since the id tells annotators apart where the name shown may not."""
    kept, owner = [], {}  # owner: annotation key -> index of the kept row that holds it
    for record in records:
        keys = _annotation_keys(record)
        held = sorted({owner[key] for key in keys if key in owner})
        if not held:
            held = [len(kept)]
            kept.append(record)
        elif _has_annotator_id(record) and not _has_annotator_id(kept[held[0]]):
            kept[held[0]] = record
        # a dropped row's keys too: it may link a later row to the kept one
        owner.update(dict.fromkeys(keys, held[0]))
    return kept


def _has_annotator_id(record: dict) -> bool:
    return record.get("annotator_id") not in ("", None)


def _annotation_keys(record: dict) -> set[tuple]:
    """What identifies one annotation among several sets' rows: its cells with the email shown for its author, and,
    where its author's user id is known, its cells with that id instead of the email. A pull before and after an
    annotator changed their email, or a pull from the server (emails) and one from an export file (user ids),
    hold the same annotation under two names, and a set pulled before annotator_id was recorded has no id."""
    cells = {key: value for key, value in record.items() if not (key == "annotator_id" and value in ("", None))}
    keys = {("by name", tuple(sorted((key, value) for key, value in cells.items() if key != "annotator_id")))}
    if "annotator_id" in cells:
        keys.add(("by id", tuple(sorted((key, value) for key, value in cells.items() if key != "annotator"))))
    return keys


def check_labeled_out(out: Path, inputs: Sequence[str | Path] = ()) -> None:
    """Refuse an output folder whose replacement would delete something else: an existing path that is not a
    folder, a non-empty folder without labels.csv (not a labeled set), or a folder that is or holds one of
    ``inputs``. An existing labeled set is replaced whole, as the verbs that write one say."""
    target = out.resolve()
    for folder in map(Path, inputs):
        if folder.resolve() == target or target in folder.resolve().parents:
            raise AttnpatError(f"--out {out} would replace the input set {folder}; name a new folder")
    if out.exists() and not out.is_dir():
        raise AttnpatError(f"--out {out} is a file, not a labeled-set folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "labels.csv").is_file():
        raise AttnpatError(f"--out {out} is a folder with other files in it (no labels.csv); "
                           "name a new folder or an earlier labeled set to replace")


def write_labeled_folder(out: Path, rows: list[dict], maps: dict[str, np.ndarray], annotations: list[dict],
                         summary: dict, tokens: dict[str, list[str]] | None = None) -> Path:
    """Write the labeled set (maps.npz, labels.csv), annotations.csv and pull_report.json into a temporary
    sibling folder, then rename it onto ``out`` (replacing an older labeled set of that name; anything else
    there is refused: :func:`check_labeled_out`)."""
    check_labeled_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; the labeled set is an ordinary folder
    try:
        save_labeled_set(staging, rows, maps, tokens)
        # with no annotations the table still gets its header, so that every reader can parse it
        save_table(pd.DataFrame(annotations, columns=None if annotations else list(ANNOTATION_COLUMNS)),
                   staging / "annotations.csv")
        atomic_write_text(staging / "pull_report.json", json.dumps(summary, indent=2))
        if out.exists():
            retired = out.with_name(f".{out.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            # a stop between the two renames would leave no set at ``out`` (the old one hidden, the new one
            # deleted below): Ctrl-C and SIGTERM are held back until both are done
            with signals_held():
                out.rename(retired)
                staging.rename(out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def fleiss_kappa(label_lists: list[list[str]], classes=CLASSES) -> float:
    """Fleiss' kappa for items rated by several annotators (equal to Cohen's kappa's chance model for 2
    raters of equal marginals). label_lists: one list of labels per item, each of length >= 2. NaN when every
    label is one class: chance agreement is then certain and kappa is 0 / 0, not a perfect 1."""
    return kappa_of_counts(rating_counts(label_lists, classes))


def rating_counts(label_lists: list[list[str]], classes=CLASSES) -> np.ndarray:
    """(N, K) how many of item n's labels are class k; refuses an item with fewer than two labels."""
    counts = np.asarray([[labels.count(c) for c in classes] for labels in label_lists],
                        dtype=float).reshape(len(label_lists), len(classes))
    if (counts.sum(1) < 2).any():
        raise AttnpatError("Fleiss' kappa needs at least two labels per item")
    return counts


def kappa_of_counts(counts: np.ndarray) -> float:
    """Fleiss' kappa of (N, K) rating counts (:func:`rating_counts`), each row summing to 2 or more; NaN when
    every label is one class."""
    raters = counts.sum(1)
    per_item = ((counts ** 2).sum(1) - raters) / (raters * (raters - 1))
    p_bar = per_item.mean()
    shares = counts.sum(0) / counts.sum()
    p_e = float((shares ** 2).sum())
    return float((p_bar - p_e) / (1 - p_e)) if p_e < 1 else float("nan")


def fleiss_kappa_interval(label_lists: list[list[str]], classes=CLASSES, *, level: float = 0.95,
                          n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """Percentile bootstrap interval of :func:`fleiss_kappa`, resampling the items (maps) with their labels.

    label_lists: N lists of labels, each of length >= 2. Returns (2,) lower and upper bounds
    (analysis.uncertainty.bootstrap_statistic_interval, seed fixed). A draw whose labels are all one class has
    no kappa (NaN, as fleiss_kappa gives it) and is left out of the percentiles, so the bounds are over the
    draws that have one; NaN bounds when no draw has one, or with fewer than two items (one map resampled
    shows no spread)."""
    if not label_lists:
        raise AttnpatError("an interval of Fleiss' kappa needs at least one item")
    counts = rating_counts(label_lists, classes)  # (N, K), counted once: each draw only picks rows
    return bootstrap_statistic_interval(lambda draw: kappa_of_counts(counts[draw]), len(counts), level=level,
                                        n_boot=n_boot, seed=seed)


def cohen_kappa(first: np.ndarray, second: np.ndarray, n_classes: int = len(CLASSES)) -> float:
    """Cohen's kappa of two annotators' labels of the same N items. first, second: (N,) class indices, N >= 1.
    Chance agreement multiplies each annotator's own class shares; NaN when it is certain (both gave every item
    one and the same class), as :func:`fleiss_kappa` gives it."""
    joint = np.zeros((n_classes, n_classes))
    np.add.at(joint, (np.asarray(first), np.asarray(second)), 1)  # (K, K): first's class x second's
    total = joint.sum()
    observed = np.trace(joint) / total
    chance = float(joint.sum(1) @ joint.sum(0)) / total ** 2
    return float((observed - chance) / (1 - chance)) if chance < 1 else float("nan")


def cohen_kappa_interval(first: np.ndarray, second: np.ndarray, *, level: float = 0.95,
                         n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0) -> np.ndarray:
    """Percentile bootstrap interval of :func:`cohen_kappa`, resampling the items with both their labels.

    first, second: (N,) class indices of the same N items. Returns (2,) lower and upper bounds
    (analysis.uncertainty.bootstrap_statistic_interval, seed fixed); draws whose kappa is undefined are left out,
    and fewer than two items give NaN bounds, as :func:`fleiss_kappa_interval` does."""
    first, second = np.asarray(first), np.asarray(second)
    if len(first) != len(second) or not len(first):
        raise AttnpatError(f"an interval of Cohen's kappa needs two labels of each item, at least one item; got "
                           f"{len(first)} and {len(second)} labels")
    return bootstrap_statistic_interval(lambda draw: cohen_kappa(first[draw], second[draw]), len(first),
                                        level=level, n_boot=n_boot, seed=seed)


@dataclass
class SetAgreement:
    """Fleiss' kappa of a labeled set's first-round labels (:func:`first_round_annotations`) over the ``maps``
    maps with two or more of them, with its percentile bootstrap 95% interval over those maps (low, high: NaN from
    one map), and how many of the maps got equal labels from all their annotators (``unanimous``)."""

    kappa: float
    low: float
    high: float
    maps: int
    unanimous: int


def set_agreement(labeled: LabeledSet, earlier: str | None = None, *, n_boot: int = DEFAULT_BOOTSTRAP,
                  seed: int = 0) -> SetAgreement:
    """The agreement of ``labeled``'s annotators (:class:`SetAgreement`), from its annotations.csv (with ``earlier``'s
    labels in place, :func:`read_single_annotations`). AttnpatError when it has none, or no map has two first-round
    labels."""
    first_round = first_round_annotations(labeled, earlier)
    # in map-id order, as pull takes them: the same labels get the same bootstrap draws, so the same interval
    label_lists = [list(group.label) for _, group in first_round.groupby("map_id")]
    several = [labels for labels in label_lists if len(labels) >= 2]
    if not several:
        raise AttnpatError(f"{labeled.path}: no map has two first-round labels, so there is no agreement to measure")
    low, high = fleiss_kappa_interval(several, n_boot=n_boot, seed=seed)
    return SetAgreement(fleiss_kappa(several), float(low), float(high), len(several),
                        sum(len(set(labels)) == 1 for labels in several))


# ---------------------------------------------------------------- single annotators

def is_tie(labels: list[str]) -> bool:
    """Whether the most frequent labels of a map's list are two or more equally frequent ones."""
    ranked = Counter(labels).most_common()
    return len(ranked) > 1 and ranked[0][1] == ranked[1][1]


def first_round_size(label_lists: Sequence[Sequence[str]]) -> int:
    """The independent round's size: the most common number of labels per map (the smaller on a tie)."""
    sizes = Counter(len(labels) for labels in label_lists)
    return max(sizes, key=lambda size: (sizes[size], -size))


def independent_labels(labels: list[str], round_size: int) -> list[str]:
    """A map's labels (earliest first) without those that settled a tie: when its first ``round_size`` labels
    (the independent round) tie, the later ones were asked for because of it, and are left out."""
    independent = labels[:round_size]
    return independent if len(labels) > round_size and is_tie(independent) else labels


def read_single_annotations(labeled: LabeledSet, earlier: str | None = None) -> pd.DataFrame:
    """The set's annotations.csv rows on its maps (with ``earlier``, a file of earlier labels in its folder such as
    annotations-before-rule9.csv, its rows stand in for annotations.csv's on the maps it holds: the labels as they
    were before a relabel) (map_id, label, annotator, ...), each map's earliest first as
    `annotate pull` writes them, with two more columns: annotator_key, who wrote the row (:func:`annotator_keys`),
    and annotator_name, how to show them (:func:`annotator_names`). AttnpatError when the set has none, or one
    annotator labeled a map twice (a pull keeps each annotator's last word only, so such a file was written by hand
    and cannot be read as votes)."""
    path = labeled.path / "annotations.csv" if labeled.path is not None else None
    if path is None or not path.is_file():
        raise AttnpatError(f"{labeled.path}: no annotations.csv, so its single annotators' labels are unknown")
    frame = read_text_table(path, ("map_id", "label", "annotator"))
    if earlier is not None:
        frame = with_earlier_labels(frame, labeled.path, earlier)
    frame = frame.assign(annotator_key=annotator_keys(frame))
    frame = frame.assign(annotator_name=frame.annotator_key.map(annotator_names(frame)))
    frame = frame[frame.map_id.isin(set(labeled.map_ids))]
    twice = frame[frame.duplicated(["map_id", "annotator_key"])]
    if len(twice):
        raise AttnpatError(f"{path}: annotator {ascii(twice.annotator_name.iloc[0][:80])} labeled map "
                           f"{ascii(twice.map_id.iloc[0][:80])} twice; an annotator may label a map once")
    unknown = sorted(set(frame.label) - set(CLASSES))
    if unknown:
        raise AttnpatError(f"{path}: unknown labels {unknown}; the classes are {', '.join(CLASSES)}")
    return frame


ID_PREFIX = "id:"  # an annotator_key of a known Label Studio user id; a key without it is a name (older sets)


def annotator_keys(frame: pd.DataFrame) -> pd.Series:
    """(rows,) who wrote each annotations.csv row of ``frame``: 'id:<annotator_id>' where the Label Studio user id is
    known (an email can change between pulls, and two users can show one name); else the name shown (sets pulled
    before annotator_id was kept), or that user's id where the name was shown for exactly one id in the file."""
    ids = frame["annotator_id"] if "annotator_id" in frame else pd.Series("", index=frame.index)
    known = frame[ids != ""]
    ids_of_name = known.groupby("annotator")["annotator_id"].unique() if len(known) else pd.Series(dtype=object)
    one_id = {name: ID_PREFIX + found[0] for name, found in ids_of_name.items() if len(found) == 1}
    return pd.Series([ID_PREFIX + user if user else one_id.get(name, name)
                      for user, name in zip(ids, frame.annotator, strict=True)], index=frame.index, dtype=object)


def annotator_names(frame: pd.DataFrame) -> dict[str, str]:
    """annotator_key (:func:`annotator_keys`, a column of ``frame``) -> the name to show: for a user id, the latest
    email seen for it (by labeled_at, then file order), with ' (id N)' added where another annotator shows the
    same name; for a name, the name itself."""
    ordered = frame.sort_values("labeled_at", kind="stable") if "labeled_at" in frame else frame
    latest = dict(zip(ordered.annotator_key, ordered.annotator, strict=True))  # the last row of each key wins
    shown = Counter(latest.values())
    return {key: (f"{name} (id {key[len(ID_PREFIX):]})" if key.startswith(ID_PREFIX) and shown[name] > 1 else name)
            for key, name in latest.items()}


def with_earlier_labels(frame: pd.DataFrame, folder: Path, earlier: str) -> pd.DataFrame:
    """annotations.csv rows ``frame`` with the rows of ``earlier`` (a file in ``folder``) in place of its rows on
    the maps that file holds. A name that is no file there, or a path, is one AttnpatError."""
    if Path(earlier).name != earlier or not (folder / earlier).is_file():
        raise AttnpatError(f"--earlier-labels {earlier!r} must name a file in {folder} (no '/')")
    before = read_text_table(folder / earlier, ("map_id", "label", "annotator"))
    return pd.concat([frame[~frame.map_id.isin(set(before.map_id))], before], ignore_index=True).fillna("")


def first_round_annotations(labeled: LabeledSet, earlier: str | None = None) -> pd.DataFrame:
    """The independent (first-round) annotations of the set's maps: :func:`read_single_annotations` without the
    labels that settled a tie, as Fleiss' kappa leaves them out (annotation.labelstudio.independent_kappa)."""
    return first_round_of(read_single_annotations(labeled, earlier))


def first_round_of(frame: pd.DataFrame) -> pd.DataFrame:
    """Annotations ``frame`` (:func:`read_single_annotations`, each map's earliest first) without the labels that
    settled a tie (:func:`independent_labels`)."""
    groups = [group for _, group in frame.groupby("map_id", sort=False)]
    if not groups:
        return frame
    round_size = first_round_size([list(group.label) for group in groups])
    kept = [group.iloc[:len(independent_labels(list(group.label), round_size))] for group in groups]
    return pd.concat(kept)


def annotator_labeled_set(labeled: LabeledSet, annotator: str) -> LabeledSet:
    """The maps of ``labeled`` that ``annotator`` (a name shown for them, or their Label Studio user id) labeled in the
    first round, with that annotator's labels (in the set's map order); its annotator is the name shown for them
    (:func:`annotator_names`). An unknown or ambiguous annotator, or one who gave only labels that settled ties, is
    one AttnpatError naming the annotators there are."""
    annotations = read_single_annotations(labeled)  # read once: the first round is taken from it
    first_round = first_round_of(annotations)
    key = find_annotator(annotations, annotator, labeled.path)
    shown = annotations.annotator_name[annotations.annotator_key == key].iloc[0]
    mine = first_round[first_round.annotator_key == key]
    own = dict(zip(mine.map_id, mine.label, strict=True))
    if not own:
        raise AttnpatError(f"{labeled.path}: {shown} only settled ties (no first-round label); the first-round "
                           f"annotators are {', '.join(sorted(set(first_round.annotator_name)))}")
    keep = [i for i, map_id in enumerate(labeled.map_ids) if map_id in own]
    ids = [labeled.map_ids[i] for i in keep]
    labels = np.asarray([CLASSES.index(own[map_id]) for map_id in ids], dtype=np.int64)
    rows = [{**labeled.rows[i], "label": own[labeled.map_ids[i]], "annotator": shown} for i in keep]
    return LabeledSet([labeled.maps[i] for i in keep], labels, ids, rows, labeled.path,
                      {map_id: labeled.tokens[map_id] for map_id in ids if map_id in labeled.tokens}, shown)


def find_annotator(annotations: pd.DataFrame, annotator: str, where: Path | None) -> str:
    """The annotator_key of ``annotator`` in ``annotations`` (:func:`read_single_annotations`): the user whose id it
    is, else the one annotator shown under that name (now or in an earlier pull). None found, or a name shown for
    several users, is one AttnpatError listing the annotators there are."""
    if "annotator_id" in annotations and (annotations.annotator_id == annotator).any():
        return ID_PREFIX + annotator
    found = sorted(set(annotations.annotator_key[(annotations.annotator == annotator)
                                                 | (annotations.annotator_name == annotator)]))
    listing = ", ".join(sorted(_listed(annotations))) or "none"
    if not found:
        raise AttnpatError(f"{where}: no annotator {ascii(annotator)}; its annotators are {listing}")
    if len(found) > 1:
        raise AttnpatError(f"{where}: {ascii(annotator)} is shown for {len(found)} annotators; name one by its user "
                           f"id: {listing}")
    return found[0]


def _listed(annotations: pd.DataFrame) -> set[str]:
    """Each annotator once, as --annotator takes them: the name shown, with the user id where known."""
    names = dict(zip(annotations.annotator_key, annotations.annotator_name, strict=True))
    return {name if not key.startswith(ID_PREFIX) or name.endswith(f" (id {key[len(ID_PREFIX):]})")
            else f"{name} (id {key[len(ID_PREFIX):]})" for key, name in names.items()}
