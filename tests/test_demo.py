"""The demo pipeline's bookkeeping: steps skipped when outputs exist and inputs are unchanged, rerun otherwise
(the commands themselves are replaced by a fake that writes the expected outputs)."""
import json
import os
import re
import socket

import pandas as pd
import pytest

from analysis.errors import AttnpatError, StepStopped, Terminated
from analysis.finetune import is_finished
from analysis.rundir import locked
from app import cli_core, demo
from app.cli import main


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    return tmp_path


class FakeCommands:
    """Stands in for app.cli.main: records each argv and writes the step's outputs (a fine-tune writes its
    model's attnpat.json with a new training id and the settings of its argv, as a real one would, and keeps a
    finished model unless --force)."""

    def __init__(self, root, sizes):
        self.root, self.sizes, self.calls, self.trainings = root, sizes, [], 0

    def meta(self, training, argv):
        """A store model's attnpat.json as `attnpat finetune <argv>` writes it (the parts the demo reads)."""
        def value(option):
            return argv[argv.index(option) + 1]

        recipe = {"learning_rate": float(value("--lr")), "batch_size": 32, "epochs": int(value("--epochs")),
                  "max_length": 128, "warmup_ratio": 0.1, "weight_decay": 0.01, "seed": 0}
        return {"training": training, "base_model": value("--model"), "task": value("--task"),
                "metric": "accuracy", "metric_value": 0.5, "scores": {"accuracy": 0.5, "f1": 0.6},
                "split": {"mode": "train/validation", "n_train": int(value("--n")), "n_eval": 872,
                          "notes": [f"--n: a seeded sample (seed 0) of {value('--n')} training examples"]},
                "epochs": recipe["epochs"], "learning_rate": recipe["learning_rate"], "recipe": recipe,
                "n_eval": 872, "steps": 2, "elapsed_seconds": 1.0}

    def __call__(self, argv):
        self.calls.append(argv)
        step = next(step for step in demo.pipeline(self.sizes) if tuple(argv[:len(step.argv)]) == step.argv)
        folder = self.root.parent / "models" / self.sizes.name
        if step.verb == "finetune" and ("--force" in argv or not is_finished(folder)):
            self.trainings += 1
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text("{}")
            (folder / "attnpat.json").write_text(json.dumps(self.meta(self.trainings, argv)))
            (folder / ".force-pending").unlink(missing_ok=True)
        for output in step.outputs:
            path = self.root / output  # absolute for the model's attnpat.json, written above
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.write_text("x\n")
        return 0


def verbs(calls):
    return [argv[0] for argv in calls]


def test_second_run_skips_every_step_and_says_so(workspace):
    runs = workspace / "runs"
    fake, lines = FakeCommands(runs, demo.QUICK), []
    records = demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lines.append)
    assert [r["status"] for r in records] == ["run"] * len(demo.pipeline(demo.QUICK))
    assert verbs(fake.calls)[0] == "finetune" and all(argv[-2:] == ["--runs-dir", str(runs)] for argv in fake.calls)
    assert sum("done in" in line for line in lines) == len(records)

    fake.calls.clear()
    lines.clear()
    records = demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lines.append)
    assert fake.calls == [] and {r["status"] for r in records} == {"skipped"}
    assert sum("skipped: outputs exist and inputs are unchanged" in line for line in lines) == len(records)


def test_missing_outputs_or_a_new_model_rerun_what_depends_on_them(workspace):
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    fake.calls.clear()
    os.remove(runs / "minilm" / "wiki" / "probing_dependency.csv")
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert verbs(fake.calls) == ["probe-dep"]
    # an output rewritten by a command run by hand (another --n into the same folder): that step reruns
    fake.calls.clear()
    (runs / "minilm" / "wiki" / "clusters.csv").write_text("made by hand\n")
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert verbs(fake.calls) == ["cluster"]
    # a state written by an earlier attnpat (the inputs' fingerprint alone) still skips a step whose outputs exist
    state = json.loads((runs / demo.STATE_FILE).read_text())
    json_state = {command: recorded["inputs"] for command, recorded in state.items()}
    (runs / demo.STATE_FILE).write_text(json.dumps(json_state))
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert fake.calls == []

    # the fine-tuned model's run record is gone: written again from the store (tests below), the model kept
    fake.calls.clear()
    os.remove(runs / demo.QUICK.name / "sst2" / "finetune_eval.csv")
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert fake.calls == [] and fake.trainings == 1
    # --force trains it again, and every step reading it reruns
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None, only=["finetune"], force=True)
    assert fake.calls[0][0] == "finetune" and "--force" in fake.calls[0]
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert verbs(fake.calls) == ["finetune", "compare", "special", "disable", "importance", "prune"]
    # that retraining stopped midway (its model marked pending): the rerun resumes it, without --force
    fake.calls.clear()
    os.remove(runs / demo.QUICK.name / "sst2" / "finetune_eval.csv")
    (workspace / "models" / demo.QUICK.name / ".force-pending").touch()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None, only=["finetune"])
    assert fake.calls[0][0] == "finetune" and "--force" not in fake.calls[0]


def test_a_model_replaced_during_a_step_makes_that_step_run_again(workspace):
    """A step is recorded with the model it read, not one that replaced it while it ran (before, `disable` was
    recorded as done on the new model it never saw, and skipped)."""
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    meta = workspace / "models" / demo.QUICK.name / "attnpat.json"

    def replaced_during_disable(argv):  # `finetune --force` with the same settings, run by hand meanwhile
        code = fake(argv)
        if argv[0] == "disable":
            meta.write_text(json.dumps(fake.meta("by hand", list(demo.pipeline(demo.QUICK)[0].argv))))
        return code

    demo.run_pipeline(replaced_during_disable, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    # compare, special and disable read the old model: they rerun; importance and prune read the new one
    assert verbs(fake.calls) == ["finetune", "compare", "special", "disable"]
    assert "--force" not in fake.calls[0] and fake.trainings == 1  # the finished model is kept


def test_a_new_runs_folder_reuses_the_finished_fine_tune_of_the_same_settings(workspace):
    """A second --runs-dir (or runs/ removed) gets the evaluation table from the store's record; before, the
    shared model was trained again with --force."""
    fake, lines = FakeCommands(workspace / "runs", demo.QUICK), []
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=workspace / "runs", echo=lambda line: None)
    fake.calls.clear()
    other = workspace / "other-runs"
    demo.run_pipeline(FakeCommands(other, demo.QUICK), sizes=demo.QUICK, runs_dir=other, only=["finetune"],
                      echo=lines.append)
    assert fake.trainings == 1 and (workspace / "models" / demo.QUICK.name / "attnpat.json").is_file()
    table = pd.read_csv(other / demo.QUICK.name / "sst2" / "finetune_eval.csv").set_index("metric").value
    assert table["accuracy"] == 0.5 and table["n_eval"] == 872  # the store model's scores
    manifest = json.loads((other / demo.QUICK.name / "sst2" / "manifest.json").read_text())
    assert "finetune_eval.csv" in json.dumps(manifest)
    assert any("its evaluation written from the model store" in line for line in lines)
    # recorded as done: the next demo skips it
    again = FakeCommands(other, demo.QUICK)
    demo.run_pipeline(again, sizes=demo.QUICK, runs_dir=other, only=["finetune"], echo=lambda line: None)
    assert again.calls == []


@pytest.mark.parametrize("option", ["--n", "--lr", "--epochs"])
def test_a_store_model_of_other_settings_is_not_taken_for_the_demos_fine_tune(workspace, option):
    """`attnpat finetune --n 32 ... --name minilm-sst2-demo-quick --force` by hand: the demo trains its own
    (--force), in a runs folder with or without an evaluation record (before, it said "already fine-tuned")."""
    runs = workspace / "runs"
    fake, lines = FakeCommands(runs, demo.QUICK), []
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["finetune"], echo=lambda line: None)
    by_hand = list(demo.pipeline(demo.QUICK)[0].argv)
    by_hand[by_hand.index(option) + 1] = {"--n": "32", "--lr": "0.001", "--epochs": "2"}[option]
    for removed in (False, True):
        (workspace / "models" / demo.QUICK.name / "attnpat.json").write_text(json.dumps(fake.meta("by hand", by_hand)))
        if removed:
            os.remove(runs / demo.QUICK.name / "sst2" / "finetune_eval.csv")
        fake.calls.clear()
        demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["finetune"], echo=lines.append)
        assert len(fake.calls) == 1 and "--force" in fake.calls[0]
        meta = json.loads((workspace / "models" / demo.QUICK.name / "attnpat.json").read_text())
        assert meta["split"]["n_train"] == demo.QUICK.finetune_n and meta["recipe"]["epochs"] == 1
    assert any("is not the demo's fine-tune (it was trained with " in line for line in lines)


@pytest.mark.parametrize(("sizes", "rerun"), [(demo.QUICK, "attnpat demo --quick"), (demo.FULL, "attnpat demo")])
def test_the_summary_names_only_models_that_exist_and_the_rerun_that_fills_the_tabs(workspace, sizes, rerun):
    """Before, Explore listed the fine-tune before it existed, and the hint said `attnpat demo` after --quick."""
    lines = demo.tab_summary(workspace / "runs", sizes)
    assert lines[0].endswith("(models to pick: minilm)")
    assert all(line.endswith(f"rerun `{rerun}`") for line in lines if "incomplete" in line) and len(lines) > 1
    FakeCommands(workspace / "runs", sizes)(list(demo.pipeline(sizes)[0].argv))
    assert demo.tab_summary(workspace / "runs", sizes)[0].endswith(f"(models to pick: minilm, {sizes.name})")


def test_force_and_only(workspace):
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["overview", "probe-coref"], echo=lambda line: None)
    assert verbs(fake.calls) == ["overview", "overview", "probe-coref"]  # SST-2 and wiki overviews
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["probe-coref"], force=True, echo=lambda line: None)
    assert verbs(fake.calls) == ["probe-coref"]
    with pytest.raises(AttnpatError, match="not a demo step: train"):
        demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["train"], echo=lambda line: None)


def test_a_step_that_writes_no_output_is_one_error_line(workspace):
    with pytest.raises(AttnpatError, match="demo step `attnpat finetune .*` finished without writing"):
        demo.run_pipeline(lambda argv: 0, sizes=demo.QUICK, runs_dir=workspace / "runs", echo=lambda line: None)
    assert not (workspace / "runs" / demo.STATE_FILE).exists()


def test_a_failing_step_stops_the_demo_with_one_line(workspace):
    with pytest.raises(AttnpatError, match="demo step `attnpat finetune .*` failed \\(exit 2\\)"):
        demo.run_pipeline(lambda argv: 2, sizes=demo.QUICK, runs_dir=workspace / "runs", echo=lambda line: None)
    assert not (workspace / "runs" / demo.STATE_FILE).exists()
    # a step stopped by Ctrl-C (130) or SIGTERM (143) stops the demo as such, not as a failed step (exit 2)
    for code in (130, 143):
        with pytest.raises(StepStopped) as stopped:
            demo.run_pipeline(lambda argv, code=code: code, sizes=demo.QUICK, runs_dir=workspace / "runs",
                              echo=lambda line: None)
        assert stopped.value.code == code
    assert not (workspace / "runs" / demo.STATE_FILE).exists()


@pytest.mark.parametrize(("stop", "code", "line"), [(KeyboardInterrupt, 130, "interrupted"),
                                                    (Terminated, 143, "terminated")])
def test_a_stopped_demo_step_says_so_once(workspace, monkeypatch, capsys, stop, code, line):
    """The stopped step prints its stop line; `attnpat demo` then exits with the step's code, silently."""
    def stopped(*args, **kwargs):
        raise stop()

    monkeypatch.setattr(cli_core, "load_model", stopped)
    assert main(["demo", "--no-app", "--quick", "--only", "overview", "--runs-dir", str(workspace / "runs")]) == code
    assert capsys.readouterr().err.count(f"{line}; rerun the same command to resume") == 1


def test_full_sizes_cover_the_issue(workspace):
    steps = {step.verb: step for step in demo.pipeline(demo.FULL)}
    assert {"finetune", "compare", "special", "disable", "importance", "probe-dep", "overview", "classify",
            "surface", "cluster", "probe-coref"} <= set(steps)
    assert int(steps["disable"].argv[steps["disable"].argv.index("--n") + 1]) >= 400
    assert steps["compare"].argv[-2:] == ("--mode", "both") and "--parse" in steps["probe-dep"].argv


def test_a_second_demo_on_the_same_runs_folder_stops_before_any_step(workspace):
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    with locked(runs / ".demo.lock", "held"):  # stands for a demo running in another process
        with pytest.raises(AttnpatError, match=f"the demo in {runs} is being written by another attnpat process"):
            demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert fake.calls == [] and not (runs / demo.STATE_FILE).exists()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert fake.calls and not (runs / ".demo.lock").exists()


@pytest.mark.parametrize(("serve", "code", "line"), [
    ("fails", 2, "error: cannot serve on 127.0.0.1:{port} (address in use); pick another --port"),
    ("terminated", 143, "terminated; rerun the same command to resume")])
def test_the_demo_exits_with_the_web_apps_status(workspace, monkeypatch, capsys, serve, code, line):
    """The app failing to serve, or stopped while serving, is the demo's exit status too (before, 0)."""
    import app.webapp  # noqa: PLC0415 (gradio: only this test serves)

    class Served:
        def block_thread(self):
            raise Terminated()

    def launch(host, port, *args, **kwargs):
        if serve == "fails":
            raise AttnpatError(f"cannot serve on {host}:{port} (address in use); pick another --port")
        return Served(), type("Web", (), {"runs": type("Runs", (), {"root": workspace})})()

    monkeypatch.setattr(demo, "run_pipeline", lambda *args, **kwargs: [])
    monkeypatch.setattr(app.webapp, "launch", launch)
    with socket.socket() as probe:  # a port free when the demo checks it, taken (says the fake) when it serves
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["demo", "--quick", "-q", "--only", "overview", "--port", str(port),
                 "--runs-dir", str(workspace / "runs")]) == code
    assert capsys.readouterr().err.strip() == line.format(port=port)


def test_a_port_or_host_the_app_cannot_use_stops_the_demo_before_its_first_step(workspace, monkeypatch, capsys):
    """Checked before the pipeline, not after every step has run (the port in use: a bind tried at once)."""
    ran = []
    monkeypatch.setattr(demo, "run_pipeline", lambda *args, **kwargs: ran.append(args) or [])
    runs = ["--runs-dir", str(workspace / "runs")]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for options, line in ((["--port", "99999"], "error: port must be between 1 and 65535, got 99999"),
                              (["--port", str(port)], f"error: cannot serve on 127.0.0.1:{port} (address already "
                                                      "in use); pick another --port"),
                              (["--host", "999.1.1.1"], "error: --host 999.1.1.1 is not a host name or address")):
            assert main(["demo", "--quick", "-q", *options, *runs]) == 2
            assert capsys.readouterr().err.strip().startswith(line)
    assert ran == []
    assert main(["demo", "--quick", "-q", "--no-app", "--port", "99999", *runs]) == 0  # no app, no port to check
    assert len(ran) == 1


@pytest.mark.parametrize("only", [",", "", " , "])
def test_only_naming_no_step_is_one_error_line(workspace, monkeypatch, capsys, only):
    """Before, `--only ,` ran the whole pipeline."""
    ran = []
    monkeypatch.setattr(demo, "run_pipeline", lambda *args, **kwargs: ran.append(args) or [])
    assert main(["demo", "--quick", "--no-app", "--only", only, "--runs-dir", str(workspace / "runs")]) == 2
    assert capsys.readouterr().err.strip() == ("error: --only names no demo step; give one or more of: finetune, "
                                               "overview, classify, compare, special, disable, importance, prune, "
                                               "surface, cluster, probe-dep, probe-coref")
    assert ran == []


def write_disabling_tables(folder):
    """The disable and prune tables of the demo's fine-tune (a `disable --mode zero` by hand added a layer row)."""
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"layer": [0] * 6, "head": [0, 1] * 3, "metric": ["uniform_delta"] * 2 + ["uniform_delta_ci_low"] * 2
                  + ["uniform_delta_ci_high"] * 2, "value": [-0.02, 0.01, -0.04, -0.005, 0.0, 0.025]}).to_csv(
        folder / "disable_heads.csv", index=False)
    pd.DataFrame({"layer": [0, 1, 0], "mode": ["uniform", "uniform", "zero"], "delta": [-0.1, 0.0, -0.3],
                  "ci_low": [-0.15, -0.01, -0.4], "ci_high": [-0.05, 0.01, -0.2]}).to_csv(
        folder / "disable_layers.csv", index=False)
    pd.DataFrame({"fraction_pruned": [0.0, 0.5, 1.0], "metric": [0.8, 0.75, 0.5], "delta": [0.0, -0.05, -0.3],
                  "ci_low": [0.0, -0.1, -0.4], "ci_high": [0.0, 0.0, -0.2], "n_scored": 8}).to_csv(
        folder / "pruning.csv", index=False)


def test_the_disabling_summary_quotes_the_pruning_change_on_the_held_out_examples(workspace):
    """prune scores its curve on the odd-numbered examples only: the summary says on how many. The layers' range is
    the demo's uniform mode only (before, a `disable --mode zero` row by hand widened it to -30.0)."""
    write_disabling_tables(workspace / "runs" / demo.QUICK.name / "sst2")
    line = demo._tab_lines(workspace / "runs", demo.QUICK)["Disabling"]()
    assert "50.0% of heads pruned: accuracy 75.0% (-5.0 points, 95% interval -10.0 to +0.0), on the 8 held-out" in line
    # each extreme with its 95% interval (before, bare changes)
    assert "by -2.0 [-4.0, +0.0] (L1-H1) to +1.0 [-0.5, +2.5] (L1-H2) points" in line
    assert "whole layers -10.0 [-15.0, -5.0] (L1) to +0.0 [-1.0, +1.0] (L2);" in line


@pytest.mark.parametrize(("tab", "table", "text"), [
    ("Pattern ratios", "minilm/all/pattern_ratios_by_task.csv", "task,class,count,fraction\n"),  # header only
    ("Disabling", "{tuned}/sst2/disable_layers.csv", "layer,mode,delta\n0,zero,-0.3\n"),  # no uniform rows
    ("Disabling", "{tuned}/sst2/disable_heads.csv", "layer,head,value\n0,0,0.1\n"),  # no metric column
    ("Fine-tuning", "{tuned}/sst2/cosine.csv", "layer,head,value\n0,0,0.9\n"),
    ("Fine-tuning", "{tuned}/sst2/manifest.json", "[1]"),
])
def test_a_summary_table_empty_or_without_its_columns_leaves_its_tab_incomplete(workspace, tab, table, text):
    """Before, a header-only table printed blanks and NaNs ('pattern shares over : ', 'whole layers +nan to
    +nan'), and a table without a column the line reads stopped the demo with a traceback (AttributeError)."""
    runs, tuned = workspace / "runs", demo.QUICK.name
    write_disabling_tables(runs / tuned / "sst2")
    pd.DataFrame({"metric": ["accuracy"], "value": [0.5]}).to_csv(runs / tuned / "sst2" / "finetune_eval.csv",
                                                                  index=False)
    pd.DataFrame({"layer": [0], "head": [0], "metric": ["cosine_cropped"], "value": [0.9]}).to_csv(
        runs / tuned / "sst2" / "cosine.csv", index=False)
    path = runs / table.format(tuned=tuned)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    lines = {line.split(": ", 1)[0]: line for line in demo.tab_summary(runs, demo.QUICK)}
    assert lines[tab].startswith(f"{tab}: incomplete (") and lines[tab].endswith("rerun `attnpat demo --quick`")
    assert "nan" not in lines[tab]


def test_a_forced_fine_tune_stopped_midway_is_resumed_by_the_next_demo(workspace):
    """`attnpat demo --force` stopped during the fine-tune leaves the old model's files (and the --force marker):
    the next demo resumes that training (before, its unchanged files counted as done and it was skipped)."""
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["finetune"], echo=lambda line: None)
    (workspace / "models" / demo.QUICK.name / ".force-pending").touch()  # as `finetune --force` marks it, then killed
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["finetune"], echo=lambda line: None)
    assert verbs(fake.calls) == ["finetune"] and "--force" not in fake.calls[0] and fake.trainings == 2
    assert is_finished(workspace / "models" / demo.QUICK.name)
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["finetune"], echo=lambda line: None)
    assert fake.calls == []


def test_a_new_classifier_checkpoint_reruns_the_classify_step(workspace, monkeypatch):
    """`attnpat train --out classifier/checkpoints/default.safetensors` (or a pull that ships a new one): the
    pattern ratios came from the old classifier, so classify runs again (before, it was skipped)."""
    import shutil  # noqa: PLC0415

    from classifier import checkpoint  # noqa: PLC0415

    shipped = workspace / "checkpoints" / "default.safetensors"
    shipped.parent.mkdir()
    for suffix in (".safetensors", ".json"):
        shutil.copy(checkpoint.DEFAULT_CHECKPOINT.with_suffix(suffix), shipped.with_suffix(suffix))
    monkeypatch.setattr(checkpoint, "DEFAULT_CHECKPOINT", shipped)
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["classify", "overview"], echo=lambda line: None)
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["classify", "overview"], echo=lambda line: None)
    assert fake.calls == []
    for changed in (shipped, shipped.with_suffix(".json")):  # new weights, or new metadata (the confusion matrix)
        changed.write_bytes(changed.read_bytes() + b" ")
        demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=["classify", "overview"], echo=lambda line: None)
        assert verbs(fake.calls) == ["classify"]
        fake.calls.clear()


def test_a_step_that_crashes_stops_the_demo_with_one_line_naming_it(workspace, monkeypatch, capsys):
    """An exception a verb lets through (a bug, not a bad input): its traceback, then one error line naming the
    step, exit 2, the step not recorded as done (before, the traceback alone, naming no step, exit 1)."""
    def crashed(*args, **kwargs):
        raise RuntimeError("CUDA out of memory\nmore detail")

    monkeypatch.setattr(cli_core, "load_model", crashed)
    runs = workspace / "runs"
    assert main(["demo", "--no-app", "--quick", "-q", "--only", "overview", "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" in err
    assert err.splitlines()[-1] == ("error: demo step `attnpat overview --task sst2 --n 16` crashed (RuntimeError: "
                                    "CUDA out of memory); its traceback is above")
    assert not (runs / demo.STATE_FILE).exists()


def test_a_change_of_attnpats_result_code_reruns_the_steps(workspace, monkeypatch):
    """An editable install (`make setup`) keeps attnpat's version through a `git pull`: the source of analysis/ and
    classifier/ is among the inputs, so changed code reruns the steps (before, the old results counted current)."""
    source = workspace / "src" / "analysis"
    source.mkdir(parents=True)
    (source / "stats.py").write_text("SEED = 0\n")
    monkeypatch.setattr(demo, "RESULT_SOURCES", (source,))
    runs = workspace / "runs"
    fake = FakeCommands(runs, demo.QUICK)
    only = ["overview", "cluster"]
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=only, echo=lambda line: None)
    (source / "README.txt").write_text("not code\n")  # what is not a .py file changes no result
    fake.calls.clear()
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=only, echo=lambda line: None)
    assert fake.calls == []
    (source / "stats.py").write_text("SEED = 1\n")
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, only=only, echo=lambda line: None)
    assert verbs(fake.calls) == ["overview", "overview", "cluster"]


def test_the_demos_steps_run_offline_and_the_users_setting_comes_back(workspace, monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE once, at import (before `demo` runs): its flag, which transformers asks,
    is set during the steps too (before, only os.environ was, and transformers' hub calls stayed online); the
    user's environment and flag are as they were afterwards, for the web app."""
    from huggingface_hub import constants  # noqa: PLC0415

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    seen = []

    def run_pipeline(*args, **kwargs):
        seen.append((constants.is_offline_mode(), os.environ.get("HF_HUB_OFFLINE"), os.environ["HF_DATASETS_OFFLINE"]))
        return []

    monkeypatch.setattr(demo, "run_pipeline", run_pipeline)
    assert main(["demo", "--quick", "-q", "--no-app", "--runs-dir", str(workspace / "runs")]) == 0
    assert seen == [(True, "1", "1")]
    assert not constants.is_offline_mode() and "HF_HUB_OFFLINE" not in os.environ
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"


def test_the_surface_summary_quotes_each_heads_accuracy_with_its_interval(workspace):
    """The dependency heads, their offset baselines and the WinoBias head are quoted with the 95% intervals of
    their tables (before, the bare shares)."""
    wiki, winobias = workspace / "runs" / "minilm" / "wiki", workspace / "runs" / "minilm" / "winobias"
    wiki.mkdir(parents=True)
    winobias.mkdir(parents=True)
    pd.DataFrame({"layer": [0, 1], "head": [0, 0], "label": ["prev", "other"]}).to_csv(wiki / "head_labels.csv",
                                                                                       index=False)
    pd.DataFrame({"relation": ["dobj"], "direction": ["dep->head"], "best_layer": [2], "best_head": [0],
                  "accuracy": [0.782], "ci_low": [0.722], "ci_high": [0.84], "baseline_offset": [-2],
                  "baseline_accuracy": [0.379], "baseline_ci_low": [0.315], "baseline_ci_high": [0.443],
                  "parses": ["silver parses"]}).to_csv(wiki / "probing_dependency.csv", index=False)
    pd.DataFrame({"model": ["nearest mention", "minilm head L2-H1"], "accuracy": [0.518, 0.716],
                  "ci_low": [0.468, 0.668], "ci_high": [0.568, 0.759]}).to_csv(
        winobias / "probing_coref_table.csv", index=False)
    line = demo._tab_lines(workspace / "runs", demo.QUICK)["Surface and clusters"]()
    assert "dobj head L3-H1 78.2% [72.2, 84.0] vs offset -2 37.9% [31.5, 44.3] (silver parses, held-out half)" in line
    assert line.endswith("WinoBias best head 71.6% [66.8, 75.9] (held-out half; 95% intervals in brackets)")


def test_every_table_a_tab_shows_is_an_output_and_compare_reads_the_checkpoint(workspace, monkeypatch):
    """A table the app shows, removed or rewritten by hand, reruns the step that writes it (before, only one or two
    tables per step were checked: special_tokens.csv removed left Fine-tuning's heatmap empty, the step skipped);
    compare classifies both models' heads with the shipped checkpoint (pattern transitions), so a new one reruns
    it too."""
    import shutil  # noqa: PLC0415

    from classifier import checkpoint  # noqa: PLC0415

    shipped = workspace / "checkpoints" / "default.safetensors"
    shipped.parent.mkdir()
    for suffix in (".safetensors", ".json"):
        shutil.copy(checkpoint.DEFAULT_CHECKPOINT.with_suffix(suffix), shipped.with_suffix(suffix))
    monkeypatch.setattr(checkpoint, "DEFAULT_CHECKPOINT", shipped)
    runs, tuned = workspace / "runs", demo.QUICK.name
    fake = FakeCommands(runs, demo.QUICK)
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    for table, verb in ((f"{tuned}/sst2/special_tokens.csv", "special"),
                        ("minilm/sst2/cls_last_layer.csv", "special"),
                        (f"{tuned}/sst2/pattern_transitions.csv", "compare"),
                        ("minilm/rte/pattern_ratios.csv", "classify"),
                        ("minilm/wiki/head_distances.csv", "cluster"),
                        ("minilm/wiki/probing_dependency_heads.csv", "probe-dep"),
                        ("minilm/winobias/probing_coref_baselines.csv", "probe-coref")):
        fake.calls.clear()
        os.remove(runs / table)
        demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
        assert verbs(fake.calls) == [verb], table
    fake.calls.clear()
    shipped.write_bytes(shipped.read_bytes() + b" ")
    demo.run_pipeline(fake, sizes=demo.QUICK, runs_dir=runs, echo=lambda line: None)
    assert verbs(fake.calls) == ["classify", "compare"]


def test_the_pattern_summary_quotes_each_tasks_leading_shares_with_their_intervals(workspace):
    """Each task's shares of the three classes leading over the tasks, in one order, with its table's 95% interval
    (before, the bare unweighted mean of the three tasks' shares); a bound left blank (too few examples) leaves
    that share bare, not 'nan'."""
    folder = workspace / "runs" / "minilm" / "all"
    folder.mkdir(parents=True)
    shares = {"sst2": [0.50, 0.30, 0.10, 0.06, 0.04], "rte": [0.40, 0.20, 0.30, 0.06, 0.04]}
    rows = [{"task": task, "class": name, "fraction": share, "ci_low": share - 0.02, "ci_high": share + 0.03}
            for task, values in shares.items()
            for name, share in zip(("vertical", "block", "heterogeneous", "diagonal", "vertical+diagonal"), values)]
    rows[0]["ci_low"] = rows[0]["ci_high"] = float("nan")
    pd.DataFrame(rows).to_csv(folder / "pattern_ratios_by_task.csv", index=False)
    line = demo._tab_lines(workspace / "runs", demo.QUICK)["Pattern ratios"]()
    assert line == ("minilm/all: shares of the leading pattern classes, as classified: rte vertical 40.0% "
                    "[38.0, 43.0], block 20.0% [18.0, 23.0], heterogeneous 30.0% [28.0, 33.0]; sst2 vertical 50.0%, "
                    "block 30.0% [28.0, 33.0], heterogeneous 10.0% [8.0, 13.0] (95% intervals in brackets)")


def test_the_classifier_summary_quotes_the_cross_validated_scores_with_bootstrap_intervals(workspace, monkeypatch):
    """The checkpoint's cross-validated macro-F1 and accuracy with 95% bootstrap intervals over its labeled maps,
    the classifier floor's (classifier.evaluate.cross_validation_intervals, as the Classifier tab shows them; before,
    the demo drew its own and took a matrix of any size); a checkpoint without a confusion matrix says it has no
    interval, and one whose matrix is no (5, 5) table of counts leaves the tab incomplete."""
    from classifier import checkpoint  # noqa: PLC0415
    from classifier.evaluate import cross_validation_intervals  # noqa: PLC0415

    shipped = workspace / "checkpoints" / "default.safetensors"
    shipped.parent.mkdir()
    monkeypatch.setattr(checkpoint, "DEFAULT_CHECKPOINT", shipped)
    # 200 maps of the 5 classes, rows true, columns predicted: macro-F1 0.665, accuracy 69.5%
    confusion = [[60, 4, 6, 2, 8], [3, 25, 4, 1, 2], [5, 3, 20, 1, 1], [2, 1, 0, 22, 5], [6, 2, 1, 4, 12]]
    cross_validation = {"folds": 5, "macro_f1": 0.6651, "accuracy": 0.695, "confusion": confusion}
    shipped.with_suffix(".json").write_text(json.dumps({"trained_on": "panel-x", "cross_validation": cross_validation}))
    line = demo._tab_lines(workspace / "runs", demo.QUICK)["Classifier"]()
    (f1_low, f1_high), (accuracy_low, accuracy_high) = (
        [float(bound) for bound in bounds.split(", ")] for bounds in re.findall(r"\[([-\d., ]+)\]", line))
    expected = cross_validation_intervals(cross_validation)
    assert (f1_low, f1_high) == pytest.approx(expected["macro_f1"], abs=0.0005)  # printed to 3 decimals
    assert (accuracy_low, accuracy_high) == pytest.approx([100 * bound for bound in expected["accuracy"]], abs=0.05)
    assert f1_low < 0.665 < f1_high and 0.05 < f1_high - f1_low < 0.25  # 200 maps: about +-0.07
    assert accuracy_low < 69.5 < accuracy_high and 5 < accuracy_high - accuracy_low < 20
    assert line.startswith("the shipped pattern CNN (panel-x): 5-fold macro-F1 0.665 [")
    assert "(95% bootstrap intervals over its 200 labeled maps; maps of one head or example are alike" in line
    shipped.with_suffix(".json").write_text(json.dumps({"cross_validation": {
        key: value for key, value in cross_validation.items() if key != "confusion"}}))
    line = demo._tab_lines(workspace / "runs", demo.QUICK)["Classifier"]()
    assert "5-fold macro-F1 0.665, accuracy 69.5% (no interval: the checkpoint records no confusion matrix)" in line
    # a matrix of another size than the 5 classes (before, the demo drew intervals from it): the tab is incomplete
    shipped.with_suffix(".json").write_text(json.dumps({"cross_validation": {**cross_validation, "confusion": [
        [40, 5, 5], [4, 30, 6], [1, 2, 7]]}}))
    lines = {line.split(": ", 1)[0]: line for line in demo.tab_summary(workspace / "runs", demo.QUICK)}
    assert lines["Classifier"].startswith("Classifier: incomplete (AttnpatError: the recorded confusion matrix is "
                                          "not 5 x 5")
    # a confusion matrix with a true class of no map: its scores, with no interval and why (before, an error that
    # left the tab incomplete, while the classifier floor's score_intervals had NaN bounds for it)
    shipped.with_suffix(".json").write_text(json.dumps({"cross_validation": {**cross_validation, "confusion": [
        [3, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 2, 0, 0], [0, 0, 0, 2, 0], [0, 0, 0, 0, 2]]}}))
    line = demo._tab_lines(workspace / "runs", demo.QUICK)["Classifier"]()
    assert ("5-fold macro-F1 0.665, accuracy 69.5% (no interval: no labeled map of diagonal in the cross-validation, "
            "so the confusion matrix cannot be redrawn)") in line
