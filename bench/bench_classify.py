"""Benchmark: classifying every head's map vs the bare forward pass with attentions, and peak memory.

Targets (issue 4): on the CPU, classifying all heads on all 872 SST-2 dev examples with MiniLM takes at
most 1.5x the bare forward pass with attentions over the same data; peak memory stays within 1.2x from
100 to 872 examples.

    .venv/bin/python bench/bench_classify.py                    # both measurements, all 872 examples
    .venv/bin/python bench/bench_classify.py --threads 2 --repeats 3 --json out.json
    .venv/bin/python bench/bench_classify.py --model mpnet --n 200 --memory-n 50 200  # after models fetch mpnet

Timing: the bare pass is analysis.stream.stream_maps consumed without work (the same batches, padding,
masking and copy to the CPU the classifier gets); the classified pass is classifier.classify.head_class_counts
(stream + crop + resize + CNN + counting). Model and CNN are loaded, and both passes run once on 64 examples
(a warm-up), before any timing. Then each pass runs --repeats times, alternating, and the ratio classify / bare
is taken per repeat (the two passes of a repeat saw the same machine load): its median is the figure, with the
range over the repeats. The CPU time of the process is reported the same way, since on a busy machine it is far
more stable than wall time. One torch thread unless --threads says otherwise (0: torch's default).
Memory: peak resident set size (VmHWM) of a fresh process that loads the model and classifies n examples, for
each n in --memory-n.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from measure import peak_rss_mib, ratio_spread, spread_text

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.models import load_model
from analysis.rundir import atomic_write_json, writable_path
from analysis.stream import stream_maps
from classifier.classify import head_class_counts
from classifier.predict import load_classifier


def _setup(threads: int, checkpoint: str | None = None, precision: str = "auto", model: str = "minilm"):
    if threads:
        torch.set_num_threads(threads)
    bf16 = {"auto": None, "fp32": False, "bf16": True}[precision]
    return load_model(model, device="cpu"), load_classifier(checkpoint, bf16=bf16)


def bare_pass(bundle, examples, batch_size: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of the bare map stream."""
    started, cpu = time.perf_counter(), time.process_time()
    for _ in stream_maps(bundle, examples, batch_size=batch_size):
        pass
    return time.perf_counter() - started, time.process_time() - cpu


def classified_pass(bundle, examples, classifier, batch_size: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, maps classified) of the classified stream."""
    started, cpu = time.perf_counter(), time.process_time()
    counts = head_class_counts(bundle, examples, classifier, batch_size=batch_size, progress=False)
    return time.perf_counter() - started, time.process_time() - cpu, int(counts.sum())


def peak_memory_child(n: int, threads: int, batch_size: int, checkpoint: str | None,
                      model: str = "minilm", precision: str = "auto") -> None:
    """Runs in a fresh process: classify n examples and print this process's peak RSS in MiB."""
    bundle, classifier = _setup(threads, checkpoint, precision, model)
    _, _, maps = classified_pass(bundle, load_data("sst2", n=n).examples, classifier, batch_size)
    print(json.dumps({"n": n, "maps": maps, "peak_rss_mib": peak_rss_mib()}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", help="the encoder (e.g. mpnet after `attnpat models fetch mpnet`)")
    parser.add_argument("--n", type=int, default=872, help="SST-2 dev examples to time (872 = all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each pass (default 3)")
    parser.add_argument("--memory-n", type=int, nargs="*", default=[100, 872], help="example counts for peak memory")
    parser.add_argument("--classifier", default=None, help="checkpoint (default: the shipped one)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="the CNN's arithmetic (auto: bfloat16 where the CPU supports it natively)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.repeats < 1 or args.threads < 0 or any(n < 1 for n in args.memory_n):
            raise AttnpatError("--repeats and every --memory-n must be at least 1 and --threads at least 0")
        if args.json:
            writable_path(args.json)  # before the work
        if args.child is not None:
            peak_memory_child(args.child, args.threads, args.batch_size, args.classifier, args.model, args.precision)
            return 0
        return measure(args)
    except AttnpatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def measure(args) -> int:
    bundle, classifier = _setup(args.threads, args.classifier, args.precision, args.model)
    examples = load_data("sst2", n=args.n).examples
    bare_pass(bundle, examples[:64], args.batch_size)  # warm-up: first-call allocations, thread pools
    classified_pass(bundle, examples[:64], classifier, args.batch_size)
    bare_times, classify_times, bare_cpu, classify_cpu, maps = [], [], [], [], 0
    for _ in range(args.repeats):
        wall, cpu = bare_pass(bundle, examples, args.batch_size)
        bare_times.append(wall)
        bare_cpu.append(cpu)
        wall, cpu, maps = classified_pass(bundle, examples, classifier, args.batch_size)
        classify_times.append(wall)
        classify_cpu.append(cpu)
    ratio, cpu_ratio = ratio_spread(classify_times, bare_times), ratio_spread(classify_cpu, bare_cpu)
    bare, classified = statistics.median(bare_times), statistics.median(classify_times)
    result = {"model": bundle.name, "layers": bundle.num_layers, "heads": bundle.num_heads,
              "examples": len(examples), "maps": maps, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "cnn_dtype": str(classifier.input_dtype).replace("torch.", ""),
              "bare_forward_s_median": round(bare, 2), "classify_s_median": round(classified, 2),
              "ratio": ratio, "cpu_ratio": cpu_ratio, "maps_per_s_median": round(maps / classified),
              "bare_runs_s": [round(t, 2) for t in bare_times],
              "classify_runs_s": [round(t, 2) for t in classify_times],
              "bare_cpu_runs_s": [round(t, 2) for t in bare_cpu],
              "classify_cpu_runs_s": [round(t, 2) for t in classify_cpu], "target_ratio": 1.5}
    memory = []
    for n in args.memory_n:
        command = [sys.executable, __file__, "--child", str(n), "--batch-size", str(args.batch_size),
                   "--model", args.model, "--precision", args.precision]
        command += ["--threads", str(args.threads)]
        if args.classifier:
            command += ["--classifier", args.classifier]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        memory.append(json.loads(output.strip().splitlines()[-1]))
    if len(memory) >= 2:
        result["peak_rss_mib"] = {str(m["n"]): round(m["peak_rss_mib"]) for m in memory}
        result["peak_memory_ratio"] = round(memory[-1]["peak_rss_mib"] / memory[0]["peak_rss_mib"], 3)
        result["target_memory_ratio"] = 1.2

    print(f"SST-2 dev, {result['examples']} examples, {bundle.name} ({bundle.num_layers} x {bundle.num_heads} heads), "
          f"CPU, {result['threads']} threads, "
          f"CNN in {result['cnn_dtype']}")
    print(f"  bare forward pass with attentions : median {bare:7.2f} s   (runs: {result['bare_runs_s']})")
    print(f"  classify all {maps} maps       : median {classified:7.2f} s   (runs: {result['classify_runs_s']}), "
          f"{result['maps_per_s_median']} maps/s")
    print(f"  ratio classify / forward          : {spread_text(ratio)}   (target <= 1.5 on the median: "
          f"{'met' if ratio['median'] <= 1.5 else 'NOT met'})")
    print(f"  CPU-time ratio (robust on a busy machine): {spread_text(cpu_ratio)}")
    if "peak_memory_ratio" in result:
        print(f"  peak RSS by examples (MiB)        : {result['peak_rss_mib']}   "
              f"ratio {result['peak_memory_ratio']:.2f} "
              f"(target <= 1.2: {'met' if result['peak_memory_ratio'] <= 1.2 else 'NOT met'})")
    if args.json:
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
