"""Pattern classifier verbs: train (cross-validated CNN + baselines + checkpoint), classify, and evaluate (the
classifier against a labeled set).

The classifier package is imported inside the verbs on purpose: it loads torchvision and the CNN (seconds),
which no other verb needs.
"""
from __future__ import annotations

import math
from pathlib import Path

import typer

from analysis.artifacts import HELD_OUT_LABELED_SET, SHIPPED_LABELED_SET
from analysis.cluster import check_ray_options, maybe_ray
from analysis.errors import AttnpatError
from analysis.mapkinds import KIND_NOTES
from analysis.models import load_model
from analysis.rundir import RunDir, writable_path
from app import options as opt
from app.display import ratio_lines, ratio_notes
from classifier import DEFAULT_POOL, SYNTHETIC_MIX


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("classify")(classify)
    app.command("evaluate")(evaluate)


def train(data: str = typer.Option(..., "--data", help=f"labeled-set folder (e.g. {SHIPPED_LABELED_SET}) or "
                                   "synthetic[:N]"),
          out: opt.OptionalPath = typer.Option(None, "--out", help="checkpoint .safetensors (default: run "
                                               "dir/classifier.safetensors)"),
          folds: int = typer.Option(5, "--folds", help="stratified cross-validation folds"),
          fold_groups: str = typer.Option("map", "--fold-groups", help="what a fold keeps together: map (new maps "
                                          "of the trained heads), head (heads never seen, as another model's) or "
                                          "example"),
          epochs: int = typer.Option(100, "--epochs", min=1, help="maximum epochs (early stopping ends sooner)"),
          seed: int = opt.seed_option("seed for folds, initialisation and batches"),
          synthetic_mix: int | None = typer.Option(None, "--synthetic-mix", min=0,
                                                   help="synthetic maps per class added to every training part "
                                                        f"(default {SYNTHETIC_MIX}; with --data synthetic none is "
                                                        "added, and a count is refused)"),
          baselines: bool = typer.Option(True, "--baselines/--no-baselines",
                                         help="also score the rule and feature baselines"),
          pool: int | None = typer.Option(None, "--pool", help="unlabeled maps a teacher labels for the CNN to "
                                          f"learn from too (default {DEFAULT_POOL}; 0 = none; with --data synthetic "
                                          "none is drawn, and a count is refused)"),
          pool_model: str | None = typer.Option(None, "--pool-model", help="model the unlabeled maps come from "
                                                "(default: the labeled maps' model)"),
          pool_exclude: list[Path] = typer.Option([], "--pool-exclude", help="a labeled set, a sample or a folder "
                                                  "of them whose maps stay out of the unlabeled pool (repeatable; "
                                                  "e.g. annotation/labeled keeps the held-out panels out; not "
                                                  "with --data synthetic)"),
          pool_weight: float = typer.Option(1.0, "--pool-weight",
                                            help="loss weight of a pool map relative to a labeled "
                                                 "map (0: no pool is drawn)"),
          pool_rounds: int = typer.Option(1, "--pool-rounds", help="1: the CNN learns the pool from the teacher; 2: "
                                          "a second CNN learns it from the teacher and the first CNN"),
          class_weight_power: float = typer.Option(0.5, "--class-weight-power", help="loss weight of a class = "
                                                   "(inverse frequency) ** this (0 = none, 1 = fully balanced)"),
          image_dropout: float = typer.Option(0.5, "--image-dropout", help="share of training maps the CNN "
                                              "classifies from the profile scalars alone (0 = none; below 1)"),
          runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Train the 8-layer CNN on a labeled set: k-fold CV scores vs baselines, then a checkpoint."""
    from annotation.sample import map_ids_in  # noqa: PLC0415
    from classifier.checkpoint import checkpoint_path  # noqa: PLC0415
    from classifier.evaluate import comparison_lines  # noqa: PLC0415
    from classifier.train import TrainConfig  # noqa: PLC0415
    from classifier.training_run import load_training_data, train_pattern_cnn  # noqa: PLC0415

    if (pool or 0) < 0 or not 0 <= pool_weight < math.inf or pool_rounds < 1 or not 0 <= class_weight_power < math.inf:
        raise AttnpatError(f"--pool, --pool-weight and --class-weight-power must be 0 or more and --pool-rounds at "
                           f"least 1 (got {pool}, {pool_weight}, {class_weight_power}, {pool_rounds})")
    if not 0 <= image_dropout < 1:
        raise AttnpatError(f"--image-dropout must be at least 0 and below 1 (got {image_dropout})")
    training = load_training_data(data, seed)
    if training.synthetic:
        refuse_options_synthetic_data_ignores(data, pool=pool, pool_model=pool_model, pool_exclude=pool_exclude,
                                              synthetic_mix=synthetic_mix)
    pool = DEFAULT_POOL if pool is None else pool
    synthetic_mix = SYNTHETIC_MIX if synthetic_mix is None else synthetic_mix
    # read before any work: a folder that is missing or holds no labeled set is an option to correct
    held_out = sorted(set().union(*(map_ids_in(path) for path in pool_exclude))) if pool_exclude else []
    run = RunDir("classifier", training.name, runs_dir)
    out = checkpoint_path(out or run.file("classifier.safetensors"))  # before the pool is drawn
    config = TrainConfig(max_epochs=epochs, folds=folds, seed=seed, pool_weight=pool_weight, pool_rounds=pool_rounds,
                         class_weight_power=class_weight_power, image_dropout=image_dropout,
                         synthetic_per_class=0 if training.synthetic else synthetic_mix)
    unlabeled = None
    if pool and pool_weight and not training.synthetic:  # a pool of weight 0 would teach nothing: not drawn
        from classifier.distill import PoolRequest, model_of  # noqa: PLC0415
        from classifier.train import check_labels  # noqa: PLC0415

        check_labels(training.labels, folds)  # first: an empty set is said to be empty, not of an unknown model
        # drawn once train_pattern_cnn has checked the labels and folds and locked the run folder (or taken from the
        # run it resumes)
        unlabeled = PoolRequest(pool_model or model_of(training.map_ids), pool,
                                exclude=(*training.map_ids, *held_out),
                                excluded_from=tuple(str(path) for path in pool_exclude))
    report = train_pattern_cnn(training, out, run, config, baselines=baselines, progress=not quiet, pool=unlabeled,
                               fold_grouping=fold_groups)
    kept_together = {"head": "; every map of a head in one fold", "example": "; every map of an input in one fold"}
    typer.echo(f"{len(training.labels)} maps from {training.source}; {folds}-fold cross-validation "
               f"(out-of-fold scores{kept_together.get(fold_groups, '')}):")
    typer.echo(report.summary.to_string(float_format=lambda v: f"{v:.3f}"))
    for line in comparison_lines(report.comparison):
        typer.echo(line)
    tables = ["cv_scores.csv", "cv_confusion.csv", "cv_predictions.csv", "cv_vs_baselines.csv"]
    typer.echo("tables: " + ", ".join(str(run.file(name)) for name in tables))
    typer.echo(f"checkpoint: {out} (+ {Path(out).with_suffix('.json').name})")


def refuse_options_synthetic_data_ignores(data: str, *, pool: int | None, pool_model: str | None,
                                          pool_exclude: list[Path], synthetic_mix: int | None) -> None:
    """Refuse, for --data synthetic, an option that would be silently ignored: synthetic maps come from no model's
    heads, so no pool of unlabeled maps (nor maps kept out of one) belongs with them, and no synthetic maps are
    mixed into what is synthetic already. A count of 0 asks for nothing and passes."""
    asked = [name for name, given in (("--pool", pool), ("--pool-model", pool_model), ("--pool-exclude", pool_exclude),
                                      ("--synthetic-mix", synthetic_mix)) if given]
    if asked == ["--synthetic-mix"]:
        raise AttnpatError(f"--data {data} trains on synthetic maps, to which no more are added: leave out "
                           "--synthetic-mix (it mixes synthetic maps into a labeled set)")
    if asked:
        raise AttnpatError(f"--data {data} trains on synthetic maps, which no unlabeled pool goes with: leave out "
                           f"{asked[0]} (no pool is drawn for synthetic data)")


def classify(model: str = opt.Model, task: str = opt.Task, n: opt.OptionalInt = opt.N, split: str = opt.Split,
             maps: opt.OptionalPath = typer.Option(None, "--maps",
                                                   help="classify map files from `attnpat extract` instead"),
             classifier: opt.OptionalPath = typer.Option(None, "--classifier",
                                                         help="checkpoint (default: the shipped one)"),
             out: opt.OptionalPath = typer.Option(None, "--out", help="with --maps: output CSV (default: <maps "
                                                  "folder>/map_classes.csv)"),
             max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize, map_kind: str = opt.MapKind,
             text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
             pair_column: opt.OptionalStr = opt.PairColumn,
             runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet, ray: opt.OptionalStr = opt.Ray,
             workers: opt.OptionalInt = opt.Workers, ray_dashboard: bool = opt.RayDashboard) -> None:
    """Classify every head's attention maps on a task (or --task all), or saved map files (--maps); --map-kind norm
    or rollout classifies those maps instead (into runs/<model>@<kind>/); --ray spreads batches over workers."""
    check_ray_options(ray, workers, ray_dashboard)
    from classifier.predict import load_classifier  # noqa: PLC0415

    if out is not None and maps is None:
        raise AttnpatError("--out names the table of --maps; a task's tables go to its run folder (see --runs-dir)")
    if maps is not None:
        check_no_task_options({"--model": model, "--task": task, "--n": n, "--split": split, "--max-length": max_length,
                               "--map-kind": map_kind, "--text-column": text_column, "--label-column": label_column,
                               "--pair-column": pair_column})
    cnn = load_classifier(str(classifier) if classifier else None)
    if maps is not None:
        if ray is not None:
            raise AttnpatError("--ray classifies a task's maps as they are computed, not saved map files (--maps)")
        folder = maps if maps.is_dir() else maps.parent
        try:
            if maps.exists():  # (else classify_saved_maps says the maps are missing)
                writable_path(out or folder / "map_classes.csv")  # before the maps are classified
        except AttnpatError as exc:
            raise AttnpatError(f"{exc}; write the table elsewhere with --out FILE.csv" if out is None else str(exc)) \
                from None
        from classifier.classify import classify_saved_maps, write_map_classes  # noqa: PLC0415

        frame = classify_saved_maps(maps, cnn, progress=not quiet)
        path = write_map_classes(frame, out or folder / "map_classes.csv")
        typer.echo(f"classified {len(frame)} maps; predicted classes: "
                   + ", ".join(f"{cls} {count}" for cls, count in frame.predicted.value_counts().items()))
        typer.echo(f"table: {path}")
        return

    from classifier.classify import available_glue_tasks, classify_tasks  # noqa: PLC0415

    tasks = available_glue_tasks(split) if task == "all" else [task]
    if not tasks:
        raise AttnpatError(f"--task all: no GLUE task's {split} split can be loaded now (no offline files for it and "
                           "the hub unreachable; see `attnpat info`)")
    bundle = load_model(model, map_kind=map_kind)
    with maybe_ray(ray, workers, ray_dashboard) as cluster:
        ratios = classify_tasks(bundle, tasks, cnn, n=n, split=split, batch_size=batch_size, max_length=max_length,
                                root=runs_dir, progress=not quiet,
                                columns={"text_column": text_column, "pair_column": pair_column,
                                         "label_column": label_column}, cluster=cluster)
    kind_note = "" if map_kind == "weight" else f", {KIND_NOTES[map_kind]}"
    typer.echo(f"pattern ratios of {bundle.name} (classifier trained on {cnn.trained_on}{kind_note}), share of "
               "the task's maps [95% bootstrap interval over the examples; adjusted: also over the labeled maps "
               "behind the confusion matrix]:")
    for name, table in ratios.items():
        typer.echo(f"  {name}")
        for line in ratio_lines(table):
            typer.echo(line)
        uncertainty = RunDir(bundle.slug, name, runs_dir).manifest().get("analyses", {}).get("classify", {}).get(
            "ratio_uncertainty", {})
        for note in ratio_notes(uncertainty):
            typer.echo(f"    note: {note}")
    last = RunDir(bundle.slug, list(ratios)[-1], runs_dir)
    typer.echo(f"tables and figures: {last.path} (per-task comparison: {RunDir(bundle.slug, 'all', runs_dir).path})")


# The options that choose which maps of a task classify computes, with their defaults
TASK_OPTIONS = {"--model": opt.Model, "--task": opt.Task, "--n": opt.N, "--split": opt.Split,
                "--max-length": opt.MaxLength, "--map-kind": opt.MapKind, "--text-column": opt.TextColumn,
                "--label-column": opt.LabelColumn, "--pair-column": opt.PairColumn}


def check_no_task_options(given: dict) -> None:
    """With --maps, a one-line AttnpatError naming the task options (TASK_OPTIONS) given other values than their
    defaults: the saved maps are classified as they are, so such an option would be ignored without a word."""
    changed = [flag for flag, value in given.items() if value != TASK_OPTIONS[flag].default]
    if changed:
        raise AttnpatError(f"{', '.join(changed)} {'chooses' if len(changed) == 1 else 'choose'} a task's maps; "
                           "--maps classifies every map of the files as they were saved (choose them when extracting: "
                           "attnpat extract)")


def evaluate(data: str = typer.Option(..., "--data", help=f"labeled-set folder (e.g. {HELD_OUT_LABELED_SET})"),
             classifier: opt.OptionalPath = typer.Option(None, "--classifier",
                                                         help="checkpoint (default: the shipped one)"),
             panel_size: int | None = typer.Option(None, "--panel-size", help="also the macro-F1 that a fresh panel "
                                                   "of this many maps, drawn as these were, would score"),
             annotator: str | None = typer.Option(None, "--annotator", help="score against this annotator's own "
                                                  "first-round labels (annotations.csv), on the maps they labeled: "
                                                  "the name shown for them or their Label Studio user id"),
             paired_with: str | None = typer.Option(None, "--paired-with", help="another labeled set of the same "
                                                    "maps: also the scores against --data's labels minus against "
                                                    "its labels, with a 95% paired bootstrap interval"),
             runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Score the classifier against a labeled set: macro-F1 with a 95% bootstrap interval over maps, accuracy,
    per-class precision, recall and F1, the confusion matrix, and its annotators against each other; warns when
    some maps were in its training set."""
    from annotation.dataset import annotator_labeled_set, load_labeled_set  # noqa: PLC0415
    from classifier.agreement import evaluate_labeled_set, evaluation_run, overlap_warning, summary_lines  # noqa: PLC0415
    from classifier.predict import load_classifier  # noqa: PLC0415

    labeled = load_labeled_set(data)
    if annotator is not None:
        labeled = annotator_labeled_set(labeled, annotator)
    other = load_labeled_set(paired_with) if paired_with is not None else None
    cnn = load_classifier(classifier, bf16=False)  # float32: the scores do not depend on the CPU
    found = evaluate_labeled_set(labeled, cnn, evaluation_run(data, runs_dir, labeled.annotator), progress=not quiet,
                                 panel_size=panel_size, paired_with=other)
    warning = overlap_warning(found)
    if warning:
        typer.echo(warning, err=True)
    for line in summary_lines(found, data, cnn.trained_on, paired_with):
        typer.echo(line)
    typer.echo("tables and figure: " + ", ".join(str(path) for path in found.files))
