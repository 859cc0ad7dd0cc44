"""The `attnpat` CLI core verbs on the real embedded model and data; bad input; resumable extraction."""
import importlib.util
import json

import numpy as np
import pandas as pd
import pytest

from analysis.mapstore import iter_saved_maps, read_shard
from app.cli import COMMAND_MODULES, app, main


def run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_verb_group_is_present_and_registered():
    missing = [group for group in COMMAND_MODULES if importlib.util.find_spec(f"app.cli_{group}") is None]
    assert not missing, f"CLI groups without a module: {missing}"
    names = {command.name for command in app.registered_commands} | {group.name for group in app.registered_groups}
    for verb in ("info", "extract", "overview", "annotate", "train", "classify", "finetune", "compare", "disable",
                 "surface", "app", "demo"):
        assert verb in names, verb


@pytest.mark.slow
def test_extract_streams_all_sst2_dev_maps_and_resumes(tmp_path, capsys):
    out = tmp_path / "maps"
    argv = ["extract", "--model", "minilm", "--task", "sst2", "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
            "-q"]
    code, stdout, _ = run(argv, capsys)
    assert code == 0, stdout
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] and index["n_examples"] == 872 and index["n_truncated"] == 0
    shards = sorted(out.glob("shard-*.npz"))
    assert len(shards) == index["n_shards"] == 14
    saved = list(iter_saved_maps(out))
    assert len(saved) == 872 and len({m.example_id for m in saved}) == 872
    first = saved[0]
    assert first.attn.shape == (6, 12, len(first.tokens), len(first.tokens))
    np.testing.assert_allclose(first.attn.sum(-1), 1.0, atol=5e-3)  # float16 storage
    manifest = json.loads((tmp_path / "runs" / "minilm" / "sst2" / "manifest.json").read_text())
    entry = manifest["analyses"]["extract"]
    assert manifest["model"]["revision"] and manifest["packages"]["torch"] and entry["elapsed_seconds"] > 0
    assert entry["data"]["n_examples"] == 872 and entry["n_truncated"] == 0

    before = read_shard(shards[3])
    shards[3].unlink()  # as if the job had been killed before writing this shard
    code, stdout, _ = run(argv, capsys)
    assert code == 0
    assert json.loads((out / "index.json").read_text())["resumed_shards"] == 13
    after = read_shard(shards[3])
    assert [m.example_id for m in after] == [m.example_id for m in before]
    np.testing.assert_array_equal(after[0].attn, before[0].attn)


def test_overview_prints_one_row_per_layer_and_writes_the_table(tmp_path, capsys):
    code, stdout, _ = run(["overview", "--task", "mrpc", "--n", "16", "--runs-dir", str(tmp_path), "-q"], capsys)
    assert code == 0
    assert len([line for line in stdout.splitlines() if line.strip()[:1].isdigit()]) == 6
    table = pd.read_csv(tmp_path / "minilm" / "mrpc" / "overview.csv")
    assert len(table) == 3 * 6 * 12 and set(table.metric) == {"to_cls", "to_sep", "entropy"}
    assert table.value.between(0, 10).all()


def test_overview_gives_every_head_and_layer_mean_a_bootstrap_interval(tmp_path, capsys):
    """overview.csv and the per-layer printout carried bare means; each now has its percentile bootstrap 95% interval
    over the examples (ci_low, ci_high; printed as mean [low, high])."""
    code, stdout, _ = run(["overview", "--task", "sst2", "--n", "12", "--runs-dir", str(tmp_path), "-q"], capsys)
    assert code == 0
    table = pd.read_csv(tmp_path / "minilm" / "sst2" / "overview.csv")
    assert list(table.columns) == ["layer", "head", "metric", "value", "ci_low", "ci_high"]
    assert (table.ci_low <= table.value + 1e-12).all() and (table.value <= table.ci_high + 1e-12).all()
    assert (table.ci_high - table.ci_low > 0).mean() > 0.9  # 12 inputs differ: most heads' intervals are open
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 6
    for layer, row in enumerate(rows):
        for column, metric in enumerate(("to_cls", "to_sep", "entropy")):
            mean = table[(table.layer == layer) & (table.metric == metric)].value.mean()
            value, low, high = row[1 + 3 * column:4 + 3 * column]
            value, low, high = float(value), float(low.strip("[,")), float(high.strip("]"))
            assert value == pytest.approx(mean, abs=5e-4) and low <= value <= high and low < high
    manifest = json.loads((tmp_path / "minilm" / "sst2" / "manifest.json").read_text())
    assert "bootstrap 95% interval over the examples" in manifest["analyses"]["overview"]["interval"]


@pytest.mark.parametrize("argv, message", [
    (["overview", "--task", "nope"], "unknown task 'nope'"),
    (["overview", "--split", "dev"], "unknown split 'dev'; known splits: train, validation, test; did you mean "
                                     "'validation'?"),
    # --task all: before, the tasks serving split 'dev' (none offline) made it `no task to classify`
    (["classify", "--task", "all", "--split", "dev"], "unknown split 'dev'"),
    (["overview", "--model", "no-such-org/no-such-model", "--n", "2"], "--model minilm"),
    (["overview", "--task", "{file}", "--n", "2"], "empty text"),
    (["overview", "--task", "{nocol}"], "has no 'text' column"),
    (["extract", "--task", "sst2", "--n", "0"], "--n must be positive"),
    (["overview", "--task", "sst2", "--n", "2", "--max-length", "100000"], "exceeds the model's limit"),
])
def test_bad_input_gives_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data.jsonl").write_text('{"text": "fine"}\n{"text": ""}\n')
    (tmp_path / "nocol.csv").write_text("sentence\nhello\n")
    argv = [a.format(file=tmp_path / "data.jsonl", nocol=tmp_path / "nocol.csv") for a in argv]
    code, _, stderr = run(argv + ["--runs-dir", str(tmp_path / "runs"), "-q"], capsys)
    assert code == 2
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], stderr
    assert not (tmp_path / "runs").exists()


def test_info_lists_offline_models_and_tasks(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, stdout, _ = run(["info"], capsys)
    assert code == 0
    assert "minilm" in stdout and "unreachable" in stdout
    assert "sst2     offline: validation; offline: train" in stdout
    assert "qqp      unavailable (needs the hub)" in stdout


@pytest.mark.slow
def test_demo_pipeline_steps_run_in_process(tmp_path, capsys):
    code, stdout, stderr = run(["demo", "--no-app", "--only", "overview", "--runs-dir", str(tmp_path), "-q"], capsys)
    assert code == 0, stderr
    assert "[1/2] per-layer overview of the SST-2 dev maps" in stdout and "[2/2] done in" in stdout
    assert (tmp_path / "minilm" / "sst2" / "overview.csv").is_file()
    assert (tmp_path / "minilm" / "wiki" / "overview.csv").is_file()
    manifest = json.loads((tmp_path / "minilm" / "sst2" / "manifest.json").read_text())
    assert manifest["analyses"]["overview"]["data"]["n_examples"] == 872
    assert "Surface and clusters: incomplete" in stdout  # the per-tab summary names what is missing

    code, stdout, stderr = run(["demo", "--no-app", "--only", "overview", "--runs-dir", str(tmp_path), "-q"], capsys)
    assert code == 0, stderr
    assert stdout.count("skipped: outputs exist and inputs are unchanged") == 2 and "2 skipped" in stdout
