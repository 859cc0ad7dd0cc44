"""Clark et al. (2019) verbs: surface, grad-importance, cluster, probe-dep, probe-coref."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import typer

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.gradients import OBJECTIVES, check_mask_probability, load_gradient_model
from analysis.gradients import grad_importance as run_grad_importance
from analysis.models import load_model
from analysis.parsing import SILVER_PARSES
from analysis.probing import FEW_SENTENCES, probe_dependency, score_name
from analysis.probing import probe_coref as run_probe_coref
from analysis.rundir import RunDir
from analysis.surface import SURFACE_METRICS, LabelThresholds, surface_statistics
from app import options as opt
from app.display import layer_interval_lines

WikiTask = typer.Option("wiki", "--task", "-t", help="wiki (Clark's input), a GLUE task, or a .jsonl/.csv/.tsv file")
BroadThreshold = typer.Option(3.8, "--broad-threshold", help="entropy (nats) above which a head 'attends broadly'")
PositionThreshold = typer.Option(0.5, "--position-threshold", help="attention above which a head attends to prev/next")
SpecialThreshold = typer.Option(0.6, "--special-threshold",
                                help="attention above which a head attends to [CLS]/[SEP]/punct.")
MaskSeed = opt.seed_option("random seed of the MLM masking (each example's own draw)")
MdsSeed = opt.seed_option("random seed of the MDS embedding")


def register(app: typer.Typer) -> None:
    app.command("surface")(surface)
    app.command("grad-importance")(grad_importance)
    app.command("cluster")(cluster)
    app.command("probe-dep")(probe_dep)
    app.command("probe-coref")(probe_coref)


def _thresholds(broad: float, position: float, special: float):
    """Clark's thresholds, checked: entropy a finite number of nats, the two shares within [0, 1]."""
    if not 0 <= broad < math.inf:
        raise AttnpatError(f"--broad-threshold is an entropy in nats, 0 or more; got {broad}")
    for option, share in (("--position-threshold", position), ("--special-threshold", special)):
        if not 0 <= share <= 1:
            raise AttnpatError(f"{option} is a share of attention between 0 and 1; got {share}")
    return LabelThresholds(broad=broad, position=position, special=special)


def surface(model: str = opt.Model, task: str = WikiTask, n: opt.OptionalInt = opt.n_option(1000, "examples"),
            split: str = opt.Split, max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
            broad_threshold: float = BroadThreshold, position_threshold: float = PositionThreshold,
            special_threshold: float = SpecialThreshold, map_kind: str = opt.MapKind,
            text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
            pair_column: opt.OptionalStr = opt.PairColumn,
            runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Per-head attention to prev/next/same token, [CLS], [SEP], '.', ',' and entropy; head labels (Clark Fig. 2, 4)."""
    thresholds = _thresholds(broad_threshold, position_threshold, special_threshold)
    data = load_data(task, split, n, text_column=text_column, pair_column=pair_column, label_column=label_column)
    bundle = load_model(model, map_kind=map_kind)
    run = RunDir(bundle.slug, data.task, runs_dir)
    _, per_layer = surface_statistics(bundle, data, run, max_length=max_length, batch_size=batch_size,
                                      progress=not quiet, thresholds=thresholds)
    record = run.manifest()["analyses"]["surface"]
    typer.echo(f"{bundle.name} on {data.task} ({len(data.examples)} examples); layer means over the heads [bootstrap "
               f"95% interval over the examples], layers 1-indexed, entropies in nats; uniform-attention entropy "
               f"{record['uniform_entropy']:.2f} nats")
    half = len(SURFACE_METRICS) // 2  # two tables of five: ten columns of intervals are too wide for a terminal
    for metrics in (SURFACE_METRICS[:half], SURFACE_METRICS[half:]):
        for line in layer_interval_lines(per_layer, {metric: metric for metric in metrics}):
            typer.echo(line)
    typer.echo(_label_line(record))
    _note_unreachable_broad(record["uniform_entropy"], thresholds.broad)
    typer.echo(f"tables and figures: {run.path}")


def _note_unreachable_broad(uniform_entropy: float, broad: float) -> None:
    """A head's mean entropy is at most uniform attention's (log n, averaged over the examples): at or below the
    threshold no head can be 'broad', which a count of 0 alone would not tell."""
    if uniform_entropy <= broad:
        typer.echo(f"note: no head can attend broadly here: uniform attention's entropy on these inputs averages "
                   f"{uniform_entropy:.2f} nats, not above --broad-threshold {broad:g} (Clark's 3.8 is for inputs "
                   "of 128 tokens; lower it for short inputs)")


def _label_line(record: dict) -> str:
    """'head labels (certain: ...): broad 12 (9 certain), ...' from a surface or clusters manifest record."""
    certain = record["certain_label_counts"]
    return ("head labels (certain: the same label anywhere in its statistics' 95% intervals): "
            + ", ".join(f"{label} {count} ({certain[label]} certain)"
                        for label, count in record["label_counts"].items() if count))


def grad_importance(model: str = opt.Model, task: str = WikiTask,
                    n: opt.OptionalInt = opt.n_option(200, "examples"), split: str = opt.Split,
                    max_length: int = opt.MaxLength, batch_size: int = opt.batch_size_option(8),
                    mask_probability: float = typer.Option(0.15, "--mask-probability",
                                                           help="MLM: share of tokens masked"),
                    text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
                    pair_column: opt.OptionalStr = opt.PairColumn,
                    seed: int = MaskSeed, runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Gradient of the MLM loss (or a fine-tuned classifier's task loss) w.r.t. attention to [SEP], '.'/',' and
    other tokens, per layer (Clark Fig. 5)."""
    check_mask_probability(mask_probability)  # before the model loads: the masks are drawn batch by batch
    bundle, objective = load_gradient_model(model)
    data = load_data(task, split, n, text_column=text_column, pair_column=pair_column, label_column=label_column)
    run = RunDir(bundle.slug, data.task, runs_dir)
    table = run_grad_importance(bundle, data, run, objective, max_length=max_length, batch_size=batch_size,
                                progress=not quiet, mask_probability=mask_probability, seed=seed)
    typer.echo(f"{bundle.name} on {data.task}: mean |d {OBJECTIVES[objective]} / d attention| [bootstrap 95% "
               "interval over the examples] (layers 1-indexed)")
    for line in layer_interval_lines(_per_layer_by_target(table), {"sep": "[SEP]", "punct": ". or ,", "other": "other"},
                                     spec=".2e"):
        typer.echo(line)
    typer.echo(f"table and figure: {run.file('grad_importance.csv')}")


def _per_layer_by_target(table: pd.DataFrame) -> pd.DataFrame:
    """grad_importance.csv (layer, target, value, ci_low, ci_high) as one row per layer: layer, <target>,
    <target>_ci_low, <target>_ci_high (the layout app.display.layer_interval_lines reads)."""
    wide = table.pivot(index="layer", columns="target", values=["value", "ci_low", "ci_high"])
    columns = {}
    for target in table.target.unique():
        columns.update({target: wide["value", target], f"{target}_ci_low": wide["ci_low", target],
                        f"{target}_ci_high": wide["ci_high", target]})
    return pd.DataFrame(columns).reset_index()


def cluster(model: str = opt.Model, task: str = WikiTask, n: opt.OptionalInt = opt.n_option(200, "examples"),
            split: str = opt.Split, max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
            broad_threshold: float = BroadThreshold, position_threshold: float = PositionThreshold,
            text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
            pair_column: opt.OptionalStr = opt.PairColumn,
            special_threshold: float = SpecialThreshold, seed: int = MdsSeed, runs_dir: opt.OptionalPath = opt.RunsDir,
            quiet: bool = opt.Quiet) -> None:
    """Jensen-Shannon divergences between heads and their 2-D MDS embedding, coloured by behaviour (Clark Fig. 6)."""
    # imported here on purpose: scikit-learn (the MDS) takes seconds to load and only this verb needs it
    from analysis.clustering import head_clusters  # noqa: PLC0415

    thresholds = _thresholds(broad_threshold, position_threshold, special_threshold)
    data = load_data(task, split, n, text_column=text_column, pair_column=pair_column, label_column=label_column)
    bundle = load_model(model)
    run = RunDir(bundle.slug, data.task, runs_dir)
    clusters = head_clusters(bundle, data, run, max_length=max_length, batch_size=batch_size, progress=not quiet,
                             thresholds=thresholds, seed=seed)
    record = run.manifest()["analyses"]["clusters"]
    typer.echo(f"{len(clusters)} heads embedded (JS divergence in nats, {len(data.examples)} examples)")
    if record.get("resumed_examples"):
        typer.echo(f"resumed: the divergences and surface statistics of {record['resumed_examples']} of the "
                   f"{len(data.examples)} inputs were kept by a stopped run (.clusters/ in the run folder); only the "
                   "other inputs' maps were streamed")
    if record["all_identical"]:
        typer.echo("every head attends alike (all divergences below 1e-6 nats): all heads embedded at one point")
    split_half = record["split_half_correlation"]
    typer.echo("stability: " + ("needs at least 2 examples and 2 heads that differ" if split_half is None else
                                f"split-half correlation of the distance matrices r = {split_half:.4f} (even- vs "
                                "odd-numbered examples); per-pair bootstrap 95% intervals in head_distances.csv"))
    typer.echo(_stress_line(record))
    typer.echo(_position_line(record))
    typer.echo(_label_line(record))
    _note_unreachable_broad(record["uniform_entropy"], thresholds.broad)
    typer.echo(f"tables and figure: {run.file('clusters.csv')}")


def _stress_line(record: dict) -> str:
    """'MDS fit: Kruskal stress-1 ..., fair to poor by Kruskal's guide (...)' from a clusters manifest record."""
    from analysis.clustering import stress_reading  # noqa: PLC0415 (scikit-learn loads slowly, as in cluster)

    bounds = record.get("mds_stress_interval")
    spread = "" if bounds is None else f" [{bounds[0]:.3f}, {bounds[1]:.3f}] (95% over the bootstrap draws)"
    return (f"MDS fit: Kruskal stress-1 {record['mds_stress']:.3f}{spread} (RMS gap between the figure's distances "
            f"and the divergences, relative to the divergences), {stress_reading(record['mds_stress'], bounds)}")


def _position_line(record: dict) -> str:
    """'positions: median radius ...' from a clusters manifest record."""
    relative = record["median_radius_to_spread"]
    if relative is None:
        return "positions: no radius (needs at least 2 examples and 2 heads that differ)"
    return (f"positions: median 95% radius {record['median_position_radius']:.4f} = {relative:.1%} of the plot's "
            f"spread (RMS distance of the heads from their centre, {record['plot_spread']:.4f}); "
            f"{record['position_interval']}; per head in clusters.csv (position_radius), circles in the figure"
            + _layout_text(record))


def _layout_text(record: dict) -> str:
    """'; layout: ...' from a clusters manifest record (none in a record made before it was kept)."""
    layout = record.get("median_layout_radius_to_spread")
    if layout is None:
        return ""
    return (f"\nlayout: median radius {record['median_layout_radius']:.4f} = {layout:.1%} of the spread, the "
            f"{record['layout_note']}")


def probe_dep(conllu_file: Path | None = typer.Argument(None, help="a CoNLL-U file with gold dependency trees"),
              parse: str | None = typer.Option(None, "--parse", help="instead of a CoNLL-U file: parse the "
                                                  "sentences of a task (wiki, sst2, ...) or a .jsonl/.csv/.tsv file "
                                                  "with spaCy en_core_web_sm 3.8.0 (silver parses)"),
              model: str = opt.Model, n: opt.OptionalInt = opt.n_option(None, "first N sentences"),
              split: str = opt.Split, max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
              min_count: int = typer.Option(1, "--min-count", min=1, help="list relations seen at least this often "
                                            "(the overall row is always listed)"),
              text_column: opt.OptionalStr = opt.TextColumn,
              runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Which head finds each word's syntactic head? Best head per relation vs offset baselines (Clark Table 1)."""
    if (conllu_file is None) == (parse is None):
        raise AttnpatError("give a CoNLL-U file (gold parses) or --parse TASK (silver parses), not both or neither")
    if text_column is not None and parse is None:
        raise AttnpatError("--text-column names a data file's column for --parse; a CoNLL-U file has none")
    source = parse if parse is not None else conllu_file
    bundle = load_model(model)
    table, run = probe_dependency(bundle, source, runs_dir, parse=parse is not None, split=split, n=n,
                                  max_length=max_length, batch_size=batch_size, progress=not quiet,
                                  min_count=min_count, text_column=text_column)
    entry = run.manifest()["analyses"]["probing_dependency"]
    score = score_name(entry["parses"])
    typer.echo(f"{bundle.name} on {run.task} ({entry['n_sentences']} sentences, {entry['parses']}); "
               "layers and heads 1-indexed")
    if entry["parses"] == SILVER_PARSES:
        typer.echo(f"silver parses: every figure is {score}'s head words, not accuracy against gold trees")
    if entry.get("n_tied_predictions"):  # absent from a manifest written before ties were counted
        typer.echo(f"{entry['n_tied_predictions']} predictions (word x head x direction) had two or more words tied "
                   "for the most attention: no head predicted, counted wrong")
    typer.echo(f"head and offset picked on the even-numbered sentences; words (in sents sentences), {score} "
               f"[95% interval] on the odd-numbered ones ({entry['n_held_out_sentences']}); intervals resample "
               f"whole sentences, and below {FEW_SENTENCES} sentences are widened to Wilson's over the sentences; "
               f"head-base: {score.split()[0]} difference; p: paired sign-flip test over the held-out sentences, "
               f"p_holm: Holm-adjusted across the {len(table)} rows; in-sample: Clark's best head picked and scored "
               "on all sentences")
    typer.echo(f"{'relation':<14} {'words':>6} {'sents':>5} {'attn [95% interval]':<20}  {'head':<17} {'offset':>6} "
               f"{'base [95% interval]':<20} {'head-base [95% interval]':<24} {'p':>7} {'p_holm':>7} {'in-sample':>9}")
    for row in table.itertuples():
        attention = _percent_interval(row.accuracy, row.ci_low, row.ci_high)
        baseline = _percent_interval(row.baseline_accuracy, row.baseline_ci_low, row.baseline_ci_high)
        difference = _percent_interval(row.head_minus_baseline, row.head_minus_baseline_ci_low,
                                       row.head_minus_baseline_ci_high, sign="+")
        typer.echo(f"{row.relation[:14]:<14} {row.held_out_count:>6} {row.held_out_sentences:>5} {attention}  "
                   f"{f'L{row.best_layer + 1}-H{row.best_head + 1} {row.direction}':<17} {row.baseline_offset:>+6d} "
                   f"{baseline} {difference:<24} {row.p_value:>7.2g} {row.p_holm:>7.2g} "
                   f"{100 * row.in_sample_accuracy:>9.1f}")
    typer.echo(f"tables and figure: {run.path}")


def _percent_interval(value: float, low: float, high: float, sign: str = "") -> str:
    """A share and its interval in percent, 20 characters: ' 76.2 [ 70.1,  81.4]'; sign="+" signs each number
    (a difference, 23 characters: ' +40.3 [ +30.1,  +50.2]')."""
    width = 5 + len(sign)
    return f"{100 * value:>{sign}{width}.1f} [{100 * low:>{sign}{width}.1f}, {100 * high:>{sign}{width}.1f}]"


def probe_coref(model: str = opt.Model, n: opt.OptionalInt = opt.n_option(None, "first N sentences"),
                max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
                runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Antecedent selection accuracy per head on the packaged WinoBias sentences vs baselines (Clark Table 2)."""
    bundle = load_model(model)
    table, _, run = run_probe_coref(bundle, runs_dir, n=n, max_length=max_length, batch_size=batch_size,
                                    progress=not quiet)
    entry = run.manifest()["analyses"]["probing_coref"]
    typer.echo(f"WinoBias antecedent selection ({entry['n_items']} sentences): head picked on the even-numbered "
               f"sentences, all scored on the odd-numbered ones ({entry['n_held_out']}); p: exact McNemar vs the head, "
               "p_holm: Holm-adjusted across the baselines")
    typer.echo(f"{'model':<40} {'accuracy [95% interval]':<23} {'p':>7} {'p_holm':>7}")
    for row in table.itertuples():
        p_value, p_holm = ("" if math.isnan(p) else f"{p:.2g}" for p in (row.p_value, row.p_holm))
        typer.echo(f"{row.model:<40} {_percent_interval(row.accuracy, row.ci_low, row.ci_high):<23} {p_value:>7} "
                   f"{p_holm:>7}")
    typer.echo(f"the best head picked and scored on all sentences, as Clark et al. report it (optimistic): "
               f"{100 * entry['in_sample_best_accuracy']:.1f}")
    typer.echo(f"tables and figure: {run.path}")
