"""Task data from the packaged offline files, wiki segments and user files."""
import json

import pytest

from analysis.data import GLUE_TASKS, load_data, load_file, normalise_sentence, sst2_offline_train, wiki_segments
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


def test_sst2_offline_train_excludes_every_dev_sentence():
    train, removed = sst2_offline_train()
    dev = {normalise_sentence(e.text) for e in load_data("sst2", allow_hub=False).examples}
    assert removed == 732
    assert not dev & {normalise_sentence(e.text) for e in train}
    assert {e.label for e in train} == {0, 1} and len(train) > 9000


def test_sst2_train_is_served_offline_with_a_note():
    data = load_data("sst2", split="train", n=10, allow_hub=False)
    assert len(data.examples) == 10 and "732" in data.notes[0]


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
