"""Push map samples to Label Studio as tasks with pre-annotations; pull annotations back into a labeled set.

Tasks carry the map's id and the sha256 of its raw float bytes; the raw maps stay in the local sample
folder (``maps.npz``), so every pulled label joins back to the exact map, never to a re-rendered image.
Pushing is idempotent (tasks already on the server, by map id, are skipped), so a push interrupted by a
lost connection is finished by running it again.
"""
from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from xml.etree import ElementTree

import httpx
import numpy as np
from label_studio_sdk import LabelStudio
from label_studio_sdk.core.api_error import ApiError

from analysis.errors import AttnpatError
from analysis.mapstore import maps_digest
from analysis.patterns import CLASSES
from analysis.progress import progress_bar
from analysis.rendering import cue_text
from analysis.rundir import atomic_write_json, read_json
from analysis.uncertainty import wilson_interval
from annotation.dataset import (
    check_labeled_out,
    first_round_size,
    fleiss_kappa,
    fleiss_kappa_interval,
    independent_labels,
    is_tie,
    write_labeled_folder,
    write_new_version,
)
from annotation.instructions import GALLERY, instructions_html
from annotation.preannotate import RULES_VERSION, preannotate
from annotation.sample import read_sample
from annotation.server import Credentials, is_loopback

PREANNOTATOR_VERSION = RULES_VERSION
CHUNK = 50

# defaultZoom="original": Label Studio fits a task's image to its panel by default (653 pixels drawn, 811 shown at
# 1400 pixels' width), so a one-token column was no whole number of screen pixels; at the image's own size each
# token cell keeps the guideline's whole pixels (a panel narrower than the image still fits it).
# smoothing="false": a scaled image (zoomed in, or fitted) is otherwise smoothed, which blurs the guideline's crisp
# token cells into their neighbours
LABEL_CONFIG = """<View>
  <Header value="Which pattern dominates this attention map? (see the labeling guideline)"/>
  <Text name="info" value="$caption"/>
  <Image name="image" value="$image" zoom="true" smoothing="false" defaultZoom="original"/>
  <Choices name="pattern" toName="image" choice="single" showInLine="true" required="true">
""" + "\n".join(f'    <Choice value="{name}"/>' for name in CLASSES) + """
  </Choices>
</View>"""


class ServerUnreachable(AttnpatError):
    """The connection failed (server down, or lost midway): rerunning the same command finishes the job."""


def map_sha256(attn: np.ndarray) -> str:
    """The sha256 of one map's float32 bytes: a task records it, so a pull notices a map changed since the push."""
    return maps_digest([attn])


def connect(credentials: Credentials):
    """An SDK client whose token has been checked (wrong token and server down give one-line errors)."""
    # the SDK refuses an expired personal access token (or one without an expiry) as it builds the client
    # a server on this machine is reached directly, whatever the proxy settings (see server.http_session)
    transport = httpx.Client(timeout=60, follow_redirects=True, trust_env=not is_loopback(credentials.url))
    client = _call(credentials.url, lambda: LabelStudio(base_url=credentials.url, api_key=credentials.token,
                                                         timeout=60, httpx_client=transport))
    _call(credentials.url, lambda: client.users.whoami())
    return client


def _call(url: str, action, what: str = "request"):
    """Run an SDK call, translating transport and HTTP failures into AttnpatError."""
    try:
        return action()
    except ApiError as exc:
        if exc.status_code in (401, 403):
            raise AttnpatError(f"Label Studio at {url} rejected the token (HTTP {exc.status_code}); "
                               "check --token or rerun `attnpat annotate serve`") from exc
        if exc.status_code == 404:
            raise AttnpatError(f"Label Studio at {url}: {what} not found (HTTP 404)") from exc
        raise AttnpatError(f"Label Studio at {url} answered HTTP {exc.status_code} to a {what}") from exc
    except (httpx.TransportError, ConnectionError) as exc:
        raise ServerUnreachable(f"cannot reach Label Studio at {url} ({type(exc).__name__}); is it running? "
                                "(`attnpat annotate serve`); rerun to finish the job") from exc
    except json.JSONDecodeError as exc:
        # the SDK decodes the body of some answers before it looks at their status (its token refresh does)
        raise AttnpatError(f"{url} did not answer as Label Studio does (not JSON); is it the Label Studio "
                           "server's address?") from exc
    except Exception as exc:
        # The SDK wraps a refused PAT refresh in other exception types; keep the message one line.
        if "401" in str(exc) or "token" in str(exc).lower():
            raise AttnpatError(f"Label Studio at {url} rejected the token ({type(exc).__name__})") from exc
        raise


@dataclass(frozen=True)
class PanelSettings:
    """How a project hands out its tasks. annotators: how many different people label each task (Label Studio's
    overlap: maximum_annotations, on every task); None leaves the project's setting as it is. blind: hide the
    rule pre-annotations from annotators (Label Studio's show_collab_predictions), so an independent panel
    labels from the image and the guideline alone; None leaves it as it is, except for a panel (annotators 2 or
    more), which is blind unless blind=False asks for the pre-annotations: a suggestion every panelist sees pulls
    their labels towards it, and the panel's agreement would measure the suggestion, not the guideline."""

    annotators: int | None = None
    blind: bool | None = None

    def __post_init__(self):
        if self.annotators is not None and self.annotators < 1:
            raise AttnpatError(f"--annotators must be at least 1, got {self.annotators}")
        if self.blind is None and self.annotators is not None and self.annotators > 1:
            object.__setattr__(self, "blind", True)  # frozen dataclass: the panel's default, set once

    def project_fields(self) -> dict:
        """The Label Studio project fields these settings change."""
        fields = {}
        if self.annotators is not None:
            fields.update(maximum_annotations=self.annotators, overlap_cohort_percentage=100)
        if self.blind is not None:
            fields.update(show_collab_predictions=not self.blind)
        return fields


@dataclass(frozen=True)
class ReplacedView:
    """A labeling view that differed from attnpat's and that a push replaced: ``differences`` names the tags that
    differ (:func:`view_differences`); ``label_config`` is the view as it was, kept so it can be restored."""

    differences: list[str]
    label_config: str


def ensure_project(client, url: str, title: str, project_id: int | None = None,
                   panel: PanelSettings = PanelSettings()) -> tuple[int, bool, ReplacedView | None]:
    """Reuse the project (by id, else by title) or create it, then bring its instructions, labeling view and
    ``panel`` settings up to date. Returns (id, created, the view replaced where it differed from ours)."""
    found = _titled_project(client, url, project_id, title)
    if found is None:
        found = _project_by_title(client, url, title)
    created = found is None
    replaced = None
    if not created:
        # a view edited in Label Studio (a tag added, an attribute changed) is replaced, since the labels depend on
        # what annotators saw, but not in silence: the caller says so and keeps the old view
        current = getattr(_call(url, lambda: client.projects.get(id=found), "project"), "label_config", None) or ""
        differences = view_differences(current)
        replaced = ReplacedView(differences, current) if differences else None
    if created:
        # Uniform sampling: the labeling stream hands out tasks in random order, not in push order (a natural
        # sample is pushed task by task, shortest maps first), so a panel that stops partway has labeled an
        # unbiased share of the sample
        found = _call(url, lambda: client.projects.create(title=title, label_config=LABEL_CONFIG,
                                                         description="attnpat attention-pattern labeling",
                                                         sampling="Uniform sampling"),
                      "project").id
    # Every push brings the project's instructions up to the current guideline and gallery, and its labeling view
    # up to the current one (the classes stay the same, so the labels made in it keep their meaning).
    instructions = instructions_html(image_url=gallery_image_url(client, url, found))
    _call(url, lambda: client.projects.update(id=found, expert_instruction=instructions, show_instruction=True,
                                              label_config=LABEL_CONFIG, **panel.project_fields()),
          "project update")
    return found, created, replaced


def _view_elements(label_config: str) -> Counter:
    """(tag, its attributes sorted) -> count, for every element of a labeling view; ValueError if not XML."""
    try:
        root = ElementTree.fromstring(label_config)
    except ElementTree.ParseError as exc:
        raise ValueError(str(exc)) from exc
    return Counter((element.tag, tuple(sorted(element.attrib.items()))) for element in root.iter())


def view_differences(current: str, ours: str = LABEL_CONFIG) -> list[str]:
    """The tags by which a project's labeling view ``current`` differs from ``ours``, each as its tag and name (or
    value), e.g. ['Image image', 'Choice extra'], in the order first met (ours, then current); [] when they hold
    the same elements with the same attributes (layout and attribute order do not count). A view that is not XML
    differs as a whole."""
    if not current.strip():
        return ["the whole view (empty)"]
    try:
        theirs = _view_elements(current)
    except ValueError:
        return ["the whole view (not XML)"]
    mine = _view_elements(ours)
    differing = list((mine - theirs).elements()) + list((theirs - mine).elements())
    return list(dict.fromkeys(_tag_name(tag, dict(attributes)) for tag, attributes in differing))


def _tag_name(tag: str, attributes: dict) -> str:
    """'Image image', 'Choice block', or the tag alone where it has no name (a Header's value is its text)."""
    name = attributes.get("name") or (attributes.get("value") if tag == "Choice" else None)
    return f"{tag} {name}" if name else tag


def gallery_image_url(client, url: str, project_id: int):
    """File name -> URL of a gallery image on this server, or None where the server cannot serve the folder.

    `attnpat annotate serve` lets Label Studio serve files under the annotation package; a project sees them
    once the gallery folder is attached to it as a (never synchronised) local-files storage.
    """
    folder = str(GALLERY.parent)
    storages = _call(url, lambda: client.import_storage.local.list(project=project_id), "storage list")
    if not any(storage.path == folder for storage in storages):
        try:
            _call(url, lambda: client.import_storage.local.create(project=project_id, path=folder,
                                                                  title="attnpat labeling gallery",
                                                                  use_blob_urls=False), "gallery storage")
        except ServerUnreachable:
            raise
        except AttnpatError:
            return None  # another server, with local files off or another document root: text-only gallery
    return lambda name: f"/data/local-files/?d={GALLERY.parent.name}/{name}"


def existing_tasks(client, url: str, project_id: int) -> dict[str, dict]:
    """map_id -> task dict (with annotations, drafts and predictions) for every task of ours in the project,
    through :func:`check_export`."""
    tasks = []

    def collect():
        for task in client.tasks.list(project=project_id, fields="all"):
            tasks.append(task.model_dump() if hasattr(task, "model_dump") else dict(task))

    _call(url, collect, "task list")
    return check_export(tasks)


def check_export(tasks) -> dict[str, dict]:
    """The one door for Label Studio tasks, from the server or an exported JSON file: map_id -> task, each
    checked to hold the fields a pull reads, with the types it expects. Tasks without a map_id are not ours
    and are left out; anything malformed is one AttnpatError naming the task."""
    if not isinstance(tasks, list):
        raise AttnpatError(f"a Label Studio export is a JSON list of tasks, got {type(tasks).__name__}")
    checked = {}
    for position, task in enumerate(tasks, start=1):
        where = f"Label Studio task {position}"
        if not isinstance(task, dict) or not isinstance(task.get("data"), dict):
            raise AttnpatError(f"{where} is not a task (an object with a 'data' object)")
        map_id = task["data"].get("map_id")
        if map_id is None:
            continue
        if not isinstance(map_id, str) or not isinstance(task["data"].get("map_sha256", ""), str):
            raise AttnpatError(f"{where}: map_id and map_sha256 must be strings")
        if map_id in checked:
            raise AttnpatError(f"{where}: map {ascii(map_id[:80])} is in two tasks")
        predictions = task.get("predictions")
        if isinstance(predictions, list) and predictions and all(type(item) is int for item in predictions):
            # Label Studio's JSON export lists a task's predictions by id and nests each one in the annotations
            # made from it; the API gives the objects themselves
            nested = {item["prediction"].get("id"): item["prediction"] for item in _objects(
                task.get("annotations"), f"{where}: annotations") if isinstance(item.get("prediction"), dict)}
            task = {**task, "predictions": [nested[number] for number in predictions if number in nested]}
        for key in ("annotations", "predictions", "drafts"):
            for item in _objects(task.get(key), f"{where}: {key}"):
                _check_result(item, f"{where}: {key}")
        for annotation in task.get("annotations") or []:
            who = annotation.get("completed_by")
            if not (who is None or type(who) is int or (isinstance(who, dict) and type(who.get("id")) is int)):
                raise AttnpatError(f"{where}: an annotation's completed_by is neither a user id nor a user")
            if not (annotation.get("id") is None or type(annotation.get("id")) is int):
                raise AttnpatError(f"{where}: an annotation's id is not a number")
            # read as a skip whenever truthy: the text "false" would drop a real label
            if not (annotation.get("was_cancelled") is None or type(annotation.get("was_cancelled")) is bool):
                raise AttnpatError(f"{where}: an annotation's was_cancelled is neither true nor false")
        checked[map_id] = task
    return checked


def _objects(value, where: str) -> list:
    """``value`` as a list of objects (None means none)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise AttnpatError(f"{where} must be a list of objects")
    return value


def _check_result(item: dict, where: str) -> None:
    """An annotation's or prediction's result: a list of objects whose 'value' holds a list of choice names."""
    for part in _objects(item.get("result"), f"{where} result"):
        value = part.get("value")
        choices = value.get("choices") if isinstance(value, dict) else None
        if not (value is None or isinstance(value, dict)) or not (
                choices is None or (isinstance(choices, list) and all(isinstance(c, str) for c in choices))):
            raise AttnpatError(f"{where} result: 'value' must hold a list of choice names")


def read_export(path: str | Path) -> dict[str, dict]:
    """Tasks from a Label Studio JSON export file (Export > JSON), through :func:`check_export`."""
    path = Path(path)
    try:
        tasks = json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as exc:
        raise AttnpatError(f"cannot read the Label Studio export {path}: {exc.strerror or type(exc).__name__}") from exc
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, bad JSON, an integer over 4300 digits
        raise AttnpatError(f"{path} is not a Label Studio JSON export ({type(exc).__name__})") from exc
    return check_export(tasks)


def build_task(row: dict, attn: np.ndarray, png: bytes) -> dict:
    """One Label Studio task: the image as a data URI, the map's id and hash, and the pre-annotation."""
    label, score = preannotate(attn, row["tokens"])
    return {
        "data": {"image": "data:image/png;base64," + base64.b64encode(png).decode(),
                 "caption": task_caption(row, attn),
                 "map_id": row["map_id"], "map_sha256": map_sha256(attn), "task": row["task"],
                 "layer": row["layer"], "head": row["head"], "example_id": row["example_id"]},
        "predictions": [{"model_version": PREANNOTATOR_VERSION, "score": score,
                         "result": [{"from_name": "pattern", "to_name": "image", "type": "choices",
                                     "value": {"choices": [label]}}]}],
    }


def task_caption(row: dict, attn: np.ndarray) -> str:
    """The text shown above a task's image: map id, layer, head, tokens, and the map's cue line. attn: (n, n)."""
    # a map of a cut input is of part of the text: the annotator is told, as the sample's index records it
    cut = " (input truncated to these)" if row.get("truncated") else ""
    # layer and head as the map id, the gallery and labels.csv number them (0-indexed): a caption's numbers find
    # the map's row in labels.csv and index.jsonl as written (a 1-indexed caption's "layer 3" was L2 there)
    return (f"map {row['map_id']} · layer {row['layer']} · head {row['head']} (0-indexed, as in the map id) · "
            f"{row['n']} tokens{cut}\ncues: {cue_text(attn, row['tokens'])}")


def stale_captions(present: dict[str, dict], rows: list[dict], maps: dict[str, np.ndarray]) -> dict[str, str]:
    """map_id -> the current caption, for each task already in the project whose caption differs from it (pushed
    before the caption changed). present: map_id -> task; maps: map_id -> (n, n). Only the caption: the image and
    the map's digest stay as pushed (a changed map is refused by :func:`check_pushed_maps`)."""
    return {row["map_id"]: caption for row in rows if row["map_id"] in present
            and present[row["map_id"]]["data"].get("caption") != (caption := task_caption(row, maps[row["map_id"]]))}


@dataclass
class PushReport:
    """What a push did. updated: tasks already there whose caption was brought up to date; replaced_view: the tags
    by which the project's labeling view differed from attnpat's before the push replaced it ([] when it did
    not differ, or the project is new)."""

    project_id: int
    created_project: bool
    pushed: int
    already_there: int
    total: int
    updated: int = 0
    replaced_view: list = field(default_factory=list)


def push(credentials: Credentials, sample: str | Path, title: str | None = None, state_file: Path | None = None,
         chunk: int = CHUNK, log=print, progress: bool = True, panel: PanelSettings = PanelSettings()) -> PushReport:
    """Import every map of a sample folder that the project does not hold yet, ``chunk`` tasks per request.

    Each chunk is one import (Label Studio commits it whole), so a push cut off at any point leaves whole
    chunks on the server, and running it again imports exactly the maps that are still missing."""
    sample = Path(sample)
    rows, maps = read_sample(sample, images=True)  # a folder written half is refused before the server is reached
    title = title or f"attnpat patterns: {sample.name}"
    state = _read_state(state_file)
    client = connect(credentials)
    project_id, created, replaced = ensure_project(client, credentials.url, title,
                                                   state.get("projects", {}).get(title), panel)
    state.setdefault("projects", {})[title] = project_id
    if replaced is not None:
        # the old view is kept in the state file, so an edit made in Label Studio can be looked at or restored
        state.setdefault("replaced_views", {}).setdefault(title, []).append(
            {"project_id": project_id, "replaced_at": datetime.now(UTC).isoformat(timespec="seconds"),
             "differences": replaced.differences, "label_config": replaced.label_config})
        kept = f" (the old view is kept in {state_file})" if state_file else ""
        log(f"replaced project {project_id}'s labeling view, which differed from attnpat's in: "
            f"{', '.join(replaced.differences)}{kept}")
    if state_file:
        atomic_write_json(state_file, state)
    present = existing_tasks(client, credentials.url, project_id)
    check_pushed_maps(present, maps, project_id, sample.name)
    updated = stale_captions(present, rows, maps)
    for map_id, caption in updated.items():
        task = present[map_id]
        _call(credentials.url, lambda task=task, caption=caption: client.tasks.update(
            id=task["id"], data={**task["data"], "caption": caption}), "task update")
    if updated:
        log(f"updated the caption of {len(updated)} tasks already in project {project_id} to the current one")
    todo = [row for row in rows if row["map_id"] not in present]
    bar = progress_bar(len(todo), progress and bool(todo), f"push to project {project_id}", unit="task")
    try:
        for start in range(0, len(todo), chunk):
            batch = [build_task(row, maps[row["map_id"]], (sample / row["image"]).read_bytes())
                     for row in todo[start:start + chunk]]
            _call(credentials.url, lambda batch=batch: client.projects.import_tasks(
                id=project_id, request=batch, return_task_ids=True), "task import")
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    if todo:
        log(f"pushed {len(todo)} new tasks to project {project_id}")
    return PushReport(project_id, created, len(todo), len(rows) - len(todo), len(rows), len(updated),
                      replaced.differences if replaced is not None else [])


def check_pushed_maps(present: dict[str, dict], maps: dict[str, np.ndarray], project_id: int, sample: str) -> None:
    """AttnpatError when a task of the project holds one of the sample's map ids with another map's digest (the
    sample was deleted and drawn again, from a changed model): such a task would count as already pushed, yet
    every label on it is set aside by pull, so a panel would label it for nothing. present: map_id -> task;
    maps: map_id -> (n, n)."""
    changed = [map_id for map_id, task in present.items()
               if map_id in maps and task["data"].get("map_sha256") != map_sha256(maps[map_id])]
    if changed:
        raise AttnpatError(f"project {project_id} holds {len(changed)} of sample {sample}'s maps with other values "
                           f"(first: {changed[0]}): they were pushed from an earlier drawing of the sample, and "
                           "labels on them cannot be pulled; push to another project (--project) or restore that "
                           "drawing of the sample")


def _read_state(path: Path | None) -> dict:
    if not (path and path.is_file()):
        return {}
    state = read_json(path, "the push state file", "delete it (projects are then found by their title)")
    if not isinstance(state, dict) or not isinstance(state.get("projects", {}), dict):
        raise AttnpatError(f"the push state file {path} is not a push state; delete it (projects are then found "
                           "by their title)")
    return state


# ---------------------------------------------------------------- pull

@dataclass
class PullReport:
    """What a pull found. drafts / skipped / unknown / hash_mismatch / not_in_sample list map ids (unknown: each
    with the label that is not a class); skipped: the maps left out of the set because they were skipped
    (each once: no label, and the last word of an annotator on it a skip); unlabeled: the other maps of the sample
    with no label yet (no annotation, or only ones without a usable class); no_choice: annotations submitted
    without a class; multi_choice: annotations that chose several classes (none of them counts as a label);
    repeated: maps where one annotator submitted twice (their latest annotation counts, once; a later skip, empty
    or several-class one withdraws their label); ties: maps whose annotators split evenly (the earliest
    annotation's label was kept). tasks: the project's tasks, each in exactly one part of :meth:`task_parts`.
    kappa: Fleiss' kappa over the kappa_maps maps with two or more independent labels, before the
    settling_labels that settled ties (:func:`independent_kappa`), kappa_ci_low / kappa_ci_high its percentile
    bootstrap 95% interval over those maps."""

    folder: Path
    labeled: int
    class_counts: dict
    drafts: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    unknown: list = field(default_factory=list)
    unlabeled: int = 0
    hash_mismatch: list = field(default_factory=list)
    not_in_sample: list = field(default_factory=list)
    tasks: int = 0
    ties: list = field(default_factory=list)
    no_choice: list = field(default_factory=list)
    multi_choice: list = field(default_factory=list)
    repeated: list = field(default_factory=list)
    prediction_agreement: float | None = None
    # Wilson's 95% interval of the agreement, over the prediction_maps maps with a pre-annotation and a label
    prediction_agreement_ci: tuple[float, float] | None = None
    prediction_maps: int = 0
    preannotator_versions: list = field(default_factory=list)  # model_version of the predictions compared
    # of the prediction_maps predictions compared, those whose model_version is not the current rules' (pushed
    # before the thresholds or rule code changed): the agreement is then, in part, of those older rules
    other_rules_predictions: int = 0
    rules_version: str = RULES_VERSION  # the current rules' version, the one the others are told from
    preannotations_shown: bool | None = None  # the project showed annotators the rules' labels (None: unknown)
    kappa: float | None = None
    # the kappa's percentile bootstrap 95% interval over the kappa_maps maps (None: no kappa, or one map)
    kappa_ci_low: float | None = None
    kappa_ci_high: float | None = None
    kappa_maps: int = 0
    settling_labels: int = 0  # labels that settled a tie after the independent round: not in the kappa
    n_annotators: int = 0  # distinct Label Studio users among the annotations kept (those that name one)
    # annotations kept that name no user (no completed_by): each is its own voter, and who wrote them is unknown,
    # so they are counted here, not as annotators
    unidentified_annotations: int = 0

    def annotators_text(self) -> str:
        """'3 annotators', with the annotations that name no annotator said apart: '2 annotators and 5 annotations
        that name no annotator'."""
        known = f"{self.n_annotators} annotator{'s' if self.n_annotators != 1 else ''}"
        if not self.unidentified_annotations:
            return known
        unknown = (f"{self.unidentified_annotations} annotation{'s' if self.unidentified_annotations != 1 else ''}"
                   " that name no annotator")
        return f"{known} and {unknown}" if self.n_annotators else unknown

    def kappa_text(self) -> str:
        """'Fleiss' kappa 0.871 [0.84, 0.90] (bootstrap 95% over 270 maps)', or, from one map (no interval), what
        stands in for the interval; called only when the kappa is defined."""
        if self.kappa_ci_low is None or self.kappa_ci_high is None:
            maps = f"{self.kappa_maps} map{'s' if self.kappa_maps > 1 else ''}"
            return f"Fleiss' kappa {self.kappa:.3f} (no bootstrap interval over {maps})"
        return (f"Fleiss' kappa {self.kappa:.3f} [{self.kappa_ci_low:.2f}, {self.kappa_ci_high:.2f}] "
                f"(bootstrap 95% over {self.kappa_maps} maps)")

    def other_rules_text(self) -> str | None:
        """One line saying how many of the predictions compared were made under other rules than the current ones,
        or None when all were made under the current rules."""
        if not self.other_rules_predictions:
            return None
        others = ", ".join(version for version in self.preannotator_versions if version != self.rules_version)
        return (f"pre-annotations made under other rules than the current {self.rules_version}: "
                f"{self.other_rules_predictions} of the {self.prediction_maps} compared ({others}); the "
                "pre-annotation agreement is, for those maps, of the older rules")

    def task_parts(self) -> dict[str, int]:
        """The project's tasks cut into disjoint parts that add up to ``tasks``: labeled (in the set), skipped
        (left out by skips), not yet labeled, and set aside (not in the sample, or changed since the push)."""
        return {"labeled": self.labeled, "skipped": len(self.skipped), "not yet labeled": self.unlabeled,
                "set aside": len(self.not_in_sample) + len(self.hash_mismatch)}


def _choice(annotation: dict) -> str | None:
    for item in annotation.get("result") or []:
        choices = (item.get("value") or {}).get("choices")
        if choices:
            return choices[0]
    return None


def _chosen(annotation: dict) -> list[str]:
    """Every distinct class an annotation chose, over all its result parts, in order. One is a label; several
    (a labeling view that allowed multiple choice, or an edited export) name no single class."""
    return list(dict.fromkeys(choice for item in annotation.get("result") or []
                              for choice in (item.get("value") or {}).get("choices") or []))


def _created(annotation: dict) -> tuple[datetime, int]:
    """An annotation's order: its creation time, parsed ('...:05Z' comes before '...:05.250Z', which text order
    reverses; a missing or odd time first), then its id."""
    try:
        when = datetime.fromisoformat(str(annotation.get("created_at")))
    except ValueError:
        when = datetime.min
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    number = annotation.get("id")
    return when, number if isinstance(number, int) else 0


def _user_names(client, url: str) -> dict[int, str]:
    """user id -> email; {} when this token may not list users (annotators are then named by id)."""
    try:
        users = _call(url, lambda: list(client.users.list()), "user list")
    except ServerUnreachable:
        raise
    except AttnpatError:
        return {}
    return {user.id: user.email or user.username or str(user.id) for user in users}


def _user_id(annotation: dict) -> int | None:
    """The Label Studio user id of an annotation's author (None when it names none): the stable identity of an
    annotator, where the email or username shown for it may change between pulls and need not be unique."""
    who = annotation.get("completed_by")
    return who if isinstance(who, int) else (who or {}).get("id")


def _annotator(annotation: dict, names: dict[int, str]) -> str:
    user_id = _user_id(annotation)
    return names.get(user_id, str(user_id))


def _titled_project(client, url: str, project_id: int | None, title: str) -> int | None:
    """``project_id`` when the server holds a project of that id titled ``title``, else None. The state file
    remembers ids, and another server (another --url) may hold an unrelated project under the same id."""
    if project_id is None:
        return None
    try:
        project = _call(url, lambda: client.projects.get(id=project_id), "project")
    except AttnpatError as exc:
        if "404" not in str(exc):
            raise
        return None
    return project_id if getattr(project, "title", None) == title else None


def _project_by_title(client, url: str, title: str) -> int | None:
    """The id of the project titled ``title`` on the server, or None; AttnpatError when several are (which one
    holds the sample's labels cannot be told, and the first listed may be an older or unrelated one)."""
    found = [project.id for project in _call(url, lambda: list(client.projects.list()), "project list")
             if project.title == title]
    if len(found) > 1:
        raise AttnpatError(f"{len(found)} projects on {url} are titled '{title}' (ids {', '.join(map(str, found))}); "
                           "rename all but the sample's own in Label Studio")
    return found[0] if found else None


def resolve_project(client, url: str, title: str, state: dict) -> int:
    """The id of the pushed project (from the state file when the server holds it under ``title``, else by
    title); AttnpatError when it is gone."""
    remembered = state.get("projects", {}).get(title)
    project_id = _titled_project(client, url, remembered, title)
    if project_id is None:
        project_id = _project_by_title(client, url, title)
        if project_id is not None:
            return project_id
        if remembered is not None:
            raise AttnpatError(f"project {remembered} ('{title}') is gone from {url}; push again to recreate it "
                               "(annotations made there are lost with it)")
        raise AttnpatError(f"no project '{title}' on {url}; push the sample first")
    return project_id


def _shows_preannotations(client, url: str, project_id: int) -> bool | None:
    """Whether the project shows annotators the rules' pre-annotations (Label Studio's show_collab_predictions):
    labels made with a suggestion in view lean towards it, so the labeled set's card records it."""
    shown = getattr(_call(url, lambda: client.projects.get(id=project_id), "project"), "show_collab_predictions",
                    None)
    return shown if isinstance(shown, bool) else None


def independent_kappa(label_lists: list[list[str]]) -> tuple[float | None, tuple[float, float] | None, int, int]:
    """Fleiss' kappa of the independent labels: label_lists, one list per labeled map, earliest label first.
    The independent round is as many labels as most maps have; a tie among them is settled by a further label
    (docs/labeling.md), chosen because the round disagreed, so counting it would raise the agreement measured.
    Returns (kappa, or None when no map has two labels or every label is one class (kappa undefined); its 95%
    bootstrap interval over those maps (:func:`fleiss_kappa_interval`; None with the kappa, NaN bounds from one
    map); maps with two or more independent labels; settling labels left out)."""
    if not label_lists:
        return None, None, 0, 0
    round_size = first_round_size(label_lists)
    independent = [independent_labels(labels, round_size) for labels in label_lists]
    settling = sum(len(labels) - len(kept) for labels, kept in zip(label_lists, independent, strict=True))
    several = [labels for labels in independent if len(labels) > 1]
    kappa = fleiss_kappa(several) if several else float("nan")
    if np.isnan(kappa):
        return None, None, len(several), settling
    low, high = fleiss_kappa_interval(several)
    return kappa, (float(low), float(high)), len(several), settling


def pull(credentials: Credentials | None, sample: str | Path, out: str | Path, title: str | None = None,
         state_file: Path | None = None, export: str | Path | None = None, new_version: bool = False) -> PullReport:
    """Export annotations, join them to the sample's raw maps and write a labeled set to ``out``.

    One row per map in labels.csv (the majority label over its annotators; ties go to the earliest
    annotation and are reported); every single annotation in annotations.csv. Drafts (of any user),
    maps left out because they were skipped (cancelled), unknown labels and maps whose hash no longer matches are
    reported, never dropped silently. Everything is read before anything is written, and the folder appears whole
    (written under a temporary name, then renamed), so a pull cut off midway leaves nothing behind.
    export: a Label Studio JSON export file to read instead of the server (annotators are then named by id).
    new_version: ``out`` holds a labeled set's versions; the set is written to the next one, ``out``/v<N+1>
    (:func:`annotation.dataset.write_new_version`), and the report names it.
    """
    sample, out = Path(sample), Path(out)
    if not new_version:
        check_labeled_out(out)
    rows, maps = read_sample(sample)
    rows = {row["map_id"]: row for row in rows}
    title = title or f"attnpat patterns: {sample.name}"
    shown = None  # an export does not say whether its project showed the pre-annotations
    if export is not None:
        project_id, tasks, names, url = None, read_export(export), {}, f"file:{Path(export).resolve()}"
    else:
        client = connect(credentials)
        project_id = resolve_project(client, credentials.url, title, _read_state(state_file))
        shown = _shows_preannotations(client, credentials.url, project_id)
        tasks = existing_tasks(client, credentials.url, project_id)
        names, url = _user_names(client, credentials.url), credentials.url
    report = PullReport(out, 0, {}, preannotations_shown=shown)
    all_annotations, final_rows, agree, compared, label_lists = [], [], 0, 0, []
    versions = set()  # the pre-annotators of the predictions compared (tasks pushed under other rules differ)
    report.tasks = len(tasks)
    for map_id, task in sorted(tasks.items()):
        if map_id not in rows:
            report.not_in_sample.append(map_id)  # set aside, and listed there only (not also as unknown)
            continue
        if task["data"].get("map_sha256") != map_sha256(maps[map_id]):
            report.hash_mismatch.append(map_id)
            continue
        # Label Studio shows a task's drafts only to their author; draft_exists covers everyone's.
        if task.get("drafts") or task.get("draft_exists"):
            report.drafts.append(map_id)
        latest = {}  # voter -> (order, annotation or None): each annotator's last word, a skip included
        skipped_by = set()  # the voters whose last word is a skip
        ordered = sorted(((_created(annotation), annotation) for annotation in task.get("annotations") or []),
                         key=lambda pair: pair[0])
        for order, annotation in ordered:
            chosen, annotator = _chosen(annotation), _annotator(annotation, names)
            label = chosen[0] if len(chosen) == 1 else None
            # a voter is a user id, not a name; an annotation that names no user is its own voter: it cannot be
            # told to repeat anyone
            user_id = _user_id(annotation)
            voter = user_id if user_id is not None else ("unnamed", len(latest))
            if voter in latest and map_id not in report.repeated:
                report.repeated.append(map_id)
            record = None
            skipped_by.discard(voter)
            if annotation.get("was_cancelled"):
                skipped_by.add(voter)
            elif len(chosen) > 1:  # not a vote for its first class: the annotator did not settle on one
                report.multi_choice.append(map_id)
            elif label is None:
                report.no_choice.append(map_id)
            elif label not in CLASSES:
                report.unknown.append(f"{map_id}: {label!r}")
            else:
                record = {"map_id": map_id, "label": label, "annotator": annotator,
                          "labeled_at": str(annotation.get("created_at")),
                          "annotator_id": "" if user_id is None else str(user_id)}
            latest[voter] = (order, record)
        annotations = [record for _, record in sorted(latest.values(), key=lambda kept: kept[0])
                       if record is not None]
        if not annotations:
            if skipped_by:
                report.skipped.append(map_id)
            else:  # counted once: a skipped map is not also a map waiting for a label
                report.unlabeled += 1
            continue
        all_annotations.extend(annotations)
        labels = [a["label"] for a in annotations]
        ranked = Counter(labels).most_common()  # equal counts keep first-seen order: the earliest wins a tie
        if is_tie(labels):
            report.ties.append(map_id)
        label_lists.append(labels)
        final = ranked[0][0]
        prediction = _choice((task.get("predictions") or [{}])[0])
        if prediction is not None:
            compared += 1
            agree += prediction == final
            version = str((task.get("predictions") or [{}])[0].get("model_version"))
            versions.add(version)
            report.other_rules_predictions += version != RULES_VERSION
        row = rows[map_id]
        final_rows.append({"map_id": map_id, "label": final,
                           "annotator": "+".join(sorted({a["annotator"] for a in annotations})),
                           "labeled_at": annotations[-1]["labeled_at"],
                           "task": row["task"], "example_id": row["example_id"], "layer": row["layer"],
                           "head": row["head"], "n": row["n"], "prediction": prediction,
                           "n_annotations": len(labels)})
    if not final_rows:
        raise AttnpatError(f"{'the export' if export is not None else f'project {project_id}'} has no submitted "
                           "annotations yet")
    report.labeled = len(final_rows)
    report.class_counts = dict(Counter(r["label"] for r in final_rows))
    report.prediction_agreement = agree / compared if compared else None
    report.preannotator_versions = sorted(versions)
    if compared:
        report.prediction_maps = compared
        report.prediction_agreement_ci = tuple(float(bound) for bound in wilson_interval(agree, compared))
    report.kappa, interval, report.kappa_maps, report.settling_labels = independent_kappa(label_lists)
    if interval is not None:  # NaN bounds (one map) are stored as null: JSON has no NaN
        report.kappa_ci_low, report.kappa_ci_high = (None if np.isnan(bound) else bound for bound in interval)
    report.n_annotators = len({a["annotator_id"] for a in all_annotations} - {""})
    report.unidentified_annotations = sum(a["annotator_id"] == "" for a in all_annotations)
    summary = {**{k: v for k, v in report.__dict__.items() if k != "folder"}, "project_id": project_id,
               "url": url, "sample": sample.name,
               "pulled_at": datetime.now(UTC).isoformat(timespec="seconds")}
    tokens = {map_id: rows[map_id]["tokens"] for map_id in (row["map_id"] for row in final_rows)
              if rows[map_id].get("tokens") is not None}
    if new_version:
        report.folder = write_new_version(out, final_rows, maps, all_annotations, summary, tokens)
    else:
        write_labeled_folder(out, final_rows, maps, all_annotations, summary, tokens)
    return report

