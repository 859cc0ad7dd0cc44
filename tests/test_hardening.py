"""Bad inputs and faults a new user meets: each gets one `error:` line (or works), and nothing is left half.

One test (at least) per numbered item of the hardening issue; the fuzz tests of every input door are in
tests/test_fuzz_inputs.py and the kill-and-resume tests in tests/test_fault_resume.py.
"""
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client
from sklearn.metrics import cohen_kappa_score
from transformers import BertConfig

from analysis.data import ALL_TASKS, load_data, load_file
from analysis.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, AttnpatError, os_error_message
from analysis.mapstore import (
    is_whole_map_file,
    iter_map_groups,
    read_maps,
    read_shard,
    read_single_maps,
    write_single_maps,
)
from analysis.models import check_class_order, load_model, model_slug
from analysis.patterns import CLASSES
from analysis.rundir import RunDir, atomic_write_json, atomic_write_text, locked
from analysis.uncertainty import wilson_interval
from annotation import dataset as ds
from annotation import labelstudio as ls
from annotation import server
from annotation.dataset import (
    fleiss_kappa,
    fleiss_kappa_interval,
    load_labeled_set,
    merge_labeled_sets,
    read_annotations,
)
from annotation.sample import ensure_sample, read_index
from annotation.server import (
    Credentials,
    _moved_port,
    credentials_file,
    resolve_credentials,
    save_credentials,
    server_dir,
)
from app.cli import main
from app.jobs import KEEP_JOB_LOGS, BatchJobs, Job, RecordedJob, boot_id, process_start_ticks, prune_logs
from app.webapp import WebApp, launch
from classifier.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from tests.conftest import free_port
from tests.tiny import save_tiny_labeled_set, save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random BERT with a (random) two-class head, saved as a local model folder."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", kind="classifier")


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    return code, captured.out, captured.err, errors


def files_under(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


# ------------------------------------------------------------------ 1. string labels

def test_string_labels_map_to_ids_in_sorted_order(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text("text,label\ngreat film,positive\ndull,negative\nfine,positive\nno label here,\n")
    data = load_file(path)
    assert [e.label for e in data.examples] == [1, 0, 1, None]
    assert data.label_names == ("negative", "positive") and data.num_labels == 2 and data.metric == "accuracy"
    assert data.manifest()["labels"] == {"negative": 0, "positive": 1}


def test_whole_number_labels_below_zero_are_classes_in_numeric_order(tmp_path):
    """-1/+1 labels (an SVM-style file) are two classes, not regression scores; scores stay scores."""
    path = tmp_path / "polarity.csv"
    path.write_text("text,label\ngreat film,1\ndull,-1\nfine,1\nmeh,0\nno label here,\n")
    data = load_file(path)
    assert [e.label for e in data.examples] == [2, 0, 2, 1, None]
    assert data.label_names == ("-1", "0", "1") and data.num_labels == 3 and data.metric == "accuracy"
    path.write_text("text,label\ngreat film,1.5\ndull,-1\n")
    scores = load_file(path)
    assert [e.label for e in scores.examples] == [1.5, -1] and scores.num_labels == 1


@pytest.mark.parametrize("verb", [["extract"], ["overview"], ["disable", "--unit", "layer"]])
def test_every_verb_runs_on_string_labels_and_records_the_mapping(tmp_path, capsys, tiny_model, verb):
    path = tmp_path / "reviews.csv"
    path.write_text("text,label\ngreat film,positive\ndull,negative\nfine,positive\nbad,negative\n")
    runs = tmp_path / "runs"
    code, _, err, errors = run_cli([*verb, "--model", tiny_model, "--task", path, "--runs-dir", runs, "-q"], capsys)
    assert code == 0 and not errors, err
    (manifest_path,) = runs.glob("*/*/manifest.json")
    (entry,) = json.loads(manifest_path.read_text())["analyses"].values()
    assert entry["data"]["labels"] == {"negative": 0, "positive": 1}
    index = manifest_path.parent / "maps" / "index.json"
    assert not index.exists() or json.loads(index.read_text())["complete"]


def test_a_pair_column_makes_each_input_a_sentence_pair(tmp_path, capsys, tiny_model):
    """A GLUE-style pair file (sentence1, sentence2): --pair-column names the second segment on every verb."""
    path = tmp_path / "pairs.tsv"
    path.write_text("sentence1\tsentence2\tlabel\nthe cat sat\ta cat was sitting\t1\nit rained\tthe sun shone\t0\n")
    runs = tmp_path / "runs"
    code, _, err, _ = run_cli(["extract", "--model", tiny_model, "--task", path, "--text-column", "sentence1",
                               "--pair-column", "Sentence2", "--runs-dir", runs, "-q"], capsys)
    assert code == 0, err
    (manifest_path,) = runs.glob("*/*/manifest.json")
    data = json.loads(manifest_path.read_text())["analyses"]["extract"]["data"]
    assert data["columns"] == {"text": "sentence1", "text_pair": "sentence2", "label": "label"}
    groups = list(iter_map_groups(manifest_path.parent / "maps"))
    assert len(groups) == 2 and all(group.tokens.count("[SEP]") == 2 for group in groups)
    for verb in (["disable", "--unit", "layer"], ["importance"], ["surface"]):
        code, _, err, _ = run_cli([*verb, "--model", tiny_model, "--task", path, "--text-column", "sentence1",
                                   "--pair-column", "sentence2", "--runs-dir", runs, "-q"], capsys)
        assert code == 0, (verb, err)
    code, _, _, errors = run_cli(["extract", "--task", "sst2", "--pair-column", "x", "--runs-dir", runs], capsys)
    assert code == 2 and "--pair-column applies only to a data file" in errors[0]


def test_label_and_text_columns_are_options(tmp_path, capsys, tiny_model):
    path = tmp_path / "reviews.tsv"
    path.write_text("Review\tStars\tlabel\ngreat film\tgood\tx\ndull\tbad\ty\n")
    runs = tmp_path / "runs"
    code, _, err, _ = run_cli(["extract", "--model", tiny_model, "--task", path, "--text-column", "review",
                               "--label-column", "stars", "--runs-dir", runs, "-q"], capsys)
    assert code == 0, err
    (manifest_path,) = runs.glob("*/*/manifest.json")
    data = json.loads(manifest_path.read_text())["analyses"]["extract"]["data"]
    assert data["labels"] == {"bad": 0, "good": 1} and data["columns"] == {"text": "Review", "label": "Stars"}
    code, _, _, errors = run_cli(["extract", "--model", tiny_model, "--task", path, "--text-column", "review",
                                  "--label-column", "grade", "--runs-dir", runs, "-q"], capsys)
    assert code == 2 and len(errors) == 1 and "no 'grade' column" in errors[0]
    code, _, _, errors = run_cli(["extract", "--task", "sst2", "--text-column", "x", "--runs-dir", runs], capsys)
    assert code == 2 and "--text-column applies only to a data file" in errors[0]
    code, _, _, errors = run_cli(["extract", "--task", "sst2", "--text-column", "x", "--label-column", "y",
                                  "--runs-dir", runs], capsys)
    assert code == 2 and "--text-column, --label-column apply only to a data file" in errors[0]
    # a path that is no data file is named as given (before: lowercased, and called an unknown task)
    code, _, _, errors = run_cli(["extract", "--task", str(tmp_path / "Notes.MD"), "--runs-dir", runs], capsys)
    assert code == 2 and f"{tmp_path / 'Notes.MD'} is not a data file (.jsonl, .csv or .tsv) nor a task" in errors[0]


# ------------------------------------------------------------------ 2. a user file named like a built-in task

def test_a_user_file_never_shares_a_built_in_tasks_run_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "sst2.tsv").write_text("text\tlabel\nhello\t1\n")
    (tmp_path / "b" / "sst2.tsv").write_text("text\tlabel\nother\t0\n")
    first, second = load_file(tmp_path / "a" / "sst2.tsv"), load_file(tmp_path / "b" / "sst2.tsv")
    assert first.task.startswith("sst2-") and first.task not in ALL_TASKS
    assert first.task != second.task  # same name, other content: other run directories
    assert load_file(tmp_path / "a" / "sst2.tsv").task == first.task  # the same file: the same directory


def test_cli_on_a_file_named_sst2_leaves_the_sst2_run_alone(tmp_path, capsys, tiny_model):
    runs = tmp_path / "runs"
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "sst2.tsv").write_text("text\tlabel\nhello there\t1\nbye\t0\n")
    code, _, err, _ = run_cli(["overview", "--model", tiny_model, "--task", tmp_path / "my" / "sst2.tsv",
                               "--runs-dir", runs, "-q"], capsys)
    assert code == 0, err
    (folder,) = (runs / "model").iterdir()
    assert folder.name != "sst2" and folder.name.startswith("sst2-")


# ------------------------------------------------------------------ 3. OS errors on the run directory

def test_a_read_only_run_directory_is_one_error_line(tmp_path, capsys, tiny_model, monkeypatch):
    (tmp_path / "d.csv").write_text("text\nhello there\n")

    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)  # as a read-only folder does (tests may run as root)
    runs = tmp_path / "runs"
    code, _, err, errors = run_cli(["overview", "--model", tiny_model, "--task", tmp_path / "d.csv",
                                    "--runs-dir", runs, "-q"], capsys)
    assert code == 2 and len(errors) == 1 and "permission denied" in errors[0], err
    assert ".tmp" not in errors[0]  # the user's path, not the temporary name of the write
    assert "Traceback" not in err and files_under(runs) == []


def test_a_run_directory_blocked_by_a_file_is_one_error_line(tmp_path, capsys, tiny_model):
    (tmp_path / "d.csv").write_text("text\nhello there\n")
    (tmp_path / "runs").write_text("not a folder")
    code, _, err, errors = run_cli(["extract", "--model", tiny_model, "--task", tmp_path / "d.csv",
                                    "--runs-dir", tmp_path / "runs", "-q"], capsys)
    assert code == 2 and len(errors) == 1 and "runs is a file, not a folder" in errors[0], err
    assert (tmp_path / "runs").read_text() == "not a folder"


def test_atomic_write_turns_os_errors_into_attnpat_errors(tmp_path):
    (tmp_path / "blocker").write_text("")
    with pytest.raises(AttnpatError, match="cannot write .*blocker is a file, not a folder"):
        atomic_write_text(tmp_path / "blocker" / "x.txt", "x")
    with pytest.raises(AttnpatError, match="cannot write .*blocker.*not a directory"):
        atomic_write_text(tmp_path / "blocker" / "sub" / "x.txt", "x")


# ------------------------------------------------------------------ 4. --n checked the same way everywhere

@pytest.mark.parametrize("n", ["0", "-1"])
@pytest.mark.parametrize("verb", [["extract"], ["overview"], ["disable"], ["importance"], ["classify"],
                                  ["special"], ["surface"], ["cluster"]])
def test_n_must_be_positive_on_every_verb_and_every_source(tmp_path, capsys, tiny_model, verb, n):
    (tmp_path / "d.csv").write_text("text,label\nhello,1\nthere,0\n")
    for task in (tmp_path / "d.csv", "sst2"):
        code, _, err, errors = run_cli([*verb, "--model", tiny_model, "--task", task, "--n", n,
                                        "--runs-dir", tmp_path / "runs", "-q"], capsys)
        assert code == 2 and len(errors) == 1 and f"--n must be positive, got {n}" in errors[0], err
    assert not (tmp_path / "runs").exists()


def test_load_data_checks_n_for_files_too(tmp_path):
    (tmp_path / "d.csv").write_text("text\na\nb\n")
    for n in (0, -1):
        with pytest.raises(AttnpatError, match="--n must be positive"):
            load_data(str(tmp_path / "d.csv"), n=n)
    assert len(load_data(str(tmp_path / "d.csv"), n=1).examples) == 1


# ------------------------------------------------------------------ 7. byte-order mark, header case

def test_a_bom_and_any_header_case_are_accepted(tmp_path):
    (tmp_path / "bom.csv").write_bytes("\ufefftext,label\nhello,1\n".encode("utf-8"))
    (tmp_path / "upper.tsv").write_text(" Text \tLABEL\nhello\t0\n")
    (tmp_path / "upper.jsonl").write_text('{"TEXT": "hello", "Label": 1}\n')
    assert [(e.text, e.label) for e in load_file(tmp_path / "bom.csv").examples] == [("hello", 1)]
    assert [(e.text, e.label) for e in load_file(tmp_path / "upper.tsv").examples] == [("hello", 0)]
    assert [(e.text, e.label) for e in load_file(tmp_path / "upper.jsonl").examples] == [("hello", 1)]


def test_a_missing_column_names_columns_visibly(tmp_path):
    (tmp_path / "bom.csv").write_bytes("\ufeffsentence\nhello\n".encode("utf-8"))
    with pytest.raises(AttnpatError, match=r"has no 'text' column \(columns: sentence\)$"):
        load_file(tmp_path / "bom.csv")


# ------------------------------------------------------------------ 9. exact line numbers

@pytest.mark.parametrize("content, line", [
    ('{"text": "a"}\n\n{"text": "b"}\n{broken\n', 4),
    ('{"text": "a"}\n{"text": "b \u2028 c"}\n[1, 2]\n', 3),  # U+2028 inside a string is no line break
    ('\ufeff{"text": "a"}\n{"text": ""}\n', 2),
])
def test_jsonl_errors_name_the_exact_line(tmp_path, content, line):
    (tmp_path / "d.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(AttnpatError, match=f"line {line}[^0-9]"):
        load_file(tmp_path / "d.jsonl")


def test_csv_errors_name_the_exact_line(tmp_path):
    (tmp_path / "d.csv").write_text('text,label\n"two\nlines",1\n\n   ,0\n')
    with pytest.raises(AttnpatError, match="line 5: empty text"):
        load_file(tmp_path / "d.csv")
    (tmp_path / "e.csv").write_text("text,label\na,1\nb,0,extra\n")
    with pytest.raises(AttnpatError, match="line 3 has 3 fields, the header has 2"):
        load_file(tmp_path / "e.csv")
    (tmp_path / "f.csv").write_bytes(b"text\nok\n\xff\xfe\n")
    with pytest.raises(AttnpatError, match="not UTF-8 text \\(line 3\\)"):
        load_file(tmp_path / "f.csv")


# ------------------------------------------------------------------ 10. smaller ones

def test_empty_and_whitespace_text_pairs_both_mean_one_sentence(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a", "text_pair": ""}\n{"text": "b", "text_pair": "  "}\n'
                                      '{"text": "c", "text_pair": null}\n{"text": "d", "text_pair": "e"}\n')
    assert [e.text_pair for e in load_file(tmp_path / "d.jsonl").examples] == [None, None, None, "e"]


def test_the_manifest_command_is_shell_quoted(tmp_path, monkeypatch):
    argv = ["attnpat", "extract", "--task", "my data/it's.csv", "--n", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    run = RunDir("m", "t", tmp_path)
    with run.record("extract"):
        pass
    command = run.manifest()["analyses"]["extract"]["command"]
    assert shlex.split(command) == argv
    # the console script's full path, or the module file of `python -m app.cli` (the web app's jobs): `attnpat`
    monkeypatch.setattr(sys, "argv", ["/home/u/.venv/bin/attnpat", *argv[1:]])
    with run.record("extract"):
        pass
    assert shlex.split(run.manifest()["analyses"]["extract"]["command"]) == argv
    monkeypatch.setattr(sys, "argv", ["/srv/attnpat/app/cli.py", *argv[1:]])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", types.SimpleNamespace(name="app.cli"), raising=False)
    with run.record("extract"):
        pass
    assert shlex.split(run.manifest()["analyses"]["extract"]["command"]) == argv


def test_a_checkpoints_json_metadata_is_checked_not_ignored(tmp_path):
    weights = tmp_path / "cnn.safetensors"
    shutil.copy(DEFAULT_CHECKPOINT, weights)
    shutil.copy(DEFAULT_CHECKPOINT.with_suffix(".json"), weights.with_suffix(".json"))
    _, metadata = load_checkpoint(weights)
    edited = dict(metadata, input_size=metadata["input_size"] + 8)
    weights.with_suffix(".json").write_text(json.dumps(edited))
    with pytest.raises(AttnpatError, match="cnn.json disagrees with the metadata inside cnn.safetensors on input_size"):
        load_checkpoint(weights)
    weights.with_suffix(".json").write_text('{"format": ')
    with pytest.raises(AttnpatError, match="cnn.json .* cannot be read \\(JSONDecodeError\\)"):
        load_checkpoint(weights)
    weights.with_suffix(".json").unlink()  # the weights carry their own metadata: no .json is fine
    assert load_checkpoint(weights)[1] == metadata


# ------------------------------------------------------------------ 5, 8 and 10: Label Studio

def test_serve_fails_fast_on_a_busy_port_and_starts_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(AttnpatError, match=f"port {port} is in use by another program; choose another with --port"):
            server.serve(port=port, root=tmp_path, timeout=30, log=lambda message: None)
        assert time.monotonic() - started < 10
    assert server.running_pid(tmp_path) is None and not (tmp_path / "server.pid").exists()


def test_a_server_whose_pid_file_cannot_be_written_is_ended_not_left_running(tmp_path, monkeypatch):
    """serve started the server, then wrote its pid file: when that write failed (a full disk), the error came and
    the server ran on with no record, so `annotate stop` could not end it and every later serve found its port
    taken "by another program". Now the server it cannot record is ended before the error."""
    fake = tmp_path / "label-studio"
    fake.write_text("#!/bin/sh\nexec sleep 120\n")  # a server that never answers: it would run on
    fake.chmod(0o755)
    started, real_popen, real_write = [], subprocess.Popen, server.atomic_write

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def write(path, writer):
        if Path(path).name == "server.pid":
            raise OSError(28, "No space left on device", str(path))
        return real_write(path, writer)

    monkeypatch.setattr(server.subprocess, "Popen", popen)
    monkeypatch.setattr(server, "atomic_write", write)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            server.serve(port=free_port(), root=tmp_path / "ls", timeout=30, log=lambda message: None,
                         label_studio=fake)
        assert len(started) == 1 and started[0].poll() is not None  # ended (and reaped), not running on
        assert server.running_pid(tmp_path / "ls") is None
    finally:
        for process in started:  # a failing run leaves nothing behind either
            process.kill()
            process.wait()


def test_a_server_started_by_a_serve_that_then_fails_is_stopped_again(tmp_path, monkeypatch):
    """A serve whose new server started but refused the admin a token (or whose credentials could not be saved) ended
    with the error and left that server running: `annotate status` showed it and its port stayed taken, with no
    usable credentials. Now the error line says the server it started is stopped again, and it is."""
    fake = tmp_path / "label-studio"  # runs as a server would: its command line names it and the data folder
    fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
    fake.chmod(0o755)
    started, real_popen = [], subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def refuse(url, email, password):
        raise AttnpatError(f"Label Studio refused to create a token for {email} (HTTP 500)")

    monkeypatch.setattr(server.subprocess, "Popen", popen)
    root = tmp_path / "ls"
    # it answers once it runs (just after exec its /proc command line can still be empty)
    monkeypatch.setattr(server, "health", lambda url, timeout=3.0: bool(started) and server.running_pid(root)
                        is not None)
    monkeypatch.setattr(server, "personal_access_token", refuse)
    try:
        with pytest.raises(AttnpatError, match=r"refused to create a token .* \(the Label Studio this serve started "
                                               r"is stopped again\)") as caught:
            server.serve(port=free_port(), root=root, timeout=30, log=lambda message: None, label_studio=fake)
        assert "\n" not in str(caught.value)
        assert len(started) == 1 and started[0].poll() is not None and server.running_pid(root) is None
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_a_port_label_studio_moved_to_is_noticed_in_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("old run\n* Port 8080 is in use.\n* Trying to start at 8081\n")
    start = log.stat().st_size
    assert _moved_port(log, start) is None  # only what this start wrote counts
    with open(log, "a") as handle:
        handle.write("\n*** WARNING! ***\n* Port 8090 is in use.\n* Trying to start at 8091\n****************\n")
    assert _moved_port(log, start) == 8091


def listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                found.append(address)
    return found


def test_label_studio_listens_on_127_0_0_1_only(label_studio):
    """README: every server binds to 127.0.0.1. Label Studio's own default is 0.0.0.0 (every interface), which would
    offer the admin login and the annotations to the network; serve passes --internal-host 127.0.0.1."""
    port = int(label_studio.url.rsplit(":", 1)[1])
    assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, little-endian hex; no 0.0.0.0, no [::]


def test_the_admin_password_is_not_on_the_servers_command_line(label_studio):
    pid = server.running_pid(label_studio.root)
    assert pid and label_studio.password
    family, todo = [], [pid]
    while todo:  # the server and every process it started
        current = todo.pop()
        family.append(current)
        children = Path(f"/proc/{current}/task/{current}/children")
        todo += [int(child) for child in children.read_text().split()] if children.exists() else []
    for member in family:
        command_line = Path(f"/proc/{member}/cmdline").read_bytes().decode(errors="replace")
        assert label_studio.password not in command_line, member
    assert int(server._pid_file(label_studio.root).read_text().split()[1]) == int(label_studio.url.rsplit(":", 1)[1])


def test_url_without_token_names_what_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    monkeypatch.delenv("LABEL_STUDIO_URL", raising=False)
    monkeypatch.delenv("LABEL_STUDIO_API_KEY", raising=False)
    (tmp_path / "workspace" / "annotation" / "samples" / "s").mkdir(parents=True)
    pull = ["annotate", "pull", "--sample", "s", "--url"]
    code, _, _, errors = run_cli(pull + ["http://127.0.0.1:9"], capsys)
    assert code == 2 and errors == ["error: --url http://127.0.0.1:9 needs --token (or $LABEL_STUDIO_API_KEY); "
                                    "no credentials are stored"]
    save_credentials(Credentials("http://127.0.0.1:8080", "stored-token", "a@b.c", "pw"),
                     server_dir(tmp_path / "workspace" / "annotation" / "label-studio"))
    code, _, _, errors = run_cli(pull + ["http://127.0.0.1:9"], capsys)
    assert code == 2 and errors == ["error: --url http://127.0.0.1:9 needs --token (or $LABEL_STUDIO_API_KEY): "
                                    "the stored credentials are for http://127.0.0.1:8080"]
    code, _, _, errors = run_cli(pull + ["http://127.0.0.1:8080/"], capsys)  # the stored server: its token is used
    assert code == 2 and "needs --token" not in errors[0] and "credentials" not in errors[0]


# ------------------------------------------------------------------ 10. the app loads only the models it lists

def test_the_explore_endpoint_refuses_models_the_app_does_not_list(tmp_path, tiny_model):
    asked = []
    port = free_port()
    demo, web = launch("127.0.0.1", port, tmp_path, block=False, quiet=True, warm=False)
    try:
        web.explorer.models.loader = lambda name: asked.append(name)  # records any load the endpoint attempts
        status, grid, *_ = Client(f"http://127.0.0.1:{port}/", verbose=False).predict(
            "hello", "", str(tiny_model), False, False, api_name="/explore")
    finally:
        demo.close()
    assert status.startswith("**error:** ") and "is not one this app offers" in status and "--allow-any-model" in status
    assert grid is None and asked == []


def test_allow_any_model_lets_explore_load_a_path(tmp_path, tiny_model):
    web = WebApp(tmp_path, allow_any_model=True)
    status = web.explore("hello there", "", str(tiny_model), False, False)[0]
    assert not status.startswith("**"), status
    assert "minilm" in WebApp(tmp_path).explorer.models.allowed()


# ------------------------------------------------------------------ 6. map files whose arrays disagree

def _tampered_map_file(tmp_path, **changes):
    """A valid map file (two single-head maps of 3 and 4 tokens) with some arrays replaced."""
    rng = np.random.default_rng(0)
    maps = {f"m:sst2:ex{k}:L0H{k}": rng.dirichlet(np.ones(n), size=n).astype(np.float32)
            for k, n in enumerate((3, 4))}
    path = write_single_maps(tmp_path / "maps.npz", maps)
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    arrays.update(changes)
    np.savez(path, **arrays)
    return path, arrays


@pytest.mark.parametrize("change, message", [
    (lambda a: {"attn": np.concatenate([a["attn"], np.full(5, 0.1, np.float32)])},
     "holds 30 values, but the map lengths say 25"),
    (lambda a: {"attn": a["attn"][:-1]}, "holds 24 values, but the map lengths say 25"),
    (lambda a: {"lengths": a["lengths"].astype(np.float64)}, "'lengths' is float64"),
    (lambda a: {"lengths": np.asarray([3, -4], np.int32)}, "must be positive"),
    (lambda a: {"heads": a["heads"].ravel()}, "'heads' is int32 of shape (4,)"),
    (lambda a: {"attn": np.where(np.arange(25) == 3, np.nan, a["attn"]).astype(np.float32)}, "NaN"),
    (lambda a: {"example_ids": a["example_ids"][:1]}, "'example_ids' is <U3 of shape (1,), expected 1-d str of 2 rows"),
])
def test_a_map_file_whose_arrays_disagree_is_one_error(tmp_path, change, message):
    path, arrays = _tampered_map_file(tmp_path)
    np.savez(path, **{**arrays, **change(arrays)})
    with pytest.raises(AttnpatError) as caught:
        read_maps(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_non_square_map_in_the_single_head_layout_is_one_error(tmp_path):
    np.savez(tmp_path / "old.npz", map_ids=np.asarray(["m:t:e:L0H0"]), lengths=np.asarray([3]),
             attn=np.full(12, 0.25, np.float32))  # a 3 x 4 map
    with pytest.raises(AttnpatError, match="holds 12 values, but the map lengths say 9"):
        read_maps(tmp_path / "old.npz")


# ------------------------------------------------------------------ the Label Studio export door

def _export_of(sample, labels: dict) -> list[dict]:
    """A Label Studio JSON export of ``sample`` with one submitted annotation per map in ``labels``."""
    maps = read_single_maps(sample / "maps.npz")
    tasks = []
    for k, row in enumerate(read_index(sample)):
        annotations = ([{"id": k + 1, "completed_by": 1, "created_at": f"2026-01-01T00:00:{k:02d}",
                         "was_cancelled": False, "result": [{"value": {"choices": [labels[row["map_id"]]]}}]}]
                       if row["map_id"] in labels else [])
        tasks.append({"id": k + 1, "data": {"map_id": row["map_id"], "map_sha256": ls.map_sha256(maps[row["map_id"]])},
                      "annotations": annotations, "predictions": [], "drafts": []})
    return tasks


def test_pull_reads_a_label_studio_export_file(tmp_path, synthetic_sample):
    sample = synthetic_sample("export", 10)
    labels = {row["map_id"]: CLASSES[k % len(CLASSES)] for k, row in enumerate(read_index(sample))}
    (tmp_path / "export.json").write_text(json.dumps(_export_of(sample, labels)))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    assert report.labeled == 10
    labeled = load_labeled_set(tmp_path / "labeled")
    assert {map_id: CLASSES[label] for map_id, label in zip(labeled.map_ids, labeled.labels)} == labels


def test_pull_reads_label_studio_1_23s_own_export_with_predictions_by_id(tmp_path, synthetic_sample, monkeypatch,
                                                                          capsys):
    """Label Studio's Export > JSON lists a task's predictions as ids and nests each prediction in the
    annotations made from it (before: 'predictions must be a list of objects')."""
    sample = synthetic_sample("export-ids", 6)
    labels = {row["map_id"]: CLASSES[k % len(CLASSES)] for k, row in enumerate(read_index(sample))}
    tasks = _export_of(sample, labels)
    for k, task in enumerate(tasks):
        guess = CLASSES[0] if k % 2 else labels[task["data"]["map_id"]]
        prediction = {"id": 100 + k, "model_version": "attnpat-rules-v1", "score": 0.7, "task": task["id"],
                      "result": [{"from_name": "pattern", "to_name": "image", "type": "choices",
                                  "value": {"choices": [guess]}}]}
        task["predictions"] = [100 + k]
        task["annotations"][0]["prediction"] = prediction
    tasks[5]["annotations"][0].pop("prediction")  # an id whose prediction no annotation carries: not compared
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    assert report.labeled == 6
    right = [labels[task["data"]["map_id"]] == (CLASSES[0] if k % 2 else labels[task["data"]["map_id"]])
             for k, task in enumerate(tasks[:5])]
    assert report.prediction_agreement == pytest.approx(sum(right) / 5)
    # the agreement is a share of 5 maps: it carries Wilson's interval, in the report, its card and the CLI's line
    low, high = wilson_interval(sum(right), 5)
    assert report.prediction_maps == 5 and report.prediction_agreement_ci == pytest.approx((low, high))
    # which rules made the predictions compared: tasks pushed under other thresholds carry another version
    assert report.preannotator_versions == ["attnpat-rules-v1"] != [ls.PREANNOTATOR_VERSION]
    assert json.loads((tmp_path / "labeled" / "pull_report.json").read_text())["preannotator_versions"] == \
        ["attnpat-rules-v1"]
    assert json.loads((tmp_path / "labeled" / "pull_report.json").read_text())["prediction_agreement_ci"] == \
        pytest.approx([low, high])
    shutil.copytree(sample, tmp_path / "home" / "workspace" / "annotation" / "samples" / sample.name)
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path / "home"))
    assert main(["annotate", "pull", "--sample", sample.name, "--export", str(tmp_path / "export.json"),
                 "--out", str(tmp_path / "again")]) == 0
    assert (f"pre-annotation agreement with final labels: {sum(right) / 5:.3f} [{low:.3f}, {high:.3f}] "
            "(Wilson 95% over 5 maps)\n") in capsys.readouterr().out


def test_pull_warns_when_pre_annotations_were_made_under_other_rules(tmp_path, synthetic_sample, monkeypatch,
                                                                     capsys):
    """Tasks pushed before the rules changed keep their old pre-annotations: pull listed their versions in
    pull_report.json but said nothing, so the printed agreement read as the current rules'. Now one line says how
    many of the predictions compared were made under other rules, and the report counts them."""
    sample = synthetic_sample("old-rules", 5)
    tasks = _export_of(sample, {row["map_id"]: "block" for row in read_index(sample)})
    versions = ["attnpat-rules-v1", "attnpat-rules-v1", "attnpat-rules-0123abcd", ls.PREANNOTATOR_VERSION,
                ls.PREANNOTATOR_VERSION]
    for task, version in zip(tasks, versions, strict=True):
        task["predictions"] = [{"model_version": version, "result": [{"value": {"choices": ["block"]}}]}]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    shutil.copytree(sample, tmp_path / "home" / "workspace" / "annotation" / "samples" / sample.name)
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path / "home"))
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", sample.name, "--export", tmp_path / "export.json",
                                 "--out", tmp_path / "labeled"], capsys)
    assert code == 0, err
    warning = (f"pre-annotations made under other rules than the current {ls.PREANNOTATOR_VERSION}: 3 of the 5 "
               "compared (attnpat-rules-0123abcd, attnpat-rules-v1); the pre-annotation agreement is, for those "
               "maps, of the older rules\n")
    assert warning in out
    written = json.loads((tmp_path / "labeled" / "pull_report.json").read_text())
    assert (written["other_rules_predictions"], written["rules_version"]) == (3, ls.PREANNOTATOR_VERSION)
    # every prediction of the current rules: no such line
    for task in tasks:
        task["predictions"][0]["model_version"] = ls.PREANNOTATOR_VERSION
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", sample.name, "--export", tmp_path / "export.json",
                                 "--out", tmp_path / "labeled"], capsys)
    assert code == 0 and "other rules" not in out and "pre-annotation agreement with final labels: 1.000" in out


def test_pull_counts_each_annotator_once_orders_by_time_and_reports_an_empty_choice(tmp_path, synthetic_sample):
    """One user's second annotation tab replaces their first (one vote each); a tie goes to the earliest
    annotation by time, not by text ('...:05Z' is earlier than '...:05.250Z'); a submission with no class is
    reported as such, not as an unknown label."""
    sample = synthetic_sample("votes", 5)
    ids = [row["map_id"] for row in read_index(sample)]
    tasks = _export_of(sample, {})

    def vote(number, user, when, label):
        return {"id": number, "completed_by": user, "created_at": when, "was_cancelled": False,
                "result": [{"value": {"choices": [label]}}] if label else []}

    tasks[0]["annotations"] = [vote(1, 7, "2026-01-01T00:00:01Z", "block"), vote(2, 7, "2026-01-01T00:00:02Z",
                                                                             "vertical")]
    tasks[1]["annotations"] = [vote(4, 8, "2026-01-01T00:00:05.250Z", "block"),
                               vote(3, 9, "2026-01-01T00:00:05Z", "diagonal")]
    tasks[2]["annotations"] = [vote(5, 8, "2026-01-01T00:00:06Z", None)]
    tasks[3]["annotations"] = [{**vote(6, None, "2026-01-01T00:00:07", "block"), "completed_by": None},
                               {**vote(7, None, "2026-01-01T00:00:08+00:00", "block"), "completed_by": None}]
    # user 7 labels, then skips: the skip is their last word; user 8's label stands alone
    tasks[4]["annotations"] = [vote(8, 7, "2026-01-01T00:00:09Z", "diagonal"), vote(10, 8, "2026-01-01T00:00:11Z",
                                                                                 "block"),
                               {**vote(9, 7, "2026-01-01T00:00:10Z", None), "was_cancelled": True}]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    rows = {row["map_id"]: row for row in load_labeled_set(tmp_path / "labeled").rows}
    # user 7's skip withdrew their label; user 8's keeps the map in the set, so it is not a map the skips left out
    assert rows[ids[4]]["label"] == "block" and rows[ids[4]]["n_annotations"] == 1 and report.skipped == []
    assert rows[ids[0]]["label"] == "vertical" and rows[ids[0]]["n_annotations"] == 1
    assert report.repeated == [ids[0], ids[4]] and report.kappa_maps == 2  # maps 1 and 3 have two voters
    assert rows[ids[1]]["label"] == "diagonal" and report.ties == [ids[1]]
    assert rows[ids[1]]["labeled_at"] == "2026-01-01T00:00:05.250Z"
    assert report.no_choice == [ids[2]] and report.unknown == [] and report.unlabeled == 1
    assert rows[ids[3]]["n_annotations"] == 2  # annotations naming no user are not one user's repeats
    assert len((tmp_path / "labeled" / "annotations.csv").read_text().splitlines()) == 1 + 6


def test_pull_counts_no_annotation_that_chose_several_classes(tmp_path, synthetic_sample, monkeypatch, capsys):
    """An annotation choosing two classes (a labeling view that allowed multiple choice, or an edited export), in
    one result part or in two, counted as a vote for its first class, so "block, vertical" was a block label and
    agreed with a block annotator. Now it names no label: it is reported, and as an annotator's last word it
    withdraws their earlier label, as an empty submission does; the same class chosen twice is still one label."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("multi", 4), tmp_path / "workspace" / "annotation" / "samples"
                                  / "multi"))
    ids = [row["map_id"] for row in read_index(sample)]
    tasks = _export_of(sample, {ids[3]: "vertical"})

    def vote(number, user, *parts):
        return {"id": number, "completed_by": user, "created_at": f"2026-01-01T00:00:{number:02d}Z",
                "was_cancelled": False, "result": [{"value": {"choices": list(part)}} for part in parts]}

    tasks[0]["annotations"] = [vote(1, 7, ("block", "vertical")), vote(2, 8, ("block",))]
    tasks[1]["annotations"] = [vote(3, 7, ("block",), ("vertical",))]  # two result parts, two classes
    tasks[2]["annotations"] = [vote(4, 7, ("diagonal",)), vote(5, 7, ("block", "diagonal")),  # withdrawn
                               vote(6, 8, ("diagonal", "diagonal"))]  # one class, twice: a label
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    rows = {row["map_id"]: row for row in load_labeled_set(tmp_path / "labeled").rows}
    assert report.multi_choice == [ids[0], ids[1], ids[2]] and report.unlabeled == 1 and ids[1] not in rows
    assert rows[ids[0]]["label"] == "block" and rows[ids[0]]["n_annotations"] == 1 and report.kappa_maps == 0
    assert rows[ids[2]]["label"] == "diagonal" and rows[ids[2]]["n_annotations"] == 1
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "multi", "--export", tmp_path / "export.json"], capsys)
    assert code == 0, err
    assert f"annotations with several classes chosen (not counted): 3 (first: {ids[0]})" in out.splitlines()


def test_pull_tells_annotators_by_user_id_not_by_the_email_shown(tmp_path, synthetic_sample, monkeypatch):
    """Pull told annotators apart by the name shown for them (email, else username), which can change between
    pulls and need not be unique: two users shown under one name were one voter (the later one's label replaced
    the earlier's), and an annotator who changed their email between pulls, or the same project pulled from the
    server (emails) and from an export file (user ids), held each annotation under two names, so a merge of the
    two sets counted it twice. Now a voter is a user id, annotations.csv records it (annotator_id), and a merge
    recognises one annotation by it."""
    sample = synthetic_sample("who", 3)
    ids = [row["map_id"] for row in read_index(sample)]
    tasks = _export_of(sample, {ids[2]: "vertical"})  # user 1

    def vote(number, user, label):
        return {"id": number, "completed_by": user, "created_at": f"2026-01-01T00:00:{number:02d}Z",
                "was_cancelled": False, "result": [{"value": {"choices": [label]}}]}

    tasks[0]["annotations"] = [vote(1, 7, "block"), vote(2, 8, "block")]
    tasks[1]["annotations"] = [vote(3, 7, "vertical"), vote(4, 8, "diagonal")]
    export = tmp_path / "export.json"
    export.write_text(json.dumps(tasks))
    names = {1: "ann@lab.org", 7: "ann@lab.org", 8: "ann@lab.org"}  # three users, one name shown (usernames)

    def pull_from_server(out):
        """A pull through the server's door: the same tasks, annotators named by the user list."""
        monkeypatch.setattr(ls, "connect", lambda credentials: None)
        monkeypatch.setattr(ls, "resolve_project", lambda *args: 5)
        monkeypatch.setattr(ls, "_shows_preannotations", lambda *args: None)
        monkeypatch.setattr(ls, "existing_tasks", lambda *args: ls.read_export(export))
        monkeypatch.setattr(ls, "_user_names", lambda *args: dict(names))
        return ls.pull(ls.Credentials("http://127.0.0.1:1", "token"), sample, out)

    report = pull_from_server(tmp_path / "v1")
    assert report.repeated == [] and report.kappa_maps == 2 and report.n_annotators == 3 and report.ties == [ids[1]]
    first = read_annotations(tmp_path / "v1" / "annotations.csv")
    assert sorted(first.annotator_id) == ["1", "7", "7", "8", "8"] and set(first.annotator) == {"ann@lab.org"}
    names[7] = "ann@new.org"  # user 7 changed their email
    pull_from_server(tmp_path / "v2")
    ls.pull(None, sample, tmp_path / "from-export", export=export)  # named by user id
    older = Path(shutil.copytree(tmp_path / "v1", tmp_path / "older"))  # v1 as pulled before annotator_id was kept
    first.drop(columns="annotator_id").to_csv(older / "annotations.csv", index=False)
    sets = [older, tmp_path / "v1", tmp_path / "v2", tmp_path / "from-export"]
    merged = merge_labeled_sets(sets, tmp_path / "merged")
    assert len(merged) == 3
    assert len(read_annotations(tmp_path / "merged" / "annotations.csv")) == 5  # each annotation once


def test_pull_counts_the_maps_that_skips_left_out_of_the_set_once_each(tmp_path, synthetic_sample, monkeypatch,
                                                                      capsys):
    """`skipped: N` counted skip annotations: a map two annotators skipped counted twice, and a map that another
    annotator labeled (in the set) or that its annotator labeled after skipping it counted too, so N was neither the
    maps left out nor anything a user could check. Now it is the maps left out of the set because they were skipped,
    each once, and the line says so."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("skips", 5), tmp_path / "workspace" / "annotation" / "samples"
                                  / "skips"))
    ids = [row["map_id"] for row in read_index(sample)]
    tasks = _export_of(sample, {ids[4]: "block"})

    def vote(number, user, label, skip=False):
        return {"id": number, "completed_by": user, "created_at": f"2026-01-01T00:00:{number:02d}Z",
                "was_cancelled": skip, "result": [{"value": {"choices": [label]}}] if label else []}

    tasks[0]["annotations"] = [vote(1, 7, None, skip=True), vote(2, 8, None, skip=True)]  # left out: skipped twice
    tasks[1]["annotations"] = [vote(3, 7, None, skip=True), vote(4, 8, "block")]  # in the set: 8 labeled it
    tasks[2]["annotations"] = [vote(5, 7, None, skip=True), vote(6, 7, "diagonal")]  # in the set: 7 came back
    tasks[3]["annotations"] = [vote(7, 8, None, skip=True)]  # left out: skipped
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    assert report.labeled == 3 and report.skipped == [ids[0], ids[3]]
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "skips", "--export", tmp_path / "export.json"], capsys)
    assert code == 0 and "labeled set" in out and ": 3 maps" in out, err
    assert f"maps left out because their annotators skipped them: 2 (first: {ids[0]})" in out.splitlines()


def test_pull_counts_annotations_without_an_annotator_id_apart_from_the_annotators(tmp_path, synthetic_sample,
                                                                                   monkeypatch, capsys):
    """Pull's annotator count lumped every annotation that names no user (no completed_by) together as one
    annotator: two users and three such annotations printed '3 annotators'. Each such annotation is its own voter
    and nobody knows who wrote it, so now the line says how many annotations name no annotator, apart from the
    users counted, and pull_report.json keeps both."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("anonymous", 2), tmp_path / "workspace" / "annotation"
                                  / "samples" / "anonymous"))
    tasks = _export_of(sample, {})
    votes = [[(7, "block"), (8, "block"), (None, "block")], [(7, "vertical"), (None, "diagonal"), (None, "vertical")]]
    for task, labels in zip(tasks, votes, strict=True):
        task["annotations"] = [{"id": 10 * task["id"] + k, "completed_by": user, "was_cancelled": False,
                                "created_at": f"2026-01-01T00:{task['id']:02d}:{k:02d}Z",
                                "result": [{"value": {"choices": [label]}}]} for k, (user, label) in enumerate(labels)]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "anonymous", "--export", tmp_path / "export.json"],
                                capsys)
    assert code == 0, err
    assert ("inter-annotator agreement over the 2 maps with several annotators (2 annotators and 3 annotations that "
            "name no annotator): ") in out
    written = json.loads(next((tmp_path / "workspace" / "annotation" / "labeled" / "anonymous").glob(
        "v*/pull_report.json")).read_text())
    assert (written["n_annotators"], written["unidentified_annotations"]) == (2, 3)
    for task in tasks:  # no annotation names its annotator
        for annotation in task["annotations"]:
            annotation["completed_by"] = None
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "anonymous", "--export", tmp_path / "export.json"],
                                capsys)
    assert code == 0, err
    assert "several annotators (6 annotations that name no annotator): " in out


def test_pulls_kappa_leaves_out_the_labels_that_settled_ties(tmp_path, synthetic_sample, monkeypatch, capsys):
    """A three-way split is settled by a fourth label (docs/labeling.md), asked for because the three disagreed.
    Fleiss' kappa counted it, so pull's agreement rose with every tie settled (panel-7-images-only: 0.872 where its
    card, counting the three independent labels, says 0.871). Now the kappa is the independent round's, and the
    printed line says how many settling labels it leaves out; a map that simply has more annotators keeps them."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("settled", 6), tmp_path / "workspace" / "annotation" / "samples"
                                  / "settled"))
    tasks = _export_of(sample, {})
    rounds = [["vertical", "block", "diagonal", "block"],  # a three-way split, settled by a fourth label
              ["vertical", "vertical", "block"], ["block", "block", "block"], ["diagonal", "diagonal", "diagonal"],
              ["block", "vertical", "block"],
              ["vertical", "vertical", "block", "vertical"]]  # no tie among the first three: all four count
    for task, labels in zip(tasks, rounds, strict=True):
        task["annotations"] = [{"id": 10 * task["id"] + k, "completed_by": k + 1, "was_cancelled": False,
                                "created_at": f"2026-01-01T00:{task['id']:02d}:{k:02d}Z",
                                "result": [{"value": {"choices": [label]}}]} for k, label in enumerate(labels)]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    independent = [rounds[0][:3], *rounds[1:]]
    assert report.kappa == pytest.approx(fleiss_kappa(independent)) and report.kappa_maps == 6
    assert report.kappa < fleiss_kappa(rounds) and report.settling_labels == 1 and report.ties == []
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "settled", "--export", tmp_path / "export.json"],
                                capsys)
    assert code == 0, err
    low, high = fleiss_kappa_interval(independent)
    assert (report.kappa_ci_low, report.kappa_ci_high) == pytest.approx((low, high))
    assert ("inter-annotator agreement over the 6 maps with several annotators (4 annotators; before the 1 labels "
            f"that settled ties): Fleiss' kappa {report.kappa:.3f} [{low:.2f}, {high:.2f}] (bootstrap 95% over 6 "
            "maps)") in out.splitlines()
    written = json.loads(next((tmp_path / "workspace" / "annotation" / "labeled" / "settled").glob(
        "v*/pull_report.json")).read_text())
    assert (written["kappa_ci_low"], written["kappa_ci_high"]) == pytest.approx((low, high))


# six maps, three labels each: three unanimous, three split two to one
KAPPA_ITEMS = [["block", "block", "block"], ["vertical", "vertical", "vertical"], ["diagonal", "diagonal", "diagonal"],
               ["block", "block", "vertical"], ["vertical", "diagonal", "vertical"], ["diagonal", "block", "diagonal"]]


def test_fleiss_kappa_interval_holds_the_kappa_and_narrows_with_more_maps():
    """pull printed Fleiss' kappa as a bare number; its bootstrap interval over the maps must contain it and
    shrink when the same agreement is measured on ten times the maps."""
    kappa = fleiss_kappa(KAPPA_ITEMS)
    low, high = fleiss_kappa_interval(KAPPA_ITEMS)
    assert low < kappa < high and -1 <= low and high <= 1
    more_low, more_high = fleiss_kappa_interval(KAPPA_ITEMS * 10)
    assert fleiss_kappa(KAPPA_ITEMS * 10) == pytest.approx(kappa)
    assert more_low < kappa < more_high and more_high - more_low < (high - low) / 2
    assert list(fleiss_kappa_interval(KAPPA_ITEMS)) == [low, high]  # seed fixed: the same interval every time


def test_fleiss_kappa_interval_is_nan_from_one_map_and_leaves_out_one_class_draws():
    """One map resampled shows no spread: no interval, not [k, k]. A draw whose labels are all one class has no
    kappa (NaN, as fleiss_kappa gives it) and is left out: two unanimous maps of different classes agree
    perfectly in every draw that holds both, so the interval is [1, 1], not NaN."""
    assert np.isnan(fleiss_kappa_interval([["block", "vertical", "block"]])).all()
    assert np.isnan(fleiss_kappa([["block", "block"], ["block", "block"]]))
    assert list(fleiss_kappa_interval([["block", "block"], ["vertical", "vertical"]])) == pytest.approx([1.0, 1.0])


def test_cohen_kappa_interval_on_hand_made_labels():
    """The cards gave each annotator pair's Cohen's kappa as a bare number, computed by no code here. Now
    annotation.dataset.cohen_kappa computes it and cohen_kappa_interval gives its percentile bootstrap interval over
    the items. A textbook table (50 items: 20 both yes, 15 both no, 5 and 10 split) has kappa 0.4, inside its
    interval; two annotators who agree on every item of two classes get [1, 1]."""
    first = np.array([0] * 20 + [0] * 5 + [1] * 10 + [1] * 15)
    second = np.array([0] * 20 + [1] * 5 + [0] * 10 + [1] * 15)
    assert ds.cohen_kappa(first, second) == pytest.approx(0.4)
    assert ds.cohen_kappa(first, second) == pytest.approx(cohen_kappa_score(first, second))
    low, high = ds.cohen_kappa_interval(first, second)
    assert 0 < low < 0.4 < high < 0.8
    assert list(ds.cohen_kappa_interval(first, second)) == [low, high]  # seed fixed: the same interval every time
    assert list(ds.cohen_kappa_interval(first, first)) == pytest.approx([1.0, 1.0])
    assert np.isnan(ds.cohen_kappa(np.zeros(4, int), np.zeros(4, int)))  # chance agreement certain: undefined
    assert np.isnan(ds.cohen_kappa_interval(first[:1], second[:1])).all()  # one item resampled shows no spread
    with pytest.raises(AttnpatError, match="Cohen's kappa needs two labels of each item"):
        ds.cohen_kappa_interval(first, second[:-1])


def test_annotate_agreement_gives_every_agreement_figure_with_its_interval(tmp_path, capsys):
    """The data cards and docs/results.md gave Fleiss' kappa, each pair's agreement and Cohen's kappa, and two
    panels' agreement on the same maps without intervals, from no command. `attnpat annotate agreement` prints each
    with its percentile bootstrap 95% interval over the maps; a set without annotations, or --against a set of other
    maps, is one error line."""
    labeled = load_labeled_set(save_tiny_labeled_set(tmp_path / "a", 4, seed=1, task="a"))
    rows = [{"map_id": map_id, "label": CLASSES[label]} for map_id, label in zip(labeled.map_ids, labeled.labels)]
    maps = dict(zip(labeled.map_ids, labeled.maps))
    votes = {who: [CLASSES[(label + (k % shift == 0)) % len(CLASSES)] for k, label in enumerate(labeled.labels)]
             for who, shift in (("x", 7), ("y", 5), ("z", 3))}  # every 7th, 5th, 3rd map called the next class
    annotations = [{"map_id": map_id, "label": votes[who][k], "annotator": who, "labeled_at": f"t{k}"}
                   for k, map_id in enumerate(labeled.map_ids) for who in votes]
    panel = ds.write_labeled_folder(tmp_path / "panel", rows, maps, annotations, {})
    code, out, err, _ = run_cli(["annotate", "agreement", "--data", panel, "--against", tmp_path / "a"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    by_id = np.argsort(labeled.map_ids)  # maps are resampled in map-id order, as pull takes them
    per_map = [list(labels) for labels in np.array(list(zip(*votes.values())))[by_id]]
    kappa, (low, high) = fleiss_kappa(per_map), fleiss_kappa_interval(per_map)
    unanimous = sum(len(set(labels)) == 1 for labels in per_map)
    assert lines[0] == (f"{panel}: Fleiss' kappa {kappa:.3f} (95% CI {low:.3f}-{high:.3f}) over the {len(rows)} maps "
                        f"with two or more first-round labels; {unanimous} of them unanimous")
    first, second = (np.array([CLASSES.index(label) for label in votes[who]])[by_id] for who in ("x", "y"))
    pair_low, pair_high = ds.cohen_kappa_interval(first, second)
    assert lines[1].startswith(f"annotators x vs y ({len(rows)} maps, first round): macro-F1 ")
    assert lines[1].endswith(f"Cohen's kappa {ds.cohen_kappa(first, second):.3f} (95% CI {pair_low:.3f}-"
                             f"{pair_high:.3f})")
    assert f", agreement {np.mean(first == second):.3f} (95% CI " in lines[1]
    assert lines[4].startswith(f"first label against second, whoever gave them ({len(rows)} maps): macro-F1 ")
    x, y = (np.array([CLASSES.index(label) for label in votes[who]]) for who in ("x", "y"))
    assert lines[4].split("Cohen's kappa ")[1].startswith(f"{ds.cohen_kappa(x, y):.3f} (95% CI")  # x's labels first
    assert len(lines) == 6 and lines[5].startswith(f"{panel} against {tmp_path / 'a'} (their labels of the same "
                                                   f"{len(rows)} maps): macro-F1 1.000 (95% CI 1.000-1.000)")
    assert lines[5].endswith("Cohen's kappa 1.000 (95% CI 1.000-1.000)")  # the majority is the set's own labels
    # labels before a relabel stand in for annotations.csv's on the maps they hold: here, map 0 split three ways
    relabeled = labeled.map_ids[0]
    (panel / "before.csv").write_text("map_id,label,annotator,labeled_at\n" + "".join(
        f"{relabeled},{CLASSES[k]},{who},t0\n" for k, who in enumerate(votes)))
    code, out, err, _ = run_cli(["annotate", "agreement", "--data", panel, "--earlier-labels", "before.csv"], capsys)
    assert code == 0, err
    earlier = [list(CLASSES[:3])] + [list(labels) for labels in zip(*votes.values())][1:]
    assert out.startswith(f"{panel} (with before.csv): Fleiss' kappa {fleiss_kappa(earlier):.3f} (95% CI ")
    cases = [(["--data", tmp_path / "a"], f"error: {tmp_path / 'a'}: no map has two first-round labels, so there is "
                                          "no agreement to measure"),
             (["--data", panel, "--earlier-labels", "../a/labels.csv"], "error: --earlier-labels '../a/labels.csv' "
                                                                         f"must name a file in {panel} (no '/')"),
             (["--data", panel, "--against", save_tiny_labeled_set(tmp_path / "b", 1, seed=2, task="b")],
              f"error: --against {tmp_path / 'b'} must hold the same maps as --data {panel}")]
    for argv, expected in cases:
        code, _, err, errors = run_cli(["annotate", "agreement", *argv], capsys)
        assert code == 2 and len(errors) == 1 and errors[0].startswith(expected) and "Traceback" not in err, err


def test_pulls_kappa_is_undefined_not_perfect_when_every_label_is_one_class(tmp_path, synthetic_sample, monkeypatch,
                                                                          capsys):
    """Two annotators who both call every map vertical: chance agreement is certain, so kappa is 0 / 0. Before,
    fleiss_kappa returned 1.0 and pull printed `Fleiss' kappa 1.000`, a perfect agreement beyond chance that the
    labels cannot show."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("one-class", 3), tmp_path / "workspace" / "annotation" / "samples"
                                  / "one-class"))
    tasks = _export_of(sample, {})
    for task in tasks:
        task["annotations"] = [{"id": 10 * task["id"] + user, "completed_by": user, "was_cancelled": False,
                                "created_at": f"2026-01-01T00:{task['id']:02d}:{user:02d}Z",
                                "result": [{"value": {"choices": ["vertical"]}}]} for user in (1, 2)]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    assert np.isnan(fleiss_kappa([["vertical", "vertical"], ["vertical", "vertical", "vertical"]]))
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "one-class", "--export", tmp_path / "export.json"],
                                capsys)
    assert code == 0, err
    assert ("inter-annotator agreement: Fleiss' kappa undefined over 3 maps with several annotators: every label is "
            "the same class") in out.splitlines()
    report = json.loads(next((tmp_path / "workspace" / "annotation" / "labeled" / "one-class").glob(
        "v*/pull_report.json")).read_text())
    assert report["kappa"] is None and report["kappa_maps"] == 3


def test_pull_counts_each_task_once_and_the_parts_add_up_to_the_project(tmp_path, synthetic_sample, monkeypatch,
                                                                       capsys):
    """`not yet labeled: N tasks` counted the maps left out by skips again (a skipped map is in both lines), so
    labeled + skipped + not yet labeled came to more than the project's tasks. Now every task is in exactly one
    part (labeled, skipped, not yet labeled, set aside: not in the sample or changed since the push), and the
    summary line shows the parts adding up to the project's tasks."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("tally", 8), tmp_path / "workspace" / "annotation" / "samples"
                                  / "tally"))
    ids = [row["map_id"] for row in read_index(sample)]
    tasks = _export_of(sample, {ids[0]: "block", ids[1]: "vertical", ids[2]: "diagonal"})
    skip = {"id": 50, "completed_by": 7, "created_at": "2026-01-01T00:01:00Z", "was_cancelled": True, "result": []}
    tasks[3]["annotations"] = [skip]  # skipped, and not also waiting for a label
    tasks[4]["annotations"] = [{**skip, "id": 51, "was_cancelled": False,
                                "result": [{"value": {"choices": ["spiral"]}}]}]  # no usable label yet
    tasks[5]["data"]["map_sha256"] = "0" * 64  # changed since the push: set aside
    stranger = {**tasks[0], "id": 99, "data": {**tasks[0]["data"], "map_id": "synthetic:elsewhere:ex0:L0H0"}}
    tasks.append(stranger)  # a task of another sample: set aside
    # tasks 6 and 7: no annotation at all
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    parts = report.task_parts()
    assert parts == {"labeled": 3, "skipped": 1, "not yet labeled": 3, "set aside": 2}
    assert sum(parts.values()) == report.tasks == len(tasks) == 9
    assert report.skipped == [ids[3]] and report.hash_mismatch == [ids[5]]
    assert report.not_in_sample == ["synthetic:elsewhere:ex0:L0H0"]
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "tally", "--export", tmp_path / "export.json"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert not any(line.startswith("not yet labeled") for line in lines)  # one count, in the summary line
    assert ("tasks in the project: 9 = 3 labeled + 1 skipped + 3 not yet labeled + 2 set aside (not in the sample or "
            "changed since push)") in lines



def test_pull_lists_a_task_not_in_the_sample_once_as_set_aside(tmp_path, synthetic_sample, monkeypatch, capsys):
    """A task of another sample was listed twice in pull's report: under "unknown labels or maps" and, counted, under
    "set aside". Now it is listed once, as set aside, and "unknown labels" holds the labels that are not a class."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("aside", 3), tmp_path / "workspace" / "annotation" / "samples"
                                  / "aside"))
    ids = [row["map_id"] for row in read_index(sample)]
    tasks = _export_of(sample, {ids[0]: "block", ids[1]: "spiral"})
    stranger = {**tasks[0], "id": 99, "data": {**tasks[0]["data"], "map_id": "synthetic:elsewhere:ex0:L0H0"}}
    (tmp_path / "export.json").write_text(json.dumps([*tasks, stranger]))
    report = ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    assert report.not_in_sample == ["synthetic:elsewhere:ex0:L0H0"] and report.unknown == [f"{ids[1]}: 'spiral'"]
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "aside", "--export", tmp_path / "export.json"], capsys)
    assert code == 0, err
    mentions = [line for line in out.splitlines() if "synthetic:elsewhere" in line]
    assert mentions == ["maps not in the sample (set aside): 1 (first: synthetic:elsewhere:ex0:L0H0)"]
    assert f"unknown labels: 1 (first: {ids[1]}: 'spiral')" in out.splitlines()
    assert ("tasks in the project: 4 = 1 labeled + 0 skipped + 2 not yet labeled + 1 set aside (not in the sample or "
            "changed since push)") in out.splitlines()


def test_two_pulls_at_once_write_two_versions_not_one(tmp_path, synthetic_sample, monkeypatch, capsys):
    """Two `annotate pull` of one sample at the same moment both chose the next version, v1, and the later one
    replaced the earlier set: two pulls, one labeled set. The version is now chosen, and the set renamed into place,
    under a lock in the sample's labeled folder, so the two pulls write v1 and v2."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    samples = tmp_path / "workspace" / "annotation" / "samples"
    sample = Path(shutil.copytree(synthetic_sample("race", 5), samples / "race"))
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export_of(sample, {row["map_id"]: "block" for row in read_index(sample)})))
    both_read, real_read = threading.Barrier(2, timeout=60), ls.read_export

    def read_together(path):
        tasks = real_read(path)
        both_read.wait()  # both pulls have read their annotations (before: each had chosen its version too)
        return tasks

    monkeypatch.setattr(ls, "read_export", read_together)
    codes = []
    pulls = [threading.Thread(target=lambda: codes.append(main(["annotate", "pull", "--sample", "race", "--export",
                                                                str(export)]))) for _ in range(2)]
    [pull.start() for pull in pulls]
    [pull.join(timeout=120) for pull in pulls]
    captured = capsys.readouterr()
    assert codes == [0, 0], captured.err
    labeled = tmp_path / "workspace" / "annotation" / "labeled" / "race"
    assert sorted(path.name for path in labeled.iterdir()) == ["v1", "v2"]  # and no lock file left
    assert all(len(load_labeled_set(labeled / version)) == 5 for version in ("v1", "v2"))
    assert f"labeled set {labeled / 'v1'}: 5 maps" in captured.out and f"labeled set {labeled / 'v2'}: 5 maps" \
        in captured.out


def test_the_next_version_of_a_labeled_set_counts_only_its_version_folders(tmp_path, synthetic_sample, monkeypatch,
                                                                          capsys):
    """Versions are numbered as numbers (v10 after v9, not after v1), and a folder that only looks like one (v3-old,
    a hidden staging folder, v² that a user made by hand) is passed over; before, `v²` stopped every pull of the
    sample with a ValueError traceback (str.isdigit takes '²', int() does not)."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    sample = Path(shutil.copytree(synthetic_sample("numbered", 3), tmp_path / "workspace" / "annotation" / "samples"
                                  / "numbered"))
    labeled = tmp_path / "workspace" / "annotation" / "labeled" / "numbered"
    for name in ("v1", "v9", "v10", "v3-old", "v\u00b2", "v\u0663\u0663", ".v12.x.partial"):
        (labeled / name).mkdir(parents=True)
    export = tmp_path / "export.json"
    export.write_text(json.dumps(_export_of(sample, {row["map_id"]: "block" for row in read_index(sample)})))
    code, out, err, _ = run_cli(["annotate", "pull", "--sample", "numbered", "--export", export], capsys)
    assert code == 0, err
    assert f"labeled set {labeled / 'v11'}: 3 maps" in out and len(load_labeled_set(labeled / "v11")) == 3


def test_push_refuses_a_project_whose_tasks_hold_other_maps_under_the_samples_ids(tmp_path, synthetic_sample,
                                                                                  monkeypatch):
    """A sample deleted and drawn again (from a changed model) keeps its map ids but not its maps. Push counted a
    task of the old drawing as already there and imported the rest, so the panel labeled it, and pull set every
    label on it aside as changed since the push. Now push names such tasks in one error line and imports nothing."""
    sample = synthetic_sample("redrawn", 4)
    ids = [row["map_id"] for row in read_index(sample)]
    present = _export_of(sample, {})[:3]
    present[1]["data"]["map_sha256"] = ls.map_sha256(np.eye(5, dtype=np.float32))  # the earlier drawing's map
    imported = []
    client = types.SimpleNamespace(projects=types.SimpleNamespace(
        import_tasks=lambda id, request, return_task_ids: imported.extend(request)),
        tasks=types.SimpleNamespace(update=lambda id, data: None))  # the tasks there get the current caption
    monkeypatch.setattr(ls, "connect", lambda credentials: client)
    monkeypatch.setattr(ls, "ensure_project", lambda *args: (5, False, None))
    monkeypatch.setattr(ls, "existing_tasks", lambda *args: ls.check_export(present))
    with pytest.raises(AttnpatError, match=rf"project 5 holds 1 of sample {sample.name}'s maps with other values "
                                           rf"\(first: {ids[1]}\): .*push to another project") as caught:
        ls.push(ls.Credentials("http://127.0.0.1:1", "token"), sample, progress=False, log=lambda message: None)
    assert "\n" not in str(caught.value) and imported == []
    present[1]["data"]["map_sha256"] = ls.map_sha256(read_single_maps(sample / "maps.npz")[ids[1]])
    report = ls.push(ls.Credentials("http://127.0.0.1:1", "token"), sample, progress=False, log=lambda message: None)
    assert (report.pushed, report.already_there) == (1, 3) and [task["data"]["map_id"] for task in imported] == ids[3:]


def test_two_projects_of_the_samples_title_are_one_error_not_the_first_one(tmp_path, synthetic_sample, monkeypatch):
    """Without the push state file (another workspace, or the file deleted) a project is found by its title; with two
    projects of that title on the server (one made by hand, or pushed from another workspace) push and pull took
    the first one listed, pulling or adding to the wrong project in silence. Now both name the projects instead."""
    sample = synthetic_sample("twins", 3)
    title = f"attnpat patterns: {sample.name}"
    projects = [types.SimpleNamespace(id=3, title=title), types.SimpleNamespace(id=4, title="other"),
                types.SimpleNamespace(id=9, title=title)]
    client = types.SimpleNamespace(projects=types.SimpleNamespace(list=lambda: iter(projects)))
    monkeypatch.setattr(ls, "connect", lambda credentials: client)
    credentials = ls.Credentials("http://127.0.0.1:1", "token")
    message = rf"2 projects on http://127.0.0.1:1 are titled '{title}' \(ids 3, 9\); rename all but"
    with pytest.raises(AttnpatError, match=message):
        ls.pull(credentials, sample, tmp_path / "labeled")
    with pytest.raises(AttnpatError, match=message):
        ls.push(credentials, sample, progress=False, log=lambda text: None)
    assert not (tmp_path / "labeled").exists()
    projects.pop()  # one project of that title: found
    assert ls.resolve_project(client, credentials.url, title, {}) == 3


@pytest.mark.parametrize("mangle, message", [
    (lambda tasks: {"tasks": tasks}, "is a JSON list of tasks, got dict"),
    (lambda tasks: tasks[:2] + ["oops"], "task 3 is not a task"),
    (lambda tasks: [dict(tasks[0], annotations="none")] + tasks[1:], "task 1: annotations must be a list of objects"),
    (lambda tasks: [dict(tasks[0], data={"map_id": 7})] + tasks[1:], "task 1: map_id and map_sha256 must be strings"),
    (lambda tasks: tasks + [tasks[0]], "is in two tasks"),
    # before, read as a skip: the label was dropped and the map counted as skipped
    (lambda tasks: [dict(tasks[0], annotations=[dict(tasks[0]["annotations"][0], was_cancelled="false")])]
     + tasks[1:], "task 1: an annotation's was_cancelled is neither true nor false"),
])
def test_a_malformed_label_studio_export_is_one_error(tmp_path, synthetic_sample, mangle, message):
    sample = synthetic_sample("bad-export", 5)
    tasks = _export_of(sample, {row["map_id"]: "block" for row in read_index(sample)})
    (tmp_path / "export.json").write_text(json.dumps(mangle(tasks)))
    with pytest.raises(AttnpatError, match=message):
        ls.pull(None, sample, tmp_path / "labeled", export=tmp_path / "export.json")
    assert not (tmp_path / "labeled").exists()


def test_a_damaged_credentials_file_is_one_error(tmp_path, monkeypatch):
    monkeypatch.delenv("LABEL_STUDIO_URL", raising=False)
    monkeypatch.delenv("LABEL_STUDIO_API_KEY", raising=False)
    for damage in ("{not json", '["a list"]', '{"url": "http://x", "unexpected": 1}'):
        credentials_file(tmp_path).parent.mkdir(parents=True, exist_ok=True)
        credentials_file(tmp_path).write_text(damage)
        with pytest.raises(AttnpatError, match="credentials .* are unreadable .*; delete the file"):
            resolve_credentials(root=tmp_path)


# ------------------------------------------------------------------ found by trying further bad inputs

@pytest.mark.parametrize("argv, message", [
    (["compare", "--model", "x"], "No such option: --model"),
    (["nosuchverb"], "No such command 'nosuchverb'"),
    (["extract", "--n", "abc"], "Invalid value for '--n'"),
    (["annotate", "pull"], "Missing option '--sample'"),
    (["annotate", "serve", "--port", "99999"], "Invalid value for '--port'"),  # was an OverflowError traceback
    (["annotate", "serve", "--port", "0"], "Invalid value for '--port'"),  # started on 8080, waited on :0
])
def test_a_usage_error_is_one_error_line_not_a_traceback(capsys, argv, message):
    code, _, err, errors = run_cli(argv, capsys)
    assert code == 2 and len(errors) == 1 and message in errors[0] and "--help" in errors[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, option, bound", [
    (["train", "--data", "synthetic:6"], "--seed", "-1"),  # numpy refused it in a traceback
    (["cluster"], "--seed", "-1"),  # scikit-learn's MDS refused it after the maps were computed
    (["cluster"], "--seed", str(2**32)),  # ... and this one too, in a traceback
    (["train", "--data", "synthetic:6"], "--seed", str(2**32)),  # numpy: "Seed must be between 0 and 2**32 - 1"
    (["train", "--data", "synthetic:6"], "--seed", str(2**32 - 1)),  # its fold seeds (seed + k) went past that
    (["grad-importance"], "--seed", "-1"),
    (["finetune", "--task", "sst2"], "--seed", "-1"),
    (["annotate", "push", "--url", "http://127.0.0.1:9", "--token", "x"], "--seed", "-1"),
    (["train", "--data", "synthetic:6"], "--epochs", "0"),  # trained nothing and saved a random network
    (["train", "--data", "synthetic:6"], "--synthetic-mix", "-1"),  # was taken as 0
    (["special", "--task", "sst2"], "--top", "0"),  # listed no tokens; -1 listed all but the last
    (["probe-dep", "--parse", "sst2"], "--min-count", "-1"),
])
def test_a_seed_or_count_out_of_range_is_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, option, bound):
    monkeypatch.chdir(tmp_path)  # a verb that got through would write its runs or models here
    runs = ["--runs-dir", tmp_path / "runs"] if argv[0] != "annotate" else []
    code, _, err, errors = run_cli([*argv, option, bound, *runs], capsys)
    assert code == 2 and len(errors) == 1 and f"Invalid value for '{option}'" in errors[0], err
    side = "less than or equal to 2147483647" if int(bound) > 0 else "greater than or equal to"
    assert side in errors[0] and "Traceback" not in err
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("verb, model", [("extract", "--model"), ("overview", "--model"), ("classify", "--model"),
                                         ("grad-importance", "--model"), ("compare", "--finetuned")])
def test_batch_size_is_checked_before_any_file_is_written(tmp_path, capsys, tiny_model, verb, model):
    (tmp_path / "d.csv").write_text("text\nhello there\n")
    code, _, err, errors = run_cli([verb, model, tiny_model, "--task", tmp_path / "d.csv", "--batch-size", "0",
                                    "--runs-dir", tmp_path / "runs"], capsys)
    assert code == 2 and errors == ["error: batch size must be positive, got 0"], err
    assert files_under(tmp_path / "runs") == []


def test_damaged_state_files_are_one_error_or_recomputed(tmp_path, capsys, tiny_model):
    """Files attnpat keeps between runs (extraction index, sweep records, push state, model record), cut off or
    edited by hand: one error line saying what to delete, or (sweep records, a cache) recomputed."""
    (tmp_path / "d.csv").write_text("text,label\nhello there,1\nbye now,0\n")
    runs = tmp_path / "runs"
    extract = ["extract", "--model", tiny_model, "--task", tmp_path / "d.csv", "--runs-dir", runs, "-q"]
    assert run_cli(extract, capsys)[0] == 0
    (index,) = runs.glob("*/*/maps/index.json")
    index.write_text('{"model": ')
    code, _, err, errors = run_cli(extract, capsys)
    assert code == 2 and len(errors) == 1 and "extraction index" in errors[0] and "damaged" in errors[0], err

    disable = ["disable", "--model", tiny_model, "--task", tmp_path / "d.csv", "--unit", "layer", "--runs-dir", runs,
               "-q"]
    assert run_cli(disable, capsys)[0] == 0
    (table,) = runs.glob("*/*/disable_layers.csv")
    expected = table.read_bytes()
    for record in table.parent.glob(".sweep-*/*.json"):
        record.write_text("[1")
    table.unlink()
    assert run_cli(disable, capsys)[0] == 0 and table.read_bytes() == expected

    state = tmp_path / "projects.json"
    state.write_text("{not json")
    with pytest.raises(AttnpatError, match="push state file .* is damaged .*; delete it"):
        ls._read_state(state)
    meta = tmp_path / "stored-model"
    shutil.copytree(tiny_model, meta)
    (meta / "attnpat.json").write_text("[]")
    code, _, _, errors = run_cli(["overview", "--model", meta, "--task", tmp_path / "d.csv", "--runs-dir", runs,
                                  "-q"], capsys)
    assert code == 2 and "attnpat record" in errors[0]


def test_a_damaged_sample_index_names_its_line(tmp_path):
    row = json.dumps({"map_id": "m:t:e:L0H0", "image": "a.png", "task": "t", "example_id": "e", "layer": 0,
                      "head": 0, "n": 2, "tokens": ["a", "b"]})
    (tmp_path / "index.jsonl").write_text(f'{row}\n\n{{"map_id": \n')
    with pytest.raises(AttnpatError, match="index.jsonl line 3 is damaged"):
        read_index(tmp_path)
    (tmp_path / "index.jsonl").write_text(f"{row}\n[1, 2]\n")
    with pytest.raises(AttnpatError, match="line 2 is not a sample row"):
        read_index(tmp_path)
    (tmp_path / "index.jsonl").write_text(f"{row}\n" + '{"map_id": "m:t:e:L0H1", "image": "b.png"}\n')
    with pytest.raises(AttnpatError, match="line 2 is not a sample row .*example_id"):
        read_index(tmp_path)


def test_batch_jobs_refuse_models_the_app_does_not_list(tmp_path, tiny_model):
    with pytest.raises(AttnpatError, match="is not one this app offers .*--allow-any-model"):
        WebApp(tmp_path).jobs.arguments("overview", str(tiny_model), "sst2", 10)
    assert WebApp(tmp_path).jobs.arguments("overview", "minilm", "sst2", 10)[:3] == ["overview", "--model", "minilm"]
    argv = WebApp(tmp_path, allow_any_model=True).jobs.arguments("overview", str(tiny_model), "sst2", 10)
    assert argv[:3] == ["overview", "--model", str(tiny_model)]


@pytest.mark.parametrize("verb", [["surface"], ["cluster"], ["special", "--no-base"], ["compare-kinds"],
                                  ["importance"], ["prune", "--step", "0.5"], ["classify"]])
def test_column_options_reach_every_verb_that_reads_a_task(tmp_path, capsys, tiny_model, verb):
    (tmp_path / "r.tsv").write_text("Review\tStars\ngreat film here\tgood\ndull and slow\tbad\n")
    runs = tmp_path / "runs"
    code, _, err, _ = run_cli([*verb, "--model", tiny_model, "--task", tmp_path / "r.tsv", "--text-column", "review",
                               "--label-column", "stars", "--runs-dir", runs, "-q"], capsys)
    assert code == 0, err
    records = [record for manifest in runs.glob("*/*/manifest.json")
               for record in json.loads(manifest.read_text())["analyses"].values() if "data" in record]
    assert records and all(record["data"]["columns"] == {"text": "Review", "label": "Stars"} for record in records)


# ------------------------------------------------------------------ found by probing every verb and the app again

def test_merge_and_pull_never_replace_a_folder_that_is_not_a_labeled_set(tmp_path, capsys):
    save_tiny_labeled_set(tmp_path / "sets" / "a", 2, seed=1, task="a")
    save_tiny_labeled_set(tmp_path / "sets" / "b", 2, seed=2, task="b")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    (tmp_path / "afile").write_text("keep me too")
    sets = [tmp_path / "sets" / "a", tmp_path / "sets" / "b"]
    for out, why in ((tmp_path / "precious", "other files in it"), (tmp_path / "afile", "is a file"),
                     (tmp_path / "sets", "would replace the input set"),
                     (tmp_path / "sets" / "a", "would replace the input set")):
        before = files_under(tmp_path)
        code, _, err, errors = run_cli(["annotate", "merge", *sets, "--out", out], capsys)
        assert code == 2 and len(errors) == 1 and why in errors[0] and "Traceback" not in err, err
        assert files_under(tmp_path) == before
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    # an earlier labeled set of that name is replaced, as the verb says
    assert run_cli(["annotate", "merge", *sets, "--out", tmp_path / "merged"], capsys)[0] == 0
    assert run_cli(["annotate", "merge", *sets, "--out", tmp_path / "merged"], capsys)[0] == 0
    # pull checks its --out before it reads anything
    with pytest.raises(AttnpatError, match="other files in it"):
        ls.pull(None, tmp_path / "no-sample", tmp_path / "precious", export=tmp_path / "no-export.json")


def test_a_damaged_annotations_table_in_a_merged_set_is_one_error_line(tmp_path, capsys):
    save_tiny_labeled_set(tmp_path / "a", 2, seed=1, task="a")
    save_tiny_labeled_set(tmp_path / "b", 2, seed=2, task="b")
    for content in (b"", b"\xff\xfe\x00\x01binary", b"who,what\n1,2\n"):
        (tmp_path / "b" / "annotations.csv").write_bytes(content)
        code, _, err, errors = run_cli(["annotate", "merge", tmp_path / "a", tmp_path / "b", "--out",
                                        tmp_path / "m"], capsys)
        assert code == 2 and len(errors) == 1 and "annotations" in errors[0] and "Traceback" not in err, err
        assert not (tmp_path / "m").exists()



def test_merge_refuses_two_sets_with_other_tokens_for_one_map(tmp_path, capsys):
    """`annotate merge` of two sets holding other tokens for one map kept the later set's in silence (which text the
    map was made from was lost). Now that is one error line and nothing is written; equal tokens are kept once."""
    first = save_tiny_labeled_set(tmp_path / "a", 1, seed=1, task="a")
    labeled = load_labeled_set(first)
    rows = [{"map_id": map_id, "label": CLASSES[label]} for map_id, label in zip(labeled.map_ids, labeled.labels)]
    maps = dict(zip(labeled.map_ids, labeled.maps))
    words = {map_id: [f"w{k}" for k in range(len(attn))] for map_id, attn in maps.items()}
    ds.write_labeled_folder(first, rows, maps, [], {}, words)
    same = ds.write_labeled_folder(tmp_path / "same", rows, maps, [], {}, words)
    other_words = {**words, labeled.map_ids[0]: ["x"] * len(maps[labeled.map_ids[0]])}
    other = ds.write_labeled_folder(tmp_path / "other", rows, maps, [], {}, other_words)
    code, _, err, errors = run_cli(["annotate", "merge", first, other, "--out", tmp_path / "m"], capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0] == (f"error: map {labeled.map_ids[0]!r} has other tokens in {other} than in a set before it; "
                         "fix one first")
    assert not (tmp_path / "m").exists()
    assert run_cli(["annotate", "merge", first, same, "--out", tmp_path / "m"], capsys)[0] == 0
    assert load_labeled_set(tmp_path / "m").tokens == words


def test_merge_keeps_the_copy_of_an_annotation_that_carries_its_annotator_id(tmp_path, capsys):
    """`annotate merge` of a set pulled before annotator_id was kept and a later pull of the same annotations kept
    each annotation once, but as its first (id-less) copy, so the merged set told annotators apart by the email
    shown only. Now the copy with the user id is kept, in either order of the sets."""
    labeled = load_labeled_set(save_tiny_labeled_set(tmp_path / "a", 1, seed=1, task="a"))
    rows = [{"map_id": map_id, "label": CLASSES[label]} for map_id, label in zip(labeled.map_ids, labeled.labels)]
    maps = dict(zip(labeled.map_ids, labeled.maps))
    with_ids = [{"map_id": map_id, "label": row["label"], "annotator": "ann@lab.org", "labeled_at": f"t{k}",
                 "annotator_id": "7"} for k, (map_id, row) in enumerate(zip(labeled.map_ids, rows))]
    without_ids = [{key: value for key, value in record.items() if key != "annotator_id"} for record in with_ids]
    older = ds.write_labeled_folder(tmp_path / "older", rows, maps, without_ids, {})
    newer = ds.write_labeled_folder(tmp_path / "newer", rows, maps, with_ids, {})
    for order, out in (([older, newer], "m1"), ([newer, older], "m2")):
        assert run_cli(["annotate", "merge", *order, "--out", tmp_path / out], capsys)[0] == 0
        merged = read_annotations(tmp_path / out / "annotations.csv")
        assert len(merged) == len(with_ids) and list(merged.annotator_id) == ["7"] * len(with_ids)


def test_stop_signals_only_the_server_it_started(tmp_path):
    import subprocess  # noqa: PLC0415

    # stands for a Label Studio: an executable given by its full path, run on a data folder
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--data-dir",
                                  str(tmp_path / "data")], start_new_session=True)
    command_line = Path(f"/proc/{bystander.pid}/cmdline")
    deadline = time.monotonic() + 10
    while command_line.exists() and b"--data-dir" not in command_line.read_bytes() \
            and time.monotonic() < deadline:  # the child runs Python until its exec, on a busy machine a while
        time.sleep(0.01)
    try:
        pid_file = server._pid_file(tmp_path)
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        for content in (f"{bystander.pid} 8080 /opt/ls/bin/label-studio\n", f"{bystander.pid} 8080\n", "0 8080\n",
                        "1 8080\n", "abc\n", "", "-5 8080\n"):
            pid_file.write_text(content)
            assert server.running_pid(tmp_path) is None, content
            assert server.status(tmp_path)["running"] is False
            assert server.stop(tmp_path) is False and not pid_file.exists()
        assert bystander.poll() is None  # still running: never signalled
        # another checkout's Label Studio (same name, another path), or one on another data folder, is not ours
        pid_file.write_text(f"{bystander.pid} 8080 /other/checkout/bin/{Path(sys.executable).name}\n")
        assert server.running_pid(tmp_path) is None
        elsewhere = server._pid_file(tmp_path / "elsewhere")
        elsewhere.parent.mkdir(parents=True)
        elsewhere.write_text(f"{bystander.pid} 8080 {sys.executable}\n")
        assert server.running_pid(tmp_path / "elsewhere") is None
        # the pid of a process running the recorded executable on this folder's data counts
        pid_file.write_text(f"{bystander.pid} 8080 {sys.executable}\n")
        assert server.running_pid(tmp_path) == bystander.pid
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_copes_with_a_server_that_exits_meanwhile_or_is_a_child_of_its_own(tmp_path, monkeypatch):
    """A server that exits between stop's check and its signal is stopped (before, a ProcessLookupError
    traceback); one that this process started (a serve failing midway stops its own start) is reaped, not
    waited on as a zombie until the timeout ran out and then SIGKILLed."""
    import subprocess  # noqa: PLC0415
    import types  # noqa: PLC0415

    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    monkeypatch.setattr(server, "running_pid", lambda root=None: gone.pid)
    assert server.stop(tmp_path) is True
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        monkeypatch.setattr(server, "running_pid", lambda root=None: child.pid)
        waits = []
        monkeypatch.setattr(server, "time", types.SimpleNamespace(
            time=time.time, sleep=lambda seconds: (waits.append(seconds), time.sleep(seconds))))
        assert server.stop(tmp_path, timeout=60) is True
        assert len(waits) < 30  # SIGTERM ends it at once; a zombie would have been waited on for 60 s
        assert child.poll() is not None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("stored", [{"url": 5, "token": 7}, [1, 2], {"url": "http://127.0.0.1:8080"},
                                    {"url": "http://127.0.0.1:8080", "token": "t", "email": 3}])
def test_stored_credentials_of_the_wrong_shape_are_one_error(tmp_path, stored):
    credentials_file(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    credentials_file(tmp_path).write_text(json.dumps(stored))
    with pytest.raises(AttnpatError, match="credentials .* are unreadable"):
        server.load_credentials(tmp_path)


@pytest.mark.parametrize("url, why", [("localhost:8080", "full address"), ("http://[::1", "not a valid URL"),
                                      ("http://127.0.0.1:99999", "not a valid URL"),
                                      ("ftp://127.0.0.1", "full address")])
def test_a_malformed_server_url_is_named(tmp_path, url, why):
    with pytest.raises(AttnpatError, match=why):
        resolve_credentials(url, "token", root=tmp_path)


def test_push_checks_its_options_before_it_draws_or_writes(tmp_path):
    def refuse_network():
        raise AssertionError("the server was contacted before the options were checked")

    for count, tasks, name, shares, why in ((0, ["sst2"], None, None, "--count 0"),
                                            (-1, ["sst2"], None, None, "--count -1"),
                                            (4, ["nope"], None, None, "unknown task 'nope'"),
                                            (4, ["SST-2"], None, None, "did you mean 'sst2'"),  # load_data's check
                                            (4, ["r.csv"], None, None, "r.csv is a data file; here only a built-in"),
                                            (4, [], None, None, "names no task"),
                                            (4, ["sst2"], "../escaped", None, "plain folder name"),
                                            (4, ["sst2"], None, "block=1", "needs --stratify-by")):
        with pytest.raises(AttnpatError, match=why):
            ensure_sample(tmp_path / "samples", "minilm", count, tasks, 0, name, class_shares=shares,
                          before_drawing=refuse_network)
    assert files_under(tmp_path) == []
    # the server is checked after the options and before any map is drawn or any file written
    with pytest.raises(AttnpatError, match="server down"):
        ensure_sample(tmp_path / "samples", "minilm", 4, ["sst2"], 0, "s",
                      before_drawing=lambda: (_ for _ in ()).throw(AttnpatError("server down")))
    assert files_under(tmp_path) == []
    # settings of a sample whose drawing never finished (no index.jsonl) do not block a corrected rerun
    (tmp_path / "samples" / "s").mkdir(parents=True)
    (tmp_path / "samples" / "s" / "sample.json").write_text(json.dumps({"model": "minilm", "tasks": ["nope"]}))
    with pytest.raises(AttnpatError, match="server down"):
        ensure_sample(tmp_path / "samples", "minilm", 4, ["sst2"], 0, "s",
                      before_drawing=lambda: (_ for _ in ()).throw(AttnpatError("server down")))
    (tmp_path / "samples" / "s" / "index.jsonl").write_text("")
    with pytest.raises(AttnpatError, match="was made with other settings"):
        ensure_sample(tmp_path / "samples", "minilm", 4, ["sst2"], 0, "s", before_drawing=refuse_network)


def test_pull_names_a_sample_index_that_lacks_fields_or_maps(tmp_path):
    sample = tmp_path / "sample"
    sample.mkdir()
    write_single_maps(sample / "maps.npz", {"m:t:e:L0H0": np.full((3, 3), 1 / 3, dtype=np.float32)})
    (sample / "index.jsonl").write_text('{"map_id": "m:t:e:L0H0", "image": "a.png"}\n')
    with pytest.raises(AttnpatError, match="line 1 is not a sample row"):
        ls.pull(None, sample, tmp_path / "out", export=tmp_path / "x.json")
    row = {"image": "a.png", "task": "t", "example_id": "e", "layer": 0, "head": 0, "n": 3, "tokens": ["a"] * 3}
    (sample / "index.jsonl").write_text(json.dumps({"map_id": "m:t:e:L0H1", **row}) + "\n")
    with pytest.raises(AttnpatError, match="lists 1 maps that .*maps.npz lacks"):
        ls.pull(None, sample, tmp_path / "out", export=tmp_path / "x.json")
    assert not (tmp_path / "out").exists()


def test_an_export_with_a_huge_integer_is_one_error(tmp_path):
    (tmp_path / "export.json").write_text('[{"id": ' + "9" * 5000 + "}]")
    with pytest.raises(AttnpatError, match="is not a Label Studio JSON export"):
        ls.read_export(tmp_path / "export.json")


@pytest.mark.parametrize("manifest", [b'{"x": "\xe9"}', b"[1, 2]", b"null", b'{"analyses": [1]}',
                                      b'{"analyses": {"a": {"data": [1]}, "b": {"data": {"n_examples": [3]}}}}',
                                      None])
def test_one_damaged_manifest_does_not_break_the_runs_tab(tmp_path, manifest):
    good = RunDir("minilm", "sst2", tmp_path)
    with good.record("overview") as entry:
        entry["outputs"] = []
    bad = tmp_path / "minilm" / "rte" / "manifest.json"
    bad.parent.mkdir(parents=True)
    bad.mkdir() if manifest is None else bad.write_bytes(manifest)
    web = WebApp(tmp_path)
    table, _ = web.runs_table()
    assert sorted(table.task) == ["rte", "sst2"]
    assert json.loads(web.manifest("minilm/sst2"))["analyses"]
    shown = json.loads(web.manifest("minilm/rte"))
    assert shown == {"error": "unreadable manifest"} or "analyses" in shown


@pytest.mark.parametrize("rows", ["abc,0,x,1.0", ",0,x,1.0", "-5,0,x,1.0", "1.5,0,x,1.0", "0,0,x,abc",
                                  "100000000,0,x,1.0", "5000,5000,x,1.0"])
def test_a_damaged_layer_head_table_is_shown_as_a_table_not_drawn(tmp_path, rows):
    folder = tmp_path / "minilm" / "sst2"
    folder.mkdir(parents=True)
    (folder / "overview.csv").write_text(f"layer,head,metric,value\n0,0,x,2.0\n{rows}\n")
    message, *_ = WebApp(tmp_path).show_artifacts("Surface and clusters", "minilm", "sst2")
    assert isinstance(message, str)
    import pandas as pd  # noqa: PLC0415

    from analysis.figures import layer_head_figure  # noqa: PLC0415
    assert layer_head_figure(pd.read_csv(folder / "overview.csv")) is None


def test_a_damaged_disabling_table_leaves_the_tab_working(tmp_path):
    folder = tmp_path / "minilm" / "sst2"
    folder.mkdir(parents=True)
    (folder / "disable_heads.csv").write_text("layer,head,metric,value\n0,0,,1.0\n0,0,1,0.01\n")
    (folder / "disable_layers.csv").write_text("layer,mode,p_holm,delta\nx,uniform,abc,1\n")
    message, *_ = WebApp(tmp_path).show_artifacts("Disabling", "minilm", "sst2")
    assert isinstance(message, str) and "minilm/sst2" in message


def test_a_lone_surrogate_in_the_text_is_one_error(tmp_path, capsys, tiny_model):
    for line in ('{"text": "good \\ud800 film", "label": 1}', '{"text": "ok", "text_pair": "\\udfff", "label": 0}'):
        (tmp_path / "s.jsonl").write_text(line + "\n")
        code, _, err, errors = run_cli(["overview", "--model", tiny_model, "--task", tmp_path / "s.jsonl",
                                        "--runs-dir", tmp_path / "runs", "-q"], capsys)
        assert code == 2 and len(errors) == 1 and "lone surrogate" in errors[0] and "Traceback" not in err
    assert files_under(tmp_path / "runs") == []
    from app.explore import live_example  # noqa: PLC0415
    with pytest.raises(AttnpatError, match="lone surrogate"):
        live_example("abc\ud800")


def test_a_conllu_file_with_too_few_columns_is_one_error(tmp_path, capsys, tiny_model):
    (tmp_path / "few.conllu").write_text("1\tThe\tthe\n2\tcat\tcat\n\n")
    code, _, err, errors = run_cli(["probe-dep", tmp_path / "few.conllu", "--model", tiny_model, "--runs-dir",
                                    tmp_path / "runs", "-q"], capsys)
    assert code == 2 and len(errors) == 1 and "lacks the HEAD column" in errors[0] and "Traceback" not in err


@pytest.mark.parametrize("argv, why", [
    (["finetune", "--task", "sst2", "--n", "4", "--lr", "nan"], "learning rate must be positive"),
    (["finetune", "--task", "sst2", "--n", "4", "--device", "bogus"], "--device bogus"),
    (["finetune", "--task", "sst2", "--n", "4", "--name", "minilm"], "embedded model's name"),
    (["importance", "--task", "sst2", "--n", "2", "--exponent", "nan"], "exponent must be a positive number"),
    (["importance", "--task", "sst2", "--n", "2", "--exponent", "inf"], "exponent must be a positive number"),
    (["surface", "--task", "sst2", "--n", "2", "--broad-threshold", "nan"], "--broad-threshold"),
    (["surface", "--task", "sst2", "--n", "2", "--position-threshold", "-1"], "--position-threshold"),
    (["cluster", "--task", "sst2", "--n", "2", "--special-threshold", "5"], "--special-threshold"),
    (["train", "--data", "annotation/labeled/v5", "--class-weight-power", "nan"], "--class-weight-power"),
    (["evaluate", "--data", "annotation/labeled/panel-4", "--panel-size", "100000000"], "at most 10000")])
def test_more_out_of_range_options_are_refused_before_any_work(tmp_path, capsys, monkeypatch, argv, why):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path / "home"))
    code, _, err, errors = run_cli([*argv, "--runs-dir", tmp_path / "runs"], capsys)
    assert code == 2 and len(errors) == 1 and why in errors[0] and "Traceback" not in err, err
    assert files_under(tmp_path / "runs") == [] and files_under(tmp_path / "home") == []


def test_a_failing_option_of_compare_or_special_leaves_no_half_run(tmp_path, capsys, tiny_model):
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    runs = tmp_path / "runs"
    for argv in (["compare", "--base", tiny_model, "--finetuned", tiny_model, "--classifier",
                  tmp_path / "bad.safetensors"],
                 ["special", "--model", tiny_model, "--base", "no-such-model"]):
        code, _, err, errors = run_cli([*argv, "--task", "sst2", "--n", "2", "--runs-dir", runs, "-q"], capsys)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert files_under(runs) == []


def test_an_analysis_refuses_a_damaged_manifest_before_it_writes_a_table(tmp_path, capsys, tiny_model):
    folder = RunDir(Path(tiny_model).name, "sst2", tmp_path).path
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("[1, 2]")
    code, _, _, errors = run_cli(["overview", "--model", tiny_model, "--task", "sst2", "--n", "2", "--runs-dir",
                                  tmp_path, "-q"], capsys)
    assert code == 2 and "not a run manifest" in errors[0]
    assert files_under(folder) == ["manifest.json"]


def test_extract_does_not_resume_into_maps_of_another_kind(tmp_path, capsys, tiny_model):
    out = tmp_path / "maps"
    base = ["extract", "--model", tiny_model, "--task", "sst2", "--n", "2", "--out", out, "--runs-dir", tmp_path, "-q"]
    assert run_cli(base, capsys)[0] == 0
    code, _, _, errors = run_cli([*base, "--map-kind", "norm"], capsys)
    assert code == 2 and "other settings" in errors[0]


def test_a_model_whose_config_asks_for_layers_its_weights_lack_is_refused(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "m", layers=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    code, _, err, errors = run_cli(["overview", "--model", folder, "--task", "sst2", "--n", "2", "--runs-dir",
                                    tmp_path / "runs", "-q"], capsys)
    assert code == 2 and "config and weights disagree" in errors[0] and "Traceback" not in err


def test_a_trained_head_must_fit_the_datas_labels(tmp_path, capsys, tiny_model):
    (tmp_path / "five.jsonl").write_text('{"text": "good film", "label": 0}\n{"text": "bad film", "label": 5}\n')
    for verb in (["grad-importance"], ["importance"], ["disable", "--unit", "layer"]):
        code, _, err, errors = run_cli([*verb, "--model", tiny_model, "--task", tmp_path / "five.jsonl",
                                        "--runs-dir", tmp_path / "runs", "-q"], capsys)
        assert code == 2 and len(errors) == 1 and "classifier with 2 outputs" in errors[0], err
    assert files_under(tmp_path / "runs") == []


def test_a_trained_head_naming_the_datas_classes_in_another_order_is_one_error(tmp_path, capsys):
    """A file's names take ids in sorted order (negative 0, positive 1); a head that names its classes
    0 positive, 1 negative would have every prediction scored as the other class. Before, silently."""
    swapped = save_tiny_model(tmp_path / "swapped", kind="classifier", id2label={0: "POSITIVE", 1: "NEGATIVE"})
    (tmp_path / "named.jsonl").write_text('{"text": "good film", "label": "positive"}\n'
                                          '{"text": "bad film", "label": "negative"}\n')
    for verb in (["grad-importance"], ["disable", "--unit", "layer"]):
        code, _, err, errors = run_cli([*verb, "--model", swapped, "--task", tmp_path / "named.jsonl",
                                        "--runs-dir", tmp_path / "runs", "-q"], capsys)
        assert code == 2 and len(errors) == 1, err
        assert "numbers its classes 0 POSITIVE, 1 NEGATIVE, but the data numbers them 0 negative, 1 positive" \
            in errors[0]
    assert files_under(tmp_path / "runs") == []
    # the same names in the data's order, generic names, or other names: nothing to say about the order
    for id2label in ({0: "Negative", 1: "Positive"}, {0: "LABEL_0", 1: "LABEL_1"}, {0: "bad", 1: "good"}):
        check_class_order("m", BertConfig(id2label=id2label), ("negative", "positive"))
    check_class_order("m", BertConfig(id2label={0: "POSITIVE", 1: "NEGATIVE"}), None)  # numeric labels
    # a file naming some of the head's classes: each name it shares must keep the head's id (a file of
    # `positive` only numbers it 0, SST-2's head 1: before, not checked, every example scored as negative)
    with pytest.raises(AttnpatError, match="numbers its classes 0 negative, 1 positive, but the data numbers them "
                                           "0 positive"):
        check_class_order("m", BertConfig(id2label={0: "negative", 1: "positive"}), ("positive",))
    check_class_order("m", BertConfig(id2label={0: "negative", 1: "positive"}), ("negative",))
    check_class_order("m", BertConfig(id2label={0: "negative", 1: "positive"}), ("neutral", "positive"))


def test_a_failed_rename_names_the_users_path_not_the_temporary_file():
    exc = IsADirectoryError(21, "Is a directory", "/r/.x.csv.abc.tmp.csv", None, "/r/x.csv")
    assert os_error_message(exc, "cannot write") == "cannot write /r/x.csv: is a directory"
    assert os_error_message(PermissionError(13, "Permission denied", "/r/y.csv"), "cannot read") == \
        "cannot read /r/y.csv: permission denied"


def test_wrong_kinds_of_path_and_label_ids_past_any_task_are_named(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(AttnpatError, match="d.jsonl is a folder, not a file"):
        load_file(tmp_path / "d.jsonl")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(AttnpatError, match="is a file, not a model folder"):
        load_model(str(tmp_path / "weights.bin"))
    (tmp_path / "ids.jsonl").write_text('{"text": "a b", "label": 0}\n{"text": "c d", "label": 1000000000000}\n')
    with pytest.raises(AttnpatError, match="ids.jsonl: label 1000000000000 is a class id past 1000 classes"):
        load_file(tmp_path / "ids.jsonl")


def test_an_unknown_host_is_named_before_the_app_loads_anything(tmp_path, monkeypatch):
    import app.webapp  # noqa: PLC0415

    def must_not_run(*args, **kwargs):
        raise AssertionError("the app was built before the host was checked")

    monkeypatch.setattr(app.webapp, "build_app", must_not_run)
    with pytest.raises(AttnpatError, match="--host 999.1.1.1 is not a host name or address"):
        launch("999.1.1.1", free_port(), tmp_path, block=False, warm=True)


# ------------------------------------------------------------------ found by checking the docs' commands

def test_grad_importance_on_unlabelled_text_says_which_task_to_use(tmp_path, capsys, tiny_model):
    """A model without an MLM head takes its gradients on its task loss; the default task (wiki) has no labels."""
    runs = tmp_path / "runs"
    code, _, err, errors = run_cli(["grad-importance", "--model", tiny_model, "--n", "4", "--runs-dir", runs, "-q"],
                                   capsys)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "no masked-language-model head" in errors[0] and "wiki has examples without labels" in errors[0]
    assert "--task sst2" in errors[0] and not runs.exists()
    code, _, err, _ = run_cli(["grad-importance", "--model", tiny_model, "--task", "sst2", "--n", "4",
                               "--runs-dir", runs, "-q"], capsys)
    assert code == 0 and len(list(runs.glob("*/sst2/grad_importance.csv"))) == 1, err


def test_probe_dep_parse_takes_a_files_text_column(tmp_path, capsys, tiny_model):
    (tmp_path / "r.tsv").write_text("Review\tStars\nthe film was great fun\tgood\na dull and slow story\tbad\n")
    runs = tmp_path / "runs"
    code, _, err, _ = run_cli(["probe-dep", "--parse", tmp_path / "r.tsv", "--text-column", "review", "--model",
                               tiny_model, "--runs-dir", runs, "-q"], capsys)
    assert code == 0, err
    (manifest,) = runs.glob("*/r-*/manifest.json")
    data = json.loads(manifest.read_text())["analyses"]["probing_dependency"]["data"]
    assert data["columns"] == {"text": "Review"} and len(data["sha256"]) == 64
    code, _, err, errors = run_cli(["probe-dep", tmp_path / "gold.conllu", "--text-column", "review", "--model",
                                    tiny_model, "--runs-dir", tmp_path / "other", "-q"], capsys)
    assert code == 2 and "a CoNLL-U file has none" in errors[0] and not (tmp_path / "other").exists()


def test_the_benchmark_runner_refuses_an_unknown_name_instead_of_running_nothing():
    runner = Path(__file__).resolve().parent.parent / "bench" / "run_all.py"
    typo = subprocess.run([sys.executable, runner, "sweps"], capture_output=True, text=True, timeout=60)
    assert typo.returncode == 2 and "unknown benchmark sweps" in typo.stderr and "sweeps" in typo.stderr
    assert "===" not in typo.stdout  # nothing ran
    usage = subprocess.run([sys.executable, runner, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "benchmarks: classify" in usage.stdout and "===" not in usage.stdout


# ------------------------------------------------------------------ two writers at once (found by a probing helper)

def test_a_second_writer_of_a_maps_folder_or_a_store_model_stops_before_any_work(tmp_path, capsys, tiny_model,
                                                                                 monkeypatch):
    """Held locks stand for another process running: flock locks belong to an open file, so this process's own
    lock blocks a second open of it as another process's would."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    maps = tmp_path / "maps"
    with locked(maps / ".maps.lock", "held"):
        code, _, err, errors = run_cli(["extract", "--model", tiny_model, "--task", "sst2", "--n", "2", "--out", maps,
                                        "--runs-dir", tmp_path / "runs", "-q"], capsys)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
        assert f"the maps folder {maps} is being written by another attnpat process" in errors[0]
        assert sorted(path.name for path in maps.iterdir()) == [".maps.lock"]  # no index, no shard
    with locked(tmp_path / "models" / ".tiny-rte.lock", "held"):
        code, _, err, errors = run_cli(["finetune", "--model", tiny_model, "--task", "rte", "--split-dev", "--n", "4",
                                        "--epochs", "1", "--name", "tiny-rte", "-q"], capsys)
        assert code == 2 and "the model store entry" in errors[0] and "another attnpat process" in errors[0], err
        assert not (tmp_path / "models" / "tiny-rte").exists()
    run = RunDir(model_slug(str(tiny_model)), "sst2", tmp_path / "runs")
    with locked(run.file(".lock-overview"), "held"):  # the lock RunDir.record takes for `overview`
        code, _, err, errors = run_cli(["overview", "--model", tiny_model, "--task", "sst2", "--n", "2",
                                        "--runs-dir", tmp_path / "runs", "-q"], capsys)
        assert code == 2 and "overview in" in errors[0] and "another attnpat process" in errors[0], err
    with locked(tmp_path / "workspace" / "annotation" / ".push.lock", "held"):
        code, _, err, errors = run_cli(["annotate", "push", "--url", "http://127.0.0.1:9", "--token", "t", "--count",
                                        "4", "--tasks", "sst2"], capsys)
        assert code == 2 and "annotate push in" in errors[0] and "another attnpat process" in errors[0], err
        assert not (tmp_path / "workspace" / "annotation" / "samples").exists()
    # free again: both run, and no lock file is left
    assert run_cli(["extract", "--model", tiny_model, "--task", "sst2", "--n", "2", "--out", maps,
                    "--runs-dir", tmp_path / "runs", "-q"], capsys)[0] == 0
    assert not list(tmp_path.rglob(".*lock*"))


def test_a_job_stopped_by_sigterm_or_ctrl_c_after_its_cleanup_reads_as_stopped_not_failed():
    """Since a verb catches SIGTERM and Ctrl-C to release its locks, it exits with 143 or 130 instead of dying by
    the signal."""
    class Finished:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    def status(code):
        return Job(["overview"], Finished(code)).status()

    assert status(TERMINATED_EXIT).startswith("stopped (signal 15)") and status(-15).startswith("stopped (signal 15)")
    assert status(2).startswith("failed (exit status 2)")
    assert status(INTERRUPTED_EXIT).startswith("stopped (signal 2)")
    assert [Job(["overview"], Finished(code)).stopped for code in (TERMINATED_EXIT, INTERRUPTED_EXIT, 0, 1, 2)] \
        == [True, True, False, False, False]
    assert status(0).startswith("finished")


def test_a_job_killed_by_a_signal_nobody_sent_from_the_app_reads_as_failed_not_stopped(tmp_path):
    """A job the system killed (the out-of-memory killer's SIGKILL, a segfault, an abort) read as `stopped (signal
    9)`, styled as a note, as if someone had pressed Stop, and said nothing of a failure. Now it reads as failed;
    a SIGKILL after the app's own Stop (sent when a job does not end within 10 s of its SIGTERM) reads as stopped."""
    class Finished:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    for code in (-9, -11, -6):
        job = Job(["finetune"], Finished(code))
        assert not job.stopped and job.status().startswith(f"failed (killed by signal {-code}"), job.status()
    assert Job(["finetune"], Finished(-9)).status().startswith("failed (killed by signal 9, SIGKILL: out of memory?)")
    stopped = Job(["finetune"], Finished(-9), stop_requested=True)
    assert stopped.stopped and stopped.status().startswith("stopped (signal 9)")
    # the app's Stop marks its job, so a SIGKILL it sends after its SIGTERM reads as its own
    jobs = BatchJobs(tmp_path)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    jobs.job = Job(["finetune"], process)
    assert jobs.stop().startswith("job stopped") and jobs.job.stop_requested and jobs.job.stopped


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


# The web app's process: starts one job, says when the job waits (silent, no more output) for the run folder's
# lock, then sleeps until it is killed.
APP_WITH_A_JOB = """
import sys, time
from pathlib import Path
from app.jobs import BatchJobs
job = BatchJobs(Path(sys.argv[1])).start("overview", sys.argv[2], "sst2", 8)
while "waiting:" not in job.log_text() and job.returncode is None:
    time.sleep(0.2)
print(job.process.pid, job.returncode, flush=True)
time.sleep(600)
"""


def test_a_job_stops_when_the_web_app_that_started_it_is_killed(tmp_path, tiny_model):
    """The app stops its job when it exits (atexit), but a SIGKILLed app (the out-of-memory killer, `kill -9`, a
    crashed container runtime) runs no atexit: its job ran on alone, unseen by the restarted app, which could not
    stop it, holding its run folder's locks. Now the job watches the app's pid and stops as a Stop would when the
    app is gone: SIGTERM to itself, its cleanup runs (the staged tables are removed), a rerun resumes. Another app
    on the runs folder sees the job while it runs, refuses to start one beside it, and then reads it as stopped."""
    runs = tmp_path / "runs"
    run = RunDir(load_model(str(tiny_model)).slug, "sst2", runs)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    job_pid = None
    # the run folder's lock held here: the job does its work, then waits for it, so it is killed mid-run
    other_app = BatchJobs(runs)  # a second app on the same runs folder (or the app restarted)
    with locked(run.file(".lock"), "the test's hold on the run folder"):
        app = subprocess.Popen([sys.executable, "-c", APP_WITH_A_JOB, str(runs), str(tiny_model)], env=env,
                               stdout=subprocess.PIPE, text=True)
        try:
            job_pid, code = app.stdout.readline().split()
            job_pid = int(job_pid)
            assert code == "None" and _alive(job_pid)  # the job runs, waiting for the lock
            # the other app sees the job (before, nothing: the job lived only in its app's memory) and starts none
            assert other_app.current().status().startswith(f"running (pid {job_pid}, started ")
            with pytest.raises(AttnpatError, match=r"^a job of another attnpat app is already running on .*; wait"):
                other_app.start("overview", str(tiny_model), "mrpc", 2)
            app.kill()
            app.wait()
            deadline = time.monotonic() + 60
            while _alive(job_pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not _alive(job_pid), "the job ran on after the app that started it was killed"
        finally:
            app.kill()
            if job_pid and _alive(job_pid):
                os.kill(job_pid, signal.SIGKILL)
    # no exit status was recorded (its app was gone): the job reads as stopped, its log kept in the runs folder
    last = other_app.current()
    assert not last.is_running() and last.stopped
    assert last.status().startswith("stopped: the app that ran it ended before it finished; rerun it to resume")
    assert "waiting:" in last.log_text()
    # what the job printed once its app was gone is in its log too (before, lost with the app's end of a pipe)
    assert last.log_text().endswith("terminated; rerun the same command to resume"), last.log_text()
    assert not list(run.path.glob(".staging-*"))  # stopped by its SIGTERM, cleaning up: not killed mid-work


def test_a_path_the_terminals_encoding_lacks_prints_escaped_not_a_traceback(tmp_path, tiny_model):
    """stdout in latin-1 (PYTHONIOENCODING, an old terminal) and a run folder under 数据: the verb finishes
    with exit 0 and prints the path escaped (before, a UnicodeEncodeError traceback and exit 1 after the work)."""
    home = tmp_path / "数据"
    env = {**os.environ, "ATTNPAT_HOME": str(home), "PYTHONIOENCODING": "latin-1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "app.cli", "overview", "--model", str(tiny_model), "--task", "sst2",
                           "--n", "2", "-q"], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")[-2000:]
    assert b"\\u6570\\u636e" in done.stdout
    assert (home / "runs" / tiny_model.name / "sst2" / "overview.csv").is_file()


def test_a_data_file_name_that_is_not_utf8_is_drawn_escaped(tmp_path, tiny_model):
    """A file name with a latin-1 byte reaches Python as a lone surrogate, which matplotlib refuses: the task is
    named with U+FFFD in its place (before, a TypeError traceback from the figure, exit 1)."""
    folder = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9"))
    folder.mkdir()
    data = folder / os.fsdecode(b"r\xe9views.csv")
    data.write_text("text,label\na fine film,1\na dull film,0\n")
    env = {**os.environ, "ATTNPAT_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "app.cli", "classify", "--model", str(tiny_model), "--task",
                           str(data), "-q"], env=env, capture_output=True, timeout=300)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")[-2000:]
    (folder,) = (tmp_path / "home" / "runs" / tiny_model.name).glob("r*views-*")
    assert folder.name.startswith("r\ufffdviews-") and (folder / "pattern_ratios.svg").is_file()


@pytest.mark.parametrize("text, pair, which", [("\u200b\u200b", None, "text"), ("\ufeff", None, "text"),
                                                ("fine", "\u202e", "text pair")])
def test_text_of_invisible_characters_only_is_refused_like_empty_text(tmp_path, capsys, tiny_model, text, pair,
                                                                      which):
    """Zero-width spaces, a byte-order mark or a direction mark alone give no token: one error line, as blank text
    does (before, the maps of [CLS] [SEP] alone were classified and counted)."""
    rows = [{"text": "a real sentence"}, {"text": text, **({"text_pair": pair} if pair else {})}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    code, _, err, errors = run_cli(["overview", "--model", tiny_model, "--task", tmp_path / "d.jsonl",
                                    "--runs-dir", tmp_path / "runs", "-q"], capsys)
    assert code == 2 and len(errors) == 1 and f"has a {which} that gives no token" in errors[0], err
    assert files_under(tmp_path / "runs") == []


def test_extract_computes_a_damaged_shard_again_instead_of_trusting_it(tmp_path, capsys, tiny_model):
    """A shard cut short after it was written (a full disk, a stopped copy): the rerun said "saved maps" and kept
    it, and every later reader failed on it. It is now computed again, and the command says so."""
    out = tmp_path / "maps"
    base = ["extract", "--model", tiny_model, "--task", "sst2", "--n", "6", "--out", out, "--runs-dir", tmp_path,
            "-q"]
    assert run_cli(base, capsys)[0] == 0
    shards = sorted(out.glob("shard-*.npz"))
    whole = {path.name: read_shard(path) for path in shards}
    damaged = shards[0]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    assert not is_whole_map_file(damaged) and all(is_whole_map_file(path) for path in shards[1:])
    code, out_text, err, _ = run_cli(base, capsys)
    assert code == 0 and f"note: 1 shard(s) in {out} were damaged" in out_text, err
    again = read_shard(damaged)
    assert [item.example_id for item in again] == [item.example_id for item in whole[damaged.name]]
    for new, old in zip(again, whole[damaged.name], strict=True):
        np.testing.assert_array_equal(new.attn, old.attn)
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] and index["damaged_shards"] == 1 and index["resumed_shards"] == len(shards) - 1


def test_pull_takes_a_sample_name_not_a_path(tmp_path, capsys, monkeypatch):
    """`annotate pull --sample ../samples/s` (or an absolute path) wrote the labeled set inside the sample folder;
    push refuses such names, and pull now does too, before it reads anything."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    samples = tmp_path / "workspace" / "annotation" / "samples"
    (samples / "s").mkdir(parents=True)
    for name in ("../samples/s", str(samples / "s"), ".."):
        code, _, err, errors = run_cli(["annotate", "pull", "--sample", name, "--url", "http://127.0.0.1:9",
                                        "--token", "t"], capsys)
        assert code == 2 and errors == [f"error: --sample '{name}' must be a sample's name (no '/', not '..')"], err
    assert files_under(tmp_path) == []


def test_a_second_serve_at_the_same_moment_stops_before_starting_a_server(tmp_path):
    """Two `annotate serve` at once both started a server (Label Studio moved the second to the next port) and
    the pid file kept only one: the other ran on, orphaned. One serve per folder now holds its lock."""
    with locked(server.server_dir(tmp_path) / ".serve.lock", "held"):
        with pytest.raises(AttnpatError, match=r"^annotate serve in .* is being written by another attnpat process"):
            server.serve(port=9, root=tmp_path, log=lambda message: None)
    assert not server._pid_file(tmp_path).exists()


def _recorded_job_state(runs: Path, pid: int, **extra) -> None:
    """Write <runs>/.jobs/current.json as an app (pid ``pid`` + 1000, not running) would for a job of pid ``pid``."""
    state = {"id": "20250101-120000-abcdef", "argv": ["overview", "--model", "minilm"], "pid": pid,
             "pid_start": process_start_ticks(pid), "started": time.time() - 30, "log": "20250101-120000-abcdef.log",
             "app_pid": pid + 1000, "app_start": None, **extra}
    atomic_write_json(runs / ".jobs" / "current.json", state)


def test_another_apps_job_is_shown_from_the_runs_folder_and_none_starts_beside_it(tmp_path):
    """Batch jobs lived only in their app's memory: a restarted app, or a second app on the same runs folder, showed
    no job, lost its log, and could start a second one beside it. Now the last job's state and log are kept in
    <runs>/.jobs/, and its status follows the recorded process (its pid, start time and boot: pids are reused)."""
    runs = tmp_path / "runs"
    (runs / ".jobs").mkdir(parents=True)
    (runs / ".jobs" / "20250101-120000-abcdef.log").write_bytes(b"loading\nbar 10%\rbar 50%\nper-head table\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _recorded_job_state(runs, sleeper.pid)
        log_tail, status = WebApp(runs).job_state()
        assert log_tail == "loading\nbar 50%\nper-head table"
        assert status.startswith(f"**note:** running (pid {sleeper.pid}, started ")
        jobs = BatchJobs(runs)
        with pytest.raises(AttnpatError, match=rf"^a job of another attnpat app is already running on {runs} "
                                               rf"\(running \(pid {sleeper.pid}, .*\); wait for it or stop it$"):
            jobs.start("overview", "minilm", "sst2", 4)
        assert len(list((runs / ".jobs").glob("*.log"))) == 1 and jobs.job is None  # refused before any work
        assert jobs.stop() == f"the running job is another app's (pid {sleeper.pid + 1000}): stop it there, or " \
                              f"with `kill {sleeper.pid}`"
        # the same pid, but a process started at another time: a reused pid, not the job
        _recorded_job_state(runs, sleeper.pid, pid_start=process_start_ticks(sleeper.pid) + 1)
        assert not BatchJobs(runs).current().is_running()
        # the same pid and start ticks, recorded before a reboot (ticks count from boot): not the job either
        _recorded_job_state(runs, sleeper.pid, boot="an-earlier-boot")
        assert not BatchJobs(runs).current().is_running()
        assert BatchJobs(runs).current().status().startswith("stopped: the app that ran it ended before it finished")
        _recorded_job_state(runs, sleeper.pid, boot=boot_id())
        assert BatchJobs(runs).current().is_running()
    finally:
        sleeper.kill()
        sleeper.wait()
    _recorded_job_state(runs, sleeper.pid)
    assert BatchJobs(runs).current().status() == ("stopped: the app that ran it ended before it finished; rerun it "
                                                  "to resume: `attnpat overview --model minilm`")
    for code, start, kind in ((0, "finished (exit 0) at ", ""), (2, "failed (exit status 2) at ", "**error:** "),
                              (TERMINATED_EXIT, "stopped (signal 15) at ", "**note:** ")):
        _recorded_job_state(runs, sleeper.pid, returncode=code, finished=time.time())
        assert WebApp(runs).job_state()[1].startswith(kind + start)


def test_job_logs_are_bounded_and_a_damaged_job_state_is_replaced(tmp_path):
    folder = tmp_path / ".jobs"
    folder.mkdir()
    for number in range(8):
        log_file = folder / f"2025010{number}-000000-abcdef.log"
        log_file.write_text("x")
        os.utime(log_file, (1e9 + number, 1e9 + number))
    prune_logs(folder, KEEP_JOB_LOGS - 1)  # before a job starts: with its own log, KEEP_JOB_LOGS
    assert sorted(path.name[7] for path in folder.glob("*.log")) == ["4", "5", "6", "7"]
    (folder / "current.json").write_text('{"id": "cut off')
    assert BatchJobs(tmp_path).current() is None


@pytest.mark.slow
def test_a_restarted_app_shows_how_its_last_job_ended_and_its_log(tmp_path, tiny_model):
    runs = tmp_path / "runs"
    job = BatchJobs(runs).start("overview", str(tiny_model), "sst2", 2)
    deadline = time.monotonic() + 300
    while job.is_running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.returncode == 0, job.log_text()
    last = WebApp(runs).jobs.current()  # a new app on the same runs folder
    assert isinstance(last, RecordedJob) and last.returncode == 0 and not last.is_running()
    assert last.status().startswith("finished (exit 0) at ") and "per-head table" in last.log_text()
    assert last.log_text() == job.log_text()  # the log file holds what the app showed
