"""Sweep verbs: disable (Kovaleva Figures 8-9), importance and prune (Michel et al.)."""
from __future__ import annotations

import typer

from analysis.cluster import check_ray_options, maybe_ray
from analysis.data import load_data
from analysis.disable import check_mode
from analysis.errors import AttnpatError
from analysis.importance import (
    check_exponent,
    check_pruning_shares,
    check_split_size,
    importance_analysis,
    prune_analysis,
)
from analysis.rundir import RunDir
from analysis.sweeps import UNITS, classifier_head_note, disable_analysis, holm_criterion, seeded_classifier
from app import options as opt
from app.display import interval_text

Mode = typer.Option("uniform", "--mode", help="uniform (Kovaleva: attention 1/n over real tokens) or zero "
                    "(Michel: the head's output times 0)")
NormalizeLayers = typer.Option(True, "--normalize-layers/--no-normalize-layers",
                               help="divide each layer's importance by its L-p norm (bertology)")
Exponent = typer.Option(2.0, "--exponent", help="p of the per-layer norm (bertology: 2)")
NormalizeGlobal = typer.Option(True, "--normalize-global/--no-normalize-global",
                               help="min-max scale all importance scores to [0, 1] (bertology)")


def register(app: typer.Typer) -> None:
    app.command("disable")(disable)
    app.command("importance")(importance)
    app.command("prune")(prune)


def _load(model: str, task: str, split: str, n, check_data=None, **columns):
    """Data plus the model as a classifier; a fresh head is seeded so that reruns (and resumes) agree.
    ``check_data(data)``: the verb's checks of the data, before the model loads. ``columns``: a data file's
    text_column, pair_column and label_column."""
    data = load_data(task, split, n, **columns)
    if check_data is not None:
        check_data(data)
    bundle = seeded_classifier(model, data.num_labels, label_names=data.label_names)
    note = classifier_head_note(bundle, data.task)
    if note:
        typer.echo(f"note: {note}", err=True)
    return bundle, data, note


def _head(entry: dict) -> str:
    return f"layer {entry['layer'] + 1} head {entry['head'] + 1}"


# A metric change with its paired bootstrap 95% interval, signed: '+0.0250 [-0.0100, +0.0600]'.
CHANGE = "+.4f"


def _entry_change(entry: dict) -> str:
    """A summary entry's (a head's or a layer's) change with its interval (delta, ci_low, ci_high)."""
    return interval_text(entry["delta"], entry["ci_low"], entry["ci_high"], spec=CHANGE)


def ranking_lines(summary: dict) -> list[str]:
    """The printed 'disabling helps/hurts most' lines of a disable summary, and, where some heads have no change
    (NaN: a correlation of constant predictions), a line saying how many the rankings leave out."""
    if "best" not in summary:
        return []
    lines = [f"disabling {label} most:  " + ("; ".join(f"{_head(e)} {_entry_change(e)}" for e in rows) or "none")
             for label, rows in (("helps", summary["best"]), ("hurts", summary["worst"]))]
    unranked = summary.get("unranked") or []
    if unranked:
        lines.append(f"not ranked: {len(unranked)} head(s) whose change is undefined (NaN: the metric has no value "
                     f"without them, e.g. a correlation of constant predictions): "
                     + ", ".join(_head(e) for e in unranked))
    return lines


def disable(model: str = opt.Model, task: str = opt.Task, n: opt.OptionalInt = opt.N, split: str = opt.Split,
            mode: str = Mode,
            unit: str = typer.Option("both", "--unit",
                                     help="head (each single head), layer (each whole layer) or both"),
            max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
            text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
            pair_column: opt.OptionalStr = opt.PairColumn,
            runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet, ray: opt.OptionalStr = opt.Ray,
            workers: opt.OptionalInt = opt.Workers, ray_dashboard: bool = opt.RayDashboard) -> None:
    """Task metric with each head / each layer disabled, against the baseline (resumable: rerun to continue;
    --ray: groups of variants go to workers)."""
    check_ray_options(ray, workers, ray_dashboard)
    check_mode(mode)
    units = UNITS if unit == "both" else (unit,)
    if any(u not in UNITS for u in units):
        raise AttnpatError(f"unknown --unit '{unit}'; use head, layer or both")
    bundle, data, note = _load(model, task, split, n, text_column=text_column, pair_column=pair_column,
                               label_column=label_column)
    with maybe_ray(ray, workers, ray_dashboard) as cluster:
        summary = disable_analysis(bundle, data, RunDir(bundle.slug, data.task, runs_dir), mode=mode, units=units,
                                   max_length=max_length, batch_size=batch_size, progress=not quiet, cluster=cluster)
    metric = summary["metric_name"]
    typer.echo(f"{bundle.name} on {data.task} ({len(data.examples)} {data.split} examples), {mode} disabling; "
               f"baseline {metric} {summary['baseline']:.4f}; layers and heads 1-indexed")
    typer.echo("changes with their paired bootstrap 95% interval [low, high]:")
    for line in ranking_lines(summary):
        typer.echo(line)
    if "layer_deltas" in summary:
        typer.echo("whole layer disabled:  " + "; ".join(
            f"layer {i + 1} {interval_text(d, *interval, spec=CHANGE)}"
            for i, (d, interval) in enumerate(zip(summary["layer_deltas"], summary["layer_intervals"]))))
    for unit, rows in summary.get("significant", {}).items():
        name = _head if unit == "heads" else (lambda e: f"layer {e['layer'] + 1}")
        found = "; ".join(f"{name(e)} {_entry_change(e)}" for e in rows)
        typer.echo(f"{unit} whose change survives Holm ({holm_criterion(metric)}; {metric} change with its 95% "
                   f"bootstrap interval): {found or 'none'}")
    for unit, others in summary.get("dropped_modes", {}).items():
        for other in others:
            typer.echo(f"note: disable_{unit}s no longer holds the {other} rows: they were made on other inputs "
                       f"(data, model revision or --max-length), or by an attnpat that did not record them; rerun "
                       f"with --mode {other} --unit {unit} on these inputs to add them back", err=True)
    typer.echo("wrote " + ", ".join(summary["outputs"]))


def importance(model: str = opt.Model, task: str = opt.Task, n: opt.OptionalInt = opt.N, split: str = opt.Split,
               normalize_layers: bool = NormalizeLayers, exponent: float = Exponent,
               normalize_global: bool = NormalizeGlobal, max_length: int = opt.MaxLength,
               batch_size: int = opt.BatchSize, text_column: opt.OptionalStr = opt.TextColumn,
               pair_column: opt.OptionalStr = opt.PairColumn,
               label_column: opt.OptionalStr = opt.LabelColumn, runs_dir: opt.OptionalPath = opt.RunsDir,
               quiet: bool = opt.Quiet, ray: opt.OptionalStr = opt.Ray, workers: opt.OptionalInt = opt.Workers,
               ray_dashboard: bool = opt.RayDashboard) -> None:
    """Head importance (Michel et al.): the mean over the examples of |d loss / d gate|, the gate multiplying the
    head's output (as --mode zero, not uniform attention); heads are ranked by the score normalised as the options
    below say, the table keeps the raw mean beside it (resumable: rerun to continue; --ray: batches go to
    workers)."""
    check_ray_options(ray, workers, ray_dashboard)
    check_exponent(exponent)
    bundle, data, note = _load(model, task, split, n, text_column=text_column, pair_column=pair_column,
                               label_column=label_column)
    with maybe_ray(ray, workers, ray_dashboard) as cluster:
        summary = importance_analysis(bundle, data, RunDir(bundle.slug, data.task, runs_dir),
                                      by_layer=normalize_layers, exponent=exponent, global_minmax=normalize_global,
                                      max_length=max_length, batch_size=batch_size, progress=not quiet,
                                      cluster=cluster)
    typer.echo(f"head importance of {bundle.name} on {data.task} ({summary['normalisation']}); 1-indexed")
    for label, heads in (("least important: ", summary["least"]), ("most important:  ", summary["most"])):
        if heads:  # a one-head model has no least important head apart from its most important one
            typer.echo(label + "; ".join(_head({"layer": layer, "head": head}) for layer, head in heads))
    typer.echo("wrote " + ", ".join(summary["outputs"]))


def prune(model: str = opt.Model, task: str = opt.Task, n: opt.OptionalInt = opt.N, split: str = opt.Split,
          step: float = typer.Option(0.1, "--step", help="share of all heads pruned per step"),
          max_fraction: float = typer.Option(1.0, "--max-fraction", help="stop after this share of heads"),
          iterative: bool = typer.Option(False, "--iterative/--one-shot",
                                         help="recompute importance with the current mask before each step"),
          mode: str = typer.Option("zero", "--mode", help="how a pruned head is masked: zero (Michel, default: its "
                                   "output times 0) or uniform (Kovaleva: attention 1/n over real tokens)"),
          normalize_layers: bool = NormalizeLayers, exponent: float = Exponent,
          normalize_global: bool = NormalizeGlobal, max_length: int = opt.MaxLength,
          batch_size: int = opt.BatchSize, text_column: opt.OptionalStr = opt.TextColumn,
          pair_column: opt.OptionalStr = opt.PairColumn,
          label_column: opt.OptionalStr = opt.LabelColumn, runs_dir: opt.OptionalPath = opt.RunsDir,
          quiet: bool = opt.Quiet) -> None:
    """Pruning curve: the task metric as heads are masked in increasing importance order (one-shot by default),
    each step's change with its paired bootstrap 95% interval and Holm-corrected p (exact McNemar on accuracy; a
    paired permutation test of the change on F1 and Matthews tasks). Importance (every
    recomputation with --iterative) ranks the heads on the even-numbered examples (0, 2, ...); the curve is
    scored on the odd-numbered ones, so the order is not picked on the examples it is judged on (--n 800 scores
    400). Resumable: rerun to continue."""
    check_mode(mode)
    check_pruning_shares(step, max_fraction)
    check_exponent(exponent)
    if n is not None:
        check_split_size(n)
    bundle, data, note = _load(model, task, split, n, lambda data: check_split_size(len(data.examples)),
                               text_column=text_column, pair_column=pair_column, label_column=label_column)
    result = prune_analysis(bundle, data, RunDir(bundle.slug, data.task, runs_dir), step=step,
                            max_fraction=max_fraction, iterative=iterative, mode=mode, by_layer=normalize_layers,
                            exponent=exponent, global_minmax=normalize_global, max_length=max_length,
                            batch_size=batch_size, progress=not quiet)
    typer.echo(f"{bundle.name} on {data.task}: {result['metric_name']} while pruning ({result['label']})")
    typer.echo(f"heads ranked on the {result['n_ranked']} even-numbered {data.split} examples (0, 2, ...), the curve "
               f"scored on the {result['n_scored']} odd-numbered ones")
    typer.echo(f"{'pruned':>7} {'heads':>6} {result['metric_name']:>10} {'change [95% interval]':>28} {'p (Holm)':>9}")
    for row in result["curve"].itertuples():
        change = interval_text(row.delta, row.ci_low, row.ci_high, spec=CHANGE)
        typer.echo(f"{row.fraction_pruned * 100:6.1f}% {row.n_pruned:>6} {row.metric:>10.4f} {change:>28} "
                   f"{row.p_holm:>9.3g}")
    typer.echo("wrote " + ", ".join(result["outputs"]))
