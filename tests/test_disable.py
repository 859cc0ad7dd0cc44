"""Per-head gates (analysis.disable): uniform and zero disabling, exactness when nothing is disabled."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertModel,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
)

from analysis import disable
from analysis.disable import (
    first_changed_layer,
    gated,
    gated_attention_forward,
    head_gates,
    keep_mask,
    layer_keep_mask,
    mask_gates,
    stacked_gates,
    uniform_weights,
)
from analysis.errors import AttnpatError
from analysis.models import EncoderBundle, ModelSource, embedded_model_path

HEADS = 4


@functools.lru_cache(maxsize=1)
def tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_path())


def make_bundle(config_class=BertConfig, model_class=BertForSequenceClassification, *, layers: int = 3,
                num_labels: int = 2, seed: int = 0, **config_kwargs) -> EncoderBundle:
    """A tiny random classifier with the MiniLM tokenizer. Large initial weights make attention peaky, so
    disabling one head visibly changes the logits."""
    tok = tokenizer()
    torch.manual_seed(seed)
    sizes = dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=HEADS, intermediate_size=37)
    if config_class.model_type == "distilbert":
        sizes = dict(dim=32, n_layers=layers, n_heads=HEADS, hidden_dim=37)
    config = config_class(vocab_size=tok.vocab_size, num_labels=num_labels, initializer_range=0.3, pad_token_id=0,
                          attn_implementation="eager", **sizes, **config_kwargs)
    model = model_class(config).eval()
    source = ModelSource("tiny", "local", "<memory>", offline=True)
    return EncoderBundle("tiny", source, model, tok, torch.device("cpu"), revision=f"tiny-{seed}")


def tiny_inputs(bundle, texts=("a fine movie , truly .", "bad", "what a long and winding road it was")):
    encoded = bundle.tokenizer(list(texts), padding=True, return_tensors="pt")
    return {key: encoded[key] for key in ("input_ids", "attention_mask", "token_type_ids")}


def capture_value_and_context(model, layer: int):
    """Hooks recording layer ``layer``'s value projection (B, T, H*d) and self-attention context (B, T, H*d)."""
    seen = {}
    attention = model.bert.encoder.layer[layer].attention.self
    handles = [attention.value.register_forward_hook(lambda m, a, out: seen.__setitem__("value", out)),
               attention.register_forward_hook(lambda m, a, out: seen.__setitem__("context", out[0]))]
    return seen, handles


# ---------------------------------------------------------------- masks

def test_keep_masks_and_first_changed_layer():
    keep = keep_mask(3, 4, [(1, 2), (2, 0)])
    assert keep.shape == (3, 4) and keep.sum() == 10 and keep[1, 2] == 0 and keep[2, 0] == 0
    assert first_changed_layer(keep) == 1
    assert first_changed_layer(keep_mask(3, 4)) == 3
    assert (layer_keep_mask(3, 4, 2)[2] == 0).all() and layer_keep_mask(3, 4, 2)[:2].all()
    with pytest.raises(AttnpatError, match="outside"):
        keep_mask(3, 4, [(3, 0)])


def test_stacked_gates_are_variant_major_and_skip_unchanged_layers():
    keeps = np.stack([keep_mask(3, 4, [(1, 0)]), keep_mask(3, 4, [(1, 3)])])
    gates = stacked_gates(keeps, rows_per_variant=2)
    assert set(gates) == {1}
    assert gates[1].shape == (4, 4)
    assert gates[1][:2, 0].tolist() == [0, 0] and gates[1][2:, 3].tolist() == [0, 0]
    assert gates[1].sum() == 12


# ---------------------------------------------------------------- compute

def test_uniform_head_outputs_the_mean_of_v_over_real_tokens_function_level():
    torch.manual_seed(1)
    n_rows, heads, length, size = 2, 3, 5, 4
    query, key, value = (torch.randn(n_rows, heads, length, size) for _ in range(3))
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    additive = torch.zeros(n_rows, 1, length, length).masked_fill(~real[:, None, None, :],
                                                                  torch.finfo(torch.float32).min)
    module = torch.nn.Module().eval()
    disable._GATES[module] = disable._Gate(torch.tensor([1.0, 0.0, 1.0]), "uniform")
    try:
        context, weights = gated_attention_forward(module, query, key, value, additive)
    finally:
        disable._GATES.pop(module)
    reference, ref_weights = gated_attention_forward(torch.nn.Module().eval(), query, key, value, additive)
    for row in range(n_rows):
        n = int(real[row].sum())
        expected = value[row, 1, :n].mean(0)
        assert torch.allclose(context[row, :, 1], expected.expand(length, size), atol=1e-6)
        assert torch.allclose(weights[row, 1, :, :n], torch.full((length, n), 1.0 / n))
    assert torch.equal(context[:, :, [0, 2]], reference[:, :, [0, 2]])
    assert not torch.allclose(context[:, :, 1], reference[:, :, 1])
    assert torch.equal(uniform_weights(None, weights), torch.full((1, 1, 1, length), 1.0 / length))


@pytest.mark.parametrize("head", [0, 3])
def test_uniform_head_in_a_model_outputs_the_mean_of_v(head):
    bundle = make_bundle()
    inputs = tiny_inputs(bundle)
    lengths = inputs["attention_mask"].sum(1)
    seen, handles = capture_value_and_context(bundle.model, layer=1)
    size = 32 // HEADS
    try:
        with gated(bundle.model), head_gates(bundle.model, {1: torch.tensor(keep_mask(3, HEADS, [(1, head)])[1])},
                                             "uniform"), torch.no_grad():
            bundle.model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    value, context = seen["value"], seen["context"]
    for row, n in enumerate(lengths.tolist()):
        mean_v = value[row, :n, head * size:(head + 1) * size].mean(0)
        got = context[row, :, head * size:(head + 1) * size]
        assert torch.allclose(got, mean_v.expand_as(got), atol=1e-5)
        other = (head + 1) % HEADS
        assert not torch.allclose(context[row, :, other * size:(other + 1) * size], mean_v.expand_as(got), atol=1e-3)


def test_zero_mode_zeroes_only_the_gated_head_context():
    bundle = make_bundle()
    inputs = tiny_inputs(bundle)
    size = 32 // HEADS
    contexts = {}
    for name, gates in {"plain": {}, "zero": {0: torch.tensor([1.0, 1.0, 0.0, 1.0])}}.items():
        seen, handles = capture_value_and_context(bundle.model, layer=0)
        with gated(bundle.model), head_gates(bundle.model, gates, "zero"), torch.no_grad():
            bundle.model(**inputs)
        for handle in handles:
            handle.remove()
        contexts[name] = seen["context"]
    assert torch.equal(contexts["zero"][..., 2 * size:3 * size], torch.zeros_like(contexts["zero"][..., :size]))
    assert torch.equal(contexts["zero"][..., :2 * size], contexts["plain"][..., :2 * size])
    assert contexts["plain"][..., 2 * size:3 * size].abs().sum() > 0


@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_disabling_nothing_reproduces_the_eager_baseline_exactly(mode):
    bundle = make_bundle()
    inputs = tiny_inputs(bundle)
    with torch.no_grad():
        eager = bundle.model(**inputs).logits
        with gated(bundle.model):
            assert bundle.model.config._attn_implementation == "attnpat_gated"
            no_gates = bundle.model(**inputs).logits
            with head_gates(bundle.model, {layer: torch.ones(HEADS) for layer in range(3)}, mode):
                all_ones = bundle.model(**inputs).logits
            with head_gates(bundle.model, {1: torch.tensor([1.0, 0.0, 1.0, 1.0])}, mode):
                disabled = bundle.model(**inputs).logits
        after = bundle.model(**inputs).logits
    assert torch.equal(eager, no_gates) and torch.equal(eager, all_ones) and torch.equal(eager, after)
    assert not torch.allclose(eager, disabled, atol=1e-4)
    assert bundle.model.config._attn_implementation == "eager"


def test_gates_are_removed_after_the_block_even_on_error():
    bundle = make_bundle()
    with pytest.raises(RuntimeError):
        with gated(bundle.model), head_gates(bundle.model, {0: torch.zeros(HEADS)}, "zero"):
            assert len(disable._GATES) > 0
            raise RuntimeError("boom")
    assert len(disable._GATES) == 0
    assert bundle.model.config._attn_implementation == "eager"


def test_bad_gates_and_modes_raise_clear_errors():
    bundle = make_bundle()
    with gated(bundle.model):
        with pytest.raises(AttnpatError, match="disabling mode"):
            with head_gates(bundle.model, {0: torch.zeros(HEADS)}, "random"):
                pass
        with pytest.raises(AttnpatError, match="heads"):
            with head_gates(bundle.model, {0: torch.zeros(HEADS + 1)}, "zero"):
                pass
        with pytest.raises(AttnpatError, match="outside"):
            with head_gates(bundle.model, {7: torch.zeros(HEADS)}, "zero"):
                pass


def test_unsupported_architectures_are_named():
    for config_class, model_class, name in [(AlbertConfig, AlbertModel, "albert")]:
        config = config_class(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS,
                              intermediate_size=37, attn_implementation="eager")
        model = model_class(config)
        with pytest.raises(AttnpatError, match=f"not supported for {name}"):
            with gated(model):
                pass


# ---------------------------------------------------------------- against independent references

def _family_bundle(family: str, tmp_path):
    if family == "mpnet":
        from tests.tiny import tiny_mpnet_bundle  # noqa: PLC0415 (only this case needs a saved MPNet)

        return tiny_mpnet_bundle(tmp_path / "mpnet", kind="classifier", layers=3, heads=HEADS, initializer_range=0.3)
    if family == "distilbert":
        return make_bundle(DistilBertConfig, DistilBertForSequenceClassification)
    return make_bundle()


def _inputs_of(bundle, texts) -> dict:
    encoded = bundle.tokenizer(list(texts), padding=True, return_tensors="pt")
    accepted = {"input_ids", "attention_mask"} | ({"token_type_ids"} if bundle.config.model_type == "bert" else set())
    return {key: value for key, value in encoded.items() if key in accepted}


@pytest.mark.parametrize("family", ["bert", "distilbert", "mpnet"])
@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_a_disabled_head_in_a_padded_batch_gives_what_the_input_gives_alone(family, mode, tmp_path):
    """Uniform attention is 1/n over each input's own real tokens: padding in the batch changes nothing. Every
    hidden state of every real token and the logits equal those of the input run alone (a batch of 1, no padding),
    for one head, a whole layer and heads in two layers."""
    bundle = _family_bundle(family, tmp_path)
    texts = ["a fine movie , truly .", "bad", "what a long and winding road it was , and yet i loved it"]
    padded = _inputs_of(bundle, texts)
    assert len(set(padded["attention_mask"].sum(1).tolist())) == 3
    for keep in (keep_mask(3, HEADS, [(1, 2)]), layer_keep_mask(3, HEADS, 0), keep_mask(3, HEADS, [(0, 1), (2, 3)])):
        with torch.no_grad(), gated(bundle.model), head_gates(bundle.model, mask_gates(keep), mode):
            together = bundle.model(**padded, output_hidden_states=True)
            alone = [bundle.model(**_inputs_of(bundle, [text]), output_hidden_states=True) for text in texts]
        with torch.no_grad():
            plain = bundle.model(**padded).logits
        assert not torch.allclose(plain, together.logits, atol=1e-4)  # the gates did change the model
        for row, single in enumerate(alone):
            n = single.hidden_states[0].shape[1]
            for layer, hidden in enumerate(single.hidden_states):
                assert torch.allclose(together.hidden_states[layer][row, :n], hidden[0], atol=1e-5), (row, layer)
            assert torch.allclose(together.logits[row], single.logits[0], atol=1e-5)


def _split_heads(projected: torch.Tensor) -> torch.Tensor:
    """(N, T, H * d) -> (N, H, T, d)."""
    return projected.view(*projected.shape[:2], HEADS, -1).transpose(1, 2)


def _manual_bert_forward(model, inputs: dict, keep: np.ndarray, mode: str) -> tuple[list, list]:
    """A BERT encoder written out by hand: hidden states (L + 1 of (N, T, D)) and each layer's per-head context
    (N, H, T, d), with a disabled head's attention 1/n over the row's real keys (uniform) or its context times
    0 (zero). Feed-forward blocks, residuals and layer norms run unchanged."""
    real = inputs["attention_mask"].float()  # (N, T)
    additive = (1 - real)[:, None, None, :] * torch.finfo(torch.float32).min
    uniform = real[:, None, None, :] / real.sum(1)[:, None, None, None]
    hidden = model.bert.embeddings(input_ids=inputs["input_ids"], token_type_ids=inputs["token_type_ids"])
    states, contexts = [hidden], []
    for layer, block in enumerate(model.bert.encoder.layer):
        attention, (rows, length, width) = block.attention.self, hidden.shape
        query, key, value = (_split_heads(project(hidden)) for project in (attention.query, attention.key,
                                                                            attention.value))
        weights = torch.softmax(query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5 + additive, -1)
        gate = torch.tensor(keep[layer]).view(1, HEADS, 1, 1)
        if mode == "uniform":
            weights = gate * weights + (1 - gate) * uniform
        context = weights @ value * (gate if mode == "zero" else 1)
        contexts.append(context)
        attended = block.attention.output(context.transpose(1, 2).reshape(rows, length, width), hidden)
        hidden = block.output(block.intermediate(attended), attended)
        states.append(hidden)
    return states, contexts


@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_disabling_matches_a_hand_written_forward_and_changes_only_the_disabled_heads_context(mode):
    """One disabled head changes only its own context vector in its layer (the other heads' are untouched); a
    disabled layer changes every head's context and nothing else of that layer (its feed-forward block runs as
    before). The gated model's hidden states equal the hand-written forward's."""
    bundle = make_bundle()
    inputs = tiny_inputs(bundle)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        _, plain_contexts = _manual_bert_forward(bundle.model, inputs, np.ones((3, HEADS), np.float32), mode)
    for keep, changed in ((keep_mask(3, HEADS, [(1, 2)]), [2]), (layer_keep_mask(3, HEADS, 1), list(range(HEADS)))):
        with torch.no_grad():
            states, contexts = _manual_bert_forward(bundle.model, inputs, keep, mode)
            with gated(bundle.model), head_gates(bundle.model, mask_gates(keep), mode):
                hidden = bundle.model(**inputs, output_hidden_states=True).hidden_states
        for mine, theirs in zip(states, hidden):
            assert torch.allclose(mine[real], theirs[real], atol=1e-5)
        moved = [float((contexts[1][:, head] - plain_contexts[1][:, head]).abs().max()) for head in range(HEADS)]
        assert [head for head in range(HEADS) if moved[head] > 1e-3] == changed
        assert all(moved[head] == 0 for head in range(HEADS) if head not in changed)
        assert all(torch.equal(contexts[0][:, head], plain_contexts[0][:, head]) for head in range(HEADS))
