"""Per-head cosine similarity of two models' attention maps (Kovaleva et al. Figure 5)."""
import numpy as np
import pytest
import torch
from transformers import BertModel, BertTokenizerFast

from analysis import compare as cmp
from analysis.data import Example, load_data
from analysis.errors import AttnpatError
from analysis.models import load_model
from analysis.rundir import RunDir, table_to_array
from analysis.uncertainty import bootstrap_mean_interval
from app.cli import main
from tests.tiny import save_tiny_model, tiny_config, wrap_bundle


def tiny(seed, init=0.02):
    """A tiny random BERT; a large ``init`` gives peaked attention maps that differ between seeds."""
    torch.manual_seed(seed)
    return wrap_bundle(BertModel(tiny_config(initializer_range=init)), f"tiny{seed}")


EXAMPLES = [Example("a", "a film"), Example("b", "a much longer film about nothing in particular", "and a pair"),
            Example("c", "short , sharp and shocking .")]


def test_flat_cosine_and_cropping_match_numpy():
    torch.manual_seed(0)
    a, b = torch.rand(2, 3, 2, 5, 5), torch.rand(2, 3, 2, 5, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    values = cmp.cosine_by_mode(a, b, mask)
    for i, n in enumerate([5, 3]):
        for layer in range(3):
            for head in range(2):
                x, y = a[i, layer, head, :n, :n].numpy().ravel(), b[i, layer, head, :n, :n].numpy().ravel()
                expected = x @ y / np.linalg.norm(x) / np.linalg.norm(y)
                assert float(values["cropped"][i, layer, head]) == pytest.approx(expected, rel=1e-6)
                x, y = a[i, layer, head].numpy().ravel(), b[i, layer, head].numpy().ravel()
                assert float(values["padded"][i, layer, head]) == pytest.approx(
                    x @ y / np.linalg.norm(x) / np.linalg.norm(y), rel=1e-6)
    with pytest.raises(AttnpatError, match="unknown cosine mode"):
        cmp.cosine_by_mode(a, b, mask, modes=("diagonal",))


def test_a_model_compared_with_itself_is_one_for_every_head(tokenizer):
    model = tiny(0, init=0.5)
    values = cmp.head_cosines(model, model, EXAMPLES, max_length=16, batch_size=2)
    assert set(values) == {"cosine_cropped", "cosine_padded"}
    for array in values.values():
        assert array.shape == (2, 4) and np.allclose(array, 1.0, atol=1e-6)


def test_different_models_are_less_similar_and_padding_rows_count(tokenizer):
    values = cmp.head_cosines(tiny(0, init=0.5), tiny(1, init=0.5), EXAMPLES, max_length=64,
                              batch_size=3)
    cropped, padded = values["cosine_cropped"], values["cosine_padded"]
    assert (cropped < 0.9999).all() and (cropped > 0).all()
    assert (padded < 0.9999).all() and (padded > 0).all()
    # the padded mode also scores the padding query rows, which the cropped mode leaves out
    assert not np.allclose(padded, cropped, atol=1e-3)


def test_cropped_mode_does_not_depend_on_padding(tokenizer):
    a, b = tiny(0, init=0.5), tiny(1, init=0.5)
    only_cropped = cmp.head_cosines(a, b, EXAMPLES, modes=("cropped",), max_length=32)
    with_padding = cmp.head_cosines(a, b, EXAMPLES, modes=("cropped", "padded"), max_length=32)
    assert np.allclose(only_cropped["cosine_cropped"], with_padding["cosine_cropped"], atol=1e-5)


def test_different_tokenizers_are_refused(tokenizer, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "film"]) + "\n")
    other = tiny(0)
    other.tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    with pytest.raises(AttnpatError, match="different tokenizers"):
        cmp.head_cosines(tiny(0), other, EXAMPLES)


@pytest.mark.slow  # seconds alone; over 20 s on a busy 2-core machine
def test_minilm_with_itself_writes_the_cosine_table(tmp_path):
    bundle = load_model("minilm", device="cpu")
    data = load_data("sst2", n=12, allow_hub=False)
    run = RunDir("minilm-self", "sst2", tmp_path)
    cmp.write_cosine(bundle, bundle, data, run, max_length=64, batch_size=6)
    table = run.read_table("cosine")
    names = {f"cosine_{mode}{part}" for mode in ("cropped", "padded") for part in ("", "_ci_low", "_ci_high")}
    assert set(table.metric) == names and len(table) == 6 * 6 * 12
    for name in names:  # identical maps: every example's cosine is 1, so is every bound
        assert np.allclose(table_to_array(table, name), 1.0, atol=1e-5)
    assert (run.path / "cosine.png").is_file() and (run.path / "cosine.svg").is_file()
    entry = run.manifest()["analyses"]["compare"]
    assert entry["base_model"] == "minilm" and entry["data"]["n_examples"] == 12
    # inputs cut to --max-length are counted, as every other verb's manifest counts them
    cmp.write_cosine(bundle, bundle, data, run, max_length=16, batch_size=6, modes=("cropped",))
    longer = sum(len(bundle.tokenizer(example.text)["input_ids"]) > 16 for example in data.examples)
    assert run.manifest()["analyses"]["compare"]["n_truncated"] == longer > 0


def test_cosine_intervals_bootstrap_the_per_example_cosines(tokenizer, tmp_path):
    a, b = tiny(0, init=0.5), tiny(1, init=0.5)
    means, per_example = cmp.head_cosines(a, b, EXAMPLES, max_length=32, batch_size=2, per_example=True)
    assert per_example["cosine_cropped"].shape == (len(EXAMPLES), 2, 4)
    for name in means:
        assert np.allclose(per_example[name].mean(0), means[name])
    intervals = cmp.interval_rows(cmp.cosine_means(a, b, EXAMPLES, max_length=32, batch_size=2).intervals())
    low, high = intervals["cosine_cropped_ci_low"], intervals["cosine_cropped_ci_high"]
    assert low.shape == (2, 4) and np.all(low <= means["cosine_cropped"] + 1e-12)
    assert np.all(means["cosine_cropped"] <= high + 1e-12) and np.any(high - low > 1e-3)
    reference = bootstrap_mean_interval(per_example["cosine_padded"][:, 1, 2])  # one head on its own
    assert [intervals["cosine_padded_ci_low"][1, 2], intervals["cosine_padded_ci_high"][1, 2]] == pytest.approx(
        reference)


def test_compare_prints_each_layers_mean_cosine_with_its_interval(tokenizer, tmp_path, capsys):
    """The per-layer means the verb prints carry a bootstrap 95% interval over the examples, recorded in the manifest
    too (before, bare means)."""
    base, tuned = (save_tiny_model(tmp_path / name, seed=seed, initializer_range=0.5) for name, seed in
                   (("base", 0), ("tuned", 1)))
    assert main(["compare", "--base", str(base), "--finetuned", str(tuned), "--task", "sst2", "--n", "6",
                 "--max-length", "32", "--no-patterns", "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    entry = RunDir("tuned", "sst2", tmp_path / "runs").manifest()["analyses"]["compare"]
    table = RunDir("tuned", "sst2", tmp_path / "runs").read_table("cosine")
    for name in ("cosine_cropped", "cosine_padded"):
        means = table_to_array(table, name).mean(1)
        intervals = np.asarray(entry["layer_interval"][name])
        assert intervals.shape == (2, 2) and np.all(intervals[:, 0] <= means + 1e-9)
        assert np.all(means <= intervals[:, 1] + 1e-9) and np.all(intervals[:, 1] - intervals[:, 0] > 1e-4)
        column = 1 + 3 * ("cosine_cropped", "cosine_padded").index(name)
        for layer, row in enumerate(rows):
            assert row[column:column + 3] == [f"{means[layer]:.3f}", f"[{intervals[layer, 0]:.3f},",
                                              f"{intervals[layer, 1]:.3f}]"]


def test_layer_mean_intervals_bootstrap_each_layers_mean_over_heads_and_examples(tokenizer):
    a, b = tiny(0, init=0.5), tiny(1, init=0.5)
    means = cmp.cosine_means(a, b, EXAMPLES, max_length=32, batch_size=2)
    intervals = means.layer_intervals()
    for name in means.values:
        values, _ = means.per_example(name)
        assert intervals[name].shape == (2, 2)
        assert intervals[name] == pytest.approx(bootstrap_mean_interval(values.mean(-1)))
