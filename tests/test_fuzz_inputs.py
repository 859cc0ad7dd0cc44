"""Fuzzing every input door: random bytes, truncations, other encodings, wrong dtypes and shapes.

Each door (data file, map file, checkpoint, labeled set, Label Studio export) must either accept the input
or raise AttnpatError with a one-line message, never another exception, and must leave no file behind in
the folder it was called from. Examples per test are bounded (and deadline=None), so the whole module runs
in well under two minutes.
"""
from __future__ import annotations

import csv
import io
import json
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst
from safetensors.torch import load_file as load_tensors
from safetensors.torch import save_file

from analysis.data import load_file
from analysis.errors import AttnpatError
from analysis.mapstore import read_maps, write_single_maps
from annotation.dataset import load_labeled_set
from annotation.labelstudio import read_export
from app.cli import main
from classifier.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from tests.tiny import save_tiny_model

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
    # labels all numbers or all class names ("1.5" is a number): a column mixing the two is refused
    one_label_kind = len({label in ("pos", "neg", "x y") for _, _, label in rows if label is not None}) <= 1
    if all(t.strip() and "\x00" not in t for t, _, _ in rows) and suffix in (".jsonl", ".json") and one_label_kind:
        assert data is not None and [e.text for e in data.examples] == [t for t, _, _ in rows]
    check_loaded(data)


# ---------------------------------------------------------------- map files

def valid_map_file(path: Path, lengths: list[int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    maps = {f"m:t:ex{k}:L0H{k}": rng.dirichlet(np.ones(n), size=n).astype(np.float32) for k, n in enumerate(lengths)}
    return write_single_maps(path, maps, {f"m:t:ex{k}:L0H{k}": [f"w{i}" for i in range(n)]
                                          for k, n in enumerate(lengths) if k % 2 == 0})


def check_groups(groups) -> None:
    if groups is None:
        return
    for group in groups:
        k, n = len(group.heads), len(group.attn[0]) if len(group.attn) else 0
        assert group.attn.shape == (k, n, n) and group.heads.shape == (k, 2) and np.isfinite(group.attn).all()
        assert group.tokens is None or len(group.tokens) == n
        assert len(group.map_ids) == k


MAP_ARRAYS = ["format", "models", "tasks", "example_ids", "lengths", "head_counts", "heads", "attn", "has_tokens",
              "tokens", "token_type_ids"]
random_arrays = npst.arrays(dtype=st.sampled_from([np.int8, np.int32, np.int64, np.uint16, np.float16, np.float32,
                                                   np.float64, np.bool_, np.dtype("<U4")]),
                            shape=npst.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))


@FUZZ
@given(content=st.binary(max_size=400), prefix=st.sampled_from([b"", b"PK\x03\x04", b"\x93NUMPY"]))
def test_map_file_random_bytes(tmp_path_factory, content, prefix):
    folder = fresh(tmp_path_factory)
    (folder / "maps.npz").write_bytes(prefix + content)
    with door(folder):
        check_groups(accepted_or_one_line(lambda: read_maps(folder / "maps.npz")))


@FUZZ
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), cut=st.floats(0, 1))
def test_map_file_truncated(tmp_path_factory, lengths, cut):
    folder = fresh(tmp_path_factory)
    path = valid_map_file(folder / "maps.npz", lengths)
    content = path.read_bytes()
    path.write_bytes(content[:int(len(content) * cut)])
    with door(folder):
        check_groups(accepted_or_one_line(lambda: read_maps(path)))


def damaged_map_file(path, lengths, name, replacement):
    """A valid map file whose array ``name`` is replaced by ``replacement`` (deleted when None)."""
    valid_map_file(path, lengths)
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    if replacement is None:
        del arrays[name]
    else:
        arrays[name] = replacement
    np.savez(path, **arrays)
    return path


@FUZZ
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), name=st.sampled_from(MAP_ARRAYS),
       replacement=random_arrays | st.none())
def test_map_file_with_an_array_of_another_dtype_or_shape(tmp_path_factory, lengths, name, replacement):
    folder = fresh(tmp_path_factory)
    path = damaged_map_file(folder / "maps.npz", lengths, name, replacement)
    with door(folder):
        check_groups(accepted_or_one_line(lambda: read_maps(path)))


# ---------------------------------------------------------------- checkpoints

def checkpoint_parts():
    metadata = json.loads(DEFAULT_CHECKPOINT.with_suffix(".json").read_text())
    return load_tensors(str(DEFAULT_CHECKPOINT)), metadata


@FUZZ
@given(cut=st.floats(0, 1), noise=st.binary(max_size=64), position=st.floats(0, 1))
def test_checkpoint_truncated_or_overwritten(tmp_path_factory, cut, noise, position):
    folder = fresh(tmp_path_factory)
    content = bytearray(DEFAULT_CHECKPOINT.read_bytes())
    at = int(len(content) * position)
    content[at:at + len(noise)] = noise
    (folder / "cnn.safetensors").write_bytes(bytes(content[:max(int(len(content) * cut), 1)]))
    with door(folder):
        accepted_or_one_line(lambda: load_checkpoint(folder / "cnn.safetensors"))


@FUZZ
@given(key=st.sampled_from(["format", "classes", "channels", "strides", "input_size", None]), value=json_values,
       tensor=st.sampled_from([None, "drop", "shape", "dtype", "nan"]), beside=st.none() | json_values)
def test_checkpoint_with_wrong_metadata_or_tensors(tmp_path_factory, key, value, tensor, beside):
    folder = fresh(tmp_path_factory)
    state, metadata = checkpoint_parts()
    metadata = value if key is None else {**metadata, key: value}
    name = sorted(state)[0]
    if tensor == "drop":
        del state[name]
    elif tensor == "shape":
        state[name] = torch.zeros(3, 2)
    elif tensor == "dtype":
        state[name] = state[name].to(torch.int32)
    elif tensor == "nan":
        state[name] = torch.full_like(state[name], float("nan")) if state[name].is_floating_point() else state[name]
    path = folder / "cnn.safetensors"
    save_file(state, str(path), metadata={"attnpat": json.dumps(metadata)})
    if beside is not None:
        path.with_suffix(".json").write_text(json.dumps(beside))
    with door(folder):
        accepted_or_one_line(lambda: load_checkpoint(path))


# ---------------------------------------------------------------- labeled sets

@FUZZ
@given(labels=st.binary(max_size=300) | st.text(max_size=300).map(str.encode),
       maps=st.sampled_from(["valid", "bytes", "missing"]))
def test_labeled_set_with_any_labels_table(tmp_path_factory, labels, maps):
    folder = fresh(tmp_path_factory)
    (folder / "labels.csv").write_bytes(labels)
    if maps == "valid":
        valid_map_file(folder / "maps.npz", [3, 4, 5, 6, 3])
    elif maps == "bytes":
        (folder / "maps.npz").write_bytes(labels[:50])
    with door(folder):
        labeled = accepted_or_one_line(lambda: load_labeled_set(folder))
    if labeled is not None:
        assert len(labeled.maps) == len(labeled.labels) == len(labeled.map_ids)


@FUZZ
@given(rows=st.lists(st.tuples(st.sampled_from([f"m:t:ex{k}:L0H{k}" for k in range(6)] + ["", "x", "nan"]),
                               st.sampled_from(["vertical", "diagonal", "vertical+diagonal", "block",
                                                "heterogeneous", "Block", "", "none"])),
                     min_size=0, max_size=12))
def test_labeled_set_with_any_rows(tmp_path_factory, rows):
    folder = fresh(tmp_path_factory)
    valid_map_file(folder / "maps.npz", [3, 4, 5, 6, 3])
    with open(folder / "labels.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["map_id", "label"])
        writer.writerows(rows)
    with door(folder):
        labeled = accepted_or_one_line(lambda: load_labeled_set(folder))
    if labeled is not None:
        assert len(set(labeled.map_ids)) == len(labeled.map_ids) == len(rows)


# ---------------------------------------------------------------- Label Studio exports

task_like = st.fixed_dictionaries({"data": st.fixed_dictionaries({"map_id": st.text(max_size=8) | json_values},
                                                                 optional={"map_sha256": json_values})},
                                  optional={"annotations": json_values, "predictions": json_values,
                                            "drafts": json_values})


@FUZZ
@given(tasks=json_values | st.lists(task_like | json_values, max_size=4))
def test_label_studio_export_of_any_json(tmp_path_factory, tasks):
    folder = fresh(tmp_path_factory)
    (folder / "export.json").write_text(json.dumps(tasks))
    with door(folder):
        checked = accepted_or_one_line(lambda: read_export(folder / "export.json"))
    if checked is not None:
        assert all(isinstance(map_id, str) and isinstance(task["data"], dict) for map_id, task in checked.items())


@FUZZ
@given(content=st.binary(max_size=200))
def test_label_studio_export_random_bytes(tmp_path_factory, content):
    folder = fresh(tmp_path_factory)
    (folder / "export.json").write_bytes(content)
    with door(folder):
        accepted_or_one_line(lambda: read_export(folder / "export.json"))


# ---------------------------------------------------------------- through the CLI: nothing half-written

CLI_FUZZ = settings(FUZZ, max_examples=HUNT or 20)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("fuzz-model") / "tiny")


def cli_outcome(argv, capsys) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("error:")]


@CLI_FUZZ
@given(rows=data_rows, suffix=SUFFIXES, cut=st.floats(0, 1), noise=st.binary(max_size=8))
def test_extract_on_a_damaged_data_file_writes_all_or_nothing(tmp_path_factory, capsys, tiny_model, rows, suffix,
                                                              cut, noise):
    folder = fresh(tmp_path_factory)
    content = valid_data_file(suffix, rows)
    (folder / f"d{suffix}").write_bytes(content[:int(len(content) * cut)] + noise)
    runs = folder / "runs"
    code, errors = cli_outcome(["extract", "--model", tiny_model, "--task", folder / f"d{suffix}", "--runs-dir",
                                runs, "-q"], capsys)
    if code == 0:
        (index,) = runs.glob("*/*/maps/index.json")
        assert json.loads(index.read_text())["complete"]
    else:
        assert code == 2 and len(errors) == 1
        assert not runs.exists() or not [p for p in runs.rglob("*") if p.is_file()], "a failed extract left files"


@CLI_FUZZ
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3), name=st.sampled_from(MAP_ARRAYS),
       replacement=random_arrays | st.none())
def test_classify_maps_on_a_damaged_map_file_writes_all_or_nothing(tmp_path_factory, capsys, lengths, name,
                                                                   replacement):
    folder = fresh(tmp_path_factory)
    path = damaged_map_file(folder / "maps.npz", lengths, name, replacement)
    out = folder / "run" / "map_classes.csv"
    code, errors = cli_outcome(["classify", "--maps", path, "--out", out, "-q"], capsys)
    if code == 0:
        assert out.is_file()
    else:
        assert code == 2 and len(errors) == 1 and not (folder / "run").exists()
