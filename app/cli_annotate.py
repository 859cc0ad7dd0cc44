"""`attnpat annotate serve|stop|status|push|pull|merge|agreement`: the Label Studio workflow."""
from __future__ import annotations

from pathlib import Path

import typer

from analysis.errors import AttnpatError
from analysis.paths import annotation_root
from analysis.rundir import locked
from annotation import instructions
from annotation.dataset import merge_labeled_sets
from annotation.sample import ensure_sample
from annotation.server import credentials_file, invite_link, load_credentials, resolve_credentials
from annotation.server import serve as start
from annotation.server import status as state
from annotation.server import stop as halt
from app import options as opt

annotate = typer.Typer(no_args_is_help=True, help="Label attention maps on a Label Studio server.")

Url = typer.Option(None, "--url", help="Label Studio URL (default: the server started by `annotate serve`, or "
                   "$LABEL_STUDIO_URL)")
Token = typer.Option(None, "--token", help="API token (default: stored credentials, or $LABEL_STUDIO_API_KEY)")
Sample = typer.Option(None, "--sample", help="sample name (default: <model>-n<count>-s<seed>)")
Title = typer.Option(None, "--project", help="project title (default: 'attnpat patterns: <sample>')")
Port = typer.Option(None, "--port", min=1, max=65535,
                    help="port on 127.0.0.1 (default: the running server's, else 8080)")


def register(app: typer.Typer) -> None:
    app.add_typer(annotate, name="annotate")


def _credentials(url: str | None, token: str | None):

    return resolve_credentials(url, token)


def _samples_dir() -> Path:

    return annotation_root() / "samples"


def _state_file() -> Path:

    return annotation_root() / "projects.json"


@annotate.command("serve")
def serve(port: int | None = Port,
          label_studio: Path | None = typer.Option(None, "--label-studio", help="the label-studio executable "
                                                   "(default: $ATTNPAT_LABEL_STUDIO, else the set-up's "
                                                   ".ls-venv/bin/label-studio)")) -> None:
    """Start a local Label Studio (127.0.0.1, offline), create the admin user and store an API token (0600)."""
    credentials = start(port=port, log=typer.echo, label_studio=label_studio)
    typer.echo(f"Label Studio is serving on {credentials.url}")
    typer.echo(f"log in as {credentials.email}; password and token are in {credentials_file()} (readable by you only)")


@annotate.command("stop")
def stop() -> None:
    """Stop the local Label Studio."""
    typer.echo("stopped" if halt() else "no local Label Studio is running")


@annotate.command("status")
def status() -> None:
    """Is the local Label Studio running and healthy?"""
    info = state()
    typer.echo(f"running: {info['running']} (pid {info['pid']}); url: {info['url']}; healthy: {info['healthy']}; "
               f"credentials: {info['credentials']}")


@annotate.command("invite")
def invite() -> None:
    """Print the sign-up link for more annotators of the local Label Studio (each then labels under their own
    account, so pull can measure inter-annotator agreement)."""
    stored = load_credentials()
    if stored is None:
        raise AttnpatError("no local Label Studio credentials: run `attnpat annotate serve` first")
    typer.echo(invite_link(stored))


@annotate.command("push")
def push(model: str = opt.Model, count: int = typer.Option(480, "--count", help="maps to sample"),
         tasks: str = typer.Option("sst2,mrpc,rte,wiki", "--tasks", help="comma-separated tasks to sample from"),
         seed: int = opt.seed_option("seed for the map sample"), sample: str | None = Sample,
         project: str | None = Title,
         url: str | None = Url, token: str | None = Token, max_length: int = opt.MaxLength,
         stratify_by: str | None = typer.Option(
             None, "--stratify-by", help="draw maps by predicted class to collect rare patterns: rules, classifier "
             "(the shipped CNN) or a checkpoint path (default: stratify over tasks, layers, heads, examples)"),
         class_shares: str | None = typer.Option(
             None, "--class-shares", help="with --stratify-by: share of maps per predicted class, e.g. "
             "block=3,heterogeneous=3,diagonal=2,vertical=1,vertical+diagonal=1 (default: equal)"),
         exclude: list[Path] = typer.Option([], "--exclude", help="labeled set or sample, or a folder of them "
                                            "(e.g. annotation/labeled), whose maps are not drawn again (repeatable)"),
         maps: Path | None = typer.Option(None, "--maps", help="draw the sample from map files written by "
                                          "`attnpat extract` instead of the model"),
         annotators: int | None = typer.Option(None, "--annotators", help="different people who label each task "
                                               "in Label Studio's labeling stream, e.g. 3 for a panel (default: "
                                               "the project's setting, 1 for a new project)"),
         blind: bool | None = typer.Option(None, "--blind/--show-preannotations", help="hide the rule "
                                           "pre-annotations from annotators, for an independent panel (default: "
                                           "blind with --annotators 2 or more; else the project's setting, "
                                           "shown in a new project)")) -> None:
    """Sample maps (stratified over tasks, layers, heads, examples, or by predicted class), render them, and
    import them as tasks with pre-annotations. Rerunning never duplicates a task and finishes an interrupted push."""
    # imported here on purpose: the Label Studio SDK and the CNN (torchvision) take seconds to load
    from annotation.labelstudio import PanelSettings, connect  # noqa: PLC0415
    from annotation.labelstudio import push as push_tasks  # noqa: PLC0415
    from classifier.predict import pattern_predictor  # noqa: PLC0415

    panel = PanelSettings(annotators, blind)  # checked before anything is sampled
    # the project's instructions are built after the draw: a missing guideline or gallery image is found first
    instructions.instructions_html(instructions.GUIDELINE, instructions.GALLERY)
    credentials = _credentials(url, token)
    # one push per workspace at a time: two would draw into one sample folder and create a project twice
    with locked(annotation_root() / ".push.lock", f"annotate push in {annotation_root()}"):
        folder = ensure_sample(_samples_dir(), model, count, [t.strip() for t in tasks.split(",") if t.strip()],
                               seed, sample, max_length, log=typer.echo, stratify_by=stratify_by,
                               class_shares=class_shares, exclude=exclude, maps=maps,
                               predict=pattern_predictor(stratify_by) if stratify_by else None,
                               # a server that is down or a wrong token is found before any map is drawn
                               before_drawing=lambda: connect(credentials))
        report = push_tasks(credentials, folder, project, _state_file(), log=typer.echo, panel=panel)
    typer.echo(f"project {report.project_id} ({'created' if report.created_project else 'reused'}): "
               f"{report.pushed} new tasks, {report.already_there} already there"
               f"{f' ({report.updated} with their caption updated)' if report.updated else ''}, "
               f"{report.total} in the sample; "
               f"open {credentials.url}/projects/{report.project_id}")


@annotate.command("pull")
def pull(sample: str = typer.Option(..., "--sample", help="the sample name used by push (see "
                                    "workspace/annotation/samples)"),
         out: Path | None = typer.Option(None, "--out", help="labeled-set folder (default: a new version under "
                                            "workspace/annotation/labeled/<sample>/)"),
         project: str | None = Title, url: str | None = Url, token: str | None = Token,
         export: Path | None = typer.Option(None, "--export", help="read the annotations from a Label Studio "
                                               "JSON export file (Export > JSON) instead of the server")) -> None:
    """Export annotations, join them to the raw maps and write a versioned labeled set with agreement figures."""
    # imported here on purpose: the Label Studio SDK loads in seconds; only push and pull need it
    from annotation.labelstudio import pull as pull_labels  # noqa: PLC0415

    # a name, as push takes it: a path would put the labeled set inside the sample folder
    if Path(sample).name != sample or sample in ("", ".", ".."):
        raise AttnpatError(f"--sample '{sample}' must be a sample's name (no '/', not '..')")
    folder = _samples_dir() / sample
    if not folder.is_dir():
        raise AttnpatError(f"no sample '{sample}' in {_samples_dir()}")
    credentials = None if export is not None else _credentials(url, token)
    # no --out: the next version, chosen as the set is written (two pulls at once get two versions)
    report = pull_labels(credentials, folder, out or annotation_root() / "labeled" / sample, project, _state_file(),
                         export=export, new_version=out is None)
    typer.echo(f"labeled set {report.folder}: {report.labeled} maps; classes: {report.class_counts}")
    if report.prediction_agreement is not None:
        seen = {True: " (annotators saw them)", False: " (hidden from annotators)", None: ""}
        low, high = report.prediction_agreement_ci
        typer.echo(f"pre-annotation agreement with final labels: {report.prediction_agreement:.3f} "
                   f"[{low:.3f}, {high:.3f}] (Wilson 95% over {report.prediction_maps} maps)"
                   f"{seen[report.preannotations_shown]}")
        if report.other_rules_text() is not None:
            typer.echo(report.other_rules_text())
    if report.kappa is not None:
        settled = (f"; before the {report.settling_labels} labels that settled ties" if report.settling_labels
                   else "")
        typer.echo(f"inter-annotator agreement over the {report.kappa_maps} maps with several annotators "
                   f"({report.annotators_text()}{settled}): {report.kappa_text()}")
    elif report.kappa_maps:  # every label one class: nothing to tell agreement from chance by
        typer.echo(f"inter-annotator agreement: Fleiss' kappa undefined over {report.kappa_maps} maps with several "
                   "annotators: every label is the same class")
    for name, items in (("drafts (not submitted)", report.drafts),
                        ("maps left out because their annotators skipped them", report.skipped),
                        ("unknown labels", report.unknown),
                        ("maps not in the sample (set aside)", report.not_in_sample),
                        ("maps changed since push (set aside)", report.hash_mismatch),
                        ("annotations submitted without a class", report.no_choice),
                        ("annotations with several classes chosen (not counted)", report.multi_choice),
                        ("maps one annotator labeled twice (their latest label counts)", report.repeated),
                        ("ties between annotators (earliest label kept)", report.ties)):
        if items:
            typer.echo(f"{name}: {len(items)} (first: {items[0]})")
    parts = report.task_parts()
    typer.echo(f"tasks in the project: {report.tasks} = "
               + " + ".join(f"{count} {name}" for name, count in parts.items() if count or name != "set aside")
               + (" (not in the sample or changed since push)" if parts["set aside"] else ""))


@annotate.command("agreement")
def agreement(data: Path = typer.Option(..., "--data", help="labeled-set folder with annotations.csv"),
              against: Path | None = typer.Option(None, "--against", help="another labeled set of the same maps: "
                                                  "its labels against --data's, as two annotators'"),
              earlier: str | None = typer.Option(None, "--earlier-labels", help="a file in --data's folder whose "
                                                 "labels stand in for annotations.csv's on its maps: the labels "
                                                 "before a relabel (annotations-before-rule9.csv)")) -> None:
    """Agreement of a labeled set's annotators, each figure with its 95% bootstrap interval over the maps."""
    # imported here on purpose: classifier.agreement loads torch
    from annotation.dataset import load_labeled_set, set_agreement  # noqa: PLC0415
    from classifier.agreement import (  # noqa: PLC0415
        against_row,
        annotator_pair_table,
        ci_text,
        first_second_row,
        pair_lines,
        pair_scores_text,
    )

    labeled = load_labeled_set(data)
    other = load_labeled_set(against) if against is not None else None  # read before any work: a bad one fails
    found = set_agreement(labeled, earlier)
    source = f" (with {earlier})" if earlier is not None else ""
    typer.echo(f"{data}{source}: Fleiss' kappa {found.kappa:.3f} ({ci_text(found.low, found.high)}) over the "
               f"{found.maps} maps with two or more first-round labels; {found.unanimous} of them unanimous")
    for line in pair_lines(annotator_pair_table(labeled, earlier)):
        typer.echo(line)
    pooled = first_second_row(labeled, earlier)
    typer.echo(f"first label against second, whoever gave them ({pooled['maps']} maps): " + pair_scores_text(pooled))
    if other is not None:
        row = against_row(labeled, other)
        typer.echo(f"{data} against {against} (their labels of the same {row['maps']} maps): "
                   + pair_scores_text(row))


@annotate.command("merge")
def merge(sets: list[Path] = typer.Argument(..., help="labeled-set folders, in order"),
          out: Path = typer.Option(..., "--out", help="the merged labeled-set folder (replaced whole)")) -> None:
    """Join several labeled sets (e.g. the shipped set and a new round of labels) into one, for `attnpat train`."""
    merged = merge_labeled_sets(list(sets), out)
    typer.echo(f"labeled set {out}: {len(merged)} maps; classes: {merged.class_counts()}")
