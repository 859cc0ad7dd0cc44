"""The `disable`, `importance` and `prune` verbs end to end, and the engine on the real embedded MiniLM."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.data import load_data
from analysis.importance import head_importance
from analysis.models import load_model
from analysis.stream import encode_examples, iter_batches
from analysis.sweeps import BASELINE, fast_sweep, head_variants, layer_variants, naive_sweep
from app import cli_sweeps
from app.cli import main
from tests.test_disable import make_bundle
from tests.tiny import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random BERT classifier saved with the MiniLM tokenizer, loadable by path."""
    folder = tmp_path_factory.mktemp("models") / "tiny-bert"
    bundle = make_bundle(layers=2)
    bundle.model.save_pretrained(folder)
    bundle.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_disable_verb_writes_tables_figures_and_manifest(tiny_model_dir, tmp_path, capsys):
    argv = ["disable", "--model", str(tiny_model_dir), "--task", "sst2", "--n", "12", "--mode", "zero",
            "--batch-size", "4", "--runs-dir", str(tmp_path), "-q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "baseline accuracy" in out and "disabling helps most" in out and "whole layer disabled" in out
    assert "heads whose change survives Holm" in out and "layers whose change survives Holm" in out
    run = tmp_path / "tiny-bert" / "sst2"
    heads = pd.read_csv(run / "disable_heads.csv")
    assert set(heads.metric) == {"zero_delta", "zero_metric", "zero_delta_ci_low", "zero_delta_ci_high",
                                 "zero_p_mcnemar", "zero_p_holm"} and len(heads) == 6 * 2 * 4
    assert len(pd.read_csv(run / "disable_layers.csv")) == 2
    for stem in ("disable_heads", "disable_layers"):
        assert (run / f"{stem}.png").is_file() and (run / f"{stem}.svg").is_file()
    manifest = json.loads((run / "manifest.json").read_text())
    entry = manifest["analyses"]["disable_zero"]
    assert entry["data"]["n_examples"] == 12 and len(entry["best"]) == 5
    assert len(list((run / ".sweep-zero-head").glob("v-*.json"))) == 2 * 4 + 1
    # a rerun reads every finished variant back and writes the same table
    assert main(argv) == 0
    assert pd.read_csv(run / "disable_heads.csv").equals(heads)


def test_disable_prints_every_change_with_its_95_interval(tiny_model_dir, tmp_path, capsys):
    """The best and worst heads and every whole layer are printed with the table's paired bootstrap interval (before,
    a bare change such as +0.0250 that may be within chance)."""
    assert main(["disable", "--model", str(tiny_model_dir), "--task", "sst2", "--n", "8", "--mode", "zero",
                 "--batch-size", "4", "--runs-dir", str(tmp_path), "-q"]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    run = tmp_path / "tiny-bert" / "sst2"
    heads = pd.read_csv(run / "disable_heads.csv").pivot_table(index=["layer", "head"], columns="metric",
                                                               values="value")
    for label in ("disabling helps most", "disabling hurts most"):
        for item in lines[label].split(":  ")[1].split("; "):
            layer, head = (int(word) - 1 for word in item.split()[1:4:2])
            row = heads.loc[(layer, head)]
            assert item.endswith(f"{row['zero_delta']:+.4f} [{row['zero_delta_ci_low']:+.4f}, "
                                 f"{row['zero_delta_ci_high']:+.4f}]")
    layers = pd.read_csv(run / "disable_layers.csv")
    assert lines["whole layer disabled"].split(":  ")[1] == "; ".join(
        f"layer {row.layer + 1} {row.delta:+.4f} [{row.ci_low:+.4f}, {row.ci_high:+.4f}]"
        for row in layers.itertuples())
    entry = json.loads((run / "manifest.json").read_text())["analyses"]["disable_zero"]
    assert {"ci_low", "ci_high"} <= set(entry["best"][0]) and len(entry["layer_intervals"]) == 2


def test_disable_says_which_heads_have_no_change_and_leaves_them_unranked():
    """Heads with a NaN change are named on their own line, not printed as helping or hurting most."""
    row = {"layer": 0, "head": 1, "delta": 0.02, "ci_low": -0.01, "ci_high": 0.05}
    lines = cli_sweeps.ranking_lines({"best": [row], "worst": [row], "unranked": [{"layer": 1, "head": 2}]})
    assert lines[0] == "disabling helps most:  layer 1 head 2 +0.0200 [-0.0100, +0.0500]"
    assert lines[2].startswith("not ranked: 1 head(s) whose change is undefined (NaN") and \
        lines[2].endswith(": layer 2 head 3")
    assert "nan" not in " ".join(lines[:2]).lower()
    assert cli_sweeps.ranking_lines({"best": [], "worst": [], "unranked": []}) == [
        "disabling helps most:  none", "disabling hurts most:  none"]


@pytest.mark.parametrize("task, criterion", [
    ("sst2", "(Holm-adjusted p < 0.05; accuracy change with its 95% bootstrap interval)"),
    ("mrpc", "(f1 change, permutation test, Holm-adjusted p < 0.05; f1 change with its 95% bootstrap interval)"),
])
def test_the_survivors_line_says_what_was_tested(task, criterion, tiny_model_dir, tmp_path, capsys):
    """MRPC is scored by F1 and its layers are picked by a permutation test of the F1 change: the line says which
    test picked the layers and which change is printed beside them (before, 'survives Holm (p < 0.05 ...)' beside
    F1 changes picked by McNemar's test of the accuracy change)."""
    assert main(["disable", "--model", str(tiny_model_dir), "--task", task, "--n", "6", "--unit", "layer",
                 "--runs-dir", str(tmp_path), "-q"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layers whose change"))
    assert line.startswith(f"layers whose change survives Holm {criterion}: ")


@pytest.mark.parametrize("kind, note", [
    ("base", "has no classification head in its checkpoint (BertModel): the head is random (seeded)"),
    ("mlm", "has no classification head in its checkpoint (BertForMaskedLM): the head is random (seeded)"),
    ("classifier", "has no attnpat fine-tuning record: its classification head is the checkpoint's"),
])
def test_the_note_says_whether_the_checkpoint_holds_a_classification_head(kind, note, tmp_path, capsys):
    """A base or masked-LM checkpoint gets a fresh head: the note says so (before, for every checkpoint without an
    attnpat record: 'unless its checkpoint holds a trained classification head, metric values mean nothing')."""
    folder = save_tiny_model(tmp_path / f"tiny-{kind}", kind=kind)
    assert main(["disable", "--model", str(folder), "--task", "sst2", "--n", "4", "--unit", "layer",
                 "--runs-dir", str(tmp_path / "runs"), "-q"]) == 0
    assert note in capsys.readouterr().err
    entry = json.loads((tmp_path / "runs" / f"tiny-{kind}" / "sst2" / "manifest.json").read_text())
    assert note in entry["analyses"]["disable_uniform"]["model_note"]



def test_importance_prints_disjoint_least_and_most_important_lists_for_a_model_of_few_heads(tiny_model_dir,
                                                                                           tmp_path, capsys):
    """The tiny model has 8 heads, fewer than the two lists of 5 hold: each head is listed once, 4 least and 4 most
    important, in the order of importance.csv (before, 5 and 5, two heads in both lists)."""
    assert main(["importance", "--model", str(tiny_model_dir), "--task", "sst2", "--n", "6", "--batch-size", "3",
                 "--runs-dir", str(tmp_path), "-q"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {label: next(line for line in lines if line.startswith(label)).split(":", 1)[1].strip().split("; ")
              for label in ("least important", "most important")}
    least, most = listed["least important"], listed["most important"]
    assert len(least) == len(most) == 4 and not set(least) & set(most)
    table = pd.read_csv(tmp_path / "tiny-bert" / "sst2" / "importance.csv")
    ranked = table[table.metric == "importance"].sort_values(["value", "layer", "head"], kind="stable")
    expected = [f"layer {layer + 1} head {head + 1}" for layer, head in zip(ranked["layer"], ranked["head"])]
    assert least == expected[:4] and most == expected[::-1][:4]

def test_importance_and_prune_verbs(tiny_model_dir, tmp_path, capsys):
    common = ["--model", str(tiny_model_dir), "--task", "sst2", "--n", "10", "--batch-size", "5",
              "--runs-dir", str(tmp_path), "-q"]
    assert main(["importance", *common, "--no-normalize-global"]) == 0
    assert "least important" in capsys.readouterr().out
    assert main(["prune", *common, "--step", "0.25", "--iterative"]) == 0
    out = capsys.readouterr().out
    assert "iterative" in out and "100.0%" in out
    assert "heads ranked on the 5 even-numbered validation examples (0, 2, ...), the curve scored on the 5 " \
           "odd-numbered ones" in out
    run = tmp_path / "tiny-bert" / "sst2"
    importance = pd.read_csv(run / "importance.csv")
    scores = importance[importance.metric == "importance"].value.to_numpy().reshape(2, 4)
    assert np.allclose(np.linalg.norm(scores, axis=1), 1.0)  # per-layer norm only
    curve = pd.read_csv(run / "pruning.csv")
    assert curve.n_pruned.tolist() == [0, 2, 4, 6, 8]
    # each step's change is printed with its interval, signed, as `disable` prints its changes
    for row in curve.itertuples():
        assert f" {row.delta:+.4f} [{row.ci_low:+.4f}, {row.ci_high:+.4f}] " in out


@pytest.mark.parametrize("argv, message", [
    (["disable", "--mode", "random"], "disabling mode"),
    (["disable", "--unit", "neuron"], "--unit"),
    (["prune", "--step", "0"], "pruning step"),
    (["disable", "--task", "wiki", "--n", "2"], "without labels"),
    (["prune", "--n", "1"], "prune needs at least 2 examples, got 1: importance ranks the heads on the even"),
])
def test_bad_options_give_one_line_errors(argv, message, tiny_model_dir, tmp_path, capsys):
    assert main([*argv, "--model", str(tiny_model_dir), "--runs-dir", str(tmp_path), "-q"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") and message in last


@pytest.mark.parametrize("verb, exponent", [("importance", "-1"), ("prune", "0")])
def test_a_bad_exponent_is_refused_before_the_model_loads(verb, exponent, tiny_model_dir, tmp_path, capsys,
                                                           monkeypatch):
    # the exponent is used only once the gradients are summed: checked after, it cost the whole pass over the data
    monkeypatch.setattr(cli_sweeps, "_load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert main([verb, "--exponent", exponent, "--model", str(tiny_model_dir), "--runs-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"error: the normalisation exponent must be a positive number, got {float(exponent)}"
    assert not any(tmp_path.iterdir())


def test_a_largest_share_below_one_step_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    # no step fits under such a cap: the run pruned nothing and wrote a one-point curve without a word
    monkeypatch.setattr(cli_sweeps, "_load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert main(["prune", "--step", "0.1", "--max-fraction", "0.05", "--model", str(tiny_model_dir),
                 "--runs-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == "error: the largest pruned share (0.05) must be at least one step (0.1)"
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- the real embedded MiniLM

@pytest.fixture(scope="module")
def minilm():
    torch.manual_seed(0)
    return load_model("minilm", kind="classifier", num_labels=2, device="cpu")


@pytest.mark.slow
def test_minilm_fast_equals_naive_on_sst2(minilm):
    data = load_data("sst2", split="validation", n=8)
    encoded = encode_examples(minilm.tokenizer, data.examples)
    batches = list(iter_batches(minilm, data.examples, batch_size=4, encoded=encoded))
    variants = head_variants(6, 12)[::35] + layer_variants(6, 12)[3:4]  # heads (0,0), (2,11), (5,10); layer 3
    for mode in ("uniform", "zero"):
        fast = fast_sweep(minilm, batches, variants, mode)
        naive = naive_sweep(minilm, encoded, variants, mode, batch_size=4)
        for variant in variants:
            assert float((fast[variant.name] - naive[variant.name]).abs().max()) < 1e-5
            assert float((naive[variant.name] - naive[BASELINE]).abs().max()) > 1e-4
    with torch.no_grad():
        plain = torch.cat([minilm.model(**batch.model_inputs()).logits for batch in batches])
    order = [index for batch in batches for index in batch.indices]
    assert torch.equal(fast[BASELINE][order], plain)


def test_minilm_importance_on_sst2(minilm):
    data = load_data("sst2", split="validation", n=8)
    scores = head_importance(minilm, list(iter_batches(minilm, data.examples, batch_size=8)))
    assert scores.shape == (6, 12) and np.isfinite(scores).all() and (scores > 0).all()
    assert scores.std() > 0


def test_prune_on_a_data_file_of_one_example_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Without --n the example count is known once the file is read: checked then, not after the model loaded."""
    monkeypatch.setattr(cli_sweeps, "seeded_classifier", lambda *a, **k: pytest.fail("the model loaded first"))
    data = tmp_path / "one.csv"
    data.write_text("text,label\na fine film,1\n")
    assert main(["prune", "--task", str(data), "--runs-dir", str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: prune needs at least 2 examples, got 1: ") and "\n" not in error
    assert not (tmp_path / "runs").exists()
