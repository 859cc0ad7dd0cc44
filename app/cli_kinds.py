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
    overall = table[table["layer"] == "all"]
    header = f"{'measure':<18}" + "".join(f"{kind:>10}" for kind in wanted)
    has_change = "norm_minus_weight" in table.columns
    typer.echo(header + (f"{'norm-weight':>13}" if has_change else ""))
    for row in overall.itertuples(index=False):
        line = f"{row.measure:<18}" + "".join(f"{getattr(row, kind):>10.3f}" for kind in wanted)
        typer.echo(line + (f"{row.norm_minus_weight:>+13.3f}" if has_change else ""))
    typer.echo(f"table and figure: {RunDir(bundle.slug, data.task, runs_dir).file('map_kinds.csv')}")
