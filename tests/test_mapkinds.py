"""Map kinds (analysis.mapkinds through analysis.stream.stream_maps): Kobayashi's norm maps against their
definition computed head by head, attention rollout against a per-example reference, run folders per kind."""
from __future__ import annotations

import json
import threading

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AlbertConfig, AlbertModel, DistilBertConfig, DistilBertForSequenceClassification

from analysis.artifacts import artifact, kind_folder, split_kind_folder
from analysis.data import Example, load_data
from analysis.errors import AttnpatError
from analysis.mapkinds import (
    attention_parts,
    captured_values,
    renormalise_rows,
    rollout_maps,
    transformed_value_norms,
)
from analysis.mapstore import iter_saved_maps
from analysis.models import load_model, with_map_kind
from analysis.stream import stream_maps, token_roles
from app.cli import main
from app.display import interval_text
from app.explore import LiveExplorer, ModelCache
from app.webapp import WebApp
from tests.test_disable import make_bundle
from tests.tiny import minilm_tokenizer, save_tiny_model, tiny_bundle, tiny_mpnet_bundle

TEXTS = ["a fine movie , truly .", "bad !", "what a long and winding road it was , and yet i loved it"]


def examples(texts=TEXTS):
    return [Example(f"ex-{i}", text) for i, text in enumerate(texts)]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("bert") / "tiny-bert", layers=3, heads=4, initializer_range=0.3)


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory):
    return tiny_mpnet_bundle(tmp_path_factory.mktemp("mpnet") / "tiny-mpnet", layers=3, heads=4, initializer_range=0.3)


def projected_forward(bundle, parts, inputs) -> tuple[tuple, list, list]:
    """One forward pass of ``inputs`` recording, per layer, what the value projection and the output projection of
    ``parts`` (attention_parts) return. Returns (attentions: per layer (1, H, n, n), values: per layer (1, n, H*d),
    outputs: per layer (1, n, D))."""
    values, outputs = [], []
    handles = [value.register_forward_hook(lambda m, a, out: values.append(out)) for value, _ in parts]
    handles += [output.register_forward_hook(lambda m, a, out: outputs.append(out)) for _, output in parts]
    try:
        with torch.no_grad():
            attentions = bundle.model(**inputs, output_attentions=True).attentions
    finally:
        for handle in handles:
            handle.remove()
    return attentions, values, outputs


def kobayashi_reference(bundle, text: str) -> np.ndarray:
    """Norm maps of one unpadded example from the definition: f_h(x_j) = (x_j W_V + b_V)_h W_O^h built as vectors,
    ||alpha_ij f_h(x_j)|| per head, then each row divided by its sum. Returns (L, H, n, n)."""
    parts = attention_parts(bundle.model)
    attentions, values, _ = projected_forward(bundle, parts, bundle.tokenizer(text, return_tensors="pt"))
    heads = bundle.num_heads
    maps = []
    for layer, (_, output) in enumerate(parts):
        alpha = attentions[layer][0].double()  # (H, n, n)
        value = values[layer][0].double()  # (n, H*d)
        size = value.shape[-1] // heads
        layer_maps = []
        for head in range(heads):
            columns = slice(head * size, (head + 1) * size)
            transformed = value[:, columns] @ output.weight.double()[:, columns].T  # (n, D): f(x_j) per token
            weighted = alpha[head][:, :, None] * transformed[None, :, :]  # (n, n, D): alpha_ij f(x_j)
            norms = weighted.norm(dim=-1)
            layer_maps.append(norms / norms.sum(-1, keepdim=True))
        maps.append(torch.stack(layer_maps))
    return torch.stack(maps).numpy()


def test_norm_maps_record_only_their_own_threads_forward_passes(bert):
    """The web app runs several Explore requests on one model at once: a weight request's forward pass in
    another thread, while a norm request holds its hooks, must not add its values to the norm request's (before:
    'captured 12 value projections for 6 layers' for every norm request under load)."""
    alone = next(iter(stream_maps(with_map_kind(bert, "norm"), examples(), batch_size=3))).attentions
    inputs = bert.tokenizer(TEXTS[0], return_tensors="pt")
    with captured_values(bert.model) as values:
        other = threading.Thread(target=lambda: bert.model(**inputs, output_attentions=True))
        other.start()
        other.join()
        assert values == []
        with torch.no_grad():
            bert.model(**inputs, output_attentions=True)
        assert len(values) == bert.num_layers
    failures, results = [], []

    def norm_request():
        try:
            results.append(next(iter(stream_maps(with_map_kind(bert, "norm"), examples(), batch_size=3))).attentions)
        except Exception as exc:  # noqa: BLE001 (collected for the assertion below)
            failures.append(exc)

    def weight_requests():
        for _ in range(20):
            next(iter(stream_maps(bert, examples(), batch_size=3)))

    threads = [threading.Thread(target=norm_request) for _ in range(4)] + [threading.Thread(target=weight_requests)
                                                                          for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and len(results) == 4
    for result in results:
        torch.testing.assert_close(result, alone)


@pytest.mark.parametrize("family", ["bert", "mpnet", "distilbert"])
def test_norm_maps_follow_kobayashis_definition(family, bert, mpnet):
    bundles = {"bert": bert, "mpnet": mpnet}
    bundle = bundles.get(family) or make_bundle(DistilBertConfig, DistilBertForSequenceClassification)
    seen = 0
    for batch in stream_maps(bundle, examples(), batch_size=3, map_kind="norm"):
        for i, item in enumerate(batch.batch.items):
            got = batch.example_maps(i).numpy()
            expected = kobayashi_reference(bundle, TEXTS[item.index])
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, atol=2e-5)
            n = len(item)
            assert float(batch.attentions[i, :, :, n:, :].abs().sum()) == 0  # padding rows zero
            assert float(batch.attentions[i, :, :, :, n:].abs().sum()) == 0  # padding columns zero
            seen += 1
    assert seen == len(TEXTS)



@pytest.mark.parametrize("family", ["bert", "mpnet", "distilbert"])
def test_each_heads_transformed_values_add_up_to_the_output_projections_output(family, bert, mpnet):
    """The per-head slices of W_O against the model's own computation: sum over heads h and keys j of
    alpha_hij f_h(x_j), plus the output bias, is what the output projection returns for query i (recorded by a hook
    on it, MPNet's relative position bias included in alpha). A wrong slice, or a module that is not the value or
    output projection, breaks the sum; the norms of these f_h(x_j) are the ones norm maps weight alpha by."""
    bundle = {"bert": bert, "mpnet": mpnet}.get(family) or make_bundle(DistilBertConfig,
                                                                         DistilBertForSequenceClassification)
    parts = attention_parts(bundle.model)
    inputs = bundle.tokenizer(TEXTS[0], TEXTS[1], return_tensors="pt")
    inputs.pop("token_type_ids", None)
    attentions, values, outputs = projected_forward(bundle, parts, inputs)
    heads = bundle.num_heads
    for layer, (_, output) in enumerate(parts):
        value, weight = values[layer][0].double(), output.weight.double()  # (n, H*d), (D, H*d)
        size = value.shape[-1] // heads
        transformed = torch.stack([value[:, h * size:(h + 1) * size] @ weight[:, h * size:(h + 1) * size].T
                                   for h in range(heads)])  # (H, n, D): f_h(x_j)
        summed = torch.einsum("hij,hjd->id", attentions[layer][0].double(), transformed) + output.bias.double()
        torch.testing.assert_close(summed, outputs[layer][0].double(), atol=1e-5, rtol=1e-5)
        norms = transformed_value_norms(values[layer], output.weight, heads)[0]  # (H, n)
        torch.testing.assert_close(norms.double(), transformed.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_norm_maps_differ_from_weights_and_keep_rows_summing_to_one(bert):
    weights = next(iter(stream_maps(bert, examples(), batch_size=3)))
    norms = next(iter(stream_maps(with_map_kind(bert, "norm"), examples(), batch_size=3)))
    for i in range(len(weights)):
        np.testing.assert_allclose(norms.example_maps(i).sum(-1).numpy(), 1.0, atol=1e-5)
    assert not torch.allclose(weights.attentions, norms.attentions, atol=1e-3)
    # zero weight stays zero weight: a norm map only reweights where attention is
    assert bool(((weights.attentions == 0) <= (norms.attentions == 0)).all())


def rollout_reference(bundle, text: str) -> np.ndarray:
    """Abnar & Zuidema's rollout of one unpadded example with numpy: (L, n, n)."""
    inputs = bundle.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        attentions = [a[0].double().numpy() for a in bundle.model(**inputs, output_attentions=True).attentions]
    n = attentions[0].shape[-1]
    rolled, out = np.eye(n), []
    for layer_maps in attentions:
        mixed = 0.5 * layer_maps.mean(0) + 0.5 * np.eye(n)
        mixed = mixed / mixed.sum(-1, keepdims=True)
        rolled = mixed @ rolled
        out.append(rolled)
    return np.stack(out)


@pytest.mark.parametrize("family", ["bert", "mpnet"])
def test_rollout_is_the_recursive_product_with_the_residual_repeated_over_heads(family, bert, mpnet):
    bundle = {"bert": bert, "mpnet": mpnet}[family]
    for batch in stream_maps(bundle, examples(), batch_size=3, map_kind="rollout"):
        for i, item in enumerate(batch.batch.items):
            got = batch.example_maps(i).numpy()  # (L, H, n, n)
            expected = rollout_reference(bundle, TEXTS[item.index])
            for head in range(bundle.num_heads):
                np.testing.assert_allclose(got[:, head], expected, atol=1e-5)
            np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
            assert float(batch.attentions[i, :, :, len(item):, :].abs().sum()) == 0


def test_rollout_of_uniform_attention_over_one_layer_is_half_identity_half_uniform():
    real = torch.tensor([[True, True, True, False]])
    maps = torch.zeros(1, 1, 2, 4, 4)
    maps[0, 0, :, :3, :3] = 1 / 3
    rolled = rollout_maps(maps, real)
    expected = 0.5 * torch.full((3, 3), 1 / 3) + 0.5 * torch.eye(3)
    assert torch.allclose(rolled[0, 0, 1, :3, :3], expected)
    assert float(rolled[0, 0, :, 3].abs().sum() + rolled[0, 0, :, :, 3].abs().sum()) == 0


def test_renormalise_rows_leaves_zero_rows_alone():
    rows = torch.tensor([[2.0, 2.0], [0.0, 0.0]])
    assert torch.equal(renormalise_rows(rows), torch.tensor([[0.5, 0.5], [0.0, 0.0]]))


def test_the_weight_kind_is_the_plain_stream(bert):
    plain = next(iter(stream_maps(bert, examples(), batch_size=3)))
    weight = next(iter(stream_maps(bert, examples(), batch_size=3, map_kind="weight")))
    assert torch.equal(plain.attentions, weight.attentions)


def test_kinds_get_run_folders_of_their_own_and_hints_name_the_option(bert, tmp_path):
    assert bert.slug == "tiny-bert" and with_map_kind(bert, "norm").slug == "tiny-bert@norm"
    assert with_map_kind(bert, "rollout").model is bert.model
    assert kind_folder("minilm", "weight") == "minilm" and split_kind_folder("minilm@rollout") == ("minilm", "rollout")
    assert split_kind_folder("minilm") == ("minilm", "weight")
    assert (artifact("patterns").command("minilm@norm", "sst2")
            == "attnpat classify --model minilm --task sst2 --map-kind norm")
    assert artifact("patterns").command("minilm", "sst2") == "attnpat classify --model minilm --task sst2"
    assert "--map-kind" not in artifact("disable_heads").command("minilm@norm", "sst2")


def test_bad_kinds_are_one_line_errors(bert, tmp_path):
    with pytest.raises(AttnpatError, match="unknown map kind 'value'"):
        next(iter(stream_maps(bert, examples(), map_kind="value")))
    with pytest.raises(AttnpatError, match="unknown map kind"):
        load_model("minilm", map_kind="weights")
    albert = AlbertModel(AlbertConfig(vocab_size=bert.tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=37, embedding_size=16,
                                      attn_implementation="eager"))
    with pytest.raises(AttnpatError, match="norm maps are not supported for albert"):
        attention_parts(albert)



def save_tiny_albert(folder):
    """A tiny random ALBERT (one attention module shared by its 2 layers) with the MiniLM tokenizer, saved."""
    tokenizer = minilm_tokenizer()
    config = AlbertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=37, embedding_size=16, attn_implementation="eager")
    torch.manual_seed(0)
    AlbertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_norm_maps_of_a_family_without_per_layer_projections_are_refused_before_any_work(tmp_path, monkeypatch,
                                                                                          capsys):
    """ALBERT shares one attention module across its layers, so it has no per-layer value and output projections
    for norm maps. Before: compare-kinds classified the weight maps into runs/<model>/ and then stopped, and the
    other verbs refused only at their first batch, after the model loaded. Now the kind is refused before the
    weights load (or, for a loaded model, before its first map); weight and rollout maps still work."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_albert(tmp_path / "models" / "tiny-albert")
    runs = tmp_path / "runs"
    common = ["--model", "tiny-albert", "--task", "sst2", "--n", "4", "--runs-dir", str(runs), "-q"]
    capsys.readouterr()  # transformers' bar for the shards saved above
    assert main(["compare-kinds", *common]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: norm maps are not supported for albert models") and err.count("\n") == 1
    assert not runs.exists() or not any(runs.rglob("*"))
    albert = load_model("tiny-albert", device="cpu")
    with pytest.raises(AttnpatError, match="norm maps are not supported for albert models"):
        with_map_kind(albert, "norm")  # the web app's Explore toggle
    rollout = next(iter(stream_maps(with_map_kind(albert, "rollout"), examples(), batch_size=3)))
    np.testing.assert_allclose(rollout.example_maps(0).sum(-1).numpy(), 1.0, atol=1e-5)

    def weights_must_not_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the map kind was checked")

    monkeypatch.setattr("analysis.models.AutoModel.from_pretrained", weights_must_not_load)
    with pytest.raises(AttnpatError, match="norm maps are not supported for albert models"):
        load_model("tiny-albert", map_kind="norm")


# ---------------------------------------------------------------- compare-kinds

def test_compare_kinds_writes_each_kinds_run_and_the_side_by_side_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "models" / "tiny", layers=2, heads=4, initializer_range=0.3)
    runs = tmp_path / "runs"
    argv = ["compare-kinds", "--model", "tiny", "--task", "sst2", "--n", "6", "--runs-dir", str(runs), "-q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "to_sep" in out and "norm-weight" in out
    for kind_folder_name in ("tiny", "tiny@norm"):
        assert (runs / kind_folder_name / "sst2" / "patterns.csv").is_file()
        assert (runs / kind_folder_name / "sst2" / "pattern_ratios.csv").is_file()
    manifest = json.loads((runs / "tiny@norm" / "sst2" / "manifest.json").read_text())
    assert manifest["model"]["map_kind"] == "norm" and manifest["model"]["name"] == "tiny"
    table = pd.read_csv(runs / "tiny" / "sst2" / "map_kinds.csv", dtype={"layer": str})
    assert list(table.columns) == ["task", "group", "measure", "layer", *(f"{column}{part}" for column in
                                   ("weight", "norm", "norm_minus_weight") for part in ("", "_ci_low", "_ci_high"))]
    for stem in ("map_kinds.png", "map_kinds.svg"):
        assert (runs / "tiny" / "sst2" / stem).is_file()
    # the pattern ratios are the ones each kind's classification wrote
    for kind, folder in (("weight", "tiny"), ("norm", "tiny@norm")):
        ratios = pd.read_csv(runs / folder / "sst2" / "pattern_ratios.csv").set_index("class")["fraction"]
        rows = table[table["group"] == "pattern_ratio"].set_index("measure")[kind]
        np.testing.assert_allclose(rows.reindex(ratios.index), ratios)
    # the attention measures equal an independent pass over each kind's maps
    bundle = load_model(str(tmp_path / "models" / "tiny"), device="cpu")
    data = load_data("sst2", "validation", 6)
    for kind in ("weight", "norm"):
        mass = {"to_cls": [], "to_sep": [], "to_punct": []}
        for batch in stream_maps(bundle, data.examples, map_kind=kind):
            roles = token_roles(bundle.tokenizer, batch.batch.input_ids, batch.batch.attention_mask)
            for i in range(len(batch)):
                n = int(batch.batch.lengths[i])
                maps = batch.example_maps(i)  # (L, H, n, n)
                for measure, role in (("to_cls", "cls"), ("to_sep", "sep"), ("to_punct", "punct")):
                    mass[measure].append(maps[..., roles[role][i, :n]].sum(-1).mean(-1))  # (L, H)
        for measure, values in mass.items():
            expected = torch.stack(values).mean(0)  # (L, H)
            rows = table[(table["measure"] == measure)].set_index("layer")[kind]
            assert rows["all"] == pytest.approx(float(expected.mean()), abs=1e-5)
            for layer in range(2):
                assert rows[str(layer)] == pytest.approx(float(expected[layer].mean()), abs=1e-5)
    np.testing.assert_allclose(table["norm_minus_weight"], table["norm"] - table["weight"])
    # a rerun reuses both classifications (their manifest entries are unchanged)
    before = json.loads((runs / "tiny@norm" / "sst2" / "manifest.json").read_text())["analyses"]["classify"]
    assert main(argv) == 0
    after = json.loads((runs / "tiny@norm" / "sst2" / "manifest.json").read_text())["analyses"]["classify"]
    assert before == after


def test_compare_kinds_records_how_many_inputs_it_cut_to_max_length(tmp_path, monkeypatch):
    """Every other verb's manifest counts the inputs cut to --max-length (the option's help says they are counted);
    compare-kinds' map_kinds entry had no count, so its attention means over cut inputs were not told apart."""
    from analysis.stream import encode_examples  # noqa: PLC0415

    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "models" / "tiny", layers=1, heads=2)
    runs = tmp_path / "runs"
    assert main(["compare-kinds", "--model", "tiny", "--task", "sst2", "--n", "4", "--max-length", "12",
                 "--runs-dir", str(runs), "-q"]) == 0
    entry = json.loads((runs / "tiny" / "sst2" / "manifest.json").read_text())["analyses"]["map_kinds"]
    examples = load_data("sst2", "validation", 4).examples
    cut = sum(item.truncated for item in encode_examples(minilm_tokenizer(), examples, 12))
    assert 0 < cut < 4 and entry["n_truncated"] == cut


def per_example_special_attention(bundle, data, kind: str) -> dict[str, np.ndarray]:
    """{measure: (E, L) float64} each example's mean attention of each layer's heads to [CLS], [SEP] or punctuation,
    averaged over its real query rows, in data order: computed map by map, apart from classifier.map_kinds."""
    found = {measure: {} for measure in ("to_cls", "to_sep", "to_punct")}
    for batch in stream_maps(bundle, data.examples, map_kind=kind, batch_size=5):
        roles = token_roles(bundle.tokenizer, batch.batch.input_ids, batch.batch.attention_mask)
        for i, item in enumerate(batch.batch.items):
            n = int(batch.batch.lengths[i])
            maps = batch.example_maps(i).double()  # (L, H, n, n)
            for measure, role in (("to_cls", "cls"), ("to_sep", "sep"), ("to_punct", "punct")):
                found[measure][item.index] = maps[..., roles[role][i, :n]].sum(-1).mean(-1).mean(-1).numpy()
    return {measure: np.stack([rows[e] for e in range(len(rows))]) for measure, rows in found.items()}


def numpy_bootstrap_interval(values: np.ndarray, seed: int = 0, draws: int = 1000) -> np.ndarray:
    """The plain percentile bootstrap 95% interval of the mean of values (E, ...): (..., 2)."""
    picks = np.random.default_rng(seed).integers(0, len(values), (draws, len(values)))
    return np.moveaxis(np.percentile(values[picks].mean(1), [2.5, 97.5], axis=0), 0, -1)


def test_compare_kinds_gives_every_figure_an_interval_and_the_change_a_paired_one(tmp_path, monkeypatch, capsys):
    """map_kinds.csv holds each kind's 95% interval (the pattern ratios' from each kind's pattern_ratios.csv) and the
    paired bootstrap interval of norm minus weight: the same example draws for both kinds, equal to a direct numpy
    bootstrap of the per-example differences with seed 0. Before, the table and the printout held bare means."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "models" / "tiny", layers=2, heads=4, initializer_range=0.3)
    runs = tmp_path / "runs"
    assert main(["compare-kinds", "--model", "tiny", "--task", "sst2", "--n", "12", "--batch-size", "4",
                 "--runs-dir", str(runs), "-q"]) == 0
    out = capsys.readouterr().out
    table = pd.read_csv(runs / "tiny" / "sst2" / "map_kinds.csv", dtype={"layer": str})
    for column in ("weight", "norm", "norm_minus_weight"):
        assert table[[column, f"{column}_ci_low", f"{column}_ci_high"]].notna().all().all()
        assert (table[f"{column}_ci_low"] <= table[column] + 1e-12).all()
        assert (table[column] <= table[f"{column}_ci_high"] + 1e-12).all()
    assert (table["norm_minus_weight_ci_high"] > table["norm_minus_weight_ci_low"]).any()  # not all degenerate
    ratios = table[table["group"] == "pattern_ratio"].set_index("measure")
    patterns = {}
    for kind, folder in (("weight", "tiny"), ("norm", "tiny@norm")):
        written = pd.read_csv(runs / folder / "sst2" / "pattern_ratios.csv").set_index("class")
        np.testing.assert_allclose(ratios.loc[written.index, [f"{kind}_ci_low", f"{kind}_ci_high"]],
                                   written[["ci_low", "ci_high"]])
        patterns[kind] = pd.read_csv(runs / folder / "sst2" / "example_patterns.csv")
        assert list(patterns[kind]["index"]) == list(range(12))
        per_head = pd.read_csv(runs / folder / "sst2" / "patterns.csv").groupby("class")["count"].sum()
        np.testing.assert_array_equal(patterns[kind][list(per_head.index)].sum(0), per_head)  # every map, once
    # the ratios' change: each example's change of its share of maps, resampled by a plain numpy bootstrap
    classes = list(ratios.index)
    shares = {kind: frame[classes].to_numpy(float) / 8 for kind, frame in patterns.items()}  # 2 x 4 maps each
    np.testing.assert_allclose(ratios[["norm_minus_weight_ci_low", "norm_minus_weight_ci_high"]],
                               numpy_bootstrap_interval(shares["norm"] - shares["weight"]), atol=1e-12)
    # the attention's change, over every head and per layer, from per-example values computed map by map
    bundle = load_model(str(tmp_path / "models" / "tiny"), device="cpu")
    data = load_data("sst2", "validation", 12)
    weight, norm = (per_example_special_attention(bundle, data, kind) for kind in ("weight", "norm"))
    for measure in weight:
        rows = table[table["measure"] == measure].set_index("layer")
        difference = norm[measure] - weight[measure]  # (E, L)
        expected = {"all": numpy_bootstrap_interval(difference.mean(1)),
                    **{str(layer): numpy_bootstrap_interval(difference[:, layer]) for layer in range(2)}}
        for layer, bounds in expected.items():
            np.testing.assert_allclose(rows.loc[layer, ["norm_minus_weight_ci_low", "norm_minus_weight_ci_high"]],
                                       bounds, atol=1e-6)
            assert rows.loc[layer, "norm_minus_weight"] == pytest.approx(
                difference.mean() if layer == "all" else difference[:, int(layer)].mean(), abs=1e-6)
        np.testing.assert_allclose(rows.loc["all", ["weight_ci_low", "weight_ci_high"]],
                                   numpy_bootstrap_interval(weight[measure].mean(1)), atol=1e-6)
    # the printout: each kind's value and the change with their intervals, as app.display.interval_text writes them
    cls = table[(table["measure"] == "to_cls") & (table["layer"] == "all")].iloc[0]
    line = next(line for line in out.splitlines() if line.startswith("to_cls"))
    assert interval_text(cls["weight"], cls["weight_ci_low"], cls["weight_ci_high"]) in line
    assert interval_text(cls["norm_minus_weight"], cls["norm_minus_weight_ci_low"],
                         cls["norm_minus_weight_ci_high"], spec="+.3f") in line


def test_compare_kinds_classifies_again_a_kind_classified_before_example_patterns_were_kept(tmp_path, monkeypatch):
    """A kind's run folder that an earlier version classified (no example_patterns.csv, so no per-example counts to
    pair) is not taken as current: compare-kinds classifies it again and writes the paired change, rather than
    failing on the missing table or leaving the change without its interval."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "models" / "tiny", layers=2, heads=4, initializer_range=0.3)
    runs = tmp_path / "runs"
    argv = ["compare-kinds", "--model", "tiny", "--task", "sst2", "--n", "5", "--runs-dir", str(runs), "-q"]
    assert main(argv) == 0
    folder = runs / "tiny@norm" / "sst2"
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["analyses"]["classify"]["table_digests"]["example_patterns.csv"]  # as the earlier version recorded
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "example_patterns.csv").unlink()
    assert main(argv) == 0
    assert (folder / "example_patterns.csv").is_file()
    after = json.loads((folder / "manifest.json").read_text())["analyses"]["classify"]
    assert "example_patterns.csv" in after["table_digests"]  # only a classification writes both
    table = pd.read_csv(runs / "tiny" / "sst2" / "map_kinds.csv")
    assert table["norm_minus_weight_ci_low"].notna().all()


def test_compare_kinds_refuses_a_kind_the_model_cannot_give_before_loading_anything(tmp_path, monkeypatch, capsys):
    """`compare-kinds --kinds weight,norm` on ALBERT: the refusal comes from the model's config alone (before, the
    data, the model's weights and the classifier's checkpoint were all loaded first, then the kind was refused)."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_albert(tmp_path / "models" / "tiny-albert")
    loaded = []

    def must_not_load(what):
        def load(*args, **kwargs):
            loaded.append(what)
            raise AssertionError(f"{what} loaded before the map kind was checked")
        return load

    monkeypatch.setattr("analysis.models.AutoModel.from_pretrained", must_not_load("the model's weights"))
    monkeypatch.setattr("classifier.predict.load_checkpoint", must_not_load("the classifier checkpoint"))
    monkeypatch.setattr("app.cli_kinds.load_data", must_not_load("the data"))
    capsys.readouterr()  # transformers' bar for the shards saved above
    assert main(["compare-kinds", "--model", "tiny-albert", "--task", "sst2", "--n", "4", "--kinds", "weight,norm",
                 "--runs-dir", str(tmp_path / "runs"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: norm maps are not supported for albert models") and err.count("\n") == 1
    assert loaded == [] and not (tmp_path / "runs").exists()


def test_compare_kinds_needs_two_kinds(capsys):
    assert main(["compare-kinds", "--kinds", "norm"]) == 2
    assert "at least two map kinds" in capsys.readouterr().err
    assert main(["compare-kinds", "--kinds", "weight,value"]) == 2
    assert "unknown map kind 'value'" in capsys.readouterr().err


def test_map_kind_option_writes_each_kinds_own_run_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "models" / "tiny", layers=2, heads=4, initializer_range=0.3)
    runs = tmp_path / "runs"
    common = ["--model", "tiny", "--n", "4", "--runs-dir", str(runs), "-q"]
    assert main(["classify", "--task", "sst2", *common]) == 0
    weight_patterns = (runs / "tiny" / "sst2" / "patterns.csv").read_bytes()
    assert main(["classify", "--task", "sst2", "--map-kind", "norm", *common]) == 0
    assert "each row renormalised to sum 1" in capsys.readouterr().out
    norm_run = runs / "tiny@norm" / "sst2"
    for name in ("patterns.csv", "pattern_ratios.csv", "patterns.png", "pattern_ratios.svg", "manifest.json"):
        assert (norm_run / name).is_file(), name
    assert (runs / "tiny" / "sst2" / "patterns.csv").read_bytes() == weight_patterns  # weight run untouched
    assert json.loads((norm_run / "manifest.json").read_text())["model"]["map_kind"] == "norm"
    assert main(["extract", "--task", "sst2", "--map-kind", "norm", *common]) == 0
    maps = next(iter_saved_maps(runs / "tiny@norm" / "sst2" / "maps"))
    assert maps.map_ids[0].startswith("tiny@norm:sst2:")
    np.testing.assert_allclose(maps.attn.sum(-1), 1.0, atol=5e-3)  # float16 storage of renormalised rows
    assert main(["special", "--task", "sst2", "--map-kind", "rollout", "--no-base", *common]) == 0
    assert main(["surface", "--task", "wiki", "--map-kind", "rollout", *common]) == 0
    surface = pd.read_csv(runs / "tiny@rollout" / "wiki" / "surface.csv")
    per_layer = surface[surface.metric == "cls"].groupby("layer")["value"]
    assert (per_layer.max() - per_layer.min()).max() < 1e-9  # rollout: every head of a layer carries the same map
    assert (runs / "tiny@rollout" / "sst2" / "special_tokens.csv").is_file()
    capsys.readouterr()
    assert main(["classify", "--task", "sst2", "--map-kind", "values", *common]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown map kind 'values'; use one of: weight, norm, rollout"


# ---------------------------------------------------------------- the app's Explore toggle

def test_explore_shows_the_chosen_map_kind(bert):
    explorer = LiveExplorer(ModelCache(loader=lambda name: bert), classifier_loader=lambda: None)
    sentence = TEXTS[0]
    for kind in ("weight", "norm", "rollout"):
        view = explorer.explore("tiny", sentence, map_kind=kind)
        expected = next(iter(stream_maps(bert, examples([sentence]), batch_size=1, map_kind=kind))).example_maps(0)
        assert torch.equal(view.maps, expected), kind
        attn, _ = explorer.head_map("tiny", sentence, None, 1, 2, map_kind=kind)
        np.testing.assert_array_equal(attn, expected[1, 2].numpy())
    assert "renormalised" in explorer.explore("tiny", sentence, map_kind="norm").note
    web = WebApp(explorer=explorer)
    status = web.explore(sentence, "", "tiny", False, False, "norm")[0]
    assert "Kobayashi" in status and "error" not in status
    assert "rollout map" in web.head_map(sentence, "", "tiny", False, False, 1, 1, "rollout")[0]
    assert web.explore(sentence, "", "tiny", False, False)[0] == web.explore(sentence, "", "tiny", False, False,
                                                                              "weight")[0]


def test_a_model_named_like_a_kinds_run_folder_gets_its_own_runs(tmp_path, monkeypatch, capsys):
    """A store model named 'tiny@norm' wrote its weight runs into runs/tiny@norm/, the folder of model tiny's norm
    maps (the same file names, the same map ids 'tiny@norm:sst2:...'; the run browser offered its tables as tiny's
    norm maps). Its '@' is now spelt '_at_' in run folders."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "models" / "tiny", layers=2, heads=4, initializer_range=0.3)
    save_tiny_model(tmp_path / "models" / "tiny@norm", layers=2, heads=4, initializer_range=0.3, seed=1)
    runs = tmp_path / "runs"
    common = ["--task", "sst2", "--n", "3", "--runs-dir", str(runs), "-q"]
    assert main(["special", "--model", "tiny", "--map-kind", "norm", "--no-base", *common]) == 0
    norm_run = (runs / "tiny@norm" / "sst2" / "special_tokens.csv").read_bytes()
    assert main(["special", "--model", "tiny@norm", "--no-base", *common]) == 0
    assert (runs / "tiny@norm" / "sst2" / "special_tokens.csv").read_bytes() == norm_run
    manifest = json.loads((runs / "tiny_at_norm" / "sst2" / "manifest.json").read_text())
    assert manifest["model"]["name"] == "tiny@norm" and manifest["model"]["map_kind"] == "weight"
    assert json.loads((runs / "tiny@norm" / "sst2" / "manifest.json").read_text())["model"]["name"] == "tiny"
    assert load_model("tiny@norm").slug == "tiny_at_norm" and load_model("tiny").slug == "tiny"
