"""bench/bench_*.py: what they measure and how they refuse bad options (never timed: the benchmarks' figures are
measured by hand, docs/benchmarks.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.tiny import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:  # the scripts import their sibling bench/measure.py, as they do when run
    sys.path.insert(0, str(BENCH))


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_memory_is_measured_with_the_precision_that_is_timed(tmp_path, monkeypatch, capsys):
    # the fresh process of each memory point ran the CNN in the default precision whatever --precision said
    bench_classify = bench_module("bench_classify")
    commands = []

    def child(command, **kwargs):
        commands.append(command)
        n = int(command[command.index("--child") + 1])
        return subprocess.CompletedProcess(command, 0, json.dumps({"n": n, "maps": 1, "peak_rss_mib": 100.0}), "")

    monkeypatch.setattr(bench_classify.subprocess, "run", child)
    model = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "classify.json"
    assert bench_classify.main(["--model", str(model), "--n", "4", "--repeats", "1", "--threads", "1",
                                "--memory-n", "2", "4", "--precision", "fp32", "--json", str(out)]) == 0
    assert len(commands) == 2
    for command in commands:
        assert command[command.index("--precision") + 1] == "fp32"
    assert json.loads(out.read_text())["cnn_dtype"] == "float32"
    assert "peak RSS" in capsys.readouterr().out


def test_the_sweep_bench_warms_both_engines_up_before_it_starts_the_clock(tmp_path, monkeypatch):
    # before: no warm-up, so the fast engine, timed first, also paid the process's first-call costs
    bench_sweeps = bench_module("bench_sweeps")
    events = []
    real_fast, real_naive = bench_sweeps.fast_sweep, bench_sweeps.naive_sweep

    def fast(bundle, batches, variants, mode, **kwargs):
        events.append(("fast", len(variants), sum(len(batch.items) for batch in batches)))
        return real_fast(bundle, batches, variants, mode, **kwargs)

    def naive(bundle, encoded, variants, mode, **kwargs):
        events.append(("naive", len(variants), len(encoded)))
        return real_naive(bundle, encoded, variants, mode, **kwargs)

    def clock():
        events.append("clock")
        return time.perf_counter()

    monkeypatch.setattr(bench_sweeps, "fast_sweep", fast)
    monkeypatch.setattr(bench_sweeps, "naive_sweep", naive)
    monkeypatch.setattr(bench_sweeps, "time", SimpleNamespace(perf_counter=clock, process_time=time.process_time))
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))  # an empty model store
    model = save_tiny_model(tmp_path / "tiny")
    result = bench_sweeps.main(["--model", str(model), "--n", "6", "--batch-size", "4", "--max-length", "32",
                                "--naive-variants", "2", "--threads", "1", "--repeats", "2"])
    layers, heads = result["layers"], result["heads"]
    started = events.index("clock")
    assert events[:started] == [("fast", layers, 4), ("naive", 1, 4)]  # one head per layer, the first batch
    # then the two engines in alternation, once per repeat
    assert [event for event in events[started:] if event != "clock"] == [("fast", layers * heads, 6),
                                                                          ("naive", 2, 6)] * 2
    assert result["warm_up_examples"] == 4 and result["max_logit_difference"] < 1e-5
    assert len(result["fast_s_runs"]) == len(result["naive_s_runs"]) == result["speedup"]["repeats"] == 2
    assert result["speedup"]["low"] <= result["speedup"]["median"] <= result["speedup"]["high"]


def test_a_memory_point_is_the_fresh_process_own_peak_not_the_peak_of_the_process_that_started_it():
    # before: ru_maxrss, which Linux carries from parent to child at exec, so both memory points of
    # bench_classify read the timing process's peak (docs: 1196 MiB at 100 and at 872 examples, 1.00x)
    ballast = np.ones(600 * 2**20 // 8)  # 600 MiB resident in this process
    child = subprocess.run([sys.executable, "-c", "from measure import peak_rss_mib; print(peak_rss_mib())"],
                           capture_output=True, text=True, timeout=60, cwd=BENCH, check=True)
    own = float(child.stdout)
    assert bench_module("measure").peak_rss_mib() >= 600 and ballast.sum() > 0
    assert 0 < own < 200  # a bare interpreter, not this process's 600 MiB


def test_the_classify_ratio_is_the_median_and_range_of_paired_repeats_on_one_thread(tmp_path, monkeypatch):
    # before: the best bare time and the best classify time (possibly from different repeats), on torch's default
    # thread count unless --threads was given
    bench_classify = bench_module("bench_classify")
    calls = []
    bare = iter([(0.1, 0.1), (1.0, 1.0), (2.0, 2.0), (4.0, 4.0)])  # the warm-up, then three repeats
    classified = iter([(0.1, 0.1), (1.4, 1.4), (2.2, 2.2), (4.8, 4.8)])
    monkeypatch.setattr(bench_classify, "bare_pass", lambda *a: calls.append("bare") or next(bare))
    monkeypatch.setattr(bench_classify, "classified_pass",
                        lambda *a: calls.append("classify") or (*next(classified), 10))
    model = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "classify.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert bench_classify.main(["--model", str(model), "--n", "4", "--repeats", "3", "--memory-n",
                                    "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert calls == ["bare", "classify"] * 4  # alternating, so each pair saw the same load
    # ratios 1.4, 1.1, 1.2: the best times would give 1.4
    assert result["ratio"] == {"median": 1.2, "low": 1.1, "high": 1.4, "repeats": 3}
    assert result["threads"] == 1 and result["classify_s_median"] == 2.2


def test_the_ray_bench_names_the_tasks_it_ran_not_task_all():
    # before: "classify --task all --n 200 (2 tasks, ...)" though --tasks sst2 mrpc ran two of the three
    classify_job = bench_module("bench_ray").classify_job
    assert classify_job(["sst2", "mrpc"], every_task=False, n=200) == \
        "classify --n 200 of the tasks chosen (--tasks): sst2, mrpc"
    assert classify_job(["rte"], every_task=False, n=50) == "classify --n 50 of the tasks chosen (--tasks): rte"
    assert classify_job(["sst2", "mrpc", "rte"], every_task=True, n=872) == \
        "classify --task all --n 872 (sst2, mrpc, rte)"


@pytest.mark.parametrize("script, args, message", [
    ("bench_classify", ["--repeats", "0"], "--repeats and every --memory-n must be at least 1"),
    ("bench_classify", ["--memory-n", "100", "0"], "--repeats and every --memory-n must be at least 1"),
    ("bench_classify", ["--json", "."], "cannot write .: it is a folder"),
    ("bench_classify", ["--model", "mpnet"], "attnpat models fetch mpnet"),
    ("bench_explore", ["--repeats", "0"], "--repeats must be at least 1"),
    ("bench_sweeps", ["--naive-variants", "three"], "--naive-variants takes a count of 1 or more or 'all'"),
    ("bench_sweeps", ["--repeats", "0"], "--repeats at least 1"),
    ("bench_sweeps", ["--model", "mpnet"], "attnpat models fetch mpnet"),
    # at its defaults the single-process half (minutes) ran before the Ray half refused these
    ("bench_permutation", ["--permutations", "0"], "--permutations must be at least 1"),
    ("bench_permutation", ["--draws", "0"], "--draws must be at least 1"),
    ("bench_permutation", ["--variants", "2", "--loop-variants", "3"], "--loop-variants (3) cannot exceed"),
    ("bench_permutation", ["--json", "."], "cannot write .: it is a folder"),
    ("bench_ray", ["--workers", "0"], "--workers must be at least 1"),
    ("bench_ray", ["--repeats", "0"], "--repeats must be at least 1"),
    ("bench_ray", ["--tasks", "sst2", "nosuch"], "unknown task 'nosuch'"),
])
def test_a_bad_benchmark_option_is_one_error_line_before_the_work(script, args, message, tmp_path):
    # before: a traceback (ValueError, AttnpatError), for some only after the timed runs
    # ATTNPAT_HOME: an empty model store (no mpnet, whatever this checkout's store holds)
    environment = {**os.environ, "ATTNPAT_HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
                   "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([sys.executable, BENCH / f"{script}.py", *args], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env=environment)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
    assert message in result.stderr and result.stdout == ""


def test_the_runner_with_out_has_every_benchmark_write_its_json_into_that_folder(tmp_path, monkeypatch):
    # before: `make bench` only printed; a re-measurement left no file to compare with the docs
    run_all = bench_module("run_all")
    commands = []
    monkeypatch.setattr(run_all.subprocess, "call", lambda command, **kwargs: commands.append(command) or 0)
    out = tmp_path / "results"
    assert run_all.main(["--out", str(out), "sweeps", "explore"]) == 0
    assert out.is_dir()
    assert [(Path(command[1]).name, command[2:]) for command in commands] == [
        ("bench_explore.py", ["--json", str(out / "explore.json")]),
        ("bench_sweeps.py", ["--json", str(out / "sweeps.json")])]
    (tmp_path / "file").write_text("")
    assert run_all.main(["--out", str(tmp_path / "file")]) == 2 and run_all.main(["--out"]) == 2
    assert len(commands) == 2  # nothing ran after a bad --out
