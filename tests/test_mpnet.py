"""MPNet (all-mpnet-base-v2's architecture) on a tiny random config: head gates, the sweep engine, importance.

MPNet computes attention in its own code (relative position bias), so analysis.disable gates it by replacing
its self-attention's forward; these tests check that path against independent references.
"""
from __future__ import annotations

import pytest
import torch

from analysis.disable import gated, head_gates, keep_mask
from analysis.importance import example_losses, head_importance
from analysis.stream import encode_examples, iter_batches
from analysis.sweeps import BASELINE, fast_sweep, head_variants, layer_variants, naive_sweep
from app.cli import main
from tests.test_sweeps import max_difference, smallest_change, tiny_data
from tests.tiny import save_tiny_mpnet, tiny_mpnet_bundle

LAYERS, HEADS, SIZE = 3, 4, 8


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory):
    """A tiny random MPNet classifier; large initial weights make attention peaky, so a disabled head shows."""
    return tiny_mpnet_bundle(tmp_path_factory.mktemp("mpnet") / "tiny-mpnet", kind="classifier", layers=LAYERS,
                             heads=HEADS, initializer_range=0.3)


def padded_batch(bundle):
    """One batch of three examples of different lengths (padding present)."""
    return next(iter(iter_batches(bundle, tiny_data(3).examples, batch_size=3)))


def attention_modules(bundle):
    return [layer.attention.attn for layer in bundle.model.mpnet.encoder.layer]


def test_the_tiny_mpnet_is_an_mpnet_with_padding(mpnet):
    assert mpnet.model.config.model_type == "mpnet" and type(mpnet.model).__name__ == "MPNetForSequenceClassification"
    batch = padded_batch(mpnet)
    assert batch.token_type_ids is None and len(set(batch.lengths.tolist())) > 1


@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_gating_nothing_is_bit_identical_to_the_plain_model(mpnet, mode):
    inputs = padded_batch(mpnet).model_inputs()
    with torch.no_grad():
        plain = mpnet.model(**inputs, output_attentions=True)
        with gated(mpnet.model):
            assert all("forward" in vars(module) for module in attention_modules(mpnet))
            no_gates = mpnet.model(**inputs, output_attentions=True)
            with head_gates(mpnet.model, {layer: torch.ones(HEADS) for layer in range(LAYERS)}, mode):
                all_ones = mpnet.model(**inputs, output_attentions=True)
            with head_gates(mpnet.model, {1: torch.tensor([1.0, 0.0, 1.0, 1.0])}, mode):
                disabled = mpnet.model(**inputs).logits
        after = mpnet.model(**inputs).logits
    assert torch.equal(plain.logits, no_gates.logits) and torch.equal(plain.logits, all_ones.logits)
    assert all(torch.equal(a, b) for a, b in zip(plain.attentions, all_ones.attentions))
    assert torch.equal(plain.logits, after)
    assert not torch.allclose(plain.logits, disabled, atol=1e-4)
    assert not any("forward" in vars(module) for module in attention_modules(mpnet))  # unpatched after the block


def test_zero_mode_equals_removing_the_head_from_the_output_projection(mpnet):
    """Independent reference: a head whose context is zeroed contributes nothing through o, the same as
    zeroing that head's columns of o's weight."""
    inputs = padded_batch(mpnet).model_inputs()
    layer, head = 1, 2
    gate = torch.tensor(keep_mask(LAYERS, HEADS, [(layer, head)])[layer])
    with torch.no_grad():
        with gated(mpnet.model), head_gates(mpnet.model, {layer: gate}, "zero"):
            gated_logits = mpnet.model(**inputs).logits
        output = attention_modules(mpnet)[layer].o
        saved = output.weight.clone()
        try:
            output.weight[:, head * SIZE:(head + 1) * SIZE] = 0
            surgery = mpnet.model(**inputs).logits
        finally:
            output.weight.copy_(saved)
    assert torch.allclose(gated_logits, surgery, atol=1e-5)


def test_uniform_head_attends_evenly_to_real_tokens_and_outputs_the_mean_of_v(mpnet):
    batch = padded_batch(mpnet)
    layer, head = 0, 3
    seen = {}
    module = attention_modules(mpnet)[layer]
    handles = [module.v.register_forward_hook(lambda m, a, out: seen.__setitem__("value", out)),
               module.o.register_forward_hook(lambda m, a, out: seen.__setitem__("context", a[0]))]
    try:
        with torch.no_grad(), gated(mpnet.model), head_gates(
                mpnet.model, {layer: torch.tensor(keep_mask(LAYERS, HEADS, [(layer, head)])[layer])}, "uniform"):
            outputs = mpnet.model(**batch.model_inputs(), output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    weights = outputs.attentions[layer]
    for row, n in enumerate(batch.lengths.tolist()):
        assert torch.allclose(weights[row, head, :n, :n], torch.full((n, n), 1.0 / n), atol=1e-6)
        assert float(weights[row, head, :n, n:].abs().sum()) == 0
        mean_v = seen["value"][row, :n, head * SIZE:(head + 1) * SIZE].mean(0)
        context = seen["context"][row, :n, head * SIZE:(head + 1) * SIZE]
        assert torch.allclose(context, mean_v.expand_as(context), atol=1e-5)
        assert not torch.allclose(weights[row, (head + 1) % HEADS, :n, :n], torch.full((n, n), 1.0 / n), atol=1e-3)


@pytest.mark.parametrize("mode", ["uniform", "zero"])
def test_fast_sweep_equals_the_naive_gated_loop(mpnet, mode):
    data = tiny_data()
    variants = head_variants(LAYERS, HEADS) + layer_variants(LAYERS, HEADS)
    batches = list(iter_batches(mpnet, data.examples, batch_size=4))
    assert len({batch.input_ids.shape[1] for batch in batches}) > 1  # really dynamic padding
    fast = fast_sweep(mpnet, batches, variants, mode)
    naive = naive_sweep(mpnet, encode_examples(mpnet.tokenizer, data.examples), variants, mode, batch_size=4)
    assert max_difference(fast, naive) < 1e-5
    assert smallest_change(naive) > 1e-4  # every variant really changes the logits
    plain = torch.empty_like(fast[BASELINE])
    with torch.no_grad():
        for batch in batches:
            plain[batch.indices] = mpnet.model(**batch.model_inputs()).logits
    assert torch.equal(fast[BASELINE], plain)
    assert len(mpnet.model.mpnet.encoder.layer) == LAYERS  # the layer list is restored


def test_importance_gradient_matches_finite_differences(mpnet):
    examples = tiny_data(3).examples
    importance = head_importance(mpnet, list(iter_batches(mpnet, examples, batch_size=3)))

    def loss(batch, layer: int, head: int, value: float) -> float:
        gate = torch.ones(HEADS)
        gate[head] = value
        with torch.no_grad(), gated(mpnet.model), head_gates(mpnet.model, {layer: gate}, "zero"):
            logits = mpnet.model(**batch.model_inputs()).logits
        return float(example_losses(logits, batch.labels).sum())

    step = 1e-3
    for layer, head in [(0, 1), (2, 3)]:
        # importance is the mean over examples of |dL(x)/d gate|: each example alone, central differences
        per_example = [abs(loss(single, layer, head, 1 + step) - loss(single, layer, head, 1 - step)) / (2 * step)
                       for single in iter_batches(mpnet, examples, batch_size=1)]
        assert importance[layer, head] == pytest.approx(sum(per_example) / len(per_example), rel=2e-2, abs=1e-4)
    assert (importance > 0).all()


# ---------------------------------------------------------------- every verb on a tiny MPNet

def test_every_analysis_runs_on_a_tiny_mpnet(tmp_path, monkeypatch, capsys):
    """The demo's verbs end to end on an MPNet model folder in the store (as `attnpat models fetch` leaves it)."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_mpnet(tmp_path / "models" / "tiny-mpnet", kind="mlm", layers=2, heads=HEADS, initializer_range=0.3)
    runs = tmp_path / "runs"
    common = ["--runs-dir", str(runs), "-q"]
    commands = [
        ["extract", "--model", "tiny-mpnet", "--task", "sst2", "--n", "6"],
        ["overview", "--model", "tiny-mpnet", "--task", "sst2", "--n", "6"],
        ["classify", "--model", "tiny-mpnet", "--task", "sst2", "--n", "4"],
        ["special", "--model", "tiny-mpnet", "--task", "sst2", "--n", "6", "--no-base"],
        ["surface", "--model", "tiny-mpnet", "--task", "wiki", "--n", "6"],
        ["cluster", "--model", "tiny-mpnet", "--task", "wiki", "--n", "4"],
        ["grad-importance", "--model", "tiny-mpnet", "--task", "wiki", "--n", "4"],
        ["probe-dep", "--parse", "wiki", "--model", "tiny-mpnet", "--n", "6"],
        ["probe-coref", "--model", "tiny-mpnet", "--n", "8"],
        ["finetune", "--model", "tiny-mpnet", "--task", "sst2", "--n", "16", "--epochs", "1", "--batch-size", "8",
         "--name", "tiny-mpnet-sst2", "--device", "cpu"],
        ["compare", "--base", "tiny-mpnet", "--finetuned", "tiny-mpnet-sst2", "--task", "sst2", "--n", "6"],
        ["disable", "--model", "tiny-mpnet-sst2", "--task", "sst2", "--n", "8", "--unit", "both"],
        ["importance", "--model", "tiny-mpnet-sst2", "--task", "sst2", "--n", "8"],
        ["prune", "--model", "tiny-mpnet-sst2", "--task", "sst2", "--n", "8"],
    ]
    for argv in commands:
        code = main(argv + common)
        assert code == 0, (argv, capsys.readouterr().err)
    written = {path.relative_to(runs).as_posix() for path in runs.rglob("*.csv")}
    for expected in ("sst2/overview.csv", "sst2/patterns.csv", "sst2/special_tokens.csv", "wiki/surface.csv",
                     "wiki/clusters.csv", "wiki/grad_importance.csv", "wiki/probing_dependency.csv",
                     "winobias/probing_coref.csv"):
        assert f"tiny-mpnet/{expected}" in written, expected
    for expected in ("cosine", "disable_heads", "disable_layers", "importance", "pruning"):
        assert f"tiny-mpnet-sst2/sst2/{expected}.csv" in written, expected


# ---------------------------------------------------------------- MPNet's own special tokens

def test_special_token_measures_find_mpnets_own_special_tokens(mpnet):
    """all-mpnet-base-v2 writes <s> a </s></s> b </s> (no [CLS] or [SEP] anywhere in its inputs). Attention to
    [CLS] and [SEP] in special and surface must be attention to <s> and to every </s>, as computed here from each
    unpadded input's own token strings."""
    from analysis.data import Example, TaskData  # noqa: PLC0415
    from analysis.special import special_statistics  # noqa: PLC0415
    from analysis.surface import compute_surface  # noqa: PLC0415

    examples = [Example("a", "a fine movie , truly ."), Example("b", "bad !", "what a long and winding road it was"),
                Example("c", "it was n't good .", "no .")]
    tokenizer = mpnet.tokenizer
    assert (tokenizer.cls_token, tokenizer.sep_token, tokenizer.pad_token_id) == ("<s>", "</s>", 1)
    expected = {"cls": [], "sep": []}
    for example in examples:
        inputs = tokenizer(example.text, example.text_pair, return_tensors="pt")
        tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
        assert "[CLS]" not in tokens and "[SEP]" not in tokens
        assert tokens[0] == "<s>" and tokens.count("</s>") == (1 if example.text_pair is None else 3)
        with torch.no_grad():
            maps = torch.stack(mpnet.model(**inputs, output_attentions=True).attentions, dim=1)[0]  # (L, H, n, n)
        for role, string in (("cls", "<s>"), ("sep", "</s>")):
            keys = torch.tensor([token == string for token in tokens])
            expected[role].append(maps[..., keys].sum(-1).mean(-1))  # (L, H): mean over the rows of the mass on them
    special = special_statistics(mpnet, examples, batch_size=3)["heads"]
    surface = compute_surface(mpnet, TaskData("mpnet-check", "validation", "test", examples), batch_size=3,
                              progress=False)[0]
    for role, values in expected.items():
        mean = torch.stack(values).mean(0).numpy()
        assert mean.min() > 0
        assert special[f"to_{role}"] == pytest.approx(mean, abs=1e-6)
        assert surface[role] == pytest.approx(mean, abs=1e-6)
