"""Special-token attention, the last layer's [CLS] row and section 4.4's linguistic features."""
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BertModel, XLMRobertaTokenizer

from analysis import special as sp
from analysis.data import Example, TaskData, load_data
from analysis.errors import AttnpatError
from analysis.models import load_model
from analysis.rundir import RunDir
from analysis.stream import encode_examples, stream_maps, token_roles
from analysis.uncertainty import DEFAULT_BOOTSTRAP, bootstrap_weighted_mean_interval
from app import cli_finetune
from app.cli import main
from app.display import interval_text, layer_interval_lines
from tests.tiny import save_tiny_model, tiny_config, wrap_bundle


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return wrap_bundle(BertModel(tiny_config()))


def encode(tokenizer, *texts):
    return encode_examples(tokenizer, [Example(str(i), text) for i, text in enumerate(texts)])


def positions_of(item, occurrences):
    return [[item.tokens[p] for p in occ] for occ in occurrences]


def test_negation_found_by_word_position_not_by_substring(tokenizer):
    does_not, did_not = encode(tokenizer, "it does n't work , not at all", "I didn't know nothingness, nobody knows")
    assert positions_of(does_not, sp.negation_occurrences(does_not)) == [["n", "'", "t"], ["not"]]
    occurrences = sp.negation_occurrences(did_not)
    # "nothingness" contains "nothing" and "know" contains "no": neither is a negation word
    assert positions_of(did_not, occurrences) == [["didn", "'", "t"], ["nobody"]]
    assert occurrences[1] == [did_not.tokens.index("nobody")]
    (plain,) = encode(tokenizer, "a know-how film")
    assert sp.negation_occurrences(plain) == []


def test_negation_found_in_whitespace_split_words():
    """XLM-R, ALBERT and CamemBERT split words on whitespace only: "didn't", "not," and "never." are one word
    each (their pieces share a word id); the punctuation pieces at a word's edge are not part of the occurrence."""
    pieces = ["▁I", "▁didn", "'", "t", "▁know", "▁not", ",", "▁never", ".", "▁no", "▁nothing", "ness", "▁(", "Nor"]
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("<mask>", 0.0)]
    spm = XLMRobertaTokenizer(vocab=specials + [(piece, -1.0) for piece in pieces])
    (item,) = encode(spm, "I didn't know, not, never. no nothingness (Nor")
    not_at = item.tokens.index("▁not")
    assert item.word_ids[not_at] == item.word_ids[not_at + 1]  # "not," is one word
    assert positions_of(item, sp.negation_occurrences(item)) == [["▁didn", "'", "t"], ["▁not"], ["▁never"], ["▁no"],
                                                                 ["Nor"]]


def test_feature_attention_matches_the_definition():
    torch.manual_seed(1)
    attn = torch.rand(2, 3, 2, 6, 6)
    attn[1, :, :, 4:, :] = 0  # example 1 has 4 real tokens: padding rows are zero as the stream yields them
    attn[1, :, :, :, 4:] = 0
    lengths = torch.tensor([6, 4])
    occurrences = sp.occurrence_tensor([[[1], [3, 4]], []], width=6)  # example 1 has no occurrence
    values, present = sp.feature_attention(attn, lengths, occurrences)
    assert present.tolist() == [True, False]
    for layer in range(3):
        for head in range(2):
            received = attn[0, layer, head].sum(0) / 6
            expected = max(received[1], received[3] + received[4])
            assert values[0, layer, head] == pytest.approx(float(expected))
    assert torch.all(values[1] == 0)


def test_special_token_attention_and_cls_rows(tiny, tokenizer):
    examples = [Example("a", "a short one"), Example("b", "and a longer second input here", "with a pair")]
    maps = next(stream_maps(tiny, examples, batch_size=2))
    roles = token_roles(tokenizer, maps.batch.input_ids, maps.batch.attention_mask)
    values = sp.special_token_attention(maps.attentions, roles)
    for i in range(2):
        single = maps.example_maps(i)  # (L, H, n, n)
        tokens = maps.tokens(i)
        cls_cols = [p for p, t in enumerate(tokens) if t == "[CLS]"]
        sep_cols = [p for p, t in enumerate(tokens) if t == "[SEP]"]
        assert torch.allclose(values["to_cls"][i], single[..., cls_cols].sum(-1).mean(-1), atol=1e-6)
        assert torch.allclose(values["to_sep"][i], single[..., sep_cols].sum(-1).mean(-1), atol=1e-6)
        row = sp.cls_rows(maps.attentions[:, -1], roles["cls"])[i, :len(tokens)]
        assert torch.allclose(row, single[-1, :, 0, :].mean(0), atol=1e-6)
        assert float(row.sum()) == pytest.approx(1.0, abs=1e-5)


def test_token_tally_means_per_token():
    tally = sp.TokenTally()
    tally.add(["[CLS]", "good", "."], [0.5, 0.3, 0.2])
    tally.add(["[CLS]", "bad", "."], [0.7, 0.1, 0.2])
    table = tally.table()
    assert table.token.tolist()[0] == "[CLS]" and table.set_index("token").loc["[CLS]", "mean_attention"] == 0.6
    assert table.set_index("token").loc[".", "count"] == 2
    assert tally.table(min_count=2).token.tolist() == ["[CLS]", "."]


def test_token_tally_intervals_resample_inputs_not_occurrences():
    """cls_last_layer.csv gave bare means. Each token's mean now has a bootstrap 95% interval over the inputs
    (ratio of resampled sums: the occurrences of a token in one input share its maps); a token of one input has
    none. An input that repeats a token many times weighs in as one input, not as many independent occurrences."""
    tally = sp.TokenTally()
    inputs = [(["[CLS]", "good", "good", "good", "good", "."], [0.4, 0.9, 0.9, 0.9, 0.9, 0.1]),
              (["[CLS]", "good", "."], [0.6, 0.1, 0.2]), (["[CLS]", "good", "fine"], [0.5, 0.2, 0.3]),
              (["[CLS]", "bad", "."], [0.7, 0.1, 0.2])]
    for tokens, weights in inputs:
        tally.add(tokens, weights)
    table = tally.table().set_index("token")
    assert list(tally.table().columns) == ["token", "mean_attention", "ci_low", "ci_high", "count", "inputs"]
    assert table.loc["good", ["count", "inputs"]].tolist() == [6, 3]
    assert table.loc["good", "mean_attention"] == pytest.approx(3.9 / 6)
    # the same draws, straight from numpy: per input the summed weight and the count of "good"
    sums, counts = np.array([3.6, 0.1, 0.2, 0.0]), np.array([4, 1, 1, 0])
    draws = np.random.default_rng(0).integers(0, 4, (DEFAULT_BOOTSTRAP, 4))
    with np.errstate(invalid="ignore"):
        ratios = sums[draws].sum(1) / counts[draws].sum(1)
    expected = np.nanpercentile(ratios, [2.5, 97.5])
    assert (table.loc["good", "ci_low"], table.loc["good", "ci_high"]) == pytest.approx(tuple(expected))
    # four of six occurrences sit in one input: resampling inputs reaches far below and above the mean
    assert table.loc["good", "ci_low"] < 0.2 and table.loc["good", "ci_high"] > 0.85
    assert table.loc["fine", "inputs"] == 1 and np.isnan(table.loc["fine", ["ci_low", "ci_high"]].astype(float)).all()
    cls = table.loc["[CLS]"]
    assert cls.ci_low < cls.mean_attention < cls.ci_high and cls.inputs == 4


def test_top_cls_tokens_are_listed_for_fewer_inputs_than_min_count(tiny, tmp_path):
    """`special --n 3` printed an empty "[CLS] attends most to" list: no token can recur in 5 of 3 inputs."""
    data = TaskData("toy", "validation", "test", [Example(str(i), f"input number {i} .") for i in range(3)])
    stats = sp.write_special(tiny, data, RunDir("tiny", "toy", tmp_path), top=4, min_count=5)
    top = stats["top_cls_tokens"]
    assert len(top) == 4 and (top["count"] == 3).all() and "[CLS]" in set(top.token)


def fake_tagger(text):
    """Tags every word 'noun' and words starting with 's' 'subject' (character spans, like spaCy)."""
    spans, start = [], 0
    for word in text.split():
        start = text.index(word, start)
        features = {"noun"} | ({"subject"} if word.startswith("s") else set())
        spans.append((start, start + len(word), frozenset(features)))
        start += len(word)
    return spans


def test_tagged_features_align_by_character_offsets(tokenizer, tiny):
    example = Example("x", "submarines sink", "slowly today")
    found = sp.tagged_occurrences(tokenizer, example, fake_tagger, max_length=32)
    (item,) = encode_examples(tokenizer, [example])
    words = ["".join(item.tokens[p].removeprefix("##") for p in occ) for occ in found["subject"]]
    assert words == ["submarines", "sink", "slowly"] and len(found["noun"]) == 4
    stats = sp.special_statistics(tiny, [example, Example("y", "no nouns ?")], tagger=fake_tagger)
    assert stats["counts"]["subject"] == 1 and stats["counts"]["negation"] == 1 and stats["unavailable"] == {}
    assert stats["heads"]["noun"].shape == (2, 4)


def pronoun_tagger(text):
    """Tags the word 'it' 'pronoun' and every other word 'noun' (character spans, like spaCy)."""
    return [(start, end, frozenset({"pronoun" if word == "it" else "noun"}))
            for start, end, _ in fake_tagger(text) for word in [text[start:end]]]


def test_special_tables_give_every_head_a_bootstrap_interval_over_the_counted_inputs(tiny, tmp_path):
    """special_tokens.csv and linguistic.csv carried bare per-head means; each now has its percentile bootstrap 95%
    interval over the examples (ci_low, ci_high), a feature's over the inputs that have it: a feature of one input
    or of none has none (blank bounds: one input resampled shows no spread)."""
    texts = ["the film is not good .", "a fine , warm story", "never again , said nobody", "short and sharp",
             "it is what it is", "sad songs say so much"]
    data = TaskData("toy", "validation", "test", [Example(str(i), text) for i, text in enumerate(texts)])
    run = RunDir("tiny", "toy", tmp_path)
    stats = sp.write_special(tiny, data, run, tagger=pronoun_tagger)
    assert [stats["counts"][name] for name in ("negation", "pronoun", "noun", "verb")] == [2, 1, 6, 0]
    tokens, linguistic = run.read_table("special_tokens"), run.read_table("linguistic")
    for table in (tokens, linguistic[linguistic.feature.isin(["negation", "noun"])]):
        assert list(table.columns)[-2:] == ["ci_low", "ci_high"]
        assert (table.ci_low <= table.value + 1e-12).all() and (table.value <= table.ci_high + 1e-12).all()
    assert (tokens.ci_high > tokens.ci_low).all()
    pronoun = linguistic[linguistic.feature == "pronoun"]
    assert pronoun.value.notna().all() and pronoun[["ci_low", "ci_high"]].isna().all().all()
    assert linguistic[linguistic.feature == "verb"][["value", "ci_low", "ci_high"]].isna().all().all()
    assert "bootstrap" in run.manifest()["analyses"]["special"]["interval"]


def test_special_prints_its_means_with_the_intervals_the_analysis_computes(tmp_path, capsys):
    """`attnpat special` printed bare means (over every head, per layer, the strongest head of a feature) while
    special_tokens.csv and linguistic.csv carried intervals. Each now carries the bootstrap 95% interval over the
    examples that analysis.special computes."""
    model = save_tiny_model(tmp_path / "tiny")
    texts = ["the film is not good .", "a fine , warm story", "never again , said nobody", "short and sharp",
             "it is what it is", "sad songs say so much", "I did n't like it", "no more"]
    data_file = tmp_path / "texts.jsonl"
    data_file.write_text("".join(f'{{"text": "{text}"}}\n' for text in texts))
    assert main(["special", "--model", str(model), "--task", str(data_file), "--no-base", "-q", "--runs-dir",
                 str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    stats = sp.special_statistics(load_model(str(model), device="cpu"), load_data(str(data_file)).examples)
    heads, overall = stats["heads"], stats["model_intervals"]
    assert (f"to [CLS] {interval_text(heads['to_cls'].mean(), *overall['to_cls'])}, to [SEP] "
            f"{interval_text(heads['to_sep'].mean(), *overall['to_sep'])}; per layer") in out
    assert overall["to_cls"][0] < heads["to_cls"].mean() < overall["to_cls"][1]
    for line in layer_interval_lines(stats["special_layers"], {"to_cls": "to [CLS]", "to_sep": "to [SEP]"}):
        assert f"  {line}" in out.splitlines()
    negation = heads["negation"]
    best = np.unravel_index(negation.argmax(), negation.shape)
    # inputs 0, 2, 6 and 7 hold a negation: the head is picked on 0, 2 and 6 and scored on 7
    held = stats["strongest"]["negation"]["held_out"]
    assert held["inputs"] == 1
    assert (f"  negation: 4 inputs, strongest head L{best[0] + 1}-H{best[1] + 1} "
            f"{interval_text(negation[best], *stats['intervals']['negation'][best])} in-sample (optimistic: the best "
            f"of all heads); picked on half the inputs: L{held['layer'] + 1}-H{held['head'] + 1}, "
            f"{interval_text(held['mean'], held['ci_low'], held['ci_high'])} on the other 1") in out.splitlines()
    tokens = RunDir(load_model(str(model), device="cpu").slug, load_data(str(data_file)).task,
                    tmp_path / "runs").read_table("cls_last_layer")
    first = tokens[tokens["count"] >= 5].iloc[0]
    shown = interval_text(first.mean_attention, first.ci_low, first.ci_high)
    # the CSV ranks every token, those seen once first among them: the printout names the floor it applies
    assert (f"attends most to, of the tokens seen 5 times or more (all in cls_last_layer.csv) [bootstrap 95% "
            f"interval over the inputs]: {first.token} ({shown}, n={first['count']})") in out


def test_special_leaves_the_interval_of_a_feature_of_one_input_blank_and_prints_its_bare_value(tmp_path, capsys):
    """A feature in one input only got the zero-width interval [v, v] in linguistic.csv and the printout, which
    reads as certainty (while cls_last_layer.csv left a token of one input blank). Its bounds are now blank in the
    CSV and the printout shows the bare value; features of two inputs or more keep their interval."""
    model = save_tiny_model(tmp_path / "tiny")
    texts = ["the film is not good .", "a fine , warm story", "short and sharp", "sad songs say so much"]
    data_file = tmp_path / "texts.jsonl"
    data_file.write_text("".join(f'{{"text": "{text}"}}\n' for text in texts))
    assert main(["special", "--model", str(model), "--task", str(data_file), "--no-base", "-q", "--runs-dir",
                 str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    run = RunDir(load_model(str(model), device="cpu").slug, load_data(str(data_file)).task, tmp_path / "runs")
    linguistic = run.read_table("linguistic")
    negation = linguistic[linguistic.feature == "negation"]
    assert len(negation) and negation.value.notna().all()
    assert negation[["ci_low", "ci_high"]].isna().all().all()
    written = [line for line in (run.path / "linguistic.csv").read_text().splitlines() if ",negation," in line]
    assert written and all(line.endswith(",,") for line in written)  # empty cells, not "nan"
    tokens = run.read_table("special_tokens")
    assert tokens[["ci_low", "ci_high"]].notna().all().all()  # four inputs: intervals stay
    line = next(line for line in out.splitlines() if line.startswith("  negation: 1 inputs"))
    best = negation.loc[negation.value.idxmax()]
    assert f"strongest head L{best.layer + 1}-H{best['head'] + 1} {best.value:.3f} in-sample" in line
    assert "[" not in line and "nan" not in line


def test_the_strongest_head_is_picked_on_half_the_inputs_and_scored_on_the_other():
    """The best of all heads, scored on the inputs that picked it, is optimistic: head 0 is high on the
    even-numbered inputs only and wins in-sample; picked on the even inputs, it is reported on the odd ones."""
    values = np.zeros((8, 1, 2))
    values[0::2, 0, 0] = 0.9  # lucky: high where it is picked, low elsewhere
    values[1::2, 0, 0] = 0.3
    values[:, 0, 1] = [0.45, 0.55, 0.5, 0.5, 0.55, 0.45, 0.4, 0.5]  # steady, 0.5 on the inputs with the feature
    weights = np.array([1, 1, 1, 1, 1, 1, 0, 0], dtype=float)  # inputs 6 and 7 lack the feature
    halves = np.arange(8) % 2
    found = sp.strongest_heads(values, weights, halves)
    assert (found["layer"], found["head"]) == (0, 0)  # in-sample: 0.6 against 0.5
    held = found["held_out"]
    assert (held["layer"], held["head"], held["inputs"]) == (0, 0, 3)
    assert held["mean"] == pytest.approx(0.3)  # what the pick is worth on fresh inputs, half its in-sample 0.6
    odd = halves == 1
    expected = bootstrap_weighted_mean_interval(values[odd, 0, 0], weights[odd])
    assert (held["ci_low"], held["ci_high"]) == pytest.approx(tuple(expected))
    assert sp.strongest_heads(values, weights * (halves == 0), halves)["held_out"] is None  # no odd input has it


@pytest.mark.slow  # seconds alone; over 20 s on a busy 2-core machine
def test_minilm_writes_special_tables_on_sst2(tmp_path):
    bundle = load_model("minilm", device="cpu")
    data = load_data("sst2", n=24, allow_hub=False)
    run = RunDir(bundle.slug, "sst2", tmp_path)
    stats = sp.write_special(bundle, data, run, tagger=None, batch_size=8)
    tokens = run.read_table("special_tokens")
    assert len(tokens) == 2 * 6 * 12 and set(tokens.metric) == {"to_cls", "to_sep"}
    assert tokens.value.between(0, 1).all()
    linguistic = run.read_table("linguistic")
    assert set(linguistic.feature) == {"negation"}  # POS features need a tagger
    assert stats["unavailable"]["noun"] == sp.UNAVAILABLE
    assert stats["counts"]["negation"] == sum(bool(sp.negation_occurrences(item))
                                              for item in encode_examples(bundle.tokenizer, data.examples))
    cls_table = run.read_table("cls_last_layer")
    assert cls_table.loc[cls_table.token == "[CLS]", "count"].item() == 24
    assert (run.path / "special_tokens.png").is_file() and (run.path / "special_tokens.svg").is_file()
    assert run.manifest()["analyses"]["special"]["unavailable"]["verb"] == sp.UNAVAILABLE


def test_feature_change_is_a_paired_bootstrap_of_per_input_differences():
    """`special` gave each model's attention to a feature with its own interval, never the change fine-tuned minus
    base. feature_change differences each input's values first: the spread between inputs, shared by both models,
    cancels, so a small steady rise is told from zero where the two unpaired intervals overlap."""
    rng = np.random.default_rng(0)
    spread = rng.uniform(0.0, 0.5, size=(40, 1, 2))  # how much each input draws, the same in both models
    base_values = spread
    tuned_values = spread + np.array([0.02, 0.0]) + rng.normal(0, 0.002, size=(40, 1, 2))  # head 0 rises a little
    present = np.ones(40)
    present[[3, 8]] = 0  # the base lacks the feature on input 3, the fine-tuned one on 8: both drop out
    tuned_present = np.ones(40)
    tuned_present[8] = 0
    changes = sp.feature_change({"negation": (tuned_values, tuned_present)},
                                {"negation": (base_values, np.where(np.arange(40) == 3, 0.0, 1.0)), "noun":
                                 (base_values, present)})
    assert list(changes) == ["negation"]  # noun: only the base has it
    change = changes["negation"]
    counted = present > 0
    expected = (tuned_values - base_values)[counted].mean(0)
    assert np.allclose(change["change"], expected)
    assert change["weights"].sum() == 38
    low, high = change["intervals"][0, 0]
    assert 0 < low < 0.02 < high  # the rise is real: its paired interval excludes 0
    unpaired = bootstrap_weighted_mean_interval(tuned_values[:, 0, 0], present)
    assert unpaired[0] < base_values[counted, 0, 0].mean()  # unpaired, the base mean lies inside the tuned interval
    assert change["intervals"][0, 1, 0] < 0 < change["intervals"][0, 1, 1]  # head 1 did not move
    assert change["model"][0] == pytest.approx(expected.mean())
    # the held-out change: the odd-numbered inputs alone (3 is odd and lacks the feature)
    held = sp.held_out_change(change, 0, 0)
    odd = counted & (np.arange(40) % 2 == 1)
    assert held["inputs"] == odd.sum() == 19
    assert held["mean"] == pytest.approx((tuned_values - base_values)[odd, 0, 0].mean())
    with pytest.raises(AttnpatError, match="same inputs and heads"):
        sp.feature_change({"negation": (tuned_values, present)}, {"negation": (base_values[:, :, :1], present)})


def test_special_writes_and_prints_the_paired_change_against_the_base(tmp_path, capsys):
    """`attnpat special --model A --base B` printed each model's attention apart; it now also writes
    linguistic_change.csv (A minus B per head, with its paired interval) into A's run and prints it. A base of
    another shape has no head in common: one line says so and no change table is written."""
    tuned, base = save_tiny_model(tmp_path / "tuned", seed=1), save_tiny_model(tmp_path / "base", seed=2)
    other = save_tiny_model(tmp_path / "other", layers=1)
    texts = ["the film is not good .", "never again", "I did n't like it", "no more", "a warm story",
             "not bad , not at all", "nobody came", "it is not here"]
    data_file = tmp_path / "texts.jsonl"
    data_file.write_text("".join(f'{{"text": "{text}"}}\n' for text in texts))
    runs = tmp_path / "runs"
    assert main(["special", "--model", str(tuned), "--base", str(base), "--task", str(data_file), "-q",
                 "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    task = load_data(str(data_file)).task
    tuned_run, base_run = (RunDir(load_model(str(path), device="cpu").slug, task, runs) for path in (tuned, base))
    change = tuned_run.read_table("linguistic_change")
    negation = change[change.feature == "negation"]
    assert (negation.inputs == 7).all()  # "a warm story" has no negation
    # every input with a negation has it for both models (one tokenizer): the mean change is the difference of means
    levels = {run: run.read_table("linguistic").query("feature == 'negation'").value.to_numpy()
              for run in (tuned_run, base_run)}
    assert np.allclose(negation.value, levels[tuned_run] - levels[base_run], atol=1e-6)
    assert ((negation.ci_low <= negation.value + 1e-9) & (negation.value <= negation.ci_high + 1e-9)).all()
    assert (negation.ci_high > negation.ci_low).all()
    assert "linguistic_change.csv" in tuned_run.manifest()["analyses"]["special_change"]["outputs"]
    line = next(line for line in out.splitlines() if line.startswith("  negation: over every head"))
    assert "(7 inputs); at L" in line and "picked on the even-numbered inputs" in line
    assert main(["special", "--model", str(other), "--base", str(base), "--task", str(data_file), "-q",
                 "--runs-dir", str(runs)]) == 0
    assert "no paired change" in capsys.readouterr().out
    other_run = RunDir(load_model(str(other), device="cpu").slug, task, runs)
    assert (other_run.path / "linguistic.csv").is_file() and not (other_run.path / "linguistic_change.csv").exists()


def test_special_without_its_base_removes_an_earlier_paired_change(tmp_path, capsys):
    """linguistic_change.csv of `special --model A --base B` stayed in A's run after a later `special --model A
    --no-base` (other inputs, perhaps), read as if it belonged to the new tables; now that run removes it with its
    manifest entry special_change, when its own tables land. So does a run whose base cannot be paired."""
    tuned, base = save_tiny_model(tmp_path / "tuned", seed=1), save_tiny_model(tmp_path / "base", seed=2)
    other_shape = save_tiny_model(tmp_path / "other", layers=1)
    data_file = tmp_path / "texts.jsonl"
    data_file.write_text("".join(f'{{"text": "{text}"}}\n' for text in ["not good", "never again", "a warm story"]))
    runs = tmp_path / "runs"
    tuned_run = RunDir(load_model(str(tuned), device="cpu").slug, load_data(str(data_file)).task, runs)
    options = ["--model", str(tuned), "--task", str(data_file), "-q", "--runs-dir", str(runs)]
    for unpaired in (["--no-base"], ["--base", str(other_shape)]):
        assert main(["special", *options, "--base", str(base)]) == 0
        assert (tuned_run.path / "linguistic_change.csv").is_file()
        assert "special_change" in tuned_run.manifest()["analyses"]
        assert main(["special", *options, *unpaired]) == 0
        capsys.readouterr()
        assert not (tuned_run.path / "linguistic_change.csv").exists()
        analyses = tuned_run.manifest()["analyses"]
        assert "special_change" not in analyses and "linguistic.csv" in analyses["special"]["outputs"]
        assert (tuned_run.path / "linguistic.csv").is_file()


def save_tiny_model_without_cls(path):
    """A tiny model whose tokenizer names no [CLS] token: the path it is saved at."""
    saved = save_tiny_model(path)
    tokenizer = AutoTokenizer.from_pretrained(saved)
    tokenizer.cls_token = None
    tokenizer.save_pretrained(saved)
    return saved


def test_special_refuses_inputs_of_special_tokens_only_or_without_cls_and_sep_before_any_work(tmp_path, capsys):
    """A text "[SEP]" (tokenised as [CLS] [SEP] [SEP]) was averaged into every head's attention to [CLS]/[SEP] and
    tagged a noun; a tokenizer that names no [CLS] printed attention to [CLS] 0.000 [0.000, 0.000] and an empty
    [CLS] row list. Each is now one error line before any map, whichever of --model and --base it concerns, and
    neither model's tables are written."""
    model = save_tiny_model(tmp_path / "tiny")
    no_cls = save_tiny_model_without_cls(tmp_path / "no-cls")
    capsys.readouterr()
    runs = tmp_path / "runs"
    sentences, special_only = tmp_path / "sentences.jsonl", tmp_path / "special.jsonl"
    sentences.write_text('{"text": "not a good film"}\n{"text": "a fine one"}\n')
    special_only.write_text('{"text": "not a good film"}\n{"text": "[SEP]"}\n')
    for argv, error in (
            (["--model", str(model), "--task", str(special_only), "--no-base"],
             "error: example special-1 has only special tokens ([CLS] [SEP] [SEP]), no text to analyse"),
            (["--model", str(model), "--task", str(sentences), "--base", str(no_cls)],
             "error: the tokenizer names no [CLS] token (cls_token is unset), so attention to [CLS] cannot be "
             "measured; special needs a tokenizer that marks its inputs with [CLS] and [SEP]")):
        assert main(["special", *argv, "-q", "--runs-dir", str(runs)]) == 2
        assert capsys.readouterr().err.strip() == error
    assert not [path for path in runs.rglob("*") if path.is_file()]
    data = TaskData("toy", "validation", "test", [Example("a", "fine"), Example("b", "[CLS] [SEP]")])
    with pytest.raises(AttnpatError, match="example b has only special tokens"):
        sp.special_statistics(load_model(str(model), device="cpu"), data.examples)


def test_overview_and_compare_kinds_refuse_a_tokenizer_without_cls_before_any_map(tmp_path, capsys):
    """overview and compare-kinds took a tokenizer that names no [CLS] and reported attention to [CLS] as 0.000 for
    every head (compare-kinds after classifying every kind's maps). Now they give special's one error line, naming
    the verb, before any map, and write nothing."""
    no_cls = save_tiny_model_without_cls(tmp_path / "no-cls")
    capsys.readouterr()
    runs = tmp_path / "runs"
    sentences = tmp_path / "sentences.jsonl"
    sentences.write_text('{"text": "not a good film"}\n{"text": "a fine one"}\n')
    for verb in ("overview", "compare-kinds"):
        assert main([verb, "--model", str(no_cls), "--task", str(sentences), "-q", "--runs-dir", str(runs)]) == 2
        assert capsys.readouterr().err.strip() == (
            "error: the tokenizer names no [CLS] token (cls_token is unset), so attention to [CLS] cannot be "
            f"measured; {verb} needs a tokenizer that marks its inputs with [CLS] and [SEP]")
    assert not [path for path in runs.rglob("*") if path.is_file()]


def test_a_word_truncation_cuts_part_way_is_no_occurrence_of_a_feature(tokenizer, tiny):
    """--max-length cut "nothingness" to its first piece "nothing", which counted as a negation; a tagged word cut
    part-way ("shipwrights" kept as "ship ##wright") stood for the whole word; a "[SEP]" written in the text (the
    tokenizer's own [SEP]) could be tagged as a word. None of them is an occurrence now; whole words still are."""
    (cut,) = encode_examples(tokenizer, [Example("a", "not a nothingness")], max_length=5)
    assert cut.tokens == ["[CLS]", "not", "a", "nothing", "[SEP]"]
    assert sp.negation_occurrences(cut) == [[1]]
    (whole,) = encode_examples(tokenizer, [Example("a", "not a nothing at all")], max_length=5)
    assert sp.negation_occurrences(whole) == [[1], [3]]
    example = Example("b", "shipwrights sink [SEP] boats")
    assert tokenizer.tokenize(example.text)[:3] == ["ship", "##wright", "##s"]
    assert sp.tagged_occurrences(tokenizer, example, fake_tagger, max_length=4) == {}  # [CLS] ship ##wright [SEP]
    nouns = sp.tagged_occurrences(tokenizer, example, fake_tagger, max_length=32)["noun"]
    assert nouns == [[1, 2, 3], [4], [6]]  # shipwrights, sink, boats; not the [SEP] at 5
    stats = sp.special_statistics(tiny, [Example("c", "a nothingness"), Example("d", "not it")], max_length=4)
    assert stats["counts"]["negation"] == 1
    assert stats["per_input"]["negation"][1].tolist() == [0.0, 1.0]


def test_a_paired_run_stopped_at_its_base_leaves_no_earlier_change_beside_its_new_tables(tmp_path, capsys,
                                                                                         monkeypatch):
    """`special --model A --base B` lands A's tables first and B's after; stopped on B, it left A's new tables (other
    inputs) beside linguistic_change.csv of an earlier run, read as theirs. A's tables now land without it: the
    change comes back only when the base's statistics let it be computed on the same inputs."""
    tuned, base = save_tiny_model(tmp_path / "tuned", seed=1), save_tiny_model(tmp_path / "base", seed=2)
    data_file = tmp_path / "texts.jsonl"
    data_file.write_text("".join(f'{{"text": "{text}"}}\n' for text in ["not good", "never again", "a warm story"]))
    runs = tmp_path / "runs"
    tuned_run = RunDir(load_model(str(tuned), device="cpu").slug, load_data(str(data_file)).task, runs)
    options = ["special", "--model", str(tuned), "--base", str(base), "--task", str(data_file), "-q", "--runs-dir",
               str(runs)]
    assert main(options) == 0
    assert (tuned_run.path / "linguistic_change.csv").is_file()
    real_write_special = cli_finetune.write_special

    def stopped_at_the_base(bundle, *args, **kwargs):
        if bundle.reference == str(base):
            raise AttnpatError("stopped while the base was analysed")
        return real_write_special(bundle, *args, **kwargs)

    monkeypatch.setattr(cli_finetune, "write_special", stopped_at_the_base)
    assert main([*options, "--n", "2"]) == 2
    capsys.readouterr()
    analyses = tuned_run.manifest()["analyses"]
    assert analyses["special"]["data"]["n_examples"] == 2  # the new tables landed
    assert not (tuned_run.path / "linguistic_change.csv").exists() and "special_change" not in analyses


def test_the_tagger_reads_a_long_text_only_up_to_a_margin_past_the_part_truncation_keeps(tokenizer):
    """The tagger (spaCy) was given every input whole: a text over 1,000,000 characters stopped `special` in spaCy's
    traceback (E088), and long ones took its parser minutes and gigabytes for words truncation had cut off. It now
    reads a cut text up to TAGGER_CONTEXT_CHARS past the kept part; a text kept whole is read whole."""
    seen = []

    def recording_tagger(text):
        seen.append(text)
        return fake_tagger(text)

    long_text = "the film is good . " * 2000  # 38,000 characters, about 10,000 tokens
    found = sp.tagged_occurrences(tokenizer, Example("long", long_text, "a short pair"), recording_tagger, 16)
    enc = tokenizer(long_text, "a short pair", truncation=True, max_length=16, return_offsets_mapping=True)
    kept_end = max(b for seq, (_, b) in zip(enc.sequence_ids(), enc["offset_mapping"]) if seq == 0)
    assert seen == [long_text[:kept_end + sp.TAGGER_CONTEXT_CHARS], "a short pair"]
    assert len(found["noun"]) == enc.sequence_ids().count(0) + 3  # every kept word of the text, and the pair's
    seen.clear()
    sp.tagged_occurrences(tokenizer, Example("short", "the film is good .  "), recording_tagger, 16)
    assert seen == ["the film is good .  "]


def test_hand_made_maps_give_the_hand_computed_statistics(tokenizer):
    """Two inputs of 4 and 3 tokens in one padded batch; every real query row puts 0.5 on [CLS], 0.25 on the last
    [SEP] and 0.25 on token 1. Attention to [CLS] is exactly 0.5 and to [SEP] 0.25 whatever the padding rows hold
    (they are no query rows), [CLS]'s row is its own row, and token 1 receives 4 x 0.25 / 4 = 3 x 0.25 / 3 = 0.25."""
    input_ids = torch.tensor(tokenizer(["not good", "not"], padding=True)["input_ids"])
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    lengths = attention_mask.sum(1)
    assert lengths.tolist() == [4, 3]
    maps = torch.zeros(2, 1, 1, 4, 4)
    for b, n in enumerate(lengths.tolist()):
        maps[b, 0, 0, :n, 0] = 0.5
        maps[b, 0, 0, :n, n - 1] += 0.25
        maps[b, 0, 0, :n, 1] += 0.25
    roles = token_roles(tokenizer, input_ids, attention_mask)
    with_padding_rows = maps.clone()
    with_padding_rows[1, 0, 0, 3, 0] = 1.0  # a padding row all on [CLS]: it must not count
    special = sp.special_token_attention(with_padding_rows, roles)
    assert special["to_cls"].flatten().tolist() == [0.5, 0.5] and special["to_sep"].flatten().tolist() == [0.25, 0.25]
    assert sp.cls_rows(maps[:, -1], roles["cls"]).tolist() == [[0.5, 0.25, 0.0, 0.25], [0.5, 0.25, 0.25, 0.0]]
    values, present = sp.feature_attention(maps, lengths, sp.occurrence_tensor([[[1]], [[1]]], 4))
    assert values.flatten().tolist() == [0.25, 0.25] and present.tolist() == [True, True]
