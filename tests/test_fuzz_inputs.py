"""Fuzzing every input door: random bytes, truncations, other encodings, wrong dtypes and shapes.

Each door (data file, map file, checkpoint, labeled set, Label Studio export) must either accept the input
or raise AttnpatError with a one-line message, never another exception, and must leave no file behind in
the folder it was called from. Examples per test are bounded (and deadline=None), so the whole module runs
in well under two minutes.
"""
from __future__ import annotations

import io
import json
import os
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.data import load_file
from analysis.errors import AttnpatError

# ATTNPAT_FUZZ_EXAMPLES=N runs N random examples per test (a longer hunt); the default is a fixed, quick set.
HUNT = int(os.environ.get("ATTNPAT_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=HUNT or 60, deadline=None, derandomize=not HUNT,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@contextmanager
def door(folder: Path):
    """Call a door inside ``folder`` (as the run directory and working directory): afterwards it must hold
    exactly the files it held before. Yields a list that receives the door's outcome."""
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before, "the door left a file behind"


def accepted_or_one_line(call):
    """Run ``call``: a result, or None after an AttnpatError whose message is one non-empty line."""
    try:
        return call()
    except AttnpatError as exc:
        message = str(exc)
        assert message and "\n" not in message and "\r" not in message, repr(message)
        return None


def fresh(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("door")


# ---------------------------------------------------------------- data files

SUFFIXES = st.sampled_from([".csv", ".tsv", ".jsonl", ".json"])


def valid_data_file(suffix: str, rows: list[tuple[str, str | None, object]]) -> bytes:
    if suffix in (".jsonl", ".json"):
        return "".join(json.dumps({"text": t, "text_pair": p, "label": lab}) + "\n" for t, p, lab in rows).encode()
    delimiter = "\t" if suffix == ".tsv" else ","
    import csv

    out = io.StringIO()
    writer = csv.writer(out, delimiter=delimiter)
    writer.writerow(["text", "text_pair", "label"])
    writer.writerows([(t, p or "", "" if lab is None else lab) for t, p, lab in rows])
    return out.getvalue().encode()


data_rows = st.lists(st.tuples(st.text(min_size=1, max_size=30), st.none() | st.text(max_size=20),
                               st.none() | st.integers(0, 3) | st.sampled_from(["pos", "neg", "1.5", "x y"])),
                     min_size=1, max_size=6)


def check_loaded(data) -> None:
    if data is None:
        return
    assert data.examples and all(e.text.strip() for e in data.examples)
    assert all(e.text_pair is None or e.text_pair.strip() for e in data.examples)
    labels = [e.label for e in data.examples if e.label is not None]
    assert all(isinstance(label, (int, float)) and not isinstance(label, bool) for label in labels)
    if data.label_names is not None:
        assert all(isinstance(label, int) and 0 <= label < len(data.label_names) for label in labels)
    assert "-" in data.task


@FUZZ
@given(content=st.binary(max_size=300), suffix=SUFFIXES)
def test_data_file_random_bytes(tmp_path_factory, content, suffix):
    folder = fresh(tmp_path_factory)
    (folder / f"d{suffix}").write_bytes(content)
    with door(folder):
        check_loaded(accepted_or_one_line(lambda: load_file(folder / f"d{suffix}")))


@FUZZ
@given(rows=data_rows, suffix=SUFFIXES, cut=st.floats(0, 1), encoding=st.sampled_from(
    ["utf-8", "utf-8-sig", "utf-16", "latin-1", "cp1252", "utf-32"]))
def test_data_file_truncated_or_re_encoded(tmp_path_factory, rows, suffix, cut, encoding):
    folder = fresh(tmp_path_factory)
    text = valid_data_file(suffix, rows).decode()
    try:
        content = text.encode(encoding)
    except UnicodeEncodeError:
        content = text.encode("utf-8")
    (folder / f"d{suffix}").write_bytes(content[:int(len(content) * cut)])
    with door(folder):
        check_loaded(accepted_or_one_line(lambda: load_file(folder / f"d{suffix}")))


@FUZZ
@given(lines=st.lists(json_values, min_size=1, max_size=5))
def test_data_file_jsonl_of_any_json(tmp_path_factory, lines):
    folder = fresh(tmp_path_factory)
    (folder / "d.jsonl").write_text("\n".join(json.dumps(value) for value in lines), encoding="utf-8")
    with door(folder):
        check_loaded(accepted_or_one_line(lambda: load_file(folder / "d.jsonl")))


@FUZZ
@given(rows=data_rows, suffix=SUFFIXES)
def test_data_file_valid_rows_load_exactly(tmp_path_factory, rows, suffix):
    folder = fresh(tmp_path_factory)
    (folder / f"d{suffix}").write_bytes(valid_data_file(suffix, rows))
    with door(folder):
        data = accepted_or_one_line(lambda: load_file(folder / f"d{suffix}"))
    if all(t.strip() and "\x00" not in t for t, _, _ in rows) and suffix in (".jsonl", ".json"):
        assert data is not None and [e.text for e in data.examples] == [t for t, _, _ in rows]
    check_loaded(data)
