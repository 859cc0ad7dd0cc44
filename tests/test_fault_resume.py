"""Every resumable verb, killed by SIGKILL at a random point and rerun, ends as an uninterrupted run does.

Each verb runs as `python -m app.cli ...` in a subprocess on a tiny random model with one thread. A first
copy runs uninterrupted; a second is killed by its process id once it has done some work plus a random
delay, then rerun to the end; their tables must be byte-identical (or their values equal where a file holds
timings). The random delays come from ATTNPAT_FAULT_SEED when set (else a fresh seed, shown on failure).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from analysis.mapstore import read_shard
from annotation.labelstudio import connect
from tests.tiny import save_tiny_model

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("ATTNPAT_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fault-models")
    return {"base": save_tiny_model(root / "base"), "classifier": save_tiny_model(root / "cls", kind="classifier")}


def verb_env(home: Path) -> dict:
    """The verb's environment: its own workspace, offline, one thread (so reruns compute bit-identically)."""
    return {**os.environ, "ATTNPAT_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GRADIO_ANALYTICS_ENABLED": "False"}


def command(argv) -> list[str]:
    return [sys.executable, "-m", "app.cli", *[str(a) for a in argv]]


def run_to_end(argv, home: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command(argv), env=verb_env(home), cwd=home, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def kill_midway(argv, home: Path, started_work, rng: random.Random, jitter: float, timeout: float = 600,
                sig: int = signal.SIGKILL) -> float:
    """Start the verb, wait until ``started_work()`` is true, wait a random 0..jitter s more, then send it ``sig``
    (SIGKILL) by its process id. Returns the delay after the marker. Fails if the verb ended on its own first;
    after SIGTERM, unless it said so and exited with 143 (128 + SIGTERM) once its cleanup ran."""
    home.mkdir(parents=True, exist_ok=True)
    # Ctrl-C as in a terminal, even when this test runs in the background (where SIGINT is ignored and inherited)
    process = subprocess.Popen(command(argv), env=verb_env(home), cwd=home, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    try:
        while not started_work():
            assert process.poll() is None, f"the verb ended before it started work: {process.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the verb never started work"
            time.sleep(0.05)
        delay = rng.uniform(0, jitter)
        time.sleep(delay)
        assert process.poll() is None, f"the verb finished before the kill (seed {SEED}); give it more work"
        os.kill(process.pid, sig)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if sig == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL
    else:
        said = "interrupted" if sig == signal.SIGINT else "terminated"
        stderr = process.stderr.read()
        assert process.returncode == 128 + sig and f"{said}; rerun the same command to resume" in stderr, stderr
    return delay


def same_tables(first: Path, second: Path, names) -> None:
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs (seed {SEED})"


def leftovers(folder: Path) -> list[str]:
    """Temporary files of atomic writes left behind (a killed writer's, which a finished rerun must clear
    or at least never read)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*.tmp*"))


# ---------------------------------------------------------------- extract

def test_extract_killed_and_rerun_writes_the_same_maps(tmp_path, models):
    rng = random.Random(SEED)
    argv = ["extract", "--model", models["base"], "--task", "sst2", "--n", "640", "--batch-size", "8", "-q"]
    run_to_end(argv, tmp_path / "clean")
    killed = tmp_path / "killed"
    maps = killed / "runs" / "base" / "sst2" / "maps"
    kill_midway(argv, killed, lambda: len(list(maps.glob("shard-*.npz"))) >= 1 + rng.randrange(4), rng, 0.5)
    run_to_end(argv, killed)
    clean_maps = tmp_path / "clean" / "runs" / "base" / "sst2" / "maps"
    shards = sorted(p.name for p in clean_maps.glob("shard-*.npz"))
    assert shards == sorted(p.name for p in maps.glob("shard-*.npz")) and len(shards) == 10
    for name in shards:
        for a, b in zip(read_shard(clean_maps / name), read_shard(maps / name), strict=True):
            assert a.example_id == b.example_id and a.tokens == b.tokens
            np.testing.assert_array_equal(a.attn, b.attn)
    index = json.loads((maps / "index.json").read_text())
    clean_index = json.loads((clean_maps / "index.json").read_text())
    assert index["complete"] and 0 < index["resumed_shards"] < 10
    assert {k: v for k, v in index.items() if k != "resumed_shards"} == \
        {k: v for k, v in clean_index.items() if k != "resumed_shards"}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_extract_stopped_releases_its_locks_and_leaves_no_temporary_file(tmp_path, models, sig):
    """SIGTERM (the web app's Stop, `kill`) ends a verb as Ctrl-C does: it says so and exits 143 (Ctrl-C: 130,
    not 0), its lock files and temporary files are removed, so the folder holds only finished shards, and a
    rerun completes."""
    rng = random.Random(SEED + 5)
    argv = ["extract", "--model", models["base"], "--task", "sst2", "--n", "640", "--batch-size", "8", "-q"]
    run = tmp_path / "runs" / "base" / "sst2"
    kill_midway(argv, tmp_path, lambda: len(list((run / "maps").glob("shard-*.npz"))) >= 1, rng, 0.3, sig=sig)
    assert not list(run.rglob(".*lock*")) and leftovers(tmp_path) == []
    run_to_end(argv, tmp_path)
    assert json.loads((run / "maps" / "index.json").read_text())["complete"]


# ---------------------------------------------------------------- disable

def test_disable_killed_and_rerun_gives_byte_identical_tables(tmp_path, models):
    rng = random.Random(SEED + 1)
    argv = ["disable", "--model", models["classifier"], "--task", "sst2", "--n", "96", "--batch-size", "8",
            "--unit", "both", "-q"]
    run_to_end(argv, tmp_path / "clean")
    killed = tmp_path / "killed"
    run = killed / "runs" / "cls" / "sst2"
    kill_midway(argv, killed, lambda: len(list(run.glob(".sweep-*/v-*.json"))) >= 1 + rng.randrange(3), rng, 0.3)
    run_to_end(argv, killed)
    same_tables(tmp_path / "clean" / "runs" / "cls" / "sst2", run, ["disable_heads.csv", "disable_layers.csv"])


# ---------------------------------------------------------------- finetune

def test_finetune_killed_and_rerun_trains_the_same_weights(tmp_path, models):
    rng = random.Random(SEED + 2)
    argv = ["finetune", "--model", models["base"], "--task", "sst2", "--n", "96", "--epochs", "2", "--batch-size",
            "8", "--checkpoint-every", "3", "--name", "ft", "-q"]
    run_to_end(argv, tmp_path / "clean")
    killed = tmp_path / "killed"
    state = killed / "models" / "ft" / ".checkpoint" / "state.pt"
    kill_midway(argv, killed, state.is_file, rng, 1.0)
    run_to_end(argv, killed)
    clean, resumed = tmp_path / "clean" / "models" / "ft", killed / "models" / "ft"
    clean_weights, resumed_weights = load_file(clean / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert clean_weights.keys() == resumed_weights.keys()
    for name in clean_weights:
        np.testing.assert_array_equal(clean_weights[name], resumed_weights[name], err_msg=f"{name} (seed {SEED})")
    clean_meta, resumed_meta = (json.loads((folder / "attnpat.json").read_text()) for folder in (clean, resumed))
    assert resumed_meta["metric_value"] == clean_meta["metric_value"]
    assert not state.exists()


def test_finetune_force_killed_and_rerun_replaces_the_model_whole(tmp_path, models):
    """A --force retrain over a finished model, killed while it trains or evaluates, then rerun without --force:
    the store holds the model an uninterrupted run trains, and nothing of the replaced one (no .checkpoint/, no
    --force marker, no landing or replaced folder beside it). A kill at each step of the landing itself:
    tests/test_finetune.py::test_a_forced_retrain_killed_while_it_lands_ends_as_an_uninterrupted_one."""
    rng = random.Random(SEED + 6)
    def finetune_argv(epochs: int) -> list:
        return ["finetune", "--model", models["base"], "--task", "sst2", "--n", "96", "--epochs", epochs,
                "--batch-size", "8", "--checkpoint-every", "3", "--name", "ft", "-q"]

    argv = finetune_argv(2)
    run_to_end(argv, tmp_path / "clean")
    killed = tmp_path / "killed"
    run_to_end(finetune_argv(1), killed)  # a finished model of other settings, to be replaced
    state = killed / "models" / "ft" / ".checkpoint" / "state.pt"
    kill_midway([*argv, "--force"], killed, state.is_file, rng, 2.0)
    run_to_end(argv, killed)
    clean, resumed = tmp_path / "clean" / "models" / "ft", killed / "models" / "ft"
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in clean.iterdir())
    assert (clean / "model.safetensors").read_bytes() == (resumed / "model.safetensors").read_bytes(), f"seed {SEED}"
    assert json.loads((resumed / "attnpat.json").read_text())["epochs"] == 2
    assert sorted(p.name for p in (killed / "models").iterdir()) == ["ft"]


# ---------------------------------------------------------------- classify --task all

def test_classify_all_killed_and_rerun_resumes_per_task(tmp_path, models):
    rng = random.Random(SEED + 3)
    argv = ["classify", "--model", models["base"], "--task", "all", "--n", "48", "--batch-size", "8", "-q"]
    run_to_end(argv, tmp_path / "clean")
    killed = tmp_path / "killed"
    runs = killed / "runs" / "base"

    def first_task_done() -> bool:
        manifest = runs / "sst2" / "manifest.json"
        return manifest.is_file() and "classify" in json.loads(manifest.read_text()).get("analyses", {})

    kill_midway(argv, killed, first_task_done, rng, 1.5)
    first_record = json.loads((runs / "sst2" / "manifest.json").read_text())["analyses"]["classify"]
    run_to_end(argv, killed)
    assert json.loads((runs / "sst2" / "manifest.json").read_text())["analyses"]["classify"] == first_record
    clean = tmp_path / "clean" / "runs" / "base"
    same_tables(clean / "all", runs / "all", ["pattern_ratios_by_task.csv"])
    for task in ("sst2", "mrpc", "rte"):
        same_tables(clean / task, runs / task, ["patterns.csv", "pattern_ratios.csv"])


# ---------------------------------------------------------------- annotate push

def test_annotate_push_killed_and_rerun_holds_each_map_once(tmp_path, models, label_studio):
    rng = random.Random(SEED + 4)
    client = connect(label_studio)
    titles = {"clean": f"fault clean {SEED}", "killed": f"fault killed {SEED}"}

    def argv(which):
        return ["annotate", "push", "--model", models["base"], "--count", "160", "--tasks", "sst2", "--sample", "s",
                "--project", titles[which], "--url", label_studio.url, "--token", label_studio.token]

    def tasks_of(title) -> list[dict]:
        projects = [p for p in client.projects.list() if p.title == title]
        if not projects:
            return []
        return [task.data for task in client.tasks.list(project=projects[0].id, fields="all")]

    run_to_end(argv("clean"), tmp_path / "clean")
    kill_midway(argv("killed"), tmp_path / "killed", lambda: len(tasks_of(titles["killed"])) > 0, rng, 0.4)
    run_to_end(argv("killed"), tmp_path / "killed")
    clean, resumed = tasks_of(titles["clean"]), tasks_of(titles["killed"])
    ids = [task["map_id"] for task in resumed]
    assert len(ids) == len(set(ids)) == 160, "a map is missing or pushed twice"
    key = ("map_id", "map_sha256", "task", "layer", "head", "example_id", "caption")
    assert sorted(({k: str(t.get(k)) for k in key} for t in resumed), key=str) == \
        sorted(({k: str(t.get(k)) for k in key} for t in clean), key=str)
