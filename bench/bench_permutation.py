"""Benchmark: the permutation test of an F1 or Matthews change in `disable` and `prune`, vectorised
(analysis.uncertainty.confusion_permutation_p) against the loop per permutation and variant
(analysis.uncertainty.paired_permutation_p), on MRPC's shape: 72 variants (MiniLM's 6 x 12 heads) x 408 examples
(the MRPC dev set) x analysis.sweeps.PERMUTATIONS (20,000) permutations.

The predictions are synthetic (binary, seed 0): a baseline right on about 85% of the examples, and each variant
flipping about 3% of the baseline's predictions, as disabling one head does; the test's cost depends on the shapes
and on how many examples some variant changes, not on a model. The vectorised test is timed in full, --repeats
times (median and range); the loop is timed on its first --loop-variants variants at --loop-permutations
permutations (with the same seed, so the same swaps as the first ones of the vectorised test) and extrapolated
linearly to every variant and permutation, since each (permutation, variant) costs it the same. Its p-values on
that subset are checked equal to the vectorised test's at the same permutation count. One process, numpy's
default threads.

The paired bootstrap interval of the same changes (--draws draws, default analysis.uncertainty.DEFAULT_BOOTSTRAP,
1,000: what disable and prune use) is timed both ways in full, in the same run: the loop per draw and variant
(analysis.uncertainty.bootstrap_difference_interval, before) and the vectorised one
(analysis.uncertainty.confusion_difference_interval, after), alternating, --repeats times; the figure is the median
of the per-repeat ratios with their range, and the bounds are checked equal.

    .venv/bin/python bench/bench_permutation.py
    .venv/bin/python bench/bench_permutation.py --variants 144 --json permutation.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
from measure import run_script, write_summary

from analysis.errors import AttnpatError
from analysis.metrics import confusion_metric, task_metric
from analysis.rundir import writable_path
from analysis.sweeps import PERMUTATIONS
from analysis.uncertainty import (
    DEFAULT_BOOTSTRAP,
    bootstrap_difference_interval,
    confusion_difference_interval,
    confusion_permutation_p,
    paired_permutation_p,
)


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", type=int, default=72, help="heads tested at once (default 72: MiniLM)")
    parser.add_argument("--examples", type=int, default=408, help="examples (default 408: the MRPC dev set)")
    parser.add_argument("--permutations", type=int, default=PERMUTATIONS,
                        help=f"permutations (default {PERMUTATIONS:,}, what disable and prune use)")
    parser.add_argument("--draws", type=int, default=DEFAULT_BOOTSTRAP,
                        help=f"bootstrap draws of the interval (default {DEFAULT_BOOTSTRAP:,}, what disable and prune "
                             "use)")
    parser.add_argument("--metrics", nargs="+", default=["f1", "matthews"], choices=["f1", "matthews", "accuracy"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the vectorised test (default 3)")
    parser.add_argument("--loop-variants", type=int, default=2, help="variants the loop is timed on (default 2)")
    parser.add_argument("--loop-permutations", type=int, default=500,
                        help="permutations the loop is timed on (default 500)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    counts = {"--variants": args.variants, "--examples": args.examples, "--permutations": args.permutations,
              "--draws": args.draws,
              "--repeats": args.repeats, "--loop-variants": args.loop_variants,
              "--loop-permutations": args.loop_permutations}
    low = [name for name, value in counts.items() if value < 1]
    if low:
        raise AttnpatError(f"{', '.join(low)} must be at least 1")
    if args.loop_variants > args.variants:
        raise AttnpatError(f"--loop-variants ({args.loop_variants}) cannot exceed --variants ({args.variants})")
    if args.json:
        writable_path(args.json)  # before the work
    return args


def synthetic_predictions(examples: int, variants: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """labels (E,), baseline (E,) right on about 85%, variants (E, V) each flipping about 3% of the baseline's."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, examples)
    baseline = np.where(rng.random(examples) < 0.85, labels, 1 - labels)
    flips = rng.random((examples, variants)) < 0.03
    return labels, baseline, np.where(flips, 1 - baseline[:, None], baseline[:, None])


def time_metric(metric: str, labels, baseline, variants, args) -> dict:
    statistic = confusion_metric(metric)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        p = confusion_permutation_p(statistic, baseline, variants, labels, n_perm=args.permutations)
        runs.append(time.perf_counter() - start)
    subset = variants[:, :args.loop_variants]
    start = time.perf_counter()
    loop_p = paired_permutation_p(lambda predicted, gold: task_metric(metric, predicted, gold), baseline, subset,
                                  labels, n_perm=args.loop_permutations)
    loop_seconds = time.perf_counter() - start
    same = confusion_permutation_p(statistic, baseline, subset, labels, n_perm=args.loop_permutations)
    loop_total = loop_seconds * (args.variants / args.loop_variants) * (args.permutations / args.loop_permutations)
    median = statistics.median(runs)
    return {"metric": metric, "vectorised_seconds_median": round(median, 3),
            "vectorised_seconds_runs": [round(value, 3) for value in runs],
            "loop_seconds_timed": round(loop_seconds, 3), "loop_seconds_extrapolated": round(loop_total, 1),
            "speedup": round(loop_total / median, 1), "loop_p_equal": bool(np.array_equal(loop_p, same)),
            "smallest_p": float(p.min()), "variants_with_p_floor": int((p == p.min()).sum())}


def time_bootstrap(metric: str, labels, baseline, variants, args) -> dict:
    """The interval both ways in full, alternating (loop first), --repeats times: seconds and per-repeat ratios."""
    loop_runs, vectorised_runs, equal = [], [], True
    bootstrap_difference_interval(lambda predicted, gold: task_metric(metric, predicted, gold), baseline,
                                  variants[:, :2], labels, n_boot=20)  # untimed warm-up of both
    confusion_difference_interval(confusion_metric(metric), baseline, variants[:, :2], labels, n_boot=20)
    for _ in range(args.repeats):
        start = time.perf_counter()
        loop = bootstrap_difference_interval(lambda predicted, gold: task_metric(metric, predicted, gold), baseline,
                                             variants, labels, n_boot=args.draws)
        loop_runs.append(time.perf_counter() - start)
        start = time.perf_counter()
        vectorised = confusion_difference_interval(confusion_metric(metric), baseline, variants, labels,
                                                   n_boot=args.draws)
        vectorised_runs.append(time.perf_counter() - start)
        equal = equal and np.array_equal(loop, vectorised, equal_nan=True)
    ratios = [before / after for before, after in zip(loop_runs, vectorised_runs, strict=True)]
    return {"metric": metric, "loop_seconds_runs": [round(value, 3) for value in loop_runs],
            "vectorised_seconds_runs": [round(value, 4) for value in vectorised_runs],
            "loop_seconds_median": round(statistics.median(loop_runs), 3),
            "vectorised_seconds_median": round(statistics.median(vectorised_runs), 4),
            "speedup_median": round(statistics.median(ratios), 1),
            "speedup_range": [round(min(ratios), 1), round(max(ratios), 1)], "bounds_equal": bool(equal)}


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    labels, baseline, variants = synthetic_predictions(args.examples, args.variants)
    results = [time_metric(metric, labels, baseline, variants, args) for metric in args.metrics]
    intervals = [time_bootstrap(metric, labels, baseline, variants, args) for metric in args.metrics]
    summary = {"variants": args.variants, "examples": args.examples, "permutations": args.permutations,
               "draws": args.draws, "bootstrap": intervals,
               "repeats": args.repeats, "loop_variants": args.loop_variants,
               "loop_permutations": args.loop_permutations, "cpu_count": os.cpu_count(), "metrics": results}
    print(f"permutation bench: {args.variants} variants x {args.examples} examples x {args.permutations:,} "
          f"permutations (synthetic binary predictions; smallest attainable p {1 / (args.permutations + 1):.1g}, "
          f"Holm's first threshold over {args.variants} tests {0.05 / args.variants:.1g})")
    for row in results:
        print(f"  {row['metric']:<9} vectorised {row['vectorised_seconds_median']:.2f} s (median; runs "
              f"{row['vectorised_seconds_runs']}); loop ~{row['loop_seconds_extrapolated']:,.0f} s (extrapolated "
              f"from {args.loop_variants} variants x {args.loop_permutations} permutations, "
              f"{row['loop_seconds_timed']:.2f} s): {row['speedup']:,.0f}x; same p-values on the loop's subset: "
              f"{'yes' if row['loop_p_equal'] else 'NO'}")
    print(f"bootstrap interval bench: {args.variants} variants x {args.examples} examples x {args.draws:,} draws, "
          f"loop (bootstrap_difference_interval) vs vectorised (confusion_difference_interval), {args.repeats} "
          f"alternating repeats")
    for row in intervals:
        print(f"  {row['metric']:<9} loop {row['loop_seconds_median']:.2f} s (median; runs "
              f"{row['loop_seconds_runs']}); "
              f"vectorised {row['vectorised_seconds_median']:.3f} s (runs {row['vectorised_seconds_runs']}): "
              f"{row['speedup_median']:,.0f}x (range {row['speedup_range'][0]:,.0f}-{row['speedup_range'][1]:,.0f}); "
              f"same bounds: {'yes' if row['bounds_equal'] else 'NO'}")
    write_summary(args.json, summary)
    return summary


if __name__ == "__main__":
    run_script(main)
