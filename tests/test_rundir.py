"""Run directories: atomic writes, accumulating manifests, long tables; the saved-map format."""
import json
import os

import numpy as np
import pytest

from analysis.errors import AttnpatError
from analysis.mapstore import SavedMap, read_shard, write_shard
from analysis.rundir import RunDir, atomic_write, list_runs, long_table, table_to_array, writable_path


def test_atomic_write_leaves_nothing_when_the_writer_fails(tmp_path):
    target = tmp_path / "table.csv"
    target.write_text("old")

    def failing(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write(target, failing)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["table.csv"]


def test_writable_path_checks_without_writing(tmp_path, monkeypatch):
    nested = tmp_path / "new" / "deeper" / "table.csv"
    assert writable_path(nested) == nested and not (tmp_path / "new").exists()
    with pytest.raises(AttnpatError, match="it is a folder"):
        writable_path(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(AttnpatError, match="is a file, not a folder"):
        writable_path(tmp_path / "file" / "below" / "table.csv")
    with pytest.raises(AttnpatError, match="is a file, not a folder"):  # before the analysis, not after it
        with RunDir("model", "task", tmp_path / "file" / "runs").record("analysis"):
            raise AssertionError("the analysis ran into a run folder that cannot be written")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only folder (tests may run as root)
    with pytest.raises(AttnpatError, match=f"permission denied on {tmp_path}$"):
        writable_path(tmp_path / "new" / "table.csv")


def test_long_table_round_trip():
    values = {"a": np.arange(6.0).reshape(2, 3), "b": -np.ones((2, 3))}
    frame = long_table(values)
    assert list(frame.columns) == ["layer", "head", "metric", "value"] and len(frame) == 12
    np.testing.assert_array_equal(table_to_array(frame, "a"), values["a"])
    with pytest.raises(AttnpatError, match="layers, heads"):
        long_table({"bad": np.ones(3)})


def test_manifest_accumulates_analyses_and_skips_failed_ones(tmp_path):
    run = RunDir("m", "sst2", tmp_path)
    with run.record("first") as entry:
        entry["outputs"] = ["a.csv"]
    with pytest.raises(ValueError):
        with run.record("second"):
            raise ValueError("boom")
    with run.record("third"):
        pass
    manifest = json.loads((tmp_path / "m" / "sst2" / "manifest.json").read_text())
    assert set(manifest["analyses"]) == {"first", "third"}
    assert manifest["analyses"]["first"]["outputs"] == ["a.csv"] and "numpy" in manifest["packages"]
    assert [r["task"] for r in list_runs(tmp_path)] == ["sst2"]


def test_saved_maps_round_trip_any_lengths(tmp_path):
    rng = np.random.default_rng(0)
    maps = []
    for k, n in enumerate((3, 7)):
        attn = rng.random((2, 4, n, n)).astype(np.float32)
        maps.append(SavedMap(f"ex{k}", attn / attn.sum(-1, keepdims=True), [f"t{i}" for i in range(n)], np.zeros(n),
                             "tiny", "sst2"))
    write_shard(tmp_path / "s.npz", maps)
    back = read_shard(tmp_path / "s.npz")
    assert [m.example_id for m in back] == ["ex0", "ex1"] and back[1].tokens == maps[1].tokens
    for a, b in zip(back, maps):
        np.testing.assert_allclose(a.attn, b.attn, atol=1e-3)
    assert back[0].map_ids[5] == "tiny:sst2:ex0:L1H1"  # 4 heads per layer
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(AttnpatError, match="not an attnpat map file"):
        read_shard(tmp_path / "bad.npz")
    with pytest.raises(AttnpatError, match="expected"):
        write_shard(tmp_path / "x.npz", [SavedMap("e", np.ones((2, 4, 3, 3)), ["a", "b"], np.zeros(2), "tiny", "sst2")])
