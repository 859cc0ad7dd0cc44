"""Sweep: the pattern CNN's cross-validated macro-F1 under other training settings, against the base recipe and
against its teacher, over several fold seeds, one fold fit per process.

    .venv/bin/python bench/recipe_sweep.py --set bs32:batch_size=32 --set poolw2:pool_weight=2 --seeds 0 1 2
    .venv/bin/python bench/recipe_sweep.py --set bs32:batch_size=32 --seeds 0-9 --workers 16 --out sweep.csv

Every setting is a name and TrainConfig fields (``name:field=value,field=value``); the base recipe (no field
changed: with the default --synthetic-mix, the shipped recipe) always runs too, on the same folds. The folds, the
unlabeled pool, the synthetic maps and the seeds of each fit are those of ``attnpat train --data D --seed S``
(classifier.train.cross_validate_cnn), so a setting's row for seed S is what `attnpat train` would report with that
setting. Each finished fold fit is appended to ``<out>.<key>.folds.jsonl``, the key a hash of the labeled set (maps
and labels), the pool and the synthetic mix: a stopped sweep resumes from there, and other inputs start another
file instead of mixing them.

Output (--out, CSV): setting, seed, macro_f1, then against ``base`` and against ``teacher`` (boosting on the
profile scalars, the CNN's teacher): difference, ci_low, ci_high (95% paired bootstrap over the maps) and p_holm
(paired permutation test, Holm-corrected over the two), from classifier.evaluate.baseline_comparison.
A seed's scores repeat exactly on one machine; another torch build can move them, so compare rows of one machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis.errors import AttnpatError
from analysis.progress import progress_bar
from analysis.rundir import atomic_write_text, save_table, writable_path
from annotation.dataset import load_labeled_set
from classifier import SYNTHETIC_MIX
from classifier.distill import draw_pool, model_of
from classifier.evaluate import baseline_comparison, teacher_predictions
from classifier.model import prepare_maps
from classifier.train import TrainConfig, fit_with_pool, macro_f1, predict_images, stratified_folds, synthetic_extra

BASE = "base"
# the sweep holds these: the fold seed is --seeds', the synthetic maps --synthetic-mix', and every setting shares the
# folds and the prepared images
FIXED = ("seed", "synthetic_per_class", "folds", "input_size")
BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_inputs: dict = {}  # filled before the worker processes fork: images, labels, pool images, synthetic mix


def parse_setting(text: str) -> tuple[str, dict]:
    """'bs32:batch_size=32,pool_weight=2' -> ('bs32', {'batch_size': 32, 'pool_weight': 2.0}), typed as the
    TrainConfig field is; an unknown field or a value of the wrong type is an AttnpatError."""
    name, _, assignments = text.partition(":")
    if not name or not assignments or name == BASE:
        raise AttnpatError(f"--set '{text}': use NAME:field=value[,field=value] (NAME not '{BASE}')")
    types = {f.name: type(getattr(TrainConfig(), f.name)) for f in fields(TrainConfig) if f.name not in FIXED}
    changes = {}
    for assignment in assignments.split(","):
        field, _, value = assignment.partition("=")
        if field not in types:
            raise AttnpatError(f"--set '{text}': '{field}' is not a TrainConfig setting the sweep varies "
                               f"({', '.join(types)})")
        kind = types[field]
        try:
            changes[field] = BOOLEANS[value.lower()] if kind is bool else kind(value)
        except (KeyError, ValueError):
            raise AttnpatError(f"--set '{text}': {field} takes a {kind.__name__}, got '{value}'") from None
    return name, changes


def parse_seeds(items: list[str]) -> list[int]:
    """['0-3', '7'] -> [0, 1, 2, 3, 7]; fold seeds are 0 or more, a range runs upwards."""
    seeds = []
    for item in items:
        low, _, high = item.partition("-")
        if not low.isdigit() or not (high or low).isdigit() or int(high or low) < int(low):
            raise AttnpatError(f"--seeds '{item}': use fold seeds 0 or more, one (7) or a range (0-4)")
        seeds += list(range(int(low), int(high or low) + 1))
    return sorted(set(seeds))


def fit_fold(job: tuple[str, dict, int, int]) -> dict:
    """One fold fit of one setting: its test maps' class probabilities, as cross_validate_cnn makes them."""
    name, changes, seed, fold = job
    torch.set_num_threads(1)
    images, labels, pool = _inputs["images"], _inputs["labels"], _inputs["pool"]
    config = replace(TrainConfig(seed=seed, synthetic_per_class=_inputs["synthetic_mix"]), **changes)
    train, test = stratified_folds(labels, config.folds, seed)[fold]
    result = fit_with_pool(images[train], labels[train], config, seed + fold, synthetic_extra(config), pool)
    return {"setting": name, "changes": changes, "seed": seed, "fold": fold, "test": test.tolist(),
            "probabilities": predict_images(result.model, images[test]).numpy().round(6).tolist()}


def read_fold_cache(path: Path) -> list[dict]:
    """The fold fits appended to ``path`` so far. A line cut off when a sweep was stopped is dropped, and the file
    rewritten without it, so the next fit appended starts a line of its own."""
    if not path.exists():
        return []
    records, cut = [], False
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            cut = True
    if cut:
        atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))
    return records


def sweep_table(records: list[dict], labels: np.ndarray, teacher: dict[int, np.ndarray]) -> pd.DataFrame:
    """One row per (setting, seed) whose folds are all in ``records`` (fold fits of :func:`fit_fold`)."""
    predicted: dict[tuple[str, int], np.ndarray] = {}
    folds: dict[tuple[str, int], set] = {}
    for record in records:
        key = (record["setting"], record["seed"])
        predicted.setdefault(key, np.full(len(labels), -1))[record["test"]] = np.argmax(record["probabilities"], 1)
        folds.setdefault(key, set()).add(record["fold"])
    complete = {key for key, done in folds.items() if len(done) == TrainConfig().folds}
    rows = []
    for name, seed in sorted(complete):
        if (BASE, seed) not in complete:
            continue
        row = {"setting": name, "seed": seed, "macro_f1": macro_f1(predicted[(name, seed)], labels)}
        others = {"teacher": teacher[seed]} if name == BASE else {BASE: predicted[(BASE, seed)],
                                                                      "teacher": teacher[seed]}
        comparison = baseline_comparison({name: predicted[(name, seed)], **others}, labels, name, seed=seed)
        for other in comparison.itertuples():
            row |= {f"{other.model}_{column}": getattr(other, column)
                    for column in ("difference", "ci_low", "ci_high", "p_holm")}
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="annotation/labeled/v5", help="labeled set")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME:FIELD=VALUE,...")
    parser.add_argument("--seeds", nargs="+", default=["0-2"], help="fold seeds, e.g. 0-4 7")
    parser.add_argument("--pool", type=int, default=2000, help="unlabeled maps the teacher labels (attnpat train's)")
    parser.add_argument("--synthetic-mix", type=int, default=SYNTHETIC_MIX,
                        help="synthetic maps per class added to every training part, in every row (attnpat train's)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="recipe_sweep.csv")
    args = parser.parse_args(argv)
    try:
        settings = dict([(BASE, {})] + [parse_setting(text) for text in args.settings])
        seeds = parse_seeds(args.seeds)
        if args.workers < 1 or args.pool < 1 or args.synthetic_mix < 0:
            raise AttnpatError("--workers and --pool must be at least 1 and --synthetic-mix at least 0")
        writable_path(args.out)  # before the work
        labeled = load_labeled_set(args.data)
    except AttnpatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    labels = np.asarray(labeled.labels, dtype=np.int64)
    pool = draw_pool(model_of(labeled.map_ids), args.pool, exclude=labeled.map_ids, progress=True)
    _inputs.update(images=prepare_maps(labeled.maps), labels=labels, pool=prepare_maps(pool.maps),
                   synthetic_mix=args.synthetic_mix)
    # the fold cache is keyed by what every fit saw: another labeled set, pool or mix starts another file
    key = f"{labeled.data_hash} {pool.pool_hash} {args.synthetic_mix}"
    inputs_key = hashlib.sha256(key.encode()).hexdigest()[:12]
    cache = Path(f"{args.out}.{inputs_key}.folds.jsonl")
    cache.parent.mkdir(parents=True, exist_ok=True)  # --out's folder may be new: save_table makes it only at the end
    records = read_fold_cache(cache)
    done = {(r["setting"], r["seed"], r["fold"]) for r in records if r["changes"] == settings.get(r["setting"])}
    records = [r for r in records if (r["setting"], r["seed"], r["fold"]) in done]
    jobs = [(name, changes, seed, fold) for seed in seeds for name, changes in settings.items()
            for fold in range(TrainConfig().folds) if (name, seed, fold) not in done]
    bar = progress_bar(len(jobs), True, "fold fits", unit="fit")
    with cache.open("a") as appended, multiprocessing.get_context("fork").Pool(args.workers) as workers:
        for record in workers.imap_unordered(fit_fold, jobs):
            appended.write(json.dumps(record) + "\n")
            appended.flush()
            records.append(record)
            bar.update(1)
    bar.close()
    teacher = {seed: teacher_predictions(labeled.maps, labels, stratified_folds(labels, TrainConfig().folds, seed),
                                         seed) for seed in seeds}
    table = sweep_table([r for r in records if r["seed"] in teacher], labels, teacher)
    save_table(table, args.out)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
