"""Benchmark: the live Explore view for one sentence on the CPU with MiniLM (target: at most 1 s).

Measured: model already loaded; from the text to the grid image with all 72 heads classified
(forward pass through the map stream, classification of every head, the 6 x 12 grid drawn), and the
app's whole handler (the same plus writing the PNG/SVG/CSV downloads). Inputs are fresh every time
(no cached maps). Uses the shipped classifier checkpoint when present, otherwise an untrained classifier
of the same architecture (same cost).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_explore.py [--repeats 20] [--threads 1] [--json explore.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from analysis.errors import AttnpatError
from analysis.figures import grid_image
from analysis.rundir import atomic_write_json, writable_path
from analysis.stream import displayed_maps
from app.explore import LiveExplorer, ModelCache, sentence_maps
from app.webapp import WebApp
from classifier.model import PatternCNN
from classifier.predict import PatternClassifier, classify_heads, load_classifier

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TARGET_SECONDS = 1.0
SENTENCES = {
    "short": "A gripping, funny film.",
    "typical SST-2 sentence": "The film is strictly routine, but it has enough charm and good acting to keep you "
                                  "watching until the end.",
    "long (near the 128 limit)": " ".join(
        ["The director keeps the story moving with wit, warmth and a sharp eye for detail,"] * 6)
    + " and the cast is superb.",
}


def classifier_and_name():
    try:
        return load_classifier(), "shipped checkpoint"
    except AttnpatError:
        torch.manual_seed(0)
        untrained = PatternClassifier(PatternCNN().eval(), {"input_size": 32})
        return untrained, "untrained CNN (no usable checkpoint; same cost)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1, as `attnpat app` runs; 0 = torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        if args.repeats < 1 or args.threads < 0:
            raise AttnpatError("--repeats must be at least 1 and --threads at least 0")
        if args.json:
            writable_path(args.json)  # before the work
    except AttnpatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    classifier, source = classifier_and_name()
    models = ModelCache()
    bundle = models.get("minilm")
    bundle.model.to("cpu")
    bundle.device = torch.device("cpu")
    print(f"bench_explore: minilm ({bundle.num_layers} layers x {bundle.num_heads} heads) on CPU, "
          f"{torch.get_num_threads()} threads, classifier: {source}, {args.repeats} fresh inputs per length")

    def fresh(text: str, k: int) -> str:
        return f"{text} ({k})"  # a new input each time: nothing cached

    for k in range(3):  # warm-up: first calls allocate and fill caches (resize matrices, tokenizer)
        explorer = LiveExplorer(models, classifier_loader=lambda: classifier)
        explorer.explore("minilm", fresh(SENTENCES["short"], -k))

    web = WebApp(explorer=LiveExplorer(models, classifier_loader=lambda: classifier))  # handlers; no page built
    worst, rows = 0.0, []
    print(f"{'input':<28} {'tokens':>6} {'maps ms':>8} {'classify ms':>11} {'grid ms':>8} "
          f"{'text->grid median ms':>20} {'max ms':>7} {'app handler median ms':>21}")
    for name, text in SENTENCES.items():
        stages = {"maps": [], "classify": [], "grid": [], "total": [], "handler": []}
        tokens = 0
        for k in range(args.repeats):
            sentence = fresh(text, k)
            start = time.perf_counter()
            live = sentence_maps(bundle, sentence)
            t_maps = time.perf_counter()
            classes, _ = classify_heads(classifier, live.maps)
            t_classify = time.perf_counter()
            maps, _ = displayed_maps(live.maps, live.item)
            grid_image(maps, classes)
            t_grid = time.perf_counter()
            tokens = len(live.tokens)
            stages["maps"].append(t_maps - start)
            stages["classify"].append(t_classify - t_maps)
            stages["grid"].append(t_grid - t_classify)
            stages["total"].append(t_grid - start)

            start = time.perf_counter()
            web.explore(fresh(sentence, -1), "", "minilm", False, False)
            stages["handler"].append(time.perf_counter() - start)
        med = {key: statistics.median(values) * 1000 for key, values in stages.items()}
        worst = max(worst, statistics.median(stages["handler"]), statistics.median(stages["total"]))
        rows.append({"input": name, "tokens": tokens, "repeats": args.repeats,
                     **{f"{key}_ms_median": round(value, 1) for key, value in med.items()},
                     "total_ms_max": round(max(stages["total"]) * 1000, 1)})
        print(f"{name:<28} {tokens:>6} {med['maps']:>8.1f} {med['classify']:>11.1f} {med['grid']:>8.1f} "
              f"{med['total']:>20.1f} {max(stages['total']) * 1000:>7.1f} {med['handler']:>21.1f}")
    verdict = "PASS" if worst <= TARGET_SECONDS else "FAIL"
    print(f"target: live Explore view <= {TARGET_SECONDS:.1f} s; slowest median {worst:.3f} s -> {verdict}")
    if args.json:
        atomic_write_json(args.json, {"model": "minilm", "threads": torch.get_num_threads(), "classifier": source,
                                      "inputs": rows, "slowest_median_s": round(worst, 3),
                                      "target_s": TARGET_SECONDS, "verdict": verdict})
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
