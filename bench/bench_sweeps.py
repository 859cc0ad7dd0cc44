"""Benchmark: the fast single-head disabling sweep against the naive loop, on MiniLM and the SST-2 dev set, CPU.

What "naive" means here (what the original research code does, and what transformers' old head_mask loop did):
for every variant (each of the L x H single heads disabled, plus the baseline) one full forward pass over the
whole data set, batches of --batch-size examples in data order, every input padded to --max-length (128)
tokens. Every naive pass costs the same, so the naive total is measured on --naive-variants passes spread
over the layers and multiplied by the number of passes (``--naive-variants all`` measures every pass).

"Fast" is analysis.sweeps.fast_sweep measured in full: the baseline computed once with a rolling cache of
layer inputs, each head's variant run only from its own layer, the heads of a layer stacked in one pass,
length-sorted dynamically padded batches. The logits of the measured naive variants are compared with the
fast ones (they must agree to 1e-5). Before either is timed, both run once on the first --batch-size examples
(a warm-up, not timed), so the one timed first does not pay the process's one-time costs. Then fast and naive
run in alternation --repeats times; the speed-up is taken per repeat (the two saw the same machine load) and
reported as its median with the range over the repeats, in wall and in CPU time. One torch thread unless
--threads says otherwise (0: torch's default).

    .venv/bin/python bench/bench_sweeps.py                  # full SST-2 dev set (872 sentences), 3 repeats
    .venv/bin/python bench/bench_sweeps.py --n 64 --naive-variants 2 --repeats 2 --json sweeps.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from measure import ratio_spread, run_script, spread_text, write_summary

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.models import list_store
from analysis.rundir import writable_path
from analysis.stream import encode_examples, iter_batches
from analysis.sweeps import BASELINE, fast_sweep, head_variants, naive_sweep, recompute_share, seeded_classifier


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: minilm-sst2 from the model store, else minilm "
                        "with a random (seeded) classification head; timings are the same")
    parser.add_argument("--n", type=int, default=None, help="first N SST-2 dev sentences (default: all 872)")
    parser.add_argument("--mode", default="uniform", choices=["uniform", "zero"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--naive-variants", default="3", help="naive passes to time (the rest extrapolated), or 'all'")
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of both engines (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0 = torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.naive_variants != "all" and not (args.naive_variants.isdigit() and int(args.naive_variants) >= 1):
        raise AttnpatError(f"--naive-variants takes a count of 1 or more or 'all', got '{args.naive_variants}'")
    if args.threads < 0 or args.repeats < 1:
        raise AttnpatError(f"--threads must be at least 0 and --repeats at least 1, got {args.threads} and "
                           f"{args.repeats}")
    if args.json:
        writable_path(args.json)  # before the work
    return args


def warm_up(bundle, examples, encoded, variants, args) -> int:
    """Both engines once on the first --batch-size examples, not timed (as bench_classify and bench_explore do):
    the variant timed first no longer pays the process's one-time costs (first-call allocations, thread pools,
    kernel choices). One head per layer, so the fast engine restarts from every layer; one naive pass."""
    first = encoded[:args.batch_size]  # the first examples, so their indices are 0..k-1 as fast_sweep expects
    warm_batches = list(iter_batches(bundle, examples[:len(first)], batch_size=args.batch_size,
                                     max_length=args.max_length, encoded=first))
    one_per_layer = variants[::bundle.num_heads]
    fast_sweep(bundle, warm_batches, one_per_layer, args.mode)
    naive_sweep(bundle, first, one_per_layer[:1], args.mode, width=args.max_length, batch_size=args.batch_size,
                include_baseline=False)
    return len(first)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.model or ("minilm-sst2" if any(m["name"] == "minilm-sst2" for m in list_store()) else "minilm")
    data = load_data("sst2", split="validation", n=args.n)
    bundle = seeded_classifier(name, num_labels=2, device="cpu")
    L, H = bundle.num_layers, bundle.num_heads
    variants = head_variants(L, H)
    encoded = encode_examples(bundle.tokenizer, data.examples, args.max_length)
    batches = list(iter_batches(bundle, data.examples, batch_size=args.batch_size, max_length=args.max_length,
                                encoded=encoded))
    real_tokens = sum(len(item) for item in encoded)
    padded_dynamic = sum(batch.input_ids.numel() for batch in batches)
    padded_fixed = len(encoded) * args.max_length

    warm_up_examples = warm_up(bundle, data.examples, encoded, variants, args)
    if args.naive_variants == "all":
        timed = variants
    else:  # spread over the layers: the first head of evenly spaced layers
        k = int(args.naive_variants)
        layers = sorted({round(i * (L - 1) / max(1, k - 1)) for i in range(k)})
        timed = [variants[layer * H] for layer in layers]
    passes = len(variants) + 1  # every head, plus the baseline
    runs = {"fast_s": [], "fast_cpu_s": [], "naive_s": [], "naive_cpu_s": []}
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fast = fast_sweep(bundle, batches, variants, args.mode)
        runs["fast_s"].append(time.perf_counter() - start)
        runs["fast_cpu_s"].append(time.process_time() - cpu_start)
        start, cpu_start = time.perf_counter(), time.process_time()
        naive = naive_sweep(bundle, encoded, timed, args.mode, width=args.max_length, batch_size=args.batch_size,
                            include_baseline=False)
        # every naive pass costs the same: the timed ones, extrapolated to all passes
        runs["naive_s"].append((time.perf_counter() - start) / len(timed) * passes)
        runs["naive_cpu_s"].append((time.process_time() - cpu_start) / len(timed) * passes)
    fast_seconds, naive_seconds = statistics.median(runs["fast_s"]), statistics.median(runs["naive_s"])
    speedup, speedup_cpu = ratio_spread(runs["naive_s"], runs["fast_s"]), ratio_spread(runs["naive_cpu_s"],
                                                                                        runs["fast_cpu_s"])
    per_pass = naive_seconds / passes
    difference = max(float((fast[v.name] - naive[v.name]).abs().max()) for v in timed)
    result = {
        "model": bundle.name, "classifier_head": "fine-tuned" if bundle.meta.get("task") else "random (seeded)",
        "examples": len(encoded), "warm_up_examples": warm_up_examples, "mode": args.mode, "layers": L, "heads": H,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "batch_size": args.batch_size, "max_length": args.max_length,
        "naive_passes": passes, "naive_passes_timed": len(timed), "repeats": args.repeats,
        "naive_seconds_per_pass_median": round(per_pass, 3), "naive_seconds_median": round(naive_seconds, 2),
        "fast_seconds_median": round(fast_seconds, 2), "speedup": speedup, "speedup_cpu_time": speedup_cpu,
        **{f"{name}_runs": [round(value, 2) for value in values] for name, values in runs.items()},
        "recompute_bound": round(recompute_share(variants, L), 4),
        "real_tokens_share_dynamic": round(real_tokens / padded_dynamic, 4),
        "real_tokens_share_fixed": round(real_tokens / padded_fixed, 4),
        "max_logit_difference": difference, "baseline_logits_rows": int(fast[BASELINE].shape[0]),
    }
    print(f"sweep bench: {result['model']} ({result['classifier_head']} head), SST-2 dev, {result['examples']} "
          f"sentences, {args.mode} disabling of each of {L}x{H} heads, CPU, {result['threads']} threads "
          "(after an untimed warm-up of both engines)")
    print(f"  naive (1 full pass per head + baseline, padded to {args.max_length}, batch {args.batch_size}): "
          f"{passes} passes x {per_pass:.2f} s = {naive_seconds:.1f} s  (median; {len(timed)} passes timed per "
          f"repeat; runs {result['naive_s_runs']})")
    print(f"  fast engine (measured in full):                  {fast_seconds:.1f} s  (median; runs "
          f"{result['fast_s_runs']})")
    print(f"  speed-up:                                        {spread_text(speedup)}  (target >= 5x on the median)")
    print(f"  in process CPU time (naive / fast):              {spread_text(speedup_cpu)}  (steadier on a shared "
          "machine)")
    print(f"  recompute bound (layer evaluations fast/naive):  {result['recompute_bound']:.3f}  "
          f"((L+1)/(2L) = {(L + 1) / (2 * L):.3f})")
    print(f"  real tokens / computed tokens:                   dynamic {result['real_tokens_share_dynamic']:.3f}, "
          f"fixed-{args.max_length} {result['real_tokens_share_fixed']:.3f}")
    print(f"  max |fast - naive| logit on timed variants:      {difference:.2e}  (must be < 1e-5)")
    write_summary(args.json, result)
    return result


if __name__ == "__main__":
    run_script(main)
