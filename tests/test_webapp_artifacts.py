"""The artifact registry (analysis.artifacts): every file the analyses write is listed, every tab's hint is a
command the CLI accepts, and the app builds its run tabs from it."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pandas as pd
import pytest
import typer

from analysis.artifacts import (
    ARTIFACTS,
    MAP_KIND_VERBS,
    TABS,
    Artifact,
    artifact,
    hints,
    listed,
    split_kind_folder,
    tab_artifacts,
    weight_only,
)
from analysis.probing import WINOBIAS_TASK
from app.cli import app as cli_app
from app.cli import main
from tests.tiny import save_tiny_labeled_set, save_tiny_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def cli_command(verb: str) -> click.Command:
    group = typer.main.get_command(cli_app)
    return group.commands[verb]


def parse_hint(command: str) -> list[str]:
    """``command`` parsed by the CLI's own parser (typer's click): raises on an unknown verb or option or a bad
    value (--map-kind's check included); returns its arguments."""
    argv = shlex.split(command)
    assert argv[0] == "attnpat" and not any("<" in a for a in argv), command
    cli_command(argv[1]).make_context(argv[1], argv[2:])
    return argv


@pytest.mark.parametrize("folder", ["minilm", "minilm@norm", "minilm@rollout"])
@pytest.mark.parametrize("base", [None, "/models/my base"])
def test_every_hint_of_every_tab_is_accepted_by_the_cli_and_writes_the_runs_map_kind(folder, base):
    """Each tab's suggested commands (and those of the artifacts no tab shows), for a weight run and a norm or
    rollout run (runs/minilm@norm/...), with and without a recorded base, parse with the real CLI parser. On a
    norm run the Fine-tuning tab suggested `attnpat compare ...`, which has no --map-kind and writes the weight
    run only: now a kind run's hints all carry --map-kind <kind>, and the artifacts of verbs without it get none."""
    kind = split_kind_folder(folder)[1]
    groups = [[entry.stem for entry in tab_artifacts(tab.name)] for tab in TABS]
    groups.append([entry.stem for entry in ARTIFACTS if entry.tab is None])
    for stems in groups:
        left_out = weight_only(stems, folder)
        commands = hints(stems, folder, "sst2", base=base)
        for stem in set(stems) - set(left_out):  # every artifact the run can hold has its command
            assert artifact(stem).command(folder, "sst2", base=base) in commands
        for command in commands:
            argv = parse_hint(command)
            if kind != "weight":
                assert argv[-2:] == ["--map-kind", kind], command
        assert all(artifact(stem).verb not in MAP_KIND_VERBS for stem in left_out)
        assert left_out == ([] if kind == "weight" else
                            [stem for stem in stems if artifact(stem).verb not in MAP_KIND_VERBS])
    assert weight_only(["cosine", "pattern_transitions", "finetune_eval", "special_tokens"], folder) == (
        [] if kind == "weight" else ["cosine", "pattern_transitions", "finetune_eval"])


def test_the_finetune_eval_hint_names_the_runs_base_and_model():
    """A fine-tuned run's finetune_eval hint said `attnpat finetune --model minilm ...` whatever the run's model was
    fine-tuned from, and trained a model of another name: now it names the recorded base and the run's model as
    the store name (the other hints already named the base)."""
    assert hints(["finetune_eval", "cosine"], "tiny-rte", "rte", base="/models/my base") == [
        "attnpat finetune --model '/models/my base' --task rte --split-dev --name tiny-rte",
        "attnpat compare --base '/models/my base' --finetuned tiny-rte --task rte"]
    assert hints(["finetune_eval"], "mpnet-sst2", "sst2", base="mpnet") == [
        "attnpat finetune --model mpnet --task sst2 --split-dev --name mpnet-sst2"]


def test_hints_name_the_shipped_labeled_set_and_fill_model_and_task():
    assert hints(["cv_scores", "cv_confusion"], "classifier", "v1") == ["attnpat train --data annotation/labeled/v5"]
    assert hints(["cv_scores"], None, None) == ["attnpat train --data annotation/labeled/v5"]  # no run picked yet
    assert Path(__file__).resolve().parent.parent.joinpath("annotation/labeled/v5/labels.csv").is_file()
    assert hints(["special_tokens", "linguistic", "cosine"], "m", "rte") == [
        "attnpat special --model m --task rte", "attnpat compare --base minilm --finetuned m --task rte"]
    # the base the run's model was fine-tuned from, as recorded (a folder path quoted)
    assert hints(["linguistic_change", "cosine"], "m", "rte", base="/models/my base") == [
        "attnpat special --model m --base '/models/my base' --task rte",
        "attnpat compare --base '/models/my base' --finetuned m --task rte"]
    # the model as its manifest names it: a store name with '@' (folder tiny_at_v2), a path with a space
    assert hints(["patterns"], "tiny_at_v2@norm", "sst2", "tiny@v2") == [
        "attnpat classify --model tiny@v2 --task sst2 --map-kind norm"]
    assert hints(["patterns"], "my_model", "sst2", "./my model") == [
        "attnpat classify --model './my model' --task sst2"]


def test_tabs_show_each_registered_artifact_once():
    names = [tab.name for tab in TABS]
    shown = [entry.stem for name in names for entry in tab_artifacts(name)]
    assert len(shown) == len(set(shown))
    assert {entry.stem for entry in ARTIFACTS if entry.tab is not None} == set(shown)
    assert all(entry.tab in names for entry in ARTIFACTS if entry.tab is not None)
    assert artifact("probing_coref").folder == WINOBIAS_TASK
    for tab in TABS:  # one sentence naming the paper it reproduces
        assert tab.intro.endswith(".") and any(f"{paper} et al. 2019" in tab.intro
                                               for paper in ("Kovaleva", "Clark", "Michel"))


def header_pattern(columns: str) -> re.Pattern:
    """The CSV header an artifact's ``columns`` text describes: names separated by ", " before a two-space note,
    each name's own "(...)" a note; "[name]" optional; "<x>" any one name; "<x>..." or "p_<class>" one or more."""
    items, depth, current = [], 0, ""
    for char in columns.split("  (")[0]:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            items, current = items + [current], ""
        else:
            current += char
    pattern = ""
    for item in (part.strip() for part in items + [current]):
        name = re.sub(r"\s*\(.*\)$", "", item)
        optional, name = name.startswith("["), name.strip("[]")
        repeated, name = name.endswith("...") or "<class>" in name, name.removesuffix("...")
        one = re.sub(r"<[^>]+>", "[^,]+", re.escape(name).replace("\\<", "<").replace("\\>", ">"))
        one = f"{one}(?:,{one})*" if repeated else one
        one = f",{one}" if pattern else one
        pattern += f"(?:{one})?" if optional else one
    return re.compile(pattern + r"\Z")


def test_header_patterns_read_the_registry_notation():
    assert header_pattern("layer, head, metric (a|b), value").match("layer,head,metric,value")
    assert not header_pattern("layer, head, metric (a|b), value").match("layer,head,metric,value,extra")
    cv = header_pattern("map_id, label, [agreed], <model>... (note, with comma), p_<class>  (trailing note)")
    assert cv.match("map_id,label,cnn,rules,p_a,p_b") and cv.match("map_id,label,agreed,cnn,p_a")
    assert not cv.match("map_id,label") and not cv.match("label,map_id,cnn,p_a")


def test_listed_matches_files_and_patterns():
    assert listed("cosine.png") and listed("surface_entropy.svg") and listed("manifest.json")
    assert listed(".sweep-zero-layer") and listed("classifier.json") and listed("maps")
    assert not listed("surface_entropy.csv") and not listed("notes.txt")
    assert Artifact("x", "overview", "", None, figure=True, table=False).files() == ("x.png", "x.svg")


@pytest.mark.slow
def test_every_file_the_analyses_write_on_a_tiny_model_is_registered(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    model = str(save_tiny_model(tmp_path / "tiny", kind="mlm"))
    common = ["--runs-dir", str(tmp_path / "runs"), "-q"]
    small = ["--model", model, "--task", "sst2", "--n", "6", "--batch-size", "3", *common]
    labeled = save_tiny_labeled_set(tmp_path / "labeled", 2)
    labels = pd.read_csv(labeled / "labels.csv")  # two annotators who agree: evaluate scores the pair
    pd.concat([labels.assign(annotator=who)[["map_id", "label", "annotator"]] for who in "ab"]).to_csv(
        labeled / "annotations.csv", index=False)
    runs = [
        ["overview", *small],
        ["extract", *small],
        ["classify", *small],
        ["classify", "--model", model, "--task", "all", "--n", "3", *common],
        ["compare-kinds", *small],
        ["special", *small],
        ["surface", *small],
        ["cluster", *small],
        ["grad-importance", "--model", model, "--task", "sst2", "--n", "2", *common],
        ["disable", *small],
        ["importance", *small],
        ["prune", *small, "--step", "0.5"],
        ["probe-dep", str(FIXTURES / "tiny.conllu"), "--model", model, *common],
        ["probe-coref", "--model", model, "--n", "4", *common],
        ["finetune", "--model", model, "--task", "rte", "--split-dev", "--n", "8", "--epochs", "1",
         "--batch-size", "4", "--name", "tiny-rte", "-q", "--runs-dir", str(tmp_path / "runs")],
        ["compare", "--base", model, "--finetuned", "tiny-rte", "--task", "rte", "--n", "4", *common],
        ["special", "--model", "tiny-rte", "--task", "rte", "--n", "4", *common],  # with its base: the paired change
        ["train", "--data", "synthetic:4", "--folds", "2", "--epochs", "1", "--no-baselines", "--pool", "0",
         *common],
        ["evaluate", "--data", str(labeled), "--panel-size", "4", "--paired-with", str(labeled),
         "--classifier", str(tmp_path / "runs" / "classifier" / "synthetic-4" / "classifier.safetensors"), *common],
    ]
    for argv in runs:
        assert main(argv) == 0, f"attnpat {' '.join(argv)}: {capsys.readouterr().err}"
    written = {path.name for path in (tmp_path / "runs").glob("*/*/*")}
    assert {"cosine.csv", "probing_coref.png", "cv_confusion.svg", "maps", "disable_heads.csv",
            "evaluation_confusion.svg"} <= written
    assert sorted(name for name in written if not listed(name)) == []
    # and every registered table of a tab was written by one of the runs (the registry names no ghost)
    for entry in ARTIFACTS:
        if entry.tab is not None:
            assert set(entry.files()) <= written, entry.stem
    # every table's header is the registry's column list
    for entry in ARTIFACTS:
        if entry.table and entry.kind == "file":
            tables = list((tmp_path / "runs").glob(f"*/*/{entry.stem}.csv"))
            assert tables, entry.stem
            for table in tables:
                header = table.read_text(encoding="utf-8").splitlines()[0]
                assert header_pattern(entry.columns).match(header), (entry.stem, header, entry.columns)
    # each run folder's manifest names every file its analyses wrote there, and only files that exist
    for manifest_path in (tmp_path / "runs").glob("*/*/manifest.json"):
        folder = manifest_path.parent
        named = {output for record in json.loads(manifest_path.read_text())["analyses"].values()
                 for output in record["outputs"]}
        assert all((folder / name).exists() for name in named if "/" not in name), folder
        files = {path.name for path in folder.iterdir() if path.is_file() and path.name != "manifest.json"}
        assert files <= named, (folder, sorted(files - named))
