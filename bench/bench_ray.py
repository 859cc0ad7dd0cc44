"""Benchmark: Ray scale-out against one process, on MiniLM, CPU.

Two jobs, each run --repeats times in one process with 1 torch thread and as often on a local Ray (started here,
on 127.0.0.1) with --workers workers of 1 thread each; the figure is the ratio of the two wall times, the i-th
one-process run over the i-th Ray run, reported as the median with the range over the repeats, all measured in the
same run (target: at least 1.7x on the median with 2 workers on 2 cores):

- classify --task all --n 872: every available GLUE task, the first 872 examples of each, every head's map
  classified by the shipped CNN (classifier.classify.classify_tasks);
- the SST-2 single-head disabling sweep on the first 400 dev sentences (analysis.sweeps.disable_analysis,
  --unit head, uniform mode).

Ray's start-up (ray.init, the workers starting and each loading the model once) is timed apart and
reported, with the ratio it gives when counted in. classify runs once more on each side before its repeats: the
repeats' ratio is the steady state (what a long job sees), the ratio of the first runs adds each process's first pass
(fresh Ray workers first fault in the memory their batches need: about 1 s more on this VM). Results must be equal
(identical pattern counts and sweep metrics).
The load average before and after is printed: on a shared machine other work takes cores from both sides.

    .venv/bin/python bench/bench_ray.py
    .venv/bin/python bench/bench_ray.py --n-classify 200 --n-sweep 100 --tasks sst2 mrpc --repeats 2 --json out.json
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import peak_rss_mib, ratio_spread, run_script, spread_text, write_summary  # noqa: E402

from analysis.cluster import ray_cluster  # noqa: E402
from analysis.data import load_data  # noqa: E402
from analysis.distributed import worker_pool  # noqa: E402
from analysis.errors import AttnpatError  # noqa: E402
from analysis.models import list_store, load_model  # noqa: E402
from analysis.rundir import RunDir, writable_path  # noqa: E402
from analysis.sweeps import disable_analysis, seeded_classifier  # noqa: E402
from classifier.classify import available_glue_tasks, classify_tasks  # noqa: E402
from classifier.distributed import classify_pool  # noqa: E402
from classifier.predict import load_classifier  # noqa: E402


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="Ray workers of 1 thread each (default 2)")
    parser.add_argument("--n-classify", type=int, default=872, help="examples per task for classify (default 872)")
    parser.add_argument("--n-sweep", type=int, default=400, help="SST-2 sentences for the head sweep (default 400)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each job on each side (default 3)")
    parser.add_argument("--tasks", nargs="*", default=None, help="classify these tasks (default: all available GLUE)")
    parser.add_argument("--sweep-model", default=None, help="default: minilm-sst2 from the model store, else minilm "
                        "with a random (seeded) classification head; timings are the same")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.workers < 1:  # else only the Ray half would refuse it, after the whole single-process half
        raise AttnpatError(f"--workers must be at least 1, got {args.workers}")
    if args.repeats < 1:
        raise AttnpatError(f"--repeats must be at least 1, got {args.repeats}")
    if args.json:
        writable_path(args.json)  # before the work
    return args


def classify_job(tasks: list[str], every_task: bool, n: int) -> str:
    """The classify job as the printed lines name it: `classify --task all` only when no --tasks narrowed it to
    some tasks, and the tasks run named either way."""
    if every_task:
        return f"classify --task all --n {n} ({', '.join(tasks)})"
    return f"classify --n {n} of the tasks chosen (--tasks): {', '.join(tasks)}"


def timed(function):
    started = time.perf_counter()
    result = function()
    return result, time.perf_counter() - started


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) used so far by local processes: this one's for os.getpid()."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def busy_timed(function, pids: list[int]):
    """(result, wall seconds, share of ``pids``' CPUs they were busy: CPU seconds / (len(pids) x wall))."""
    before = cpu_seconds(pids)
    result, wall = timed(function)
    return result, wall, (cpu_seconds(pids) - before) / (len(pids) * wall)


def frames_equal(left: Path, right: Path, names: list[str]) -> bool:
    for name in names:
        try:
            pd.testing.assert_frame_equal(pd.read_csv(left / name), pd.read_csv(right / name))
        except AssertionError:
            return False
    return True


def repeated(function, pids: list[int], repeats: int) -> tuple[list[float], list[float]]:
    """(wall seconds, busy share) of each of ``repeats`` runs of ``function`` (see :func:`busy_timed`)."""
    runs = [busy_timed(function, pids)[1:] for _ in range(repeats)]
    return [wall for wall, _ in runs], [busy for _, busy in runs]


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    torch.set_num_threads(1)
    tasks = args.tasks or available_glue_tasks()
    # every task's data is loaded now: a bad task or --n-classify is refused before any timing
    examples = sum(len(load_data(task, n=args.n_classify).examples) for task in tasks)
    sweep_name = args.sweep_model or ("minilm-sst2" if any(m["name"] == "minilm-sst2" for m in list_store())
                                      else "minilm")
    bundle, cnn = load_model("minilm", device="cpu"), load_classifier()
    sweep_data = load_data("sst2", n=args.n_sweep)
    sweep_bundle = seeded_classifier(sweep_name, sweep_data.num_labels, device="cpu")
    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # its run folders only serve the equality checks
    load_before = os.getloadavg()

    def classify(where: str, cluster=None):
        return classify_tasks(bundle, tasks, cnn, n=args.n_classify, root=root / where, progress=False,
                              resume=False, cluster=cluster)

    def sweep(where: str, cluster=None):
        return disable_analysis(sweep_bundle, sweep_data, RunDir(sweep_bundle.slug, "sst2", root / where),
                                mode="uniform", units=["head"], cluster=cluster)

    me = [os.getpid()]
    _, classify_one_first = timed(lambda: classify("one-first"))
    classify_one, classify_one_busy = repeated(lambda: classify("one"), me, args.repeats)
    sweep_one, sweep_one_busy = repeated(lambda: sweep("one"), me, args.repeats)
    started = time.perf_counter()
    with ray_cluster("local", workers=args.workers) as cluster:
        connect = time.perf_counter() - started
        # each worker starts and loads the model and the CNN (then the sweep's model) once, before the timing
        pool, classify_load = timed(lambda: classify_pool(cluster, bundle, cnn))
        _, classify_ray_first = timed(lambda: classify("ray-first", cluster))
        classify_ray, classify_ray_busy = repeated(lambda: classify("ray", cluster), pool.pids(), args.repeats)
        classify_peak = max(peak_rss_mib(pid) for pid in pool.pids())
        pool, sweep_load = timed(lambda: worker_pool(cluster, sweep_bundle, "classifier"))
        sweep_ray, sweep_ray_busy = repeated(lambda: sweep("ray", cluster), pool.pids(), args.repeats)
        sweep_peak = max(peak_rss_mib(pid) for pid in pool.pids())  # peak over both jobs (same processes)
        recorded = cluster.manifest()
    load_after = os.getloadavg()
    classify_equal = all(frames_equal(root / "one" / bundle.slug / task, root / ray_run / bundle.slug / task,
                                      ["patterns.csv", "pattern_ratios.csv"]) for task in tasks
                         for ray_run in ("ray", "ray-first"))
    sweep_equal = frames_equal(root / "one" / sweep_bundle.slug / "sst2", root / "ray" / sweep_bundle.slug / "sst2",
                               ["disable_heads.csv"])
    maps = examples * bundle.num_layers * bundle.num_heads
    classify_speedup, sweep_speedup = ratio_spread(classify_one, classify_ray), ratio_spread(sweep_one, sweep_ray)
    median = statistics.median
    result = {
        "model": bundle.name, "sweep_model": sweep_bundle.name, "workers": args.workers, "threads_per_worker": 1,
        "cpu_count": os.cpu_count(), "tasks": tasks, "repeats": args.repeats,
        "classify_job": classify_job(tasks, not args.tasks, args.n_classify), "classify_examples": examples,
        "classify_maps": maps,
        "sweep_examples": len(sweep_data.examples), "sweep_variants": sweep_bundle.num_layers * sweep_bundle.num_heads,
        "classify_one_runs_s": [round(t, 2) for t in classify_one],
        "classify_ray_runs_s": [round(t, 2) for t in classify_ray], "classify_speedup": classify_speedup,
        "classify_one_first_seconds": round(classify_one_first, 2),
        "classify_ray_first_seconds": round(classify_ray_first, 2),
        "classify_speedup_first_runs": round(classify_one_first / classify_ray_first, 2),
        "classify_maps_per_second_one_median": round(maps / median(classify_one), 1),
        "classify_maps_per_second_ray_median": round(maps / median(classify_ray), 1),
        "sweep_one_runs_s": [round(t, 2) for t in sweep_one], "sweep_ray_runs_s": [round(t, 2) for t in sweep_ray],
        "sweep_speedup": sweep_speedup,
        "ray_init_seconds": round(connect, 2), "classify_workers_load_seconds": round(classify_load, 2),
        "sweep_workers_load_seconds": round(sweep_load, 2),
        "classify_speedup_with_startup": round(classify_one_first / (connect + classify_load + classify_ray_first), 2),
        "sweep_speedup_with_load": round(sweep_one[0] / (sweep_load + sweep_ray[0]), 2),
        "busy_share_median": {"classify_one": round(median(classify_one_busy), 2),
                              "classify_ray_workers": round(median(classify_ray_busy), 2),
                              "sweep_one": round(median(sweep_one_busy), 2),
                              "sweep_ray_workers": round(median(sweep_ray_busy), 2)},
        "worker_peak_rss_mib_classify": round(classify_peak), "worker_peak_rss_mib_after_sweep": round(sweep_peak),
        "classify_equal": classify_equal, "sweep_equal": sweep_equal, "cluster": recorded,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    }
    busy = result["busy_share_median"]
    print(f"ray bench: local Ray, {args.workers} workers x 1 thread, against 1 process x 1 thread; "
          f"{os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"  {result['classify_job']}: {len(tasks)} tasks, {examples} examples, {maps} maps, {bundle.name}; "
          f"one {median(classify_one):.1f} s, Ray {median(classify_ray):.1f} s (medians) = "
          f"{spread_text(classify_speedup)} (target >= 1.7x; after the first runs); equal: {classify_equal}")
    print(f"    first runs: one {classify_one_first:.1f} s, Ray {classify_ray_first:.1f} s = "
          f"{result['classify_speedup_first_runs']:.2f}x")
    print(f"  SST-2 head sweep, n = {len(sweep_data.examples)} ({result['sweep_variants']} variants, "
          f"{sweep_bundle.name}): one {median(sweep_one):.1f} s, Ray {median(sweep_ray):.1f} s (medians) = "
          f"{spread_text(sweep_speedup)} (target >= 1.7x); equal: {sweep_equal}")
    print(f"  start-up, not in the ratios above: ray.init {connect:.1f} s, workers starting and loading MiniLM + CNN "
          f"{classify_load:.1f} s, then loading the sweep's model {sweep_load:.1f} s; counted in: classify "
          f"(first runs) {result['classify_speedup_with_startup']:.2f}x, "
          f"sweep (first runs) {result['sweep_speedup_with_load']:.2f}x")
    print(f"  throughput (medians): {result['classify_maps_per_second_one_median']:.0f} maps/s in one process, "
          f"{result['classify_maps_per_second_ray_median']:.0f} maps/s on Ray")
    print(f"  CPU busy (CPU seconds / wall seconds per process, medians; below 1 = waiting, mostly for other programs "
          f"on the machine): one process {busy['classify_one']:.0%} (classify), {busy['sweep_one']:.0%} (sweep); "
          f"each Ray worker {busy['classify_ray_workers']:.0%} (classify), {busy['sweep_ray_workers']:.0%} (sweep)")
    print(f"  worker peak memory: {classify_peak:.0f} MiB after classify, {sweep_peak:.0f} MiB after the sweep")
    write_summary(args.json, result)
    return result


if __name__ == "__main__":
    run_script(main)
