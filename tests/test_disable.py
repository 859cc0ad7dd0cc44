"""Per-head gates (analysis.disable): uniform and zero disabling, exactness when nothing is disabled."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers import AlbertConfig, AlbertModel, AutoTokenizer, BertConfig, BertForSequenceClassification

from analysis import disable
from analysis.disable import (
    first_changed_layer,
    gated,
    gated_attention_forward,
    head_gates,
    keep_mask,
    layer_keep_mask,
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
