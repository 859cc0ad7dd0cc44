"""Run directories: atomic writes, accumulating manifests, long tables; the saved-map format."""
import errno
import fcntl
import json
import multiprocessing
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import rundir
from analysis.errors import AttnpatError
from analysis.figures import close, head_heatmap
from analysis.mapstore import SavedMap, read_shard, write_shard
from analysis.paths import repo_root, runs_root
from analysis.rundir import (
    RunDir,
    atomic_write,
    list_runs,
    locked,
    long_table,
    table_to_array,
    writable_path,
)


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


def test_a_stop_landing_as_the_temporary_file_is_made_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM arriving just after the temporary file exists, before it was listed for cleanup (a stopped
    `extract` once left `.shard-00006.npz.<random>.tmp.npz` behind): the stop still ends the write, and the
    temporary is removed."""
    import signal  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    real = tempfile.mkstemp

    def stopped_after_creating(*args, **kwargs):
        made = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # the default handler raises KeyboardInterrupt here, or when let through
        return made

    monkeypatch.setattr(tempfile, "mkstemp", stopped_after_creating)
    target = tmp_path / "table.csv"
    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, lambda tmp: tmp.write_text("a\n1\n"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o077, 0o600), (0o002, 0o664), (0o022, 0o644)])
def test_written_files_follow_the_umask(tmp_path, monkeypatch, umask, mode):
    """Private results stay private under umask 077, and a group can edit them under 002 (before: always 0644)."""
    import analysis.rundir as rundir_module  # noqa: PLC0415

    previous = os.umask(umask)
    try:
        monkeypatch.setattr(rundir_module, "_UMASK", None)
        path = atomic_write(tmp_path / "table.csv", lambda tmp: tmp.write_text("a\n1\n"))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_tilde_in_attnpat_home_or_the_runs_folder_is_the_home_folder(tmp_path, monkeypatch):
    """`ATTNPAT_HOME="~/attn"` or `--runs-dir "~/runs"` (quoted, so no shell expands it) mean the home folder,
    not a folder named ~ in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ATTNPAT_HOME", "~/attn data")
    assert runs_root() == tmp_path / "home" / "attn data" / "runs"
    assert RunDir("m", "sst2", "~/runs").path == tmp_path / "home" / "runs" / "m" / "sst2"
    with pytest.raises(AttnpatError, match="cannot expand ~nosuchuser"):
        RunDir("m", "sst2", "~nosuchuser/runs")


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
    bounded = long_table(values, intervals={name: np.stack([a - 1, a + 1], -1) for name, a in values.items()})
    assert list(bounded.columns) == ["layer", "head", "metric", "value", "ci_low", "ci_high"]
    assert (bounded.ci_low == bounded.value - 1).all() and (bounded.ci_high == bounded.value + 1).all()
    with pytest.raises(AttnpatError, match="intervals of 'a'"):
        long_table(values, intervals={"a": np.ones((2, 3)), "b": np.ones((2, 3, 2))})


def test_manifest_accumulates_analyses_and_skips_failed_ones(tmp_path):
    run = RunDir("m", "sst2", tmp_path)
    with run.record("first") as entry:
        entry["outputs"] = [str(run.file("a.csv"))]
    with pytest.raises(ValueError):
        with run.record("second"):
            raise ValueError("boom")
    with run.record("third"):
        pass
    manifest = json.loads((tmp_path / "m" / "sst2" / "manifest.json").read_text())
    assert set(manifest["analyses"]) == {"first", "third"}
    assert manifest["analyses"]["first"]["outputs"] == ["a.csv"] and "numpy" in manifest["packages"]
    assert [r["task"] for r in list_runs(tmp_path)] == ["sst2"]



def test_a_records_outputs_are_the_files_written_through_the_run_folder(tmp_path):
    run = RunDir("m", "sst2", tmp_path)
    run.write_table("before", pd.DataFrame({"a": [1]}))  # outside any record: belongs to none
    with run.record("analysis") as entry:
        run.write_table("scores", pd.DataFrame({"a": [1]}))
        fig = head_heatmap(np.zeros((2, 3)), title="scores")
        run.write_figure("scores", fig)
        close(fig)
        entry["outputs"] = [str(run.file("scores.csv")), str(tmp_path / "elsewhere" / "maps")]
    with run.record("nothing"):
        pass
    analyses = json.loads(run.file("manifest.json").read_text())["analyses"]
    assert analyses["analysis"]["outputs"] == ["scores.csv", "scores.png", "scores.svg",
                                               str(tmp_path / "elsewhere" / "maps")]
    assert analyses["nothing"]["outputs"] == []
    # a record nested in another on the same RunDir: each lists its own files
    with run.record("outer"):
        with run.record("inner"):
            run.write_table("inner", pd.DataFrame({"a": [1]}))
        run.write_table("outer", pd.DataFrame({"a": [1]}))
    analyses = json.loads(run.file("manifest.json").read_text())["analyses"]
    assert analyses["inner"]["outputs"] == ["inner.csv"] and analyses["outer"]["outputs"] == ["outer.csv"]


def test_an_analysis_that_fails_midway_leaves_the_previous_run_whole(tmp_path):
    """Tables and figures are staged until the analysis finishes: a run stopped after writing its new table (the
    web app's Stop, Ctrl-C) must not leave that table beside the older run's figure and manifest entry."""
    run = RunDir("m", "sst2", tmp_path)

    def analysis(value: int, fail: bool) -> None:
        with run.record("surface", n=value):
            run.write_table("surface", pd.DataFrame({"value": [value]}))
            assert not run.file("surface.csv").is_file() or pd.read_csv(run.file("surface.csv")).value[0] != value
            assert run.read_table("surface").value[0] == value  # its own staged table, read back
            fig = head_heatmap(np.full((1, 1), value), title=str(value))
            run.write_figure("surface", fig)
            close(fig)
            if fail:
                raise KeyboardInterrupt

    analysis(200, fail=False)
    before = {name: run.file(name).read_bytes() for name in ("surface.csv", "surface.png", "manifest.json")}
    with pytest.raises(KeyboardInterrupt):
        analysis(16, fail=True)
    assert {name: run.file(name).read_bytes() for name in before} == before
    assert sorted(p.name for p in run.path.iterdir()) == ["manifest.json", "surface.csv", "surface.png", "surface.svg"]
    (run.path / ".staging-surface-killed00").mkdir()  # what a killed run (SIGKILL) leaves: cleared by the next one
    (run.path / ".staging-surface-killed00" / "surface.csv").write_text("value\n999\n")
    analysis(16, fail=False)
    assert run.read_table("surface").value[0] == 16 and not list(run.path.glob(".staging*"))
    assert json.loads(run.file("manifest.json").read_text())["analyses"]["surface"]["n"] == 16


def test_a_manifest_that_cannot_be_written_leaves_the_tables_as_they_were(tmp_path, monkeypatch):
    """The manifest is written before any staged table moves in (a full disk fails there), so a failure leaves
    the old tables with the old manifest, not new tables with it."""
    import analysis.rundir as rundir_module  # noqa: PLC0415

    run = RunDir("m", "sst2", tmp_path)
    with run.record("surface", n=1):
        run.write_table("surface", pd.DataFrame({"value": [1]}))
    real = rundir_module.atomic_write_json

    def disk_full(path, data):
        raise AttnpatError(f"cannot write {path}: no space left on device")

    monkeypatch.setattr(rundir_module, "atomic_write_json", disk_full)
    with pytest.raises(AttnpatError, match="no space left"):
        with run.record("surface", n=2):
            run.write_table("surface", pd.DataFrame({"value": [2]}))
    monkeypatch.setattr(rundir_module, "atomic_write_json", real)
    assert run.read_table("surface").value[0] == 1 and run.manifest()["analyses"]["surface"]["n"] == 1
    assert not list(run.path.glob(".staging*"))


SIGNALS_HELD_CHECK = """
import os, select, signal, socket, threading
from analysis.rundir import signals_held

# as in a terminal: a process started in the background (`cmd &`, nohup, CI) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # another thread the kernel may pick for the signal
# the C-level handler writes each signal's number here once it ran, whichever thread the kernel picked: the block
# waits for that instead of a fixed time, which a loaded machine could outlast
woken, wakeup = socket.socketpair()
woken.setblocking(False)
wakeup.setblocking(False)
signal.set_wakeup_fd(wakeup.fileno())
finished = []
try:
    with signals_held():
        os.kill(os.getpid(), signal.SIGINT)
        assert select.select([woken], [], [], 30)[0], "the signal never arrived"
        finished.append(True)
except KeyboardInterrupt:
    assert finished == [True], "interrupted inside the block"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "handler not restored"
    print("interrupted after the block")
"""


def test_signals_held_back_for_a_block_arrive_after_it_even_with_other_threads():
    """Ctrl-C while the staged files move in: the move finishes, then the interrupt comes. Other threads (numpy's,
    tqdm's) must not let it through: a thread mask alone did. In a process of its own: signal handlers and masks
    are the process's, and one started in the background inherits SIGINT ignored."""
    result = subprocess.run([sys.executable, "-c", SIGNALS_HELD_CHECK], capture_output=True, text=True, timeout=120,
                            cwd=repo_root())
    assert result.returncode == 0 and result.stdout.strip() == "interrupted after the block", result.stderr


def test_an_output_outside_the_run_folder_is_recorded_by_its_full_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RunDir("m", "sst2", "runs")  # a relative runs root, as --runs-dir runs gives
    with run.record("extract") as entry:
        run.write_table("here", pd.DataFrame({"a": [1]}))
        entry["outputs"] = ["maps", str(run.file("here.csv"))]  # `--out maps`: relative to the working folder
    outputs = json.loads(run.file("manifest.json").read_text())["analyses"]["extract"]["outputs"]
    assert outputs == ["here.csv", str(tmp_path / "maps")]


def test_a_second_writer_is_refused_while_the_lock_is_held_and_nothing_is_left_after(tmp_path):
    path = tmp_path / "new" / "folder" / ".lock-x"
    with locked(path, "x in the folder"):
        assert path.read_text().strip() == str(os.getpid())
        # flock locks belong to an open file, so a second open in this process stands for a second process
        with pytest.raises(AttnpatError, match=rf"^x in the folder is being written by another attnpat process "
                                               rf"\(pid {os.getpid()}\); wait for it to finish"):
            with locked(path, "x in the folder"):
                raise AssertionError("two writers held the lock")
        with locked(tmp_path / "new" / "folder" / ".lock-y", "y"):  # another lock file is another lock
            pass
    assert not (tmp_path / "new").exists()  # the lock file, and the folders made for it
    with locked(path, "x"):  # free again
        (tmp_path / "new" / "folder" / "table.csv").write_text("kept")
    assert sorted(p.name for p in (tmp_path / "new" / "folder").iterdir()) == ["table.csv"]



def test_another_users_lock_file_is_taken_over_when_stale_and_named_when_held(tmp_path, monkeypatch):
    """In a folder shared by a group, a lock file left by another user's killed run cannot be opened for writing
    (its mode follows that user's umask): an unheld one is removed and replaced, a held one names its process
    (before, `cannot lock ...: permission denied` blocked everyone else for good)."""
    import analysis.rundir as rundir_module  # noqa: PLC0415

    path = tmp_path / ".lock-surface"

    def as_another_user(file, mode="r", *args, **kwargs):  # tests may run as root, which writes anything
        if Path(file) == path and mode != "r" and path.exists() and path.read_text() == "4242\n":
            raise PermissionError(13, "Permission denied", str(file))
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(rundir_module, "open", as_another_user, raising=False)
    path.write_text("4242\n")  # stale: its process is gone
    with locked(path, "surface in the folder"):
        assert path.read_text().strip() == str(os.getpid())
    assert not path.exists()
    path.write_text("4242\n")
    with open(path) as holder:  # a second open file stands for the other user's running process
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(AttnpatError, match=r"^surface in the folder is being written by another attnpat "
                                               r"process \(pid 4242\)"):
            with locked(path, "surface in the folder"):
                raise AssertionError("two writers held the lock")
    assert path.read_text() == "4242\n"  # a held lock is never removed


def test_a_file_system_without_locks_runs_the_block_unlocked_and_says_so(tmp_path, monkeypatch, caplog):
    def no_locks(handle, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    ran = []
    with locked(tmp_path / "nfs" / ".lock-x", "x"):
        ran.append(True)
    assert ran and "two writers at once are not detected" in caplog.text and not (tmp_path / "nfs").exists()
    monkeypatch.setattr(fcntl, "flock", lambda handle, operation: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    with pytest.raises(AttnpatError, match="cannot lock .*i/o"):
        with locked(tmp_path / ".lock-y", "y"):
            raise AssertionError("ran without a lock after an I/O error")

def test_one_process_per_analysis_and_run_folder(tmp_path):
    run = RunDir("m", "sst2", tmp_path)
    with run.record("classify"):
        with pytest.raises(AttnpatError, match=r"classify in .*m/sst2 is being written by another attnpat process"):
            with RunDir("m", "sst2", tmp_path).record("classify"):
                raise AssertionError("two classify runs wrote one folder")
        with RunDir("m", "sst2", tmp_path).record("overview"):  # another analysis of the same folder may run
            pass
    assert set(json.loads(run.file("manifest.json").read_text())["analyses"]) == {"classify", "overview"}
    with pytest.raises(ValueError), RunDir("m", "rte", tmp_path).record("overview"):
        raise ValueError("bad input found inside the analysis")
    assert not (tmp_path / "m" / "rte").exists()  # a failed analysis leaves no folder behind


def _record_many(root: str, who: str, count: int) -> None:
    for i in range(count):
        with RunDir("m", "sst2", root).record(f"{who}-{i}"):
            pass


def test_concurrent_analyses_never_lose_each_others_manifest_entries(tmp_path):
    """The manifest is read, merged and written under the run folder's lock (before, the later writer dropped
    the entry the earlier one had just added)."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_record_many, args=(str(tmp_path), who, 25)) for who in ("a", "b", "c")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    analyses = json.loads((tmp_path / "m" / "sst2" / "manifest.json").read_text())["analyses"]
    assert len(analyses) == 75 and not list((tmp_path / "m" / "sst2").glob(".lock*"))

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


def test_a_writer_that_waits_long_names_the_holder_once_then_goes_on(tmp_path, monkeypatch, capsys):
    """wait=True (a short read-merge-write): a wait under WAIT_NOTE_SECONDS is silent; a longer one prints one
    line naming the holder's pid (so a command behind a stopped one does not sit silent), then takes the lock."""
    path = tmp_path / ".lock"

    def waits_behind_a_holder(hold_seconds: float) -> list[str]:
        order = []

        def second():
            with locked(path, "the table in runs/x", wait=True):
                order.append("second")

        with locked(path, "the table in runs/x"):
            thread = threading.Thread(target=second)
            thread.start()
            time.sleep(hold_seconds)
            order.append("first released")
        thread.join(10)
        return order

    assert waits_behind_a_holder(0.3) == ["first released", "second"]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(rundir, "WAIT_NOTE_SECONDS", 0.2)
    assert waits_behind_a_holder(1.0) == ["first released", "second"]
    assert capsys.readouterr().err == (f"waiting: the table in runs/x is being written by another attnpat process "
                                       f"(pid {os.getpid()})\n")
    assert not path.exists()


def test_a_retired_file_leaves_when_the_run_lands_and_stays_when_it_fails(tmp_path):
    """An optional output an earlier run wrote and this one does not (evaluate without --panel-size): removed with
    the landing, so it never stands beside a manifest entry that did not make it; kept when the run fails, and
    kept when the run writes it after all."""
    run = RunDir("m", "t", tmp_path)
    with run.record("x"):
        run.write_table("main", pd.DataFrame({"a": [1]}))
        run.write_table("optional", pd.DataFrame({"a": [2]}))
    with pytest.raises(RuntimeError):
        with run.record("x"):
            run.retire("optional.csv")
            run.write_table("main", pd.DataFrame({"a": [3]}))
            raise RuntimeError("stopped")
    assert run.file("optional.csv").is_file() and pd.read_csv(run.file("main.csv")).a.tolist() == [1]
    with run.record("x"):
        run.retire("optional.csv", "main.csv")  # main is written again: it stays
        run.write_table("main", pd.DataFrame({"a": [4]}))
    assert not run.file("optional.csv").exists() and pd.read_csv(run.file("main.csv")).a.tolist() == [4]
    assert run.manifest()["analyses"]["x"]["outputs"] == ["main.csv"]


@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_folder_swapped_in_takes_the_name_whole_and_the_old_one_moves_aside(tmp_path, monkeypatch, can_exchange):
    """finetune --force lands its new model with swap_in_folder: in one exchange where the file system allows,
    else in two renames; either way the name ends with the new folder whole and the old one at ``replaced``."""
    if not can_exchange:
        monkeypatch.setattr(rundir, "exchange_paths", lambda first, second: False)
    path, new, replaced = tmp_path / "m", tmp_path / ".m.landing", tmp_path / ".m.replaced"
    for folder, files in ((path, {"config.json": "old", "vocab.txt": "old"}), (new, {"config.json": "new"})):
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    rundir.swap_in_folder(new, path, replaced)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"] and (path / "config.json").read_text() == "new"
    assert sorted(p.name for p in replaced.iterdir()) == ["config.json", "vocab.txt"] and not new.exists()
    rundir.swap_in_folder(replaced, tmp_path / "first", tmp_path / "unused")  # no folder there yet: one rename
    assert (tmp_path / "first" / "vocab.txt").read_text() == "old" and not (tmp_path / "unused").exists()
