"""The finetune / compare / special verbs end to end on a tiny model (offline RTE, --split-dev)."""
import json

import pandas as pd
import pytest

from analysis import finetune as ft
from analysis.special import spacy_tagger
from app.cli import main
from app.display import interval_text
from tests.tiny import save_tiny_model


@pytest.fixture()
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    save_tiny_model(tmp_path / "tiny")
    return tmp_path


@pytest.mark.slow  # about 10 s alone; longer on a busy 2-core machine
def test_finetune_compare_special_verbs(workspace, capsys):
    base = str(workspace / "tiny")
    args = ["finetune", "--model", base, "--task", "rte", "--split-dev", "--train-share", "0.2", "--n", "24",
            "--epochs", "1", "--batch-size", "8", "--lr", "1e-3", "--name", "tiny-rte", "-q"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    # the split's share (55 of RTE's 277) and what --n trained on (24) are told apart
    assert "24 train examples" in out and "--split-dev: the dev set split into 55 training examples" in out
    assert "saved as 'tiny-rte'" in out
    assert "Writing model shards" not in err and "Loading weights" not in err  # -q: no bar but attnpat's own
    meta = json.loads((workspace / "models" / "tiny-rte" / "attnpat.json").read_text())
    assert meta["split"]["train_share"] == 0.2 and meta["steps"] == 3 and meta["base_model"] == base
    evaluation = pd.read_csv(workspace / "runs" / "tiny-rte" / "rte" / "finetune_eval.csv")
    assert evaluation.set_index("metric").loc["accuracy", "value"] == meta["metric_value"]
    low, high = (evaluation.set_index("metric").loc[f"accuracy_ci_{end}", "value"] for end in ("low", "high"))
    assert low <= meta["metric_value"] <= high and f"{meta['metric_value']:.4f}, 95% interval {low:.4f}-" in out
    assert main(args) == 0 and f"{meta['metric_value']:.4f}, 95% interval {low:.4f}-{high:.4f}); use --force" in \
        capsys.readouterr().out
    assert main(args + ["--seed", "1"]) == 0  # the model of seed 0 is kept, and said to be of other settings
    assert "already fine-tuned (accuracy" in (out := capsys.readouterr().out) and \
        "with other settings (--seed 0, not 1); use --force to retrain" in out

    assert main(["compare", "--base", base, "--finetuned", "tiny-rte", "--task", "rte", "--n", "6",
                 "--max-length", "48", "-q"]) == 0
    entry = json.loads((workspace / "runs" / "tiny-rte" / "rte" / "manifest.json").read_text())["analyses"][
        "pattern_transitions"]
    kept = interval_text(entry["unchanged"], *entry["unchanged_interval"], spec=".1%")
    assert f"pattern class kept by {kept} of 48 maps (heads x examples; bootstrap 95% interval over the examples)" in \
        capsys.readouterr().out
    # with no --base, the fine-tuned model's recorded base (before: minilm, whatever the model was made from)
    assert main(["compare", "--finetuned", "tiny-rte", "--task", "rte", "--n", "6", "--max-length", "48",
                 "--no-patterns", "-q"]) == 0
    assert capsys.readouterr().out.startswith(f"{base} vs tiny-rte on rte")
    assert json.loads((workspace / "runs" / "tiny-rte" / "rte" / "manifest.json").read_text())[
        "analyses"]["compare"]["base_model"] == base
    cosine = pd.read_csv(workspace / "runs" / "tiny-rte" / "rte" / "cosine.csv")
    assert len(cosine) == 3 * 2 * 2 * 4 and cosine.value.between(-1, 1.000001).all()  # 2 modes x (mean, ci)
    transitions = pd.read_csv(workspace / "runs" / "tiny-rte" / "rte" / "pattern_transitions.csv")
    assert len(transitions) == 25 and transitions["count"].sum() == 6 * 2 * 4  # examples x layers x heads
    # the first 120 dev examples hold some of the 24 trained on: left out (before, compared as unseen ones), and
    # the 120 compared are the first 120 it was not trained on (before, 120 minus those left out)
    trained = ft.trained_example_ids(meta)
    held_out = [i for i in range(277) if f"rte-validation-{i}" not in trained][:120]
    passed_over = sum(f"rte-validation-{i}" in trained for i in range(held_out[-1]))
    assert passed_over > 0
    assert main(["compare", "--finetuned", "tiny-rte", "--task", "rte", "--n", "120", "--max-length", "48",
                 "--no-patterns", "-q"]) == 0
    assert f"(120 validation examples, leaving out {passed_over} it was trained on (--split-dev))" in \
        capsys.readouterr().out
    assert json.loads((workspace / "runs" / "tiny-rte" / "rte" / "manifest.json").read_text())[
        "analyses"]["compare"]["data"]["n_examples"] == 120

    assert main(["special", "--model", "tiny-rte", "--task", "rte", "--n", "120", "--no-base", "-q"]) == 0
    assert f"leaving out {passed_over} of the validation examples tiny-rte was trained on (--split-dev)\n" in \
        capsys.readouterr().out
    assert json.loads((workspace / "runs" / "tiny-rte" / "rte" / "manifest.json").read_text())[
        "analyses"]["special"]["data"]["n_examples"] == 120
    # more than it was not trained on: all of them, and one line says how many and why
    assert main(["compare", "--finetuned", "tiny-rte", "--task", "rte", "--n", "270", "--max-length", "48",
                 "--no-patterns", "-q"]) == 0
    assert (f"({277 - 24} validation examples, leaving out 24 it was trained on (--split-dev); only {277 - 24} "
            "validation examples it was not trained on, fewer than --n 270)") in capsys.readouterr().out
    assert main(["special", "--model", "tiny-rte", "--task", "rte", "--n", "6", "-q"]) == 0
    out = capsys.readouterr().out
    if spacy_tagger() is None:
        assert "noun: unavailable: the English tagger and parser" in out
    assert "negation:" in out and "last layer's [CLS] attends most to" in out
    for slug in ("tiny-rte", "tiny"):  # the fine-tuned model and its base (from the store metadata)
        assert (workspace / "runs" / slug / "rte" / "special_tokens.csv").is_file()
        assert (workspace / "runs" / slug / "rte" / "linguistic.csv").is_file()


def test_bad_input_is_a_one_line_error(workspace, capsys):
    assert main(["compare", "--finetuned", "minilm", "--task", "sst2", "--mode", "diagonal"]) == 2
    assert "unknown --mode 'diagonal'" in capsys.readouterr().err
    assert main(["finetune", "--model", "minilm", "--task", "rte", "-q"]) == 2
    assert "--split-dev" in capsys.readouterr().err
    assert main(["finetune", "--model", "minilm", "--task", "sst2", "--epochs", "0", "-q"]) == 2
    assert "epochs must be at least 1" in capsys.readouterr().err
    assert main(["finetune", "--model", "minilm", "--task", "sst2", "--checkpoint-every", "0", "-q"]) == 2
    assert "checkpoint interval must be at least 1 step, got 0" in capsys.readouterr().err
    # --train-share without --split-dev was ignored: the train split was trained on whole
    assert main(["finetune", "--model", "minilm", "--task", "sst2", "--train-share", "0.3", "-q"]) == 2
    assert "--train-share 0.3 splits the dev set, so it needs --split-dev" in capsys.readouterr().err
    # --n above the training set: refused before any model loads (before, capped at the set and recorded as asked)
    assert main(["finetune", "--model", "minilm", "--task", "rte", "--split-dev", "--n", "1000", "-q"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--n 1000 is more than the 138 training examples of rte" in errors[0], errors
    assert not (workspace / "models" / "minilm-rte").exists()
    assert main(["special", "--model", "minilm", "--task", "sst2", "--no-base", "--base", "minilm", "-q"]) == 2
    assert "--base and --no-base together" in capsys.readouterr().err  # before, --base was ignored silently
