"""The map stream: batching/padding invariance, exactness against a manual recomputation, word-level maps."""
import gc
import math
import platform

import numpy as np
import pytest
import torch
from transformers import BertModel, BertTokenizer

import analysis.stream as stream_module
from analysis.data import Example
from analysis.errors import AttnpatError
from analysis.stream import (
    collate,
    displayed_maps,
    drop_positions,
    encode_examples,
    forward_attentions,
    stream_maps,
    to_word_level,
    token_roles,
    word_groups,
)
from tests.tiny import tiny_bundle

TEXTS = ["a charming and often affecting journey .", "bad", "it is , in a word , a mess of a film that nobody needed .",
         "the acting , costumes and music are all first rate", "no"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tiny"), layers=3, heads=4)


def examples(texts=TEXTS):
    return [Example(f"ex{i}", text) for i, text in enumerate(texts)]


def maps_by_example(bundle, items, batch_size):
    out = {}
    for batch in stream_maps(bundle, items, batch_size=batch_size):
        for i, item in enumerate(batch.batch.items):
            out[item.example_id] = batch.example_maps(i).clone()
    return out


def test_attentions_are_present_with_the_expected_shape(bundle):
    batch = next(iter(stream_maps(bundle, examples(), batch_size=5)))
    assert batch.attentions.shape[:3] == (5, 3, 4)
    real_rows = batch.attentions.sum(-1)[batch.batch.attention_mask.bool()[:, None, None, :].expand(-1, 3, 4, -1)]
    torch.testing.assert_close(real_rows, torch.ones_like(real_rows), atol=1e-5, rtol=0)
    padding = ~batch.batch.attention_mask.bool()
    assert padding.any(), "the batch should contain padding for this test to mean something"
    assert batch.attentions.permute(0, 3, 1, 2, 4)[padding].abs().sum() == 0  # padding rows zeroed
    assert batch.attentions.permute(0, 4, 1, 2, 3)[padding].abs().sum() == 0  # no weight on padding keys


def test_batched_padded_maps_equal_batch_size_one(bundle):
    batched = maps_by_example(bundle, examples(), batch_size=5)
    single = maps_by_example(bundle, examples(), batch_size=1)
    assert set(batched) == set(single) == {f"ex{i}" for i in range(len(TEXTS))}
    for key in single:
        assert batched[key].shape == single[key].shape
        torch.testing.assert_close(batched[key], single[key], atol=1e-5, rtol=0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator settings")
def test_streaming_lets_the_allocator_keep_freed_batch_memory(bundle):
    with stream_module.freed_memory_kept() as took:
        assert took is True  # glibc took both thresholds


def test_the_allocator_keeps_freed_memory_only_while_a_stream_runs(bundle, monkeypatch):
    """Left raised, the thresholds made a later step of the same process (the demo's compare after its classify)
    peak at 6.3 GB instead of 2.3: they are set back, and the kept memory returned, when the last stream ends."""
    calls = []

    class Libc:
        def mallopt(self, option, value):
            calls.append((option, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(stream_module, "_libc", lambda: Libc())
    kept, default = stream_module.KEPT_FREED_BYTES, 128 * 1024
    outer = stream_maps(bundle, [Example("a", "one two"), Example("b", "three four five")], batch_size=1)
    next(outer)
    assert calls == [(-3, kept), (-1, kept)]  # set while the stream runs
    list(stream_maps(bundle, [Example("c", "six")], batch_size=1))  # a stream inside another: no restore yet
    assert ("trim", 0) not in calls
    list(outer)
    assert calls[-3:] == [(-3, default), (-1, default), ("trim", 0)]  # the last stream ended: defaults, memory back


def test_batches_are_length_sorted_and_cover_every_example(bundle):
    lengths, seen = [], []
    for batch in stream_maps(bundle, examples(), batch_size=2):
        lengths.extend(int(n) for n in batch.batch.lengths)
        seen.extend(batch.batch.indices)
        assert batch.attentions.shape[-1] == int(batch.batch.lengths.max())  # dynamic padding
    assert lengths == sorted(lengths)
    assert sorted(seen) == list(range(len(TEXTS)))


def test_one_head_equals_manual_softmax_of_qk(bundle):
    """Recompute layer 1 head 2 from the hidden states entering that layer: softmax(QK^T / sqrt(d))."""
    model, layer, head = bundle.model, 1, 2
    captured = {}

    def capture(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs["hidden_states"]

    hook = model.encoder.layer[layer].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        batch = next(iter(stream_maps(bundle, examples(TEXTS[:1]), batch_size=1)))
    finally:
        hook.remove()
    attention = model.encoder.layer[layer].attention.self
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        hidden = captured["hidden"][0]
        q = attention.query(hidden)[:, head * d:(head + 1) * d]
        k = attention.key(hidden)[:, head * d:(head + 1) * d]
        manual = torch.softmax(q @ k.T / math.sqrt(d), dim=-1)
    torch.testing.assert_close(batch.example_maps(0)[layer, head], manual, atol=1e-5, rtol=0)


def test_sdpa_models_are_refused_instead_of_returning_no_maps(bundle, tmp_path):
    sdpa = BertModel.from_pretrained(bundle.source.path, attn_implementation="sdpa")
    encoded = encode_examples(bundle.tokenizer, examples(TEXTS[:1]))
    with pytest.raises(AttnpatError, match="eager"), torch.inference_mode():
        forward_attentions(sdpa, collate(encoded, 0), torch.device("cpu"))


def test_word_level_rule_on_a_hand_made_map():
    # tokens: [CLS] play ##ing well [SEP]  ->  words: [CLS] playing well [SEP]
    attn = torch.tensor([
        [0.1, 0.2, 0.3, 0.2, 0.2],
        [0.0, 0.5, 0.5, 0.0, 0.0],
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [0.4, 0.1, 0.1, 0.3, 0.1],
        [1.0, 0.0, 0.0, 0.0, 0.0],
    ])
    groups = np.array([0, 1, 1, 2, 3])
    words = to_word_level(attn, groups)
    expected = torch.tensor([
        [0.1, 0.5, 0.2, 0.2],
        # FROM 'playing': mean of its pieces' rows
        [(0.0 + 0.2) / 2, (1.0 + 0.4) / 2, (0.0 + 0.2) / 2, (0.0 + 0.2) / 2],
        [0.4, 0.2, 0.3, 0.1],  # TO 'playing': sum over its pieces' columns
        [1.0, 0.0, 0.0, 0.0],
    ])
    torch.testing.assert_close(words, expected)
    torch.testing.assert_close(words.sum(-1), torch.ones(4))


def test_word_level_maps_from_the_tokenizer_keep_rows_summing_to_one(bundle):
    item_examples = [Example("w", "unbelievably charming", "tokenization works")]
    batch = next(iter(stream_maps(bundle, item_examples, batch_size=1)))
    item = batch.batch.items[0]
    groups, labels = word_groups(item)
    assert "unbelievably" in labels and "tokenization" in labels and labels.count("[SEP]") == 2
    assert len(item.tokens) > len(labels)  # some words were split
    words = to_word_level(batch.example_maps(0), groups)
    assert words.shape[-1] == len(labels)
    torch.testing.assert_close(words.sum(-1), torch.ones(words.shape[:-1]), atol=1e-5, rtol=0)


def test_drop_positions_removes_rows_and_columns_and_renormalises():
    maps = torch.softmax(torch.randn(2, 3, 5, 5), dim=-1)
    keep = np.array([False, True, True, True, False])
    kept = drop_positions(maps, keep)
    assert kept.shape == (2, 3, 3, 3)
    assert torch.allclose(kept.sum(-1), torch.ones(2, 3, 3))
    ratio = kept / maps[..., 1:4, 1:4]  # proportional to the original weights within each row
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), atol=1e-5)
    with pytest.raises(AttnpatError):
        drop_positions(maps, np.zeros(5, dtype=bool))


def test_displayed_maps_word_level_and_hidden_specials(bundle):
    batch = next(iter(stream_maps(bundle, [Example("pair", "Unbelievably good acting.", "A second one.")])))
    maps, item = batch.example_maps(0), batch.batch.items[0]
    assert item.tokens[0] == "[CLS]" and item.tokens.count("[SEP]") == 2
    shown, labels = displayed_maps(maps, item, hide_special=True)
    assert "[CLS]" not in labels and "[SEP]" not in labels and len(labels) == len(item.tokens) - 3
    assert shown.shape == (3, 4, len(labels), len(labels))
    assert torch.allclose(shown.sum(-1), torch.ones(shown.shape[:-1]), atol=1e-5)
    words, word_labels = displayed_maps(maps, item, word_level=True)
    assert "unbelievably" in word_labels and not any(label.startswith("##") for label in word_labels)
    assert words.shape[-1] == len(word_labels) < len(item.tokens)
    assert torch.allclose(words.sum(-1), torch.ones(words.shape[:-1]), atol=1e-5)
    both, both_labels = displayed_maps(maps, item, word_level=True, hide_special=True)
    assert both_labels == [label for label in word_labels if label not in {"[CLS]", "[SEP]"}]
    assert displayed_maps(maps, item)[1] == item.tokens and torch.equal(displayed_maps(maps, item)[0], maps)


def test_token_roles_match_positions_not_strings(bundle):
    encoded = encode_examples(bundle.tokenizer, [Example("p", "well , fine .", "yes .")])
    batch = collate(encoded, 0)
    roles = token_roles(bundle.tokenizer, batch.input_ids, batch.attention_mask)
    tokens = encoded[0].tokens
    assert [tokens[i] for i in roles["cls"][0].nonzero().ravel()] == ["[CLS]"]
    assert [tokens[i] for i in roles["sep"][0].nonzero().ravel()] == ["[SEP]", "[SEP]"]
    assert [tokens[i] for i in roles["period"][0].nonzero().ravel()] == [".", "."]
    assert [tokens[i] for i in roles["punct"][0].nonzero().ravel()] == [",", ".", "."]


def test_long_text_is_truncated_and_flagged(bundle):
    encoded = encode_examples(bundle.tokenizer, [Example("long", "word " * 300), Example("short", "word")],
                              max_length=32)
    assert len(encoded[0]) == 32 and encoded[0].truncated and encoded[0].tokens[-1] == "[SEP]"
    assert not encoded[1].truncated


@pytest.mark.parametrize("text, pair", [("", None), ("   ", None), ("fine", "  ")])
def test_empty_text_is_a_clear_error(bundle, text, pair):
    with pytest.raises(AttnpatError, match="empty"):
        encode_examples(bundle.tokenizer, [Example("e", text, pair)])


def test_maximum_length_beyond_the_model_is_refused(bundle):
    with pytest.raises(AttnpatError, match="exceeds"):
        encode_examples(bundle.tokenizer, examples(), max_length=100_000)


def test_token_roles_follow_each_tokenizer_even_when_python_reuses_an_id(tmp_path):
    """Tokenizers made and freed one after another (a long-lived process loading models in turn): Python hands a
    freed tokenizer's id to the next one, so a cache keyed by id() gave a new vocabulary the old one's period
    and comma ids. Each tokenizer's roles must come from its own vocabulary."""
    vocabularies = {}
    for name, order in (("a", ["hello", ".", ",", "world"]), ("b", ["world", ",", ".", "hello"])):
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *order]) + "\n")
        vocabularies[name] = path
    for trial in range(40):
        tokenizer = BertTokenizer(vocab=str(vocabularies["ab"[(trial // 3) % 2]]))
        encoded = tokenizer("hello, world.", return_tensors="pt")
        roles = token_roles(tokenizer, encoded["input_ids"], encoded["attention_mask"])
        assert tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist()) == [
            "[CLS]", "hello", ",", "world", ".", "[SEP]"]
        assert roles["period"][0].tolist() == [False, False, False, False, True, False], trial
        assert roles["comma"][0].tolist() == [False, False, True, False, False, False], trial
        del tokenizer, encoded, roles
        gc.collect()


def test_progress_bars_update_rarely_when_stderr_is_a_log_file(tmp_path, monkeypatch):
    """A bar's updates are appended to a log file, not redrawn: there it updates every FILE_LOG_INTERVAL s, or as
    often as FILE_LOG_INTERVAL_ENV says (the web app's jobs, whose log file the Runs tab follows); on a pipe it
    keeps tqdm's default."""
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from analysis.progress import FILE_LOG_INTERVAL, FILE_LOG_INTERVAL_ENV, progress_bar  # noqa: PLC0415

    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        bar = progress_bar(10, True, "maps")
        assert bar.mininterval == FILE_LOG_INTERVAL
        bar.close()
        for value, interval in (("0.5", 0.5), ("nonsense", FILE_LOG_INTERVAL), ("-1", FILE_LOG_INTERVAL)):
            monkeypatch.setenv(FILE_LOG_INTERVAL_ENV, value)
            bar = progress_bar(10, True, "maps")
            assert bar.mininterval == interval, value
            bar.close()
        monkeypatch.delenv(FILE_LOG_INTERVAL_ENV)
    read, write = os.pipe()
    with os.fdopen(read), os.fdopen(write, "w") as pipe:  # the writing end closes first
        monkeypatch.setattr(sys, "stderr", pipe)
        bar = progress_bar(10, True, "maps")
        assert bar.mininterval < 1
        bar.close()
    assert progress_bar(10, False, "maps") is None
