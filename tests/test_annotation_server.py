"""The annotation workflow against a real Label Studio server: push, annotate through the SDK, pull, faults.

The server comes from tests/conftest.py (one per session, free loopback port, stopped at the end).
"""
from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections import Counter

import httpx
import jwt
import numpy as np
import pandas as pd
import pytest
from label_studio_sdk.projects.client import ProjectsClient

from analysis.errors import AttnpatError
from analysis.mapstore import read_single_maps
from analysis.patterns import CLASSES
from annotation import labelstudio as ls
from annotation import server
from annotation.dataset import load_labeled_set
from annotation.sample import read_index
from annotation.server import Credentials, add_annotator, personal_access_token, serve, status, token_works
from app.cli import main
from tests.tiny import save_tiny_model

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli(*args: str, home) -> tuple[int, str, str]:
    """Run `attnpat ...` in-process with ATTNPAT_HOME=home; (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    previous = os.environ.get("ATTNPAT_HOME")
    os.environ["ATTNPAT_HOME"] = str(home)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code
    finally:
        if previous is None:
            os.environ.pop("ATTNPAT_HOME")
        else:
            os.environ["ATTNPAT_HOME"] = previous
    return code or 0, out.getvalue(), err.getvalue()


def new_email(name: str) -> str:
    """A fresh address per run (a server kept across sessions already knows earlier ones)."""
    return f"{name}-{uuid.uuid4().hex[:8]}@attnpat.local"


def tasks_by_map(credentials, project_id) -> dict[str, dict]:
    return ls.existing_tasks(ls.connect(credentials), credentials.url, project_id)


def count_tasks(credentials, project_id) -> Counter:
    """map_id -> number of tasks carrying it (to catch duplicates, which existing_tasks would merge)."""
    client = ls.connect(credentials)
    return Counter(task.data["map_id"] for task in client.tasks.list(project=project_id, fields="all"))


# ---------------------------------------------------------------- server and credentials

def test_server_credentials_and_status(label_studio):
    path = label_studio.root / "credentials.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    info = status(label_studio.root)
    assert info["running"] and info["healthy"] and info["url"] == label_studio.url
    # serving again while it runs reuses the server and its stored token
    again = serve(port=int(label_studio.url.rsplit(":", 1)[1]), root=label_studio.root)
    assert again.token == label_studio.token
    assert serve(root=label_studio.root).url == label_studio.url  # no --port: wherever it serves
    # another --port is refused, not answered with the server on the first one
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        other = probe.getsockname()[1]
    with pytest.raises(AttnpatError, match=f"already serves on {label_studio.url}; `attnpat annotate stop` first "
                                           f"to serve it on port {other}"):
        serve(port=other, root=label_studio.root)
    assert ls.connect(label_studio).users.whoami().email == label_studio.email


def test_a_new_token_replaces_the_old_one(label_studio):
    """Label Studio keeps one personal access token per user: asking again (a lost credentials file, a
    restart) revokes the previous one instead of failing with HTTP 409."""
    user = add_annotator(label_studio, new_email("rotation"), "rotation-pw-12345")
    assert token_works(user.url, user.token)
    replacement = personal_access_token(user.url, user.email, user.password)
    assert replacement != user.token
    assert token_works(user.url, replacement) and not token_works(user.url, user.token)
    assert ls.connect(Credentials(user.url, replacement)).users.whoami().email == user.email


# ---------------------------------------------------------------- the round trip on real maps

def test_round_trip_on_real_minilm_maps(label_studio, annotate_task, tmp_path):
    """CLI push of a real MiniLM sample, SDK annotations, CLI pull: every label joins back to its exact map."""
    title = f"real MiniLM maps {new_email('project')}"
    auth = ("--url", label_studio.url, "--token", label_studio.token, "--project", title)
    code, out, err = cli("annotate", "push", "--model", "minilm", "--count", "6", "--tasks", "sst2,rte",
                         "--sample", "real", *auth, home=tmp_path)
    assert code == 0, err
    assert "6 new tasks, 0 already there, 6 in the sample" in out
    state = ls._read_state(tmp_path / "workspace" / "annotation" / "projects.json")
    project_id = state["projects"][title]
    client = ls.connect(label_studio)
    project = client.projects.get(id=project_id)
    assert "Boundary rules" in project.expert_instruction and project.show_instruction
    images = re.findall(r'src="(/data/local-files/\?d=gallery/[^"]+\.png)"', project.expert_instruction)
    assert len(images) >= 15  # the gallery, served by Label Studio to logged-in annotators
    wrapper = client._client_wrapper
    served = httpx.get(label_studio.url + images[0], headers=wrapper.get_headers(), timeout=30)
    assert served.status_code == 200 and served.content[:8] == b"\x89PNG\r\n\x1a\n"
    client.projects.update(id=project_id, expert_instruction="an old guideline")
    code, out, err = cli("annotate", "push", "--model", "minilm", "--count", "6", "--tasks", "sst2,rte",
                         "--sample", "real", "--annotators", "3", "--blind", *auth, home=tmp_path)
    assert code == 0 and "0 new tasks, 6 already there" in out and "reused" in out, out + err
    project = client.projects.get(id=project_id)
    assert "Boundary rules" in project.expert_instruction  # a push updates it
    assert project.maximum_annotations == 3 and not project.show_collab_predictions  # now a blind panel of three

    sample = tmp_path / "workspace" / "annotation" / "samples" / "real"
    index = read_index(sample)
    assert Counter(row["task"] for row in index) == {"sst2": 3, "rte": 3}
    state = ls._read_state(tmp_path / "workspace" / "annotation" / "projects.json")
    project_id = state["projects"][title]
    tasks = tasks_by_map(label_studio, project_id)
    assert count_tasks(label_studio, project_id) == Counter({row["map_id"]: 1 for row in index})
    client = ls.connect(label_studio)
    given = {}
    for k, row in enumerate(index):
        task = tasks[row["map_id"]]
        assert task["predictions"][0]["model_version"] == ls.PREANNOTATOR_VERSION
        assert task["data"]["image"].startswith("data:image/png;base64,")
        assert "cues: n " in task["data"]["caption"] and "top column" in task["data"]["caption"]
        given[row["map_id"]] = CLASSES[k % len(CLASSES)]
        annotate_task(client, task["id"], given[row["map_id"]])

    code, out, err = cli("annotate", "pull", "--sample", "real", *auth, home=tmp_path)
    assert code == 0, err
    folder = tmp_path / "workspace" / "annotation" / "labeled" / "real" / "v1"
    assert f"labeled set {folder}: 6 maps" in out
    labeled = load_labeled_set(folder)
    raw = read_single_maps(sample / "maps.npz")
    assert sorted(labeled.map_ids) == sorted(given)
    for map_id, label, attn in zip(labeled.map_ids, labeled.labels, labeled.maps):
        assert CLASSES[label] == given[map_id]
        assert np.array_equal(attn, raw[map_id])  # the exact float map, not a re-rendered image
        assert ls.map_sha256(attn) == tasks[map_id]["data"]["map_sha256"]
    predictions = {m: t["predictions"][0]["result"][0]["value"]["choices"][0] for m, t in tasks.items()}
    agreement = np.mean([predictions[m] == given[m] for m in given])
    assert f"pre-annotation agreement with final labels: {agreement:.3f}" in out
    rows = pd.read_csv(folder / "labels.csv")
    assert set(rows.annotator) == {label_studio.email}
    # a second pull is a new version, never an overwrite
    assert cli("annotate", "pull", "--sample", "real", *auth, home=tmp_path)[0] == 0
    assert (folder.parent / "v2" / "labels.csv").is_file()


def test_extracted_maps_are_pushed_for_annotation(label_studio, tmp_path):
    """`attnpat extract` on a tiny model, then `annotate push --maps`: the server holds those exact maps."""
    model = save_tiny_model(tmp_path / "tiny", layers=2, heads=2, hidden=24)
    extracted = tmp_path / "extracted"
    assert cli("extract", "--model", str(model), "--task", "rte", "--n", "3", "--out", str(extracted), "-q",
               "--runs-dir", str(tmp_path / "runs"), home=tmp_path)[0] == 0
    title = f"extracted maps {new_email('project')}"
    code, out, err = cli("annotate", "push", "--maps", str(extracted), "--count", "5", "--sample", "extracted",
                         "--url", label_studio.url, "--token", label_studio.token, "--project", title, home=tmp_path)
    assert code == 0, err
    assert "5 new tasks, 0 already there, 5 in the sample" in out
    project_id = ls._read_state(tmp_path / "workspace" / "annotation" / "projects.json")["projects"][title]
    tasks = tasks_by_map(label_studio, project_id)
    source = read_single_maps(extracted)
    assert len(tasks) == 5 and set(tasks) <= set(source)
    for map_id, task in tasks.items():
        assert task["data"]["map_sha256"] == ls.map_sha256(source[map_id])  # the extracted map, float for float


# ---------------------------------------------------------------- several annotators, drafts, skips, unknown labels

def fleiss_by_hand(table: list[list[str]]) -> float:
    """Fleiss' kappa written out: P_i = sum_j n_ij (n_ij - 1) / (r (r - 1)); p_j = share of category j."""
    r = len(table[0])
    categories = sorted({label for labels in table for label in labels})
    n = [[labels.count(c) for c in categories] for labels in table]
    p_items = [sum(x * (x - 1) for x in counts) / (r * (r - 1)) for counts in n]
    p_bar = sum(p_items) / len(table)
    shares = [sum(counts[j] for counts in n) / (len(table) * r) for j in range(len(categories))]
    p_e = sum(s * s for s in shares)
    return (p_bar - p_e) / (1 - p_e)


def test_several_annotators_drafts_skips_and_unknown_labels(label_studio, synthetic_sample, annotate_task, tmp_path):
    sample = synthetic_sample("multi", 7)
    state = tmp_path / "projects.json"
    report = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    tasks = tasks_by_map(label_studio, report.project_id)
    ids = sorted(tasks)
    bob = add_annotator(label_studio, new_email("bob"), "bob-password-123")
    eve = add_annotator(label_studio, new_email("eve"), "eve-password-123")
    clients = [ls.connect(c) for c in (label_studio, bob, eve)]
    # maps 0-3: three annotators each (map 2: a three-way tie); map 4: two annotators who disagree (a tie)
    table = [["vertical", "vertical", "vertical"], ["diagonal", "diagonal", "block"],
             ["block", "heterogeneous", "vertical"], ["vertical+diagonal", "vertical+diagonal", "vertical+diagonal"]]
    for map_id, labels in zip(ids, table):
        for client, label in zip(clients, labels):
            annotate_task(client, tasks[map_id]["id"], label)
    annotate_task(clients[1], tasks[ids[4]]["id"], "block")
    annotate_task(clients[2], tasks[ids[4]]["id"], "diagonal")
    annotate_task(clients[0], tasks[ids[5]]["id"], "diagonal", was_cancelled=True)  # skipped
    annotate_task(clients[0], tasks[ids[6]]["id"], "spiral")  # a label outside the five classes
    draft = [{"from_name": "pattern", "to_name": "image", "type": "choices", "value": {"choices": ["block"]}}]
    response = clients[1]._client_wrapper.httpx_client.request(f"api/tasks/{tasks[ids[6]]['id']}/drafts",
                                                               method="POST", json={"result": draft})
    assert response.status_code == 201  # bob's unsubmitted draft, invisible to the admin's task list

    out = tmp_path / "labeled"
    pulled = ls.pull(label_studio, sample, out, state_file=state)
    assert pulled.labeled == 5 and pulled.n_annotators == 3
    assert pulled.kappa_maps == 5  # maps 0-3 and the tie
    hand = fleiss_by_hand(table)  # Fleiss over the equally-rated maps, checked against the 2-rater tie below
    assert ls.fleiss_kappa(table) == pytest.approx(hand)
    assert pulled.kappa == pytest.approx(ls.fleiss_kappa(table + [["block", "diagonal"]]))
    assert pulled.skipped == [ids[5]] and pulled.drafts == [ids[6]] and pulled.ties == [ids[2], ids[4]]
    assert pulled.unknown == [f"{ids[6]}: 'spiral'"]
    assert pulled.unlabeled == 1 and pulled.tasks == 7  # the skipped map is counted once, as skipped
    labels = pd.read_csv(out / "labels.csv").set_index("map_id")
    assert labels.loc[ids[1], "label"] == "diagonal"
    assert labels.loc[ids[2], "label"] == "block" and labels.loc[ids[4], "label"] == "block"  # earliest of a tie
    assert labels.loc[ids[0], "annotator"] == "+".join(sorted([label_studio.email, bob.email, eve.email]))
    annotations = pd.read_csv(out / "annotations.csv", dtype=str)
    assert len(annotations) == 14
    # each annotator is recorded by their user id beside their email
    assert dict(zip(annotations.annotator, annotations.annotator_id)) == {
        user.email: str(user.id) for user in (client.users.whoami() for client in clients)}

    # the CLI prints every one of them
    sample_home = tmp_path / "home"
    samples = sample_home / "workspace" / "annotation" / "samples"
    samples.mkdir(parents=True)
    (samples / sample.name).symlink_to(sample)
    (sample_home / "workspace" / "annotation" / "projects.json").write_text(state.read_text())
    code, text, err = cli("annotate", "pull", "--sample", sample.name, "--url", label_studio.url, "--token",
                          label_studio.token, home=sample_home)
    assert code == 0, err
    assert (f"Fleiss' kappa {pulled.kappa:.3f} [{pulled.kappa_ci_low:.2f}, {pulled.kappa_ci_high:.2f}] "
            "(bootstrap 95% over 5 maps)") in text
    for line in (f"drafts (not submitted): 1 (first: {ids[6]})",
                 f"maps left out because their annotators skipped them: 1 (first: {ids[5]})",
                 f"unknown labels: 1 (first: {ids[6]}: 'spiral')",
                 "tasks in the project: 7 = 5 labeled + 1 skipped + 1 not yet labeled",
                 f"ties between annotators (earliest label kept): 2 (first: {ids[2]})"):
        assert line in text


def next_task_for(client, project_id: int) -> dict | None:
    """The task Label Studio's labeling stream hands this user next (None when it has none for them)."""
    response = client._client_wrapper.httpx_client.request(f"api/projects/{project_id}/next", method="GET")
    if response.status_code == 404:
        return None
    assert response.status_code == 200, response.text
    return response.json()


def test_a_panel_project_hands_every_task_to_several_annotators_without_pre_annotations(
        label_studio, synthetic_sample, annotate_task, tmp_path):
    sample = synthetic_sample("panel", 2)
    bob = ls.connect(add_annotator(label_studio, new_email("bob"), "bob-password-123"))
    admin = ls.connect(label_studio)

    # a plain project: once the admin has labeled both tasks, the stream has nothing left for bob
    plain = ls.push(label_studio, sample, title=f"plain {sample.name}", progress=False, log=lambda m: None)
    project = admin.projects.get(id=plain.project_id)
    assert project.maximum_annotations == 1 and project.show_collab_predictions
    assert project.sampling == "Uniform sampling"  # not push order: a partial panel labels an unbiased share
    for task in tasks_by_map(label_studio, plain.project_id).values():
        annotate_task(admin, task["id"], "vertical")
    assert next_task_for(bob, plain.project_id) is None
    shown = ls.pull(label_studio, sample, tmp_path / "plain-set", title=f"plain {sample.name}")
    assert shown.preannotations_shown is True
    assert json.loads((tmp_path / "plain-set" / "pull_report.json").read_text())["preannotations_shown"] is True

    # a panel of two, blind without asking (--blind is a panel's default): bob still gets every task the admin
    # labeled, and no pre-filled label
    panel = ls.PanelSettings(annotators=2)
    title = f"panel {sample.name}"
    report = ls.push(label_studio, sample, title=title, progress=False, log=lambda m: None, panel=panel)
    project = admin.projects.get(id=report.project_id)
    assert project.maximum_annotations == 2 and project.overlap_cohort_percentage == 100
    assert not project.show_collab_predictions
    tasks = tasks_by_map(label_studio, report.project_id)
    assert all(task["predictions"] for task in tasks.values())  # kept for pull's pre-annotation agreement
    for task in tasks.values():
        annotate_task(admin, task["id"], "vertical")
    handed = next_task_for(bob, report.project_id)
    assert handed is not None and handed["id"] in {task["id"] for task in tasks.values()}
    ls.pull(label_studio, sample, tmp_path / "panel-set", title=title)
    assert json.loads((tmp_path / "panel-set" / "pull_report.json").read_text())["preannotations_shown"] is False

    # a later push without the options leaves the panel settings as they are
    ls.push(label_studio, sample, title=title, progress=False, log=lambda m: None)
    project = admin.projects.get(id=report.project_id)
    assert project.maximum_annotations == 2 and not project.show_collab_predictions
    with pytest.raises(AttnpatError, match="at least 1"):
        ls.PanelSettings(annotators=0)


def test_fleiss_kappa_by_hand_on_a_textbook_table():
    """Fleiss (1971)-style check with unequal agreement per item, computed independently above."""
    table = [["vertical"] * 4, ["vertical", "vertical", "block", "block"], ["diagonal", "block", "block", "block"],
             ["heterogeneous", "diagonal", "vertical", "block"], ["diagonal"] * 3 + ["vertical"]]
    assert ls.fleiss_kappa(table) == pytest.approx(fleiss_by_hand(table))
    assert ls.fleiss_kappa([["block", "block"], ["diagonal", "diagonal"]]) == pytest.approx(1.0)
    with pytest.raises(AttnpatError, match="two labels"):
        ls.fleiss_kappa([["block"]])


# ---------------------------------------------------------------- faults

def test_server_down_is_a_one_line_error(synthetic_sample, tmp_path):
    nobody = Credentials(f"http://127.0.0.1:{free_port()}", "any-token")
    with pytest.raises(AttnpatError, match="cannot reach Label Studio") as caught:
        ls.push(nobody, synthetic_sample("down", 2), state_file=tmp_path / "state.json", progress=False)
    assert "\n" not in str(caught.value)
    code, out, err = cli("annotate", "pull", "--sample", "nothing", "--url", nobody.url, "--token", "t", home=tmp_path)
    assert code == 2 and err.count("\n") == 1 and "no sample 'nothing'" in err


def test_wrong_token_is_a_one_line_error(label_studio, synthetic_sample, tmp_path):
    sample = synthetic_sample("token", 2)
    home = tmp_path / "home"
    (home / "workspace" / "annotation" / "samples").mkdir(parents=True)
    (home / "workspace" / "annotation" / "samples" / sample.name).symlink_to(sample)
    for token in ("not-a-token", label_studio.token[:-6] + "AAAAAA"):  # garbage, and a JWT with a bad signature
        code, out, err = cli("annotate", "pull", "--sample", sample.name, "--url", label_studio.url, "--token", token,
                             home=home)
        assert code == 2 and err.count("\n") == 1 and "rejected the token (HTTP 401)" in err, err


def test_an_expired_personal_access_token_is_a_one_line_error(synthetic_sample, tmp_path):
    """The SDK refuses an expired personal access token, or one without an expiry, while it builds the client,
    before any request (before, that ApiError escaped connect as a traceback)."""
    sample = synthetic_sample("expired", 2)
    home = tmp_path / "home"
    (home / "workspace" / "annotation" / "samples").mkdir(parents=True)
    (home / "workspace" / "annotation" / "samples" / sample.name).symlink_to(sample)
    url = f"http://127.0.0.1:{free_port()}"
    for claims in ({"token_type": "refresh", "exp": int(time.time()) - 60}, {"token_type": "refresh"}):
        token = jwt.encode(claims, "a signing key that the check never reads, 32+ bytes", algorithm="HS256")
        with pytest.raises(AttnpatError, match="rejected the token") as caught:
            ls.connect(Credentials(url, token))
        assert "\n" not in str(caught.value)
        code, out, err = cli("annotate", "pull", "--sample", sample.name, "--url", url, "--token", token, home=home)
        assert code == 2 and err.count("\n") == 1 and "rejected the token (HTTP 401)" in err, err


def test_another_web_server_at_the_url_is_a_one_line_error(synthetic_sample, tmp_path):
    """--url naming another web server (a wrong port): the SDK exchanges a personal access token first and
    decodes that server's HTML error page as JSON (before, a JSONDecodeError traceback)."""
    sample = synthetic_sample("not-ls", 2)
    home = tmp_path / "home"
    (home / "workspace" / "annotation" / "samples").mkdir(parents=True)
    (home / "workspace" / "annotation" / "samples" / sample.name).symlink_to(sample)
    token = jwt.encode({"token_type": "refresh", "exp": int(time.time()) + 3600},
                       "a signing key that the check never reads, 32+ bytes", algorithm="HS256")

    class Quiet(http.server.SimpleHTTPRequestHandler):  # answers every request with an HTML error page
        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{other.server_address[1]}"
        with pytest.raises(AttnpatError, match="did not answer as Label Studio does") as caught:
            ls.connect(Credentials(url, token))
        assert "\n" not in str(caught.value)
        code, out, err = cli("annotate", "pull", "--sample", sample.name, "--url", url, "--token", token, home=home)
        assert code == 2 and err.count("\n") == 1 and "did not answer as Label Studio does" in err, err
    finally:
        other.shutdown()
        other.server_close()


def test_project_deleted_between_push_and_pull(label_studio, synthetic_sample, annotate_task, tmp_path):
    sample, state = synthetic_sample("deleted", 3), tmp_path / "projects.json"
    first = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    client = ls.connect(label_studio)
    client.projects.delete(id=first.project_id)
    with pytest.raises(AttnpatError, match="is gone from .*push again") as caught:
        ls.pull(label_studio, sample, tmp_path / "labeled", state_file=state)
    assert "\n" not in str(caught.value) and not (tmp_path / "labeled").exists()
    again = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    assert again.created_project and again.project_id != first.project_id and again.pushed == 3
    tasks = tasks_by_map(label_studio, again.project_id)
    for task in tasks.values():
        annotate_task(client, task["id"], "block")
    assert ls.pull(label_studio, sample, tmp_path / "labeled", state_file=state).labeled == 3


def test_a_push_to_a_project_of_an_older_labeling_view_brings_it_up_to_date_and_keeps_its_labels(
        label_studio, synthetic_sample, annotate_task, tmp_path):
    """Label Studio scales a task's image to its panel and smooths it unless the Image tag says smoothing="false";
    a project made before that keeps its smoothed view until a push replaces it (before, a push updated only
    the instructions). The labels made in the old view stay, and no task is pushed twice."""
    image_tag = re.search(r"<Image [^>]*/>", ls.LABEL_CONFIG)[0]
    assert 'smoothing="false"' in image_tag
    sample, state = synthetic_sample("oldview", 3), tmp_path / "projects.json"
    first = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    client = ls.connect(label_studio)
    client.projects.update(id=first.project_id, label_config=ls.LABEL_CONFIG.replace(' smoothing="false"', ""))
    tasks = tasks_by_map(label_studio, first.project_id)
    labeled = sorted(tasks)[0]
    annotate_task(client, tasks[labeled]["id"], "block")

    again = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    assert (again.project_id, again.pushed, again.already_there) == (first.project_id, 0, 3)
    assert image_tag in client.projects.get(id=first.project_id).label_config
    assert count_tasks(label_studio, first.project_id) == Counter({row["map_id"]: 1 for row in read_index(sample)})
    kept = tasks_by_map(label_studio, first.project_id)[labeled]["annotations"]
    assert [annotation["result"][0]["value"]["choices"] for annotation in kept] == [["block"]]


def test_a_push_says_which_tags_of_an_edited_labeling_view_it_replaced_and_keeps_the_old_view(
        label_studio, synthetic_sample, tmp_path):
    """A view edited in Label Studio (a class added, the Image tag changed) is replaced by a push, since the labels
    depend on what annotators saw; before, it vanished without a word. Now push logs one line naming the tags that
    differed, and the push report and state file record them, the state file with the old view itself."""
    sample, state = synthetic_sample("editedview", 2), tmp_path / "projects.json"
    quiet = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    assert quiet.replaced_view == []
    client = ls.connect(label_studio)
    edited = (ls.LABEL_CONFIG.replace(' smoothing="false"', ' smoothing="true"')
              .replace("</Choices>", '<Choice value="mixed"/></Choices>'))
    client.projects.update(id=quiet.project_id, label_config=edited)
    said = []
    again = ls.push(label_studio, sample, state_file=state, progress=False, log=said.append)
    assert again.replaced_view == ["Image image", "Choice mixed"]
    assert said == [f"replaced project {quiet.project_id}'s labeling view, which differed from attnpat's in: "
                    f"Image image, Choice mixed (the old view is kept in {state})"]
    assert ls.view_differences(client.projects.get(id=quiet.project_id).label_config) == []
    kept = ls._read_state(state)["replaced_views"][f"attnpat patterns: {sample.name}"]
    assert [(entry["project_id"], entry["differences"]) for entry in kept] == [(quiet.project_id, again.replaced_view)]
    assert '<Choice value="mixed"/>' in kept[0]["label_config"]
    # a view that is attnpat's already is replaced in silence, and nothing more is recorded
    said.clear()
    assert ls.push(label_studio, sample, state_file=state, progress=False, log=said.append).replaced_view == []
    assert said == [] and len(ls._read_state(state)["replaced_views"][f"attnpat patterns: {sample.name}"]) == 1


def test_a_push_brings_the_captions_of_tasks_already_there_up_to_date_and_keeps_their_labels(
        label_studio, synthetic_sample, annotate_task, tmp_path):
    """Tasks pushed before a caption change (layer and head 1-indexed) kept their old caption, since a push only
    added missing maps. Now a push rewrites the caption of each task whose caption differs and says how many; the
    image, map digest, pre-annotation and annotations stay as they were."""
    sample, state = synthetic_sample("oldcaption", 3), tmp_path / "projects.json"
    first = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    assert first.updated == 0
    client = ls.connect(label_studio)
    before = tasks_by_map(label_studio, first.project_id)
    stale = sorted(before)[:2]
    for map_id in stale:
        client.tasks.update(id=before[map_id]["id"], data={**before[map_id]["data"], "caption": "layer 3 · head 8 "
                                                                                               "(1-indexed)"})
    annotate_task(client, before[stale[0]]["id"], "block")

    said = []
    again = ls.push(label_studio, sample, state_file=state, progress=False, log=said.append)
    assert (again.pushed, again.already_there, again.updated) == (0, 3, 2)
    assert said == [f"updated the caption of 2 tasks already in project {first.project_id} to the current one"]
    after = tasks_by_map(label_studio, first.project_id)
    assert {map_id: task["data"] for map_id, task in after.items()} == \
        {map_id: task["data"] for map_id, task in before.items()}
    assert [annotation["result"][0]["value"]["choices"] for annotation in after[stale[0]]["annotations"]] == \
        [["block"]]
    assert [[p["result"] for p in task["predictions"]] for task in after.values()] == \
        [[p["result"] for p in task["predictions"]] for task in before.values()]
    assert count_tasks(label_studio, first.project_id) == Counter({row["map_id"]: 1 for row in read_index(sample)})
    assert ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None).updated == 0


def test_push_cut_off_after_the_first_chunk_is_finished_by_a_rerun(label_studio, synthetic_sample, tmp_path,
                                                                   monkeypatch):
    """The connection drops after chunk 1; in chunk 2 the server imports but the reply is lost. A rerun
    imports exactly the rest: nothing lost, nothing duplicated."""
    sample, state = synthetic_sample("cutoff", 7), tmp_path / "projects.json"
    real_import = ProjectsClient.import_tasks
    calls = []

    def flaky_import(self, *args, **kwargs):
        calls.append(len(kwargs["request"]))
        if len(calls) == 2:
            real_import(self, *args, **kwargs)
            raise httpx.ReadError("connection reset by peer")  # imported, but the answer never came
        return real_import(self, *args, **kwargs)

    monkeypatch.setattr(ProjectsClient, "import_tasks", flaky_import)
    with pytest.raises(AttnpatError, match="cannot reach Label Studio .*ReadError") as caught:
        ls.push(label_studio, sample, state_file=state, chunk=3, progress=False)
    assert "\n" not in str(caught.value) and calls == [3, 3]
    project_id = ls._read_state(state)["projects"][f"attnpat patterns: {sample.name}"]
    assert sum(count_tasks(label_studio, project_id).values()) == 6

    monkeypatch.setattr(ProjectsClient, "import_tasks", real_import)
    rerun = ls.push(label_studio, sample, state_file=state, chunk=3, progress=False, log=lambda m: None)
    assert (rerun.project_id, rerun.pushed, rerun.already_there, rerun.created_project) == (project_id, 1, 6, False)
    assert count_tasks(label_studio, project_id) == Counter({row["map_id"]: 1 for row in read_index(sample)})


def test_pull_cut_off_midway_leaves_nothing_and_a_rerun_gets_everything(label_studio, synthetic_sample,
                                                                         annotate_task, tmp_path, monkeypatch):
    """The connection drops while the tasks stream in, then (second try) just before the user list:
    no labeled set appears, and a rerun writes the full one."""
    sample, state = synthetic_sample("pullcut", 5), tmp_path / "projects.json"
    report = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    client = ls.connect(label_studio)
    tasks = tasks_by_map(label_studio, report.project_id)
    for k, map_id in enumerate(sorted(tasks)):
        annotate_task(client, tasks[map_id]["id"], CLASSES[k])
    tasks_client = type(client.tasks)
    real_list = tasks_client.list

    def dropping_list(self, *args, **kwargs):
        for k, task in enumerate(real_list(self, *args, **kwargs)):
            if k == 2:
                raise httpx.RemoteProtocolError("server disconnected without sending a response")
            yield task

    out = tmp_path / "labeled"
    monkeypatch.setattr(tasks_client, "list", dropping_list)
    with pytest.raises(ls.ServerUnreachable, match="RemoteProtocolError"):
        ls.pull(label_studio, sample, out, state_file=state)
    monkeypatch.setattr(tasks_client, "list", real_list)

    real_send = httpx.Client.send

    def refuse_user_list(self, request, *args, **kwargs):
        if request.url.path.rstrip("/") == "/api/users":
            raise httpx.ConnectError("connection refused")
        return real_send(self, request, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "send", refuse_user_list)
    with pytest.raises(ls.ServerUnreachable, match="ConnectError"):
        ls.pull(label_studio, sample, out, state_file=state)
    monkeypatch.setattr(httpx.Client, "send", real_send)
    assert not out.exists() and not list(tmp_path.glob(".labeled*"))

    pulled = ls.pull(label_studio, sample, out, state_file=state)
    assert pulled.labeled == 5 and pulled.class_counts == {name: 1 for name in CLASSES}
    assert sorted(load_labeled_set(out).map_ids) == sorted(tasks)
    assert set(pd.read_csv(out / "labels.csv").annotator) == {label_studio.email}


def test_a_remembered_project_id_of_another_title_is_not_reused(label_studio, synthetic_sample, annotate_task,
                                                                 tmp_path):
    """The push state remembers project ids by title; on another server (another --url) that id may be an
    unrelated project. Before, the push imported its maps into that project and overwrote its instructions."""
    sample, state = synthetic_sample("stranger", 3), tmp_path / "projects.json"
    client = ls.connect(label_studio)
    stranger = client.projects.create(title=f"team NER project {uuid.uuid4().hex[:6]}", label_config=ls.LABEL_CONFIG,
                                      expert_instruction="the team's own instructions")
    title = f"attnpat patterns: {sample.name}"
    state.write_text(json.dumps({"projects": {title: stranger.id}}))
    pushed = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    assert pushed.created_project and pushed.project_id != stranger.id and pushed.pushed == 3
    assert sum(count_tasks(label_studio, stranger.id).values()) == 0
    assert client.projects.get(id=stranger.id).expert_instruction == "the team's own instructions"
    assert json.loads(state.read_text())["projects"][title] == pushed.project_id
    # pull reads the project by its title too, when the state names a stranger
    for task in tasks_by_map(label_studio, pushed.project_id).values():
        annotate_task(client, task["id"], "vertical")
    state.write_text(json.dumps({"projects": {title: stranger.id}}))
    assert ls.pull(label_studio, sample, tmp_path / "labeled", state_file=state).labeled == 3


def test_serve_recovers_its_admin_after_lost_credentials_or_a_stopped_first_start(tmp_path):
    """A serve stopped during the first start (the server, detached, made the admin) and credentials deleted as
    the damaged-file error advises both left a running server whose admin password nobody knew: every later
    serve failed ("port already serves another Label Studio", then "could not log in"). The admin login is now
    saved before the server starts, a running server of this folder is ours even without a token, and a
    password that does not log in is set anew (`label-studio reset_password`, fed on standard input)."""
    from tests.conftest import free_port  # noqa: PLC0415

    root, port = tmp_path / "ls", free_port()
    try:
        first = serve(port=port, root=root, timeout=600, log=lambda message: None)
        assert token_works(first.url, first.token)
        # as a serve stopped before it had its token leaves them: the login saved, no token
        server.save_credentials(Credentials(first.url, "", first.email, first.password), root)
        with pytest.raises(AttnpatError, match="first start did not finish"):
            server.resolve_credentials(root=root)
        again = serve(port=port, root=root, timeout=600, log=lambda message: None)
        assert again.password == first.password and token_works(again.url, again.token)
        server.credentials_file(root).unlink()  # as the damaged-credentials error says to do
        recovered = serve(port=port, root=root, timeout=600, log=lambda message: None)
        assert recovered.password != first.password and token_works(recovered.url, recovered.token)
        assert server.status(root)["running"]
    finally:
        server.stop(root)


def _bystander_server(root):
    """A process that stands for this folder's Label Studio (its own session, the recorded executable run on the
    folder's data), recorded in the pid file on a free port; returns (process, url)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--data-dir",
                                str(server.server_dir(root) / "data")], start_new_session=True)
    command_line = f"/proc/{process.pid}/cmdline"
    deadline = time.monotonic() + 10
    while os.path.exists(command_line) and b"--data-dir" not in open(command_line, "rb").read() \
            and time.monotonic() < deadline:  # the child runs Python until its exec
        time.sleep(0.01)
    port = free_port()
    server._pid_file(root).parent.mkdir(parents=True, exist_ok=True)
    server._pid_file(root).write_text(f"{process.pid} {port} {sys.executable}\n")
    return process, f"http://127.0.0.1:{port}"


def test_serve_waits_for_its_server_still_starting_instead_of_starting_a_second(tmp_path, monkeypatch):
    """A serve stopped (Ctrl-C) during the first start's migrations leaves its server starting. Before, the next serve
    found it not answering yet and started a second server on the same data and port: the two migrated one database
    at once, the pid file then named the one that lost, and the other ran on orphaned (`stop`: nothing running)."""
    root = tmp_path / "ls"
    process, url = _bystander_server(root)
    try:
        server.save_credentials(Credentials(url, "", "a@b.c", "the-password"), root)
        answers = iter([False, False, False])  # migrating: no answer for three checks, then it serves
        monkeypatch.setattr(server, "health", lambda address, timeout=3.0: address == url and next(answers, True))
        monkeypatch.setattr(server.time, "sleep", lambda seconds: None)
        monkeypatch.setattr(server, "personal_access_token", lambda address, email, password: "new-token")
        started = tmp_path / "started"
        fake = tmp_path / "label-studio"  # a second start would leave its mark
        fake.write_text(f"#!/bin/sh\ntouch {started}\nexit 1\n")
        fake.chmod(0o755)
        messages = []
        credentials = serve(root=root, label_studio=fake, log=messages.append)
        assert (credentials.url, credentials.token, credentials.password) == (url, "new-token", "the-password")
        assert not started.exists() and process.poll() is None
        assert server.running_pid(root) == process.pid and any("starting" in message for message in messages)
        # one that never answers: one line, and it is left for `attnpat annotate stop`
        monkeypatch.setattr(server, "health", lambda address, timeout=3.0: False)
        with pytest.raises(AttnpatError, match=rf"Label Studio \(pid {process.pid}\) did not answer on {url} within "
                                               r"0 s; .*annotate stop") as caught:
            serve(root=root, label_studio=fake, timeout=0, log=lambda message: None)
        assert "\n" not in str(caught.value) and not started.exists()
        assert server.running_pid(root) == process.pid
    finally:
        process.kill()
        process.wait()


def test_serve_replaces_a_stored_token_the_running_server_no_longer_accepts(tmp_path, monkeypatch):
    """A token reset or revoked in Label Studio's account page: push says `rejected the token ... rerun attnpat
    annotate serve`, and before, that serve handed back the same dead token from the credentials file."""
    root = tmp_path / "ls"
    process, url = _bystander_server(root)
    try:
        server.save_credentials(Credentials(url, "revoked-token", "a@b.c", "the-password"), root)
        monkeypatch.setattr(server, "health", lambda address, timeout=3.0: address == url)
        monkeypatch.setattr(server, "token_works", lambda address, token: token != "revoked-token")
        monkeypatch.setattr(server, "personal_access_token", lambda address, email, password: "new-token")
        fake = tmp_path / "label-studio"  # what a reset of the admin's password would run; never reached here
        fake.write_text("#!/bin/sh\nexit 1\n")
        credentials = serve(root=root, label_studio=fake, log=lambda message: None)
        assert credentials.token == "new-token" and server.load_credentials(root).token == "new-token"
        assert serve(root=root, label_studio=fake, log=lambda message: None).token == "new-token"  # kept: it works
        assert server.running_pid(root) == process.pid  # the running server was reused, not restarted
    finally:
        process.kill()
        process.wait()


def test_status_is_not_healthy_when_its_server_is_gone_and_another_serves_that_port(tmp_path, monkeypatch):
    """The workspace's server crashed (or the machine restarted) and another workspace's Label Studio now serves on
    the port: status said `running: False ... healthy: True`."""
    root = tmp_path / "ls"
    server.save_credentials(Credentials("http://127.0.0.1:8080", "token", "a@b.c", "pw"), root)
    server._pid_file(root).write_text("999999999 8080 /opt/ls/bin/label-studio\n")  # a pid that is gone
    monkeypatch.setattr(server, "health", lambda address, timeout=3.0: True)  # someone answers on 8080
    info = status(root)
    assert info["running"] is False and info["healthy"] is False


def test_a_server_on_this_machine_is_reached_directly_whatever_the_proxy_settings(tmp_path, monkeypatch):
    """With http_proxy set and no no_proxy, requests and httpx send even http://127.0.0.1 through the proxy, and
    with it the admin's password and tokens (before: every health check, login, token check and SDK call went
    there; with an unreachable proxy serve and push failed). A remote --url keeps the proxy settings."""
    seen = []

    class FakeLabelStudio(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, body: dict):
            seen.append((self.command, self.path))
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # /health, /api/current-user/whoami
            self._answer({"status": "UP"} if self.path.startswith("/health") else
                         {"id": 1, "email": "admin@example.com", "username": "admin"})

        def do_POST(self):  # /api/token/refresh/: the personal access token exchanged for an access token
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer({"access": "an-access-token"})

    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeLabelStudio)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    closed = free_port()  # a proxy that is not there: any request sent to it fails
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{closed}")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    token = jwt.encode({"token_type": "refresh", "exp": int(time.time()) + 3600},
                       "a signing key that the check never reads, 32+ bytes", algorithm="HS256")
    try:
        url = f"http://127.0.0.1:{fake.server_address[1]}"
        assert server.health(url) and token_works(url, token)
        ls.connect(Credentials(url, token))
        assert ("GET", "/health") in seen and any(path.startswith("/api/current-user/whoami") for _, path in seen)
    finally:
        fake.shutdown()
        fake.server_close()
    assert not server.http_session("http://localhost:8080").trust_env
    assert server.http_session("https://labels.example.org").trust_env
    # a remote host whose name only starts like a loopback address keeps the proxy (before: bypassed as local)
    assert server.http_session("http://127.example.com:8080").trust_env
    assert not server.http_session("http://127.9.9.9:8080").trust_env
