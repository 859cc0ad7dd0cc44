"""Sampling maps for annotation: stratified by a predicted class, with class shares and exclusions."""
from __future__ import annotations

import json
import random
import shutil
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.errors import AttnpatError
from analysis.mapstore import iter_map_groups, make_map_id, parse_map_id, read_single_maps, write_single_maps
from analysis.paths import repo_root
from analysis.patterns import CLASSES
from analysis.sampling import parse_class_shares, plan_cells, sample_maps_by_prediction
from annotation.dataset import (
    annotator_agreement,
    annotator_keys,
    annotator_names,
    load_labeled_set,
    merge_labeled_sets,
    save_labeled_set,
)
from annotation.preannotate import rule_classes
from annotation.sample import ensure_sample, read_index
from app.cli import main
from classifier.synthetic import synthetic_map
from tests.tiny import save_tiny_model, tiny_bundle


def test_class_shares_are_normalised_and_bad_ones_refused():
    shares = parse_class_shares("block=3,heterogeneous=1")
    assert shares == {"vertical": 0.0, "diagonal": 0.0, "vertical+diagonal": 0.0, "block": 0.75, "heterogeneous": 0.25}
    assert parse_class_shares(None) == {name: 0.2 for name in CLASSES}
    for bad, message in (("blob=1", "unknown class 'blob'"), ("block=x", "CLASS=NUMBER"), ("block=-1", "negative"),
                         ("block=0", "must not all be zero")):
        with pytest.raises(AttnpatError, match=message):
            parse_class_shares(bad)


def head_class(maps, tokens):
    """A stand-in predictor: the class is fixed by the map's position in the example (layer-major)."""
    return [CLASSES[k % len(CLASSES)] for k in range(len(maps))]


def test_sampling_by_prediction_fills_the_class_quotas_and_skips_excluded_maps(tmp_path):
    bundle = tiny_bundle(tmp_path / "tiny", layers=2, heads=4)  # 8 maps per example
    shares = parse_class_shares("block=1,heterogeneous=1")
    first = sample_maps_by_prediction(bundle, n_maps=10, tasks=("sst2", "rte"), seed=3, examples_per_task=6,
                                      predict=head_class, shares=shares)
    positions = Counter(CLASSES[(m.layer * 4 + m.head) % len(CLASSES)] for m in first)
    assert positions == {"block": 5, "heterogeneous": 5}
    assert Counter(m.task for m in first) == {"sst2": 5, "rte": 5}  # round-robin over tasks inside a class
    for sampled in first:
        assert sampled.attn.shape == (len(sampled.tokens),) * 2
    again = sample_maps_by_prediction(bundle, n_maps=10, tasks=("sst2", "rte"), seed=3, examples_per_task=6,
                                      predict=head_class, shares=shares)
    assert [m.map_id for m in again] == [m.map_id for m in first]  # same seed, same sample
    excluded = {m.map_id for m in first}
    second = sample_maps_by_prediction(bundle, n_maps=10, tasks=("sst2", "rte"), seed=3, examples_per_task=6,
                                       predict=head_class, shares=shares, exclude=excluded)
    assert len(second) == 10 and not excluded & {m.map_id for m in second}


def test_a_stratified_sample_records_its_settings_and_excludes_a_labeled_set(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    first = ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="a", stratify_by="rules",
                          predict=rule_classes, log=lambda _: None)
    settings = json.loads((first / "sample.json").read_text())
    assert settings["stratified_by"] == "rules" and settings["class_shares"] == parse_class_shares(None)
    first_ids = {row["map_id"] for row in read_index(first)}
    assert all((first / row["image"]).is_file() for row in read_index(first))
    second = ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="b", stratify_by="rules",
                           predict=rule_classes, exclude=[first], log=lambda _: None)
    assert not first_ids & {row["map_id"] for row in read_index(second)}
    with pytest.raises(AttnpatError, match="other settings"):
        ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="a", log=lambda _: None)


def test_a_stratified_sample_smaller_than_asked_says_so(tmp_path):
    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    said = []
    folder = ensure_sample(tmp_path / "samples", str(model), 10, ["sst2"], seed=1, name="short", stratify_by="rules",
                           predict=lambda maps, tokens: ["block"] * len(maps), class_shares="block=1,heterogeneous=1",
                           log=said.append)
    assert len(read_index(folder)) == 5  # no map is predicted heterogeneous: its 5 are missing
    assert said[-1].startswith("the sample holds 5 maps, not 10: rules predicted some classes")


def synthetic_id(name: str) -> str:
    """A map id (analysis.mapstore grammar) for synthetic map ``name``."""
    return make_map_id("synthetic", "none", name, 0, 0)


def write_set(folder, labels, seed=0):
    """A labeled set of synthetic maps: labels maps map_id -> class."""
    rng = np.random.default_rng(seed)
    rows = [{"map_id": map_id, "label": label} for map_id, label in labels.items()]
    maps = {map_id: synthetic_map(label, 12, rng) for map_id, label in labels.items()}
    save_labeled_set(folder, rows, maps)
    return maps


def test_merging_labeled_sets_keeps_every_map_once_and_refuses_conflicts(tmp_path):
    first = {synthetic_id(f"a{k}"): CLASSES[k] for k in range(5)}
    second = {synthetic_id(f"b{k}"): CLASSES[(k + 2) % 5] for k in range(5)}
    maps_a = write_set(tmp_path / "one", first, seed=1)
    maps_b = write_set(tmp_path / "two", second, seed=2)
    merged = merge_labeled_sets([tmp_path / "one", tmp_path / "two"], tmp_path / "both")
    assert merged.map_ids == list(first) + list(second)
    assert [CLASSES[i] for i in merged.labels] == list(first.values()) + list(second.values())
    for map_id, attn in zip(merged.map_ids, merged.maps):
        assert np.array_equal(attn, {**maps_a, **maps_b}[map_id])
    assert list(load_labeled_set(tmp_path / "both").rows[0].keys()).count("source") == 1
    assert {row["source"] for row in merged.rows} == {f"{tmp_path.name}/one", f"{tmp_path.name}/two"}
    # the same map with the same label in two sets is kept once, and so is each annotation
    shutil.copytree(tmp_path / "one", tmp_path / "copy")
    pd.DataFrame({"map_id": [synthetic_id("a0")] * 2, "label": ["vertical"] * 2, "annotator": ["x", "y"],
                  "labeled_at": ["t", "t"]}).to_csv(tmp_path / "one" / "annotations.csv", index=False)
    shutil.copy(tmp_path / "one" / "annotations.csv", tmp_path / "copy" / "annotations.csv")
    assert len(merge_labeled_sets([tmp_path / "one", tmp_path / "copy"], tmp_path / "again")) == 5
    assert len(pd.read_csv(tmp_path / "again" / "annotations.csv")) == 2
    # ... also when a set reached through a merge is merged again, with numeric annotator ids (read as numbers
    # alone, as text beside e-mail addresses) and blank cells (NaN never equals NaN)
    pd.DataFrame({"map_id": [synthetic_id("a0"), synthetic_id("a1")], "label": ["vertical", "diagonal"],
                  "annotator": ["7", ""], "labeled_at": ["", "t"]}).to_csv(tmp_path / "one" / "annotations.csv",
                                                                           index=False)
    pd.DataFrame({"map_id": [synthetic_id("b0")], "label": [second[synthetic_id("b0")]], "annotator": ["a@b.org"],
                  "labeled_at": ["t"]}).to_csv(tmp_path / "two" / "annotations.csv", index=False)
    merge_labeled_sets([tmp_path / "one", tmp_path / "two"], tmp_path / "both")
    twice = merge_labeled_sets([tmp_path / "both", tmp_path / "one"], tmp_path / "twice-reached")
    assert len(pd.read_csv(tmp_path / "twice-reached" / "annotations.csv")) == 3
    assert np.isnan(annotator_agreement(twice)).all()  # one label per map: no agreement to count
    # one set named twice would count its annotations twice: refused
    with pytest.raises(AttnpatError, match="named twice"):
        merge_labeled_sets([tmp_path / "one", tmp_path / "one"], tmp_path / "twice")
    # the same map id with another label is an error, and nothing is written
    write_set(tmp_path / "clash", {synthetic_id("a0"): CLASSES[1], **{synthetic_id(f"c{k}"): CLASSES[k]
                                                                     for k in range(5)}}, seed=1)
    with pytest.raises(AttnpatError, match="a0:L0H0 is in two sets"):
        merge_labeled_sets([tmp_path / "one", tmp_path / "clash"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(AttnpatError, match="at least two"):
        merge_labeled_sets([tmp_path / "one"], tmp_path / "bad")


def test_a_labeled_set_replaced_while_ctrl_c_arrives_is_the_old_or_the_new_one(tmp_path, monkeypatch):
    """Ctrl-C between the two renames that swap a new labeled set in (the old one moved aside, the new one not yet
    in place) is held back until both are done (before, the folder was gone: the old set lay hidden in
    .<name>.old and the new one was deleted)."""
    labels = {synthetic_id(f"m{k}"): CLASSES[k] for k in range(5)}
    write_set(tmp_path / "one", labels, seed=1)
    write_set(tmp_path / "two", {synthetic_id("n0"): CLASSES[0]}, seed=2)
    merge_labeled_sets([tmp_path / "one", tmp_path / "two"], tmp_path / "out")
    write_set(tmp_path / "three", {synthetic_id("p0"): CLASSES[1]}, seed=3)
    real_rename = Path.rename

    def rename_then_ctrl_c(self, target):
        moved = real_rename(self, target)
        if Path(target).name == ".out.old":  # the old set is aside, the new one not yet in its place
            signal.raise_signal(signal.SIGINT)
        return moved

    monkeypatch.setattr(Path, "rename", rename_then_ctrl_c)
    # as in a terminal: a process started in the background (CI) inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # the stop still arrives, once the swap is done
            merge_labeled_sets([tmp_path / "one", tmp_path / "three"], tmp_path / "out")
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(Path, "rename", real_rename)
    assert sorted(load_labeled_set(tmp_path / "out").map_ids) == sorted([*labels, synthetic_id("p0")])


def test_merge_and_class_share_errors_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path / "home"))  # a push that went too far would write here
    write_set(tmp_path / "one", {synthetic_id(f"a{k}"): CLASSES[k] for k in range(5)}, seed=1)
    write_set(tmp_path / "two", {synthetic_id(f"b{k}"): CLASSES[k] for k in range(5)}, seed=2)
    assert main(["annotate", "merge", str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(tmp_path / "m")]) == 0
    assert "10 maps" in capsys.readouterr().out
    assert main(["annotate", "merge", str(tmp_path / "one"), str(tmp_path / "nowhere"), "--out",
                 str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "nowhere does not exist" in err
    assert not (tmp_path / "bad").exists()
    assert main(["annotate", "push", "--stratify-by", "rules", "--class-shares", "spiral=1", "--url",
                 "http://127.0.0.1:9", "--token", "x", "--sample", "s"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown class 'spiral'" in err and "\n" not in err
    assert not (tmp_path / "home" / "workspace" / "annotation" / "samples" / "s").exists()


def test_annotator_agreement_per_map(tmp_path):
    write_set(tmp_path / "set", {synthetic_id(f"m{k}"): CLASSES[k] for k in range(5)}, seed=3)
    assert annotator_agreement(load_labeled_set(tmp_path / "set")) is None  # no annotations.csv
    pd.DataFrame({"map_id": [synthetic_id(m) for m in ("m0", "m0", "m1", "m1", "m1", "m2", "m4", "m4")],
                  "label": ["vertical", "vertical", "diagonal", "diagonal", "block", "vertical+diagonal",
                            "heterogeneous", "heterogeneous"],
                  "annotator": list("abcdeafg")}).to_csv(tmp_path / "set" / "annotations.csv", index=False)
    agreement = annotator_agreement(load_labeled_set(tmp_path / "set"))
    assert agreement[[0, 1, 4]].tolist() == [1.0, 0.0, 1.0]
    assert np.isnan(agreement[2]) and np.isnan(agreement[3])  # one annotation, none


def test_shipped_labeled_set_agreement_matches_its_card():
    agreement = annotator_agreement(load_labeled_set(Path(__file__).parents[1] / "annotation" / "labeled" / "v2"))
    # CARD.md: every map has at least two labels; 29 + 48 + 5 pairs differed and were adjudicated
    assert not np.isnan(agreement).any() and int((agreement == 0).sum()) == 29 + 48 + 5


def test_a_sample_drawn_from_extracted_maps_holds_those_exact_maps(tmp_path):
    """`attnpat extract` output becomes an annotation sample (what `annotate push --maps` pushes)."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=3, hidden=24)
    extracted = tmp_path / "maps"
    assert main(["extract", "--model", str(model), "--task", "sst2", "--n", "5", "--out", str(extracted),
                 "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0
    folder = ensure_sample(tmp_path / "samples", "minilm", 8, [], seed=4, maps=extracted, log=lambda _: None)
    index = read_index(folder)
    assert folder.name == "maps-n8-s4" and len({row["map_id"] for row in index}) == len(index) == 8
    assert {(row["layer"], row["head"]) for row in index} == {(layer, head) for layer in range(2) for head in range(3)}
    source = {group.example_id: group for group in iter_map_groups(extracted)}
    sampled = read_single_maps(folder / "maps.npz")
    for row in index:
        assert parse_map_id(row["map_id"]) == (model.name, "sst2", row["example_id"], row["layer"], row["head"])
        group = source[row["example_id"]]
        np.testing.assert_array_equal(sampled[row["map_id"]], group.grid()[row["layer"], row["head"]])
        assert row["tokens"] == group.tokens and (folder / row["image"]).is_file()
    assert ensure_sample(tmp_path / "samples", "minilm", 8, [], seed=4, maps=extracted, log=lambda _: None) == folder
    with pytest.raises(AttnpatError, match="other settings"):
        ensure_sample(tmp_path / "samples", "minilm", 9, [], seed=4, name=folder.name, maps=extracted)
    with pytest.raises(AttnpatError, match="single heads"):  # a sample is not `attnpat extract` output
        ensure_sample(tmp_path / "samples", "minilm", 2, [], maps=folder, log=lambda _: None)
    # maps already in a labeled set or sample are never drawn again from saved maps either
    other = ensure_sample(tmp_path / "samples", "minilm", 8, [], seed=4, name="other", maps=extracted,
                          exclude=[folder], log=lambda _: None)
    assert len(read_index(other)) == 8 and not {row["map_id"] for row in index} & {
        row["map_id"] for row in read_index(other)}
    assert json.loads((other / "sample.json").read_text())["exclude"] == [str(folder)]


def test_a_natural_sample_never_draws_an_excluded_map(tmp_path):
    """`annotate push --exclude` without --stratify-by: a fresh panel shares no map with the labeled sets."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=2)
    first = ensure_sample(tmp_path / "samples", str(model), 12, ["sst2", "rte"], seed=1, name="a", log=lambda _: None)
    first_ids = {row["map_id"] for row in read_index(first)}
    assert "exclude" not in json.loads((first / "sample.json").read_text())  # settings of older samples unchanged
    same = ensure_sample(tmp_path / "samples", str(model), 12, ["sst2", "rte"], seed=1, name="again",
                         log=lambda _: None)
    assert {row["map_id"] for row in read_index(same)} == first_ids  # the same seed draws the same maps
    fresh = ensure_sample(tmp_path / "samples", str(model), 12, ["sst2", "rte"], seed=1, name="b", exclude=[first],
                          log=lambda _: None)
    fresh_ids = [row["map_id"] for row in read_index(fresh)]
    assert len(fresh_ids) == len(set(fresh_ids)) == 12 and not first_ids & set(fresh_ids)
    assert Counter(parse_map_id(i)[1] for i in fresh_ids) == {"sst2": 6, "rte": 6}  # still stratified over tasks
    assert json.loads((fresh / "sample.json").read_text())["exclude"] == [str(first)]
    # a folder of labeled sets and samples excludes every one of them
    again = ensure_sample(tmp_path / "samples", str(model), 12, ["sst2", "rte"], seed=1, name="c",
                          exclude=[tmp_path / "samples"], log=lambda _: None)
    assert not (first_ids | set(fresh_ids)) & {row["map_id"] for row in read_index(again)}
    (tmp_path / "nothing").mkdir()
    with pytest.raises(AttnpatError, match="holds no labeled set"):
        ensure_sample(tmp_path / "samples", str(model), 12, ["sst2", "rte"], seed=1, name="d",
                      exclude=[tmp_path / "nothing"], log=lambda _: None)


def test_a_task_named_in_capitals_is_the_same_task_for_exclusion(tmp_path):
    """`--tasks SST2 --exclude first`: the map ids hold one spelling, so the excluded maps stay out."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=2)
    first = ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="first", log=lambda _: None)
    second = ensure_sample(tmp_path / "samples", str(model), 4, [" SST2"], seed=1, name="second", exclude=[first],
                           log=lambda _: None)
    second_ids = {row["map_id"] for row in read_index(second)}
    assert {parse_map_id(i)[1] for i in second_ids} == {"sst2"}
    assert not {row["map_id"] for row in read_index(first)} & second_ids


def test_extracted_maps_of_other_examples_are_not_resumed(tmp_path):
    """Another --text-column of one data file is other maps (the folder refuses them); a byte-identical copy of
    the file elsewhere is the same maps (the folder takes them)."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=2)
    (tmp_path / "two.csv").write_text("a,b,label\n" + "".join(f"short {i},other words {i},{i % 2}\n" for i in range(6)))
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "two.csv", tmp_path / "copy" / "two.csv")
    common = ["--model", str(model), "--out", str(tmp_path / "maps"), "--runs-dir", str(tmp_path / "runs"), "-q"]
    assert main(["extract", "--task", str(tmp_path / "two.csv"), "--text-column", "a", *common]) == 0
    assert main(["extract", "--task", str(tmp_path / "copy" / "two.csv"), "--text-column", "a", *common]) == 0
    assert main(["extract", "--task", str(tmp_path / "two.csv"), "--text-column", "b", *common]) == 2
    assert {token for group in iter_map_groups(tmp_path / "maps") for token in group.tokens} >= {"short"}


def test_planned_cells_move_past_excluded_ones_and_say_when_none_is_left():
    blocked = {(0, 0, 0), (1, 0, 0)}
    cells = plan_cells(1, 2, 4, 4, random.Random(0), lambda example, layer, head: (example, layer, head) in blocked)
    assert len(set(cells)) == 4 and not blocked & set(cells)
    assert {(layer, head) for _, layer, head in cells} == {(0, 0), (0, 1)}
    with pytest.raises(AttnpatError, match="ask for fewer maps"):
        plan_cells(1, 2, 4, 3, random.Random(0), lambda example, layer, head: head == 0)


def test_a_shipped_set_is_found_from_any_folder(tmp_path, monkeypatch):
    """The docs name shipped sets by their repository path (annotation/labeled/panel-4): it works from any
    working folder; a path that exists there is taken as given, and a missing one says it does not exist."""
    monkeypatch.chdir(tmp_path)
    shipped = load_labeled_set("annotation/labeled/panel-4")
    assert shipped.path == repo_root() / "annotation" / "labeled" / "panel-4" and len(shipped) == 270
    write_set(tmp_path / "annotation" / "labeled" / "panel-4", {synthetic_id(f"own{k}"): CLASSES[k] for k in range(5)})
    assert len(load_labeled_set("annotation/labeled/panel-4")) == 5  # the user's own folder of that name
    with pytest.raises(AttnpatError, match="annotation/labeled/nope does not exist"):
        load_labeled_set("annotation/labeled/nope")


def test_merge_never_replaces_a_shipped_input_set_named_two_ways(tmp_path, monkeypatch):
    """An input found through the repository fallback is the folder checked against --out and against the
    other inputs (a copy of the repository here, so the shipped sets are never at risk)."""
    repository = tmp_path / "repo"
    write_set(repository / "annotation" / "labeled" / "a", {synthetic_id(f"a{k}"): CLASSES[k] for k in range(5)})
    write_set(tmp_path / "b", {synthetic_id(f"b{k}"): CLASSES[k] for k in range(5)}, seed=2)
    monkeypatch.setattr("annotation.dataset.repo_root", lambda: repository)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    shipped = repository / "annotation" / "labeled" / "a"
    (shipped / "CARD.md").write_text("a card merge would not write\n")
    before = sorted(path.name for path in shipped.iterdir())
    with pytest.raises(AttnpatError, match="would replace the input set"):
        merge_labeled_sets(["annotation/labeled/a", tmp_path / "b"], shipped)
    with pytest.raises(AttnpatError, match="named twice"):
        merge_labeled_sets(["annotation/labeled/a", shipped], tmp_path / "out")
    assert sorted(path.name for path in shipped.iterdir()) == before
    assert len(merge_labeled_sets(["annotation/labeled/a", tmp_path / "b"], tmp_path / "out")) == 10


def test_an_unfinished_sample_redrawn_with_other_settings_renders_its_images_anew(tmp_path):
    """A drawing stopped after its images but before index.jsonl may be drawn again with other settings (another
    --max-length, seed...). Its old images were kept and pushed for the new maps of the same names."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=3, hidden=24)
    extracted = tmp_path / "maps"
    assert main(["extract", "--model", str(model), "--task", "sst2", "--n", "3", "--out", str(extracted),
                 "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0
    folder = ensure_sample(tmp_path / "samples", "minilm", 12, [], seed=4, name="s", maps=extracted,
                           log=lambda _: None)
    (folder / "index.jsonl").unlink()  # stopped between the images and the index
    for image in (folder / "png").iterdir():
        image.write_bytes(b"an image of the old settings")
    ensure_sample(tmp_path / "samples", "minilm", 10, [], seed=5, name="s", maps=extracted, log=lambda _: None)
    index = read_index(folder)
    assert sorted(path.name for path in (folder / "png").iterdir()) == sorted(Path(row["image"]).name
                                                                              for row in index)
    assert all((folder / row["image"]).read_bytes().startswith(b"\x89PNG") for row in index)


def refuse_network():
    raise AssertionError("the server was contacted before the options were checked")


def test_a_bad_exclude_folder_is_one_error_line_before_the_server_is_contacted(tmp_path):
    """`annotate push --exclude X` where X does not exist, or holds a labels.csv that is empty, binary or has no
    map_id column: one error line naming it, before the server is contacted or any file written (before, a pandas
    traceback, found after the server check; a missing folder was called 'not a map sample')."""
    for name, content in (("no-map-id", b"x,label\n1,block\n"), ("empty", b""), ("binary", b"\xff\xfe\x00\x01gz")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "labels.csv").write_bytes(content)
    for name, why in (("no-map-id", "has no map_id column"), ("empty", "not a readable CSV"),
                      ("binary", "not a readable CSV"), ("nowhere", "nowhere does not exist")):
        with pytest.raises(AttnpatError, match=why) as caught:
            ensure_sample(tmp_path / "samples", "minilm", 4, ["sst2"], 0, "s", exclude=[tmp_path / name],
                          before_drawing=refuse_network, log=lambda _: None)
        assert "\n" not in str(caught.value) and f"{tmp_path / name}" in str(caught.value)
    assert not (tmp_path / "samples").exists()


def test_a_count_below_the_tasks_or_a_task_named_twice_is_refused_before_anything_is_drawn(tmp_path):
    """`annotate push --count 1 --tasks sst2,rte` is refused before the server is contacted or sample.json written
    (before, after the server check and the model load, leaving a settings file behind); `--tasks sst2,SST2` names
    one task twice (before, that task got twice its share of the maps, or the draw ended in 'duplicate map ids')."""
    with pytest.raises(AttnpatError, match=r"--count 1 is smaller than the number of tasks \(2\)"):
        ensure_sample(tmp_path / "samples", "minilm", 1, ["sst2", "rte"], 0, "s", before_drawing=refuse_network)
    with pytest.raises(AttnpatError, match="--tasks names sst2 twice"):
        ensure_sample(tmp_path / "samples", "minilm", 4, ["sst2", "rte", " SST2"], 0, "s",
                      before_drawing=refuse_network)
    assert not (tmp_path / "samples").exists()


def test_a_sample_resumed_after_its_model_changed_never_keeps_images_of_the_old_maps(tmp_path):
    """A drawing stopped before index.jsonl, resumed after the model folder changed (fine-tuned again): its images
    are rendered anew from the new maps; a finished sample missing an image is refused, since drawing it again
    would replace the maps its pushed tasks join to (before, the old images were kept and pushed for the new maps,
    or maps.npz was silently replaced)."""
    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    folder = ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="s", log=lambda _: None)
    index = read_index(folder)
    (folder / "index.jsonl").unlink()  # stopped between the images and the index
    for row in index:
        (folder / row["image"]).write_bytes(b"an image of the old model's maps")
    save_tiny_model(tmp_path / "tiny", layers=1, heads=2, seed=1)  # the same folder, other weights
    ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="s", log=lambda _: None)
    assert all((folder / row["image"]).read_bytes().startswith(b"\x89PNG") for row in read_index(folder))
    maps_before = (folder / "maps.npz").read_bytes()
    (folder / read_index(folder)[0]["image"]).unlink()
    save_tiny_model(tmp_path / "tiny", layers=1, heads=2, seed=2)
    with pytest.raises(AttnpatError, match="another revision"):
        ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="s", log=lambda _: None)
    assert (folder / "maps.npz").read_bytes() == maps_before


def test_a_stratified_sample_with_no_map_of_the_classes_asked_says_why(tmp_path):
    """`--stratify-by rules --class-shares heterogeneous=1` where the rules predict no map heterogeneous: one line
    naming the predictor and the classes (before, `no maps to write`)."""
    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    with pytest.raises(AttnpatError, match="rules predicted none of the 4 maps asked for as heterogeneous"):
        ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="none", stratify_by="rules",
                      predict=lambda maps, tokens: ["block"] * len(maps), class_shares="heterogeneous=1",
                      log=lambda _: None)
    assert not (tmp_path / "samples" / "none" / "index.jsonl").exists()


def test_annotator_keys_use_the_user_id_and_names_show_the_latest_email():
    """Rows of an older pull (no annotator_id) join the user their name was shown for, when it was one user's; a
    name shown for two users stays a name of its own, and those users are shown with their ids."""
    frame = pd.DataFrame({
        "annotator": ["ann@old.org", "ann@old.org", "ann@new.org", "lab@x.org", "lab@x.org", "lab@x.org"],
        "annotator_id": ["", "7", "7", "8", "9", ""],
        "labeled_at": ["t1", "t2", "t3", "t4", "t5", "t6"]})
    keys = annotator_keys(frame)
    assert list(keys) == ["id:7", "id:7", "id:7", "id:8", "id:9", "lab@x.org"]
    assert annotator_names(frame.assign(annotator_key=keys)) == {
        "id:7": "ann@new.org", "id:8": "lab@x.org (id 8)", "id:9": "lab@x.org (id 9)", "lab@x.org": "lab@x.org"}
    older = frame.drop(columns="annotator_id")  # a set pulled before the id was kept: names, as before
    assert list(annotator_keys(older)) == list(older.annotator)


def test_maps_of_inputs_cut_at_max_length_say_so_in_the_index_the_log_and_the_caption(tmp_path):
    """An input longer than --max-length is cut to fit: its maps are of part of the text, and the sample says so
    (before, nothing in the index, the log or the annotator's caption did)."""
    from annotation.labelstudio import build_task  # noqa: PLC0415 (the Label Studio SDK loads slowly)

    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    said = []
    cut = ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="cut", max_length=6,
                        log=said.append)
    rows = read_index(cut)
    assert rows and all(row["truncated"] is True and row["n"] == 6 for row in rows)
    assert any(line.startswith(f"{len(rows)} of the {len(rows)} maps are of inputs longer than --max-length 6")
               for line in said)
    maps = read_single_maps(cut / "maps.npz")
    caption = build_task(rows[0], maps[rows[0]["map_id"]], b"")["data"]["caption"]
    assert "6 tokens (input truncated to these)" in caption
    whole = ensure_sample(tmp_path / "samples", str(model), 4, ["sst2"], seed=1, name="whole", max_length=128,
                          log=said.append)
    rows = read_index(whole)
    assert all(row["truncated"] is False for row in rows)
    assert "truncated" not in build_task(rows[0], read_single_maps(whole / "maps.npz")[rows[0]["map_id"]],
                                         b"")["data"]["caption"]


def test_the_annotators_caption_numbers_layer_and_head_as_the_map_id_does(tmp_path):
    """The caption shown with each map names the map id and numbers its layer and head from 0, as the id, the
    gallery and labels.csv do (before, 'layer 3 · head 8 (1-indexed)' beside the id's L2H7)."""
    from annotation.labelstudio import build_task  # noqa: PLC0415 (the Label Studio SDK loads slowly)

    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=4)
    folder = ensure_sample(tmp_path / "samples", str(model), 6, ["sst2"], seed=2, name="ids", log=lambda _: None)
    maps = read_single_maps(folder / "maps.npz")
    rows = read_index(folder)
    assert any(row["layer"] or row["head"] for row in rows)  # a 0 alone cannot tell the numberings apart
    for row in rows:
        caption = build_task(row, maps[row["map_id"]], b"")["data"]["caption"]
        named = parse_map_id(row["map_id"])
        assert caption.startswith(f"map {row['map_id']} · layer {named.layer} · head {named.head} (0-indexed, as "
                                  "in the map id)"), caption


def test_a_bad_maps_source_or_max_length_is_one_error_line_before_the_server_is_contacted(tmp_path):
    """`annotate push --maps` of a missing path or of a sample (single heads), and `--max-length 2`: one error line
    before the server is contacted or anything written (before, each was found after the server check, the
    max-length after the model was loaded and sample.json written)."""
    sample = tmp_path / "a-sample"
    sample.mkdir()
    rng = np.random.default_rng(0)
    maps = {f"minilm:sst2:ex{k}:L0H0": synthetic_map("block", 6, rng).astype(np.float32) for k in range(2)}
    write_single_maps(sample / "maps.npz", maps)
    for source, max_length, why in ((tmp_path / "nowhere", 128, "does not exist"), (sample, 128, "single heads"),
                                    (None, 2, "--max-length 2: an input needs at least 4 tokens")):
        with pytest.raises(AttnpatError, match=why) as caught:
            ensure_sample(tmp_path / "samples", "minilm", 4, ["sst2"], 0, "s", max_length=max_length, maps=source,
                          before_drawing=refuse_network, log=lambda _: None)
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "samples").exists()


def test_a_half_written_sample_is_refused_by_push_before_the_server_is_contacted(tmp_path, monkeypatch):
    """A sample folder whose maps.npz or images do not match its index (written half, or edited) is one error line
    from push before it connects (before, push created the project and stopped midway in a KeyError or
    FileNotFoundError traceback)."""
    import annotation.labelstudio as ls  # noqa: PLC0415 (the Label Studio SDK loads slowly)

    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    folder = ensure_sample(tmp_path / "samples", str(model), 3, ["sst2"], seed=1, name="s", log=lambda _: None)
    monkeypatch.setattr(ls, "connect", lambda credentials: refuse_network())
    rows = read_index(folder)
    (folder / rows[0]["image"]).unlink()
    with pytest.raises(AttnpatError, match="lacks 1 of its images"):
        ls.push(None, folder, progress=False, log=lambda _: None)
    maps = read_single_maps(folder / "maps.npz")
    write_single_maps(folder / "maps.npz", {map_id: maps[map_id] for map_id in list(maps)[1:]})
    with pytest.raises(AttnpatError, match="lists 1 maps that .*maps.npz lacks"):
        ls.push(None, folder, progress=False, log=lambda _: None)
    (folder / "maps.npz").unlink()
    with pytest.raises(AttnpatError, match="has no maps.npz"):
        ls.push(None, folder, progress=False, log=lambda _: None)


def test_a_natural_sample_spreads_its_maps_evenly_over_the_heads_of_all_its_tasks(tmp_path):
    """Every head gets count / heads maps give or take one over the whole sample. Before, each task began its own
    round over the heads: 24 maps over 4 tasks of 8 heads gave one head 1 map and four heads 4 (on MiniLM, 480
    maps gave heads 4 to 8). A sample drawn before keeps its own plan when finished (no 'heads' in sample.json)."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=4)
    tasks = ["sst2", "mrpc", "rte", "wiki"]
    folder = ensure_sample(tmp_path / "samples", str(model), 24, tasks, seed=0, name="even", log=lambda _: None)
    per_head = Counter((row["layer"], row["head"]) for row in read_index(folder))
    assert len(per_head) == 8 and set(per_head.values()) == {3}
    assert json.loads((folder / "sample.json").read_text())["heads"] == "one round-robin across the tasks"
    # a sample drawn before the plan was recorded: its settings still match, and finishing it keeps its maps
    old = tmp_path / "samples" / "old"
    shutil.copytree(folder, old)
    settings = json.loads((old / "sample.json").read_text())
    del settings["heads"]
    (old / "sample.json").write_text(json.dumps(settings))
    before = read_index(old)
    assert ensure_sample(tmp_path / "samples", str(model), 24, tasks, seed=0, name="old", log=lambda _: None) == old
    assert read_index(old) == before and "heads" not in json.loads((old / "sample.json").read_text())


def test_the_classifier_pool_keeps_its_per_task_head_rounds():
    """plan_cells without a head queue draws exactly as before (the shipped checkpoint's pool hash depends on it);
    with one, the rounds run on over several calls."""
    legacy, shared = random.Random(3), random.Random(3)
    queue = []
    for _ in range(4):
        alone = plan_cells(2, 4, 3, 10, legacy)
        assert len({(layer, head) for _, layer, head in alone}) == 3
        plan_cells(2, 4, 3, 10, shared, head_queue=queue)
    reference = random.Random(3)
    order = [(layer, head) for layer in range(2) for head in range(4)]
    reference.shuffle(order)
    assert [(layer, head) for _, layer, head in plan_cells(2, 4, 3, 10, random.Random(3))] == order[:3]
    assert len(queue) == 4  # 12 heads drawn of two rounds of 8: four left for the next call


def test_an_exclude_of_another_models_maps_is_named_as_excluding_nothing(tmp_path, synthetic_sample):
    """`--exclude` of a labeled set or sample of another model rules out no map of this one: the push says so
    (before, nothing told the user that the sets named were of another model)."""
    model = save_tiny_model(tmp_path / "tiny", layers=1, heads=2)
    other = synthetic_sample("other-model", 3)
    said = []
    ensure_sample(tmp_path / "samples", str(model), 2, ["sst2"], seed=1, name="x", exclude=[other], log=said.append)
    assert f"note: --exclude {other} holds maps of synthetic only, none of tiny: it excludes nothing from this " \
           "sample" in said
    said.clear()
    first = ensure_sample(tmp_path / "samples", str(model), 2, ["sst2"], seed=2, name="y", log=said.append)
    ensure_sample(tmp_path / "samples", str(model), 2, ["sst2"], seed=2, name="z", exclude=[first], log=said.append)
    assert not any(line.startswith("note: --exclude") for line in said)


def test_a_sample_holding_a_map_that_is_not_attention_weights_is_refused_before_any_image(tmp_path):
    """Maps read from files are rendered as they are: a map of zeros was drawn as a white image for annotators
    (weights above 1 as a black one), after the images of the maps before it. Now the map is named before the
    sample folder is made (from a map file) or any image is written."""
    from analysis.mapstore import MapGroup, write_maps  # noqa: PLC0415
    from analysis.sampling import SampledMap  # noqa: PLC0415
    from annotation.sample import write_sample  # noqa: PLC0415

    tokens = ["[CLS]", "a", "[SEP]"]
    attn = np.full((2, 3, 3), 1 / 3, dtype=np.float32)
    attn[1] = 0.0  # head (0, 1) of the example: a map of zeros
    write_maps(tmp_path / "maps.npz", [MapGroup("m", "sst2", "e0", np.array([[0, 0], [0, 1]]), attn, tokens)])
    with pytest.raises(AttnpatError, match="map m:sst2:e0:L0H1: each row of an attention map must sum to 1"):
        ensure_sample(tmp_path / "samples", "minilm", 2, [], maps=tmp_path / "maps.npz", log=lambda _: None)
    assert not (tmp_path / "samples").exists()
    good = SampledMap("m:sst2:e0:0:0", "sst2", "e0", 0, 0, tokens, attn[0])
    black = SampledMap("m:sst2:e1:0:0", "sst2", "e1", 0, 0, tokens, np.full((3, 3), 5.0, dtype=np.float32))
    with pytest.raises(AttnpatError, match="map m:sst2:e1:0:0: an attention map holds weights in"):
        write_sample(tmp_path / "sample", [good, black])
    assert not (tmp_path / "sample").exists()
