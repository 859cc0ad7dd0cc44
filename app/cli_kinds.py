"""`attnpat compare-kinds`: pattern ratios and attention to [CLS]/[SEP]/punctuation under weight and norm maps.

The classifier package is imported inside the verb on purpose: it loads torchvision and the CNN (seconds),
which no other verb of this module needs.
"""
from __future__ import annotations

import typer

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.mapkinds import KIND_NOTES, check_map_kind
from analysis.models import check_model_kinds, load_model
from analysis.rundir import RunDir
from app import options as opt
from app.display import interval_table_lines

# classifier.map_kinds.CHANGE, the paired change's column (that module is imported inside the verb)
CHANGE = "norm_minus_weight"


def register(app: typer.Typer) -> None:
    app.command("compare-kinds")(compare_kinds)


def compare_kinds(model: str = opt.Model, task: str = opt.Task,
                  n: opt.OptionalInt = opt.n_option(200, "use the first N examples"), split: str = opt.Split,
                  kinds: str = typer.Option("weight,norm", "--kinds", help="comma-separated map kinds to compare "
                                            "(weight, norm, rollout)"),
                  classifier: opt.OptionalPath = typer.Option(None, "--classifier",
                                                              help="checkpoint (default: the shipped one)"),
                  max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
                  text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
                  pair_column: opt.OptionalStr = opt.PairColumn,
                  runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Kobayashi et al. 2020 side by side: per-task pattern ratios and attention to [CLS], [SEP] and punctuation
    under each map kind (norm rows renormalised to sum 1); each kind is classified into its own run folder."""
    from classifier.map_kinds import compare_map_kinds  # noqa: PLC0415 (loads torchvision and the CNN)
    from classifier.predict import load_classifier  # noqa: PLC0415 (loads torchvision and the CNN)

    wanted = list(dict.fromkeys(check_map_kind(kind.strip()) for kind in kinds.split(",") if kind.strip()))
    if len(wanted) < 2:
        raise AttnpatError(f"--kinds needs at least two map kinds, got {kinds!r}")
    check_model_kinds(model, wanted)  # a kind the family cannot give: from its config, before anything loads
    data = load_data(task, split, n, text_column=text_column, pair_column=pair_column, label_column=label_column)
    bundle = load_model(model)
    cnn = load_classifier(str(classifier) if classifier else None)
    table = compare_map_kinds(bundle, data, cnn, kinds=wanted, max_length=max_length, batch_size=batch_size,
                              root=runs_dir, progress=not quiet)
    typer.echo(f"{bundle.name} on {data.task} ({len(data.examples)} examples): all heads and layers")
    for kind in wanted:
        typer.echo(f"  {kind}: {KIND_NOTES[kind]}")
    for line in overall_lines(table, wanted):
        typer.echo(line)
    typer.echo(f"table and figure: {RunDir(bundle.slug, data.task, runs_dir).file('map_kinds.csv')}")


def overall_lines(table, kinds: list[str]) -> list[str]:
    """The printout of map_kinds.csv's all-heads rows: a header, then per measure each kind's value [95% interval]
    and, with weight and norm, their paired change [95% interval] (app.display.interval_table_lines)."""
    overall = table[table["layer"] == "all"].to_dict("records")
    titles = {kind: kind for kind in kinds}
    if CHANGE in table.columns:
        titles[CHANGE] = "norm-weight (paired)"
    lines = interval_table_lines(f"{'measure':<18}", [f"{row['measure']:<18}" for row in overall], overall, titles,
                                 specs={CHANGE: "+.3f"}, separator="  ")
    note = "(95% intervals over the examples" + ("; the change pairs each example's two kinds)" if CHANGE in titles
                                                 else ")")
    return lines + [note]
