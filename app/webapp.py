"""The Gradio web app: explore one sentence live, browse the precomputed runs, start batch jobs.

This module holds the layout and its handlers only: the Explore view-model is app.explore, the run tabs'
files come from app.run_browser (which files, from analysis.artifacts), batch jobs from app.jobs.
User errors (AttnpatError) appear as a message in the page and the app keeps serving.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from analysis.artifacts import SHIPPED_LABELED_SET, TABS, hints, split_kind_folder, tab_artifacts, weight_only  # noqa: E402
from analysis.artifacts import artifact as registered  # noqa: E402
from analysis.artifacts import tab as tab_spec  # noqa: E402
from analysis.data import ALL_TASKS  # noqa: E402
from analysis.errors import AttnpatError, os_error_reason, quoted  # noqa: E402
from analysis.figures import GridLayout, close, map_figure, png_as_svg  # noqa: E402
from analysis.mapkinds import KIND_NOTES, MAP_KINDS  # noqa: E402
from analysis.models import DEFAULT_MODEL, EMBEDDED_ALIASES, list_store  # noqa: E402
from analysis.patterns import CLASS_STYLE  # noqa: E402
from analysis.rundir import save_figure, save_table  # noqa: E402
from analysis.sweeps import significance_lines  # noqa: E402
from app.classifier_card import classifier_card, read_metadata  # noqa: E402
from app.display import display_table  # noqa: E402
from app.explore import MAX_LIVE_TOKENS, LiveExplorer, ModelCache, ViewClock  # noqa: E402
from app.jobs import BatchJobs, Job, RecordedJob, cli_verbs  # noqa: E402
from app.options import check_address  # noqa: E402
from app.run_browser import FIGURE_LOCK, ArtifactView, RunBrowser, Scratch, slug_label  # noqa: E402
from classifier.predict import head_class_table  # noqa: E402

log = logging.getLogger("attnpat.webapp")

EXPLORE_INTRO = ("Every head's attention map for one sentence, with the pattern each head shows as the pattern CNN "
                 "classifies it: the five patterns of Kovaleva et al. 2019 Fig. 1, live; click a map to enlarge it.")
RUNS_INTRO = ("The run folders behind the other tabs, each with its manifest (command, data, timing, outputs), and "
              "batch jobs that add to them; no paper figure.")
EXAMPLE_SENTENCE = "The cat sat on the mat because it was warm."
# The run tab that also shows the shipped classifier's record (no training run needed).
CLASSIFIER_TAB = "Classifier"
# The run tab that also says which disabling effects survive Holm's correction.
DISABLING_TAB = "Disabling"
PICKED_HEAD_NOTE = ("The large view shows a head of the grid above, picked on it or by the layer and head boxes: after "
                    "editing the sentence, press Enter or Show all heads to draw its grid.")
# How the grid's greys read, said in its status line.
GRID_SCALES = {False: "greys are absolute weights (white = 0, black = 1), as in the large view",
               True: "each map scaled to its own maximum (black = its largest weight)"}
HIDE_SPECIAL_NOTE = ("Hiding [CLS]/[SEP] drops their rows and columns and renormalises each remaining row to sum to 1, "
                     "so it shows how the weight not spent on special tokens is spread.")


def run_hints(stems, model: str, task: str, model_name: str | None = None, base: str | None = None) -> str:
    """The distinct commands that would write ``stems``, as inline code (``model_name``: the model as the run's
    manifest names it, for ``--model``; ``base``: the base it was fine-tuned from, for ``--base``)."""
    return ", ".join(f"`{command}`" for command in hints(stems, model, task, model_name, base))


def set_minus(stems, left_out) -> list:
    """``stems`` without those in ``left_out``, in order."""
    return [stem for stem in stems if stem not in left_out]


def weight_run_note(stems, model: str, task: str) -> str:
    """Why run folder ``model`` (<model>@<kind>) lacks ``stems`` and where they are: their verbs take no --map-kind,
    so they are computed on attention weights only, in the weight run; '' for no stems."""
    if not stems:
        return ""
    weight_folder, kind = split_kind_folder(model)
    verbs = ", ".join(dict.fromkeys(f"`{registered(stem).verb}`" for stem in stems))
    return _message(f"{', '.join(slug_label(stem) for stem in stems)}: not computed on {kind} maps ({verbs} take no "
                    f"--map-kind); shown in the attention-weight run {weight_folder}/{task}, whose tab names the "
                    "commands")


def elsewhere_note(stems, model_name: str, task: str) -> str:
    """Why a run of a model with no base recorded lacks the fine-tuned-run artifacts ``stems``, and how to get them:
    they are written in the run of a model fine-tuned from this one; '' for no stems."""
    if not stems:
        return ""
    command = f"attnpat finetune --model {shlex.quote(model_name)} --task {task} --split-dev"
    return _message(f"{', '.join(slug_label(stem) for stem in stems)}: shown in the run of a model fine-tuned from "
                    f"this one ({model_name} has no base model recorded); `{command}` makes one, and that run's tab "
                    "names the commands for the rest")


# ---------------------------------------------------------------- the app

def _natural(text: str) -> tuple:
    """Sort key: whole numbers by value, before any other text (a manifest may hold either)."""
    return (not text.isdigit(), int(text) if text.isdigit() else 0, text)


def _message(text: str, kind: str = "info") -> str:
    """A status line: "**error:** ..." for problems (plain words: headless browsers often lack emoji fonts)."""
    prefix = {"error": "**error:** ", "info": "**note:** ", "ok": ""}[kind]
    return prefix + text


def _job_style(job) -> str:
    """A job that ended: finished is a success line, stopped a note, anything else an error."""
    return "ok" if job.returncode == 0 else ("info" if job.stopped else "error")


def head_index(number, name: str) -> int:
    """A layer or head box's 1-indexed number (gradio sends a float, or None when the box is empty) -> 0-indexed."""
    if number is None or number == "":
        raise AttnpatError("enter a layer and a head (1-indexed)")
    try:
        value = float(number)
    except (TypeError, ValueError):
        raise AttnpatError(f"the {name} must be a whole number from 1, got {str(number)[:20]!r}") from None
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise AttnpatError(f"the {name} must be a whole number from 1, got {value:g}")
    return int(value) - 1


@dataclass(frozen=True)
class DrawnInput:
    """The Explore inputs the grid on screen was last drawn from (or failed to be): a head picked on the grid, by a
    click or the layer and head boxes, is shown for these, not for a sentence edited since and not drawn yet."""

    text: str
    pair: str
    model: str
    word_level: bool
    hide_special: bool
    map_kind: str
    grid: int = 0  # its ViewClock ticket: the head drawn after it follows this grid only while it is the newest

    def head_map_inputs(self, layer, head) -> tuple:
        """WebApp.head_map's arguments for ``layer``, ``head`` (1-indexed) of this drawing."""
        return (self.text, self.pair, self.model, self.word_level, self.hide_special, layer, head, self.map_kind)


# A head asked for while no grid is drawn (a model was picked since): said in the large view's caption.
NO_GRID = "no grid drawn: press Show all heads to draw one, then pick a head on it"


def skipped(count: int) -> tuple:
    """``count`` outputs left as they are: a superseded request's result (ViewClock) changes nothing on screen."""
    return tuple(gr.skip() for _ in range(count))


def model_choices() -> list[str]:
    return [*EMBEDDED_ALIASES, *(entry["name"] for entry in list_store())]


class WebApp:
    """Builds the Blocks; the handlers are methods so tests can call them without a browser too."""

    def __init__(self, runs_dir: str | Path | None = None, explorer: LiveExplorer | None = None, *,
                 allow_any_model: bool = False):
        self.scratch = Scratch()
        self.runs = RunBrowser(runs_dir, self.scratch)
        # Explore and batch jobs use only the models the dropdown lists, unless the app was started with
        # --allow-any-model: a client could otherwise make the server load any path or hub id it names.
        allowed = None if allow_any_model else model_choices
        self.explorer = explorer or LiveExplorer(ModelCache(allowed=allowed))
        self.jobs = BatchJobs(self.runs.root, allowed)

    # -------------------------------------------------------- Explore

    def explore(self, text, text_pair, model, word_level, hide_special, map_kind="weight", scale_each=False):
        """-> status, grid image path, class table, grid PNG, grid SVG, classes CSV."""
        try:
            view = self.explorer.explore(model, text, text_pair, word_level=bool(word_level),
                                         hide_special=bool(hide_special), map_kind=map_kind or "weight",
                                         scale_each=bool(scale_each))
        except AttnpatError as exc:
            return self._explore_failure(str(exc))
        except Exception as exc:  # keep serving; the log has the traceback
            log.exception("explore failed")
            return self._explore_failure(f"unexpected error: {type(exc).__name__}: {exc}")
        folder = self.scratch.new_dir()
        png = folder / "heads_grid.png"
        view.grid.save(png, optimize=False, compress_level=1)
        svg = png_as_svg(png, folder / "heads_grid.svg", *view.grid.size)
        layers, heads = view.layout.layers, view.layout.heads
        if view.classes is not None:
            csv = save_table(head_class_table(view.classes, view.probs), folder / "head_classes.csv")
            tags = [[f"{layer + 1}"] + [CLASS_STYLE[c][0] for c in row] for layer, row in enumerate(view.classes)]
            wide = pd.DataFrame(tags, columns=["layer"] + [f"head {h + 1}" for h in range(heads)])
            note = "Tags: " + ", ".join(f"{tag} = {name}" for name, (tag, _) in CLASS_STYLE.items())
        else:
            csv, wide, note = None, None, view.note
        unit = "words" if word_level else "tokens"
        kind = f"{KIND_NOTES[map_kind]}; " if map_kind and map_kind != "weight" else ""
        status = _message(f"{len(view.labels)} {unit}, {layers} layers x {heads} heads (1-indexed); {kind}"
                          f"{GRID_SCALES[bool(scale_each)]}; click a map for a large view. {note}", "ok")
        return (status, str(png), gr.Dataframe(value=wide, visible=wide is not None),
                gr.DownloadButton(value=str(png), visible=True),
                gr.DownloadButton(value=str(svg), visible=True),
                gr.DownloadButton(value=str(csv) if csv else None, visible=csv is not None))

    def draw(self, text, text_pair, model, word_level, hide_special, map_kind="weight", scale_each=False,
             clock: ViewClock | None = None):
        """explore's outputs, then the DrawnInput that a pick on the grid is shown for; all left as they are when
        ``clock`` (the session's) says a later drawing or a model pick began meanwhile."""
        ticket = clock.start_grid() if clock is not None else 0
        drawn = DrawnInput(text or "", text_pair or "", model or "", bool(word_level), bool(hide_special),
                           map_kind or "weight", ticket)
        shown = (*self.explore(text, text_pair, model, word_level, hide_special, map_kind, scale_each), drawn)
        if clock is not None and not clock.show_grid(ticket):
            return skipped(len(shown))
        return shown

    def _explore_failure(self, message: str):
        hidden = gr.DownloadButton(value=None, visible=False)
        return _message(message, "error"), None, gr.Dataframe(value=None, visible=False), hidden, hidden, hidden

    def head_map(self, text, text_pair, model, word_level, hide_special, layer, head, map_kind="weight"):
        """-> caption, large map image path, map PNG, map SVG. layer and head are 1-indexed."""
        map_kind = map_kind or "weight"
        hidden = gr.DownloadButton(value=None, visible=False)
        try:
            layer, head = head_index(layer, "layer"), head_index(head, "head")
            attn, labels = self.explorer.head_map(model, text, text_pair, layer, head, word_level=bool(word_level),
                                                  hide_special=bool(hide_special), map_kind=map_kind)
            live = self.explorer.live_maps(model, text, text_pair, map_kind)
            classes, _ = self.explorer.predictions(live)
        except AttnpatError as exc:
            return _message(str(exc), "error"), None, hidden, hidden
        except Exception as exc:
            log.exception("head map failed")
            return _message(f"unexpected error: {type(exc).__name__}: {exc}", "error"), None, hidden, hidden
        predicted = f": predicted {classes[layer][head]}" if classes is not None else ""
        kind = "" if map_kind == "weight" else f", {map_kind} map"
        title = f"layer {layer + 1}, head {head + 1} (1-indexed){kind}{predicted}"
        folder = self.scratch.new_dir()
        with FIGURE_LOCK:
            fig = map_figure(attn, labels, all_ticks=len(labels) <= 64, title=title)
            png, svg = save_figure(fig, folder / f"map_L{layer + 1}_H{head + 1}")
            close(fig)
        shown = f"{len(labels)} {'words' if word_level else 'tokens'}{' without [CLS]/[SEP]' if hide_special else ''}"
        return (_message(f"{title}; {shown}. Rows are queries, columns keys; darker = more attention.", "ok"), str(png),
                gr.DownloadButton(value=str(png), visible=True), gr.DownloadButton(value=str(svg), visible=True))

    def drawn_head_map(self, drawn: DrawnInput | None, layer, head, clock: ViewClock | None = None):
        """head_map of the grid on screen (``drawn``), for a head picked on it: -> caption, map, map PNG, map SVG;
        left as they are when ``clock`` says a later head, drawing or model pick began meanwhile."""
        ticket = clock.start_head() if clock is not None else 0
        shown = self._drawn_head_map(drawn, layer, head)
        return skipped(len(shown)) if clock is not None and not clock.show_head(ticket) else shown

    def _drawn_head_map(self, drawn: DrawnInput | None, layer, head):
        if drawn is None:
            hidden = gr.DownloadButton(value=None, visible=False)
            return _message(NO_GRID, "info"), None, hidden, hidden
        return self.head_map(*drawn.head_map_inputs(layer, head))

    def follow_head(self, drawn: DrawnInput | None, layer, head, clock: ViewClock | None = None):
        """After a new grid (``drawn``): -> layer, head (moved only when outside the model's layers and heads, as
        after a model with fewer of them was picked: a box set again to the value it held when this began would
        undo a click on the grid made meanwhile), then head_map's caption, large map, map PNG, map SVG. With the
        session's ``clock``, all left as they are unless ``drawn`` is the newest grid shown, not followed yet (a
        superseded drawing is followed too), and no later head, drawing or model pick began meanwhile."""
        ticket = 0
        if clock is not None:
            ticket = clock.follow(drawn.grid) if drawn is not None else None
            if ticket is None:
                return skipped(6)
        kept = layer, head
        try:
            layers, heads = self.explorer.live_maps(drawn.model, drawn.text, drawn.pair, drawn.map_kind).maps.shape[:2]
            kept = min(max(int(layer), 1), layers), min(max(int(head), 1), heads)
        except (AttnpatError, AttributeError, TypeError, ValueError, OverflowError):  # drawn_head_map says why
            pass
        boxes = [gr.update() if new == old else new for new, old in zip(kept, (layer, head))]
        shown = (*boxes, *self._drawn_head_map(drawn, *kept))
        return skipped(len(shown)) if clock is not None and not clock.show_head(ticket) else shown

    def forget_grid(self, model, clock: ViewClock | None = None):
        """A model picked: -> the explore outputs with the grid gone and a note to draw the picked model's (the
        grid shown was another model's: a click on it would be read with the picked model's layout), then the
        large view's caption, map, map PNG, map SVG, emptied too (its head was the other model's), and no
        DrawnInput (no grid is on screen). The session's ``clock`` is moved on, so a grid or head of the other
        model still being computed is not shown when it ends."""
        if clock is not None:
            clock.start_grid()
        _, *cleared = self._explore_failure("")
        hidden = gr.DownloadButton(value=None, visible=False)
        # a name from the list as it is (a path longer than quoted's cut stays whole); anything else sent, cut short
        name = model if isinstance(model, str) and len(model) <= 300 else quoted(model)
        return (_message(f"model {name} picked: press Show all heads to draw its maps", "info"), *cleared,
                "", None, hidden, hidden, None)

    def pick_head(self, drawn: DrawnInput | None, layer, head, evt: gr.SelectData):
        """A click on the grid drawn from ``drawn`` at pixel (x, y) -> the clicked head's (layer, head), 1-indexed."""
        if drawn is None or evt is None or not evt.index:
            return layer, head
        try:
            bundle = self.explorer.models.get(drawn.model)
        except AttnpatError:
            return layer, head
        hit = GridLayout(bundle.num_layers, bundle.num_heads).head_at(*evt.index[:2])
        return (hit[0] + 1, hit[1] + 1) if hit else (layer, head)

    # -------------------------------------------------------- run tabs

    def run_choices(self, tab_name: str, model=None, task=None):
        """Model and task dropdown updates: keep the current pick when it still exists; otherwise open on the run
        folder that holds most of the tab's artifacts (of the picked model, when there is one)."""
        spec = tab_spec(tab_name)
        models = self.runs.models()
        if model not in models:
            model, task = self.runs.best_run(spec, default_model=DEFAULT_MODEL)
        tasks = self.runs.tasks(model)
        if task not in tasks:
            task = self.runs.best_run(spec, model, DEFAULT_MODEL)[1]
        return gr.Dropdown(choices=models, value=model), gr.Dropdown(choices=tasks, value=task)

    def show_artifacts(self, tab: str, model, task):
        """-> message, then per artifact of the tab: group, title, image, table, downloads, notes (6 outputs)."""
        stems = [artifact.stem for artifact in tab_artifacts(tab)]
        outputs, missing, problems = [], [], []
        try:
            folder = self.runs.folder(model, task) if model and task else None
        except AttnpatError as exc:
            return [_message(str(exc), "error"), *sum((self._artifact_outputs(None) for _ in stems), [])]
        named = self.runs.model_name(model, task)  # --model as the user gave it, not the folder's slug
        # a norm or rollout run never holds what verbs without --map-kind write: no hint, a note naming the weight run
        in_weight_run = weight_only(stems, model)
        fine_tuned_only = set_minus([stem for stem in stems if registered(stem).finetuned], in_weight_run)
        base = self.runs.base_model(model, task) if fine_tuned_only else None
        # a model without a base never gets these in its own run: no hint that would write them somewhere else
        without_base = fine_tuned_only if model and task and not base else []
        never_here = in_weight_run + without_base

        def commands(wanted) -> str:
            return run_hints(wanted, model, task, named, base)

        def with_note(message: str, elsewhere) -> str:
            unbased = [stem for stem in elsewhere if stem in without_base]  # never when no run is picked (model None)
            notes = [weight_run_note([stem for stem in elsewhere if stem in in_weight_run], model, task),
                     elsewhere_note(unbased, named or split_kind_folder(model)[0], task) if unbased else ""]
            return "  \n".join([message, *filter(None, notes)])

        if folder is not None and not folder.is_dir():
            wanted = set_minus(stems, never_here)
            message = f"no run {model}/{task} in {self.runs.root} yet" + (f": run {commands(wanted)}" if wanted else "")
            return [with_note(_message(message, "info" if tab == CLASSIFIER_TAB else "error"), never_here),
                    *sum((self._artifact_outputs(None) for _ in stems), [])]
        for stem in stems:
            try:
                view = self.runs.artifact(model, task, stem) if model and task else None
            except AttnpatError as exc:
                problems.append(str(exc))
                view = None
            except OSError as exc:  # a folder or file that cannot be read, a scratch folder that cannot be written
                problems.append(f"{slug_label(stem)} cannot be shown ({os_error_reason(exc)})")
                view = None
            if view is None or not view.found:
                missing.append(stem)
                outputs += self._artifact_outputs(None)
                continue
            if view.error:
                problems.append(view.error)
            outputs += self._artifact_outputs(view)
        elsewhere = [stem for stem in missing if stem in never_here]
        missing = set_minus(missing, elsewhere)
        # the Classifier tab is never empty: it shows the shipped checkpoint's record above the runs
        empty = "info" if tab == CLASSIFIER_TAB else "error"
        if tab == CLASSIFIER_TAB and (not model or not task or len(missing) == len(stems)):
            message = _message(f"above: the shipped classifier's record. No training run in {self.runs.root} yet; "
                               f"{commands(stems)} retrains it and shows its tables here", empty)
        elif not model or not task:
            message = _message(f"no runs in {self.runs.root} yet: start one from the Runs tab or run "
                               "`attnpat demo --no-app`", empty)
        elif missing and len(missing) + len(elsewhere) == len(stems):
            message = _message(f"no {tab.lower()} run for {model}/{task} yet: run {commands(missing)}",
                               empty)
        elif missing:
            message = _message(f"{model}/{task}: also shown here once computed: "
                               f"{', '.join(slug_label(s) for s in missing)} (run {commands(missing)})",
                               "info")
        elif len(elsewhere) == len(stems):  # a norm run on the Disabling tab: nothing of it belongs here
            message = _message(f"{model}/{task}: no {tab.lower()} artifact is computed on "
                               f"{split_kind_folder(model)[1]} maps", "ok")
        elif set(elsewhere) & set(in_weight_run):
            message = _message(f"{model}/{task}: every {tab.lower()} artifact of {split_kind_folder(model)[1]} maps "
                               "is here", "ok")
        elif elsewhere:
            message = _message(f"{model}/{task}: every {tab.lower()} artifact of a model without a base is here", "ok")
        else:
            message = _message(f"{model}/{task}: every {tab.lower()} artifact is here", "ok")
        message = with_note(message, elsewhere)
        if tab == DISABLING_TAB and folder is not None:
            try:
                message += "".join(f"  \n{line}" for line in significance_lines(folder))
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError, OSError) as exc:
                # a damaged or unreadable table: its view reports it
                log.warning("no significance line for %s: %s", folder, exc)
        if problems:
            message += "  \n" + _message("; ".join(problems), "error")
        return [message, *outputs]

    @staticmethod
    def _artifact_outputs(view: ArtifactView | None) -> list:
        """group, title, image, table, downloads (CSV, PNG, SVG that exist), notes under the table of one artifact."""
        if view is None:
            return [gr.Group(visible=False), "", gr.Image(value=None, visible=False),
                    gr.Dataframe(value=None, visible=False), None, ""]
        where = f"`{view.folder.parent.name}/{view.folder.name}`"
        # a table that says where its values come from (e.g. gold or silver parses) says so in the title too
        source = ""
        if view.table is not None and "parses" in view.table.columns and not view.table.empty:
            source = f": {', '.join(str(value) for value in view.table['parses'].dropna().unique())}"
        title = f"#### {slug_label(view.stem)}{source}  \n<small>{where}</small>"
        files = [str(path) for path in (view.csv, view.png, view.svg) if path is not None]
        image = gr.Image(value=str(view.png) if view.png else None, visible=view.png is not None)
        notes = "  \n".join(_message(note) for note in view.notes)
        return [gr.Group(visible=True), title, image,
                gr.Dataframe(value=view.displayed_table(), visible=view.table is not None), files, notes]

    # -------------------------------------------------------- Runs tab

    def runs_table(self, picked=None):
        """-> the runs (model, task, analyses, examples, updated, path) and the run picker (keeps ``picked``)."""
        return self.runs_and_pick(picked)[:2]

    def runs_and_pick(self, picked=None):
        """-> runs table, run picker update, the picked run's name."""
        rows = []
        for run in self.runs.runs():
            manifest = run["manifest"]
            analyses = manifest.get("analyses", {})
            sizes = {str(entry["data"]["n_examples"]) for entry in analyses.values()
                     if isinstance(entry, dict) and isinstance(entry.get("data"), dict)
                     and isinstance(entry["data"].get("n_examples"), int | str)}
            rows.append({"model": run["model"], "task": run["task"], "analyses": ", ".join(sorted(analyses)),
                         "examples": ", ".join(sorted(sizes, key=_natural)),
                         "updated": manifest.get("updated", ""), "path": run["path"]})
        frame = pd.DataFrame(rows, columns=["model", "task", "analyses", "examples", "updated", "path"])
        names = [f"{row['model']}/{row['task']}" for row in rows]
        chosen = picked if picked in names else (names[0] if names else None)
        return frame, gr.Dropdown(choices=names, value=chosen), chosen

    def runs_file(self) -> str | None:
        """The runs table (runs_table's columns) as runs.csv, written for this request; None when there is no run."""
        frame = self.runs_and_pick()[0]
        return None if frame.empty else str(save_table(frame, self.scratch.new_dir() / "runs.csv"))

    def manifest(self, name) -> str:
        """The picked run's manifest.json as indented JSON text ("model/task" names the run)."""
        if not isinstance(name, str) or name.count("/") != 1:
            return json.dumps({"message": "pick a run"})
        model, task = name.split("/")
        for run in self.runs.runs():
            if run["model"] == model and run["task"] == task:
                return json.dumps(run["manifest"], indent=2)
        return json.dumps({"message": f"no run {name} in {self.runs.root}"})

    def start_job(self, verb, model, task, n, picked=None):
        """Generator: start the job, then yield (log, status, runs table, run picker, manifest) until it finishes;
        the runs table and manifest are refreshed in the last answer (skipped while the job runs)."""
        try:
            job = self.jobs.start(verb, model, task, n)
        except AttnpatError as exc:
            yield "", _message(str(exc), "error"), gr.skip(), gr.skip(), gr.skip()
            return
        yield from self._follow(job, picked)

    def watch_job(self, picked=None):
        """Generator: follow the last job on this runs folder (this app's, or another app's as recorded there)."""
        job = self.jobs.current()
        if job is None:
            yield "", _message("no job started yet"), gr.skip(), gr.skip(), gr.skip()
            return
        yield from self._follow(job, picked)

    def job_state(self) -> tuple[str, str]:
        """The last job's log tail and status, once (shown when the Runs tab opens)."""
        job = self.jobs.current()
        if job is None:
            return "", _message("no job started yet")
        running = job.is_running()
        return job.log_text(), _message(job.status(), "info" if running else _job_style(job))

    def _follow(self, job: Job | RecordedJob, picked):
        while job.is_running():
            yield job.log_text(), _message(job.status()), gr.skip(), gr.skip(), gr.skip()
            time.sleep(0.5)
        table, picker, chosen = self.runs_and_pick(picked)
        yield job.log_text(), _message(job.status(), _job_style(job)), table, picker, self.manifest(chosen)

    def stop_job(self):
        return _message(self.jobs.stop())

    # -------------------------------------------------------- layout

    def build(self) -> gr.Blocks:
        # analytics off here, not only by the environment's default: GRADIO_ANALYTICS_ENABLED=True set for
        # another app would make this one report to gradio and ask PyPI for its version
        with gr.Blocks(title="attnpat: what do BERT attention heads do?", delete_cache=(3600, 3600),
                       analytics_enabled=False) as demo:
            gr.Markdown("## attnpat: what do BERT attention heads do?\nLive maps for one input; everything else "
                        f"from the run directory `{self.runs.root}`.")
            with gr.Tabs():
                self._explore_tab(demo)
                for spec in TABS:
                    self._run_tab(spec.name, demo)
                self._runs_tab(demo)
        return demo

    def _explore_tab(self, demo: gr.Blocks) -> None:
        with gr.Tab("Explore", id="explore"):
            gr.Markdown(EXPLORE_INTRO, elem_id="explore-intro")
            with gr.Row():
                text = gr.Textbox(label="Sentence", value=EXAMPLE_SENTENCE, scale=3,
                                  elem_id="explore-text", max_lines=4)
                pair = gr.Textbox(label="Second sentence (optional)", scale=2, elem_id="explore-pair", max_lines=4)
                model = gr.Dropdown(model_choices(), value=DEFAULT_MODEL, label="Model", allow_custom_value=True,
                                    scale=1, elem_id="explore-model")
            with gr.Row():
                word_level = gr.Checkbox(label="word level (pieces pooled)", value=False, elem_id="explore-words")
                hide_special = gr.Checkbox(label="hide [CLS]/[SEP]", value=False, elem_id="explore-hide")
                scale_each = gr.Checkbox(label="scale each map to its maximum", value=False, elem_id="explore-scale")
                map_kind = gr.Radio(list(MAP_KINDS), value="weight", label="map", elem_id="explore-kind",
                                    info="weight: attention; norm: ||alpha f(x)|| (Kobayashi), rows renormalised; "
                                         "rollout: per layer (Abnar & Zuidema)")
                run = gr.Button("Show all heads", variant="primary", elem_id="explore-run")
            gr.Markdown(f"<small>Live view for inputs of up to {MAX_LIVE_TOKENS} tokens. {HIDE_SPECIAL_NOTE} "
                        f"Classes are predicted on the token-level maps. {PICKED_HEAD_NOTE}</small>",
                        elem_id="explore-notes")
            status = gr.Markdown(elem_id="explore-status")
            grid = gr.Image(label="all heads (rows = layers, columns = heads, 1-indexed)", type="filepath",
                            interactive=False, elem_id="explore-grid", format="png")
            with gr.Row():
                grid_png = gr.DownloadButton("grid PNG", visible=False, size="sm")
                grid_svg = gr.DownloadButton("grid SVG", visible=False, size="sm")
                classes_csv = gr.DownloadButton("head classes CSV", visible=False, size="sm")
            with gr.Row():
                with gr.Column(scale=1):
                    with gr.Row():
                        layer = gr.Number(value=1, precision=0, minimum=1, label="layer", elem_id="explore-layer")
                        head = gr.Number(value=1, precision=0, minimum=1, label="head", elem_id="explore-head")
                    caption = gr.Markdown(elem_id="explore-caption")
                    with gr.Row():
                        map_png = gr.DownloadButton("map PNG", visible=False, size="sm")
                        map_svg = gr.DownloadButton("map SVG", visible=False, size="sm")
                with gr.Column(scale=2):
                    big = gr.Image(label="selected head", type="filepath", interactive=False, elem_id="explore-map")
            classes = gr.Dataframe(label="predicted class per head", interactive=False, elem_id="explore-classes")

            # models fine-tuned while the app runs appear on the next page load
            demo.load(lambda: gr.Dropdown(choices=model_choices()), None, model, api_name=False)
            # what the grid on screen was drawn from: a head picked on it is shown for these inputs, not for a
            # sentence edited since (before, a click showed the edited sentence's head under the old grid)
            drawn = gr.State(None)
            # which of this session's requests may still be shown: a slow grid or head finishing after a newer
            # request or a model pick is dropped (before, it replaced the newer view, or drew the old model's head
            # after the pick); one ViewClock per session, shared by reference by every handler below
            clock = gr.State(ViewClock())
            inputs = [text, pair, model, word_level, hide_special, map_kind, scale_each, clock]
            map_inputs = [text, pair, model, word_level, hide_special, layer, head, map_kind]
            map_outputs = [caption, big, map_png, map_svg]
            outputs = [status, grid, classes, grid_png, grid_svg, classes_csv]
            # the example sentence's grid is computed when the page opens, so the tab is never empty
            for trigger in (run.click, text.submit, pair.submit, word_level.input, hide_special.input,
                            map_kind.input, scale_each.input, demo.load):
                # the API's /explore has explore's outputs: a State is not part of an endpoint
                trigger(self.draw, inputs, [*outputs, drawn], api_name="explore" if trigger == run.click else False,
                        concurrency_limit=4, concurrency_id="live").then(
                    self.follow_head, [drawn, layer, head, clock], [layer, head, *map_outputs], api_name=False,
                    concurrency_limit=4, concurrency_id="live")
            # a picked model clears the grid rather than redrawing it: picked and then "Show all heads" at once would
            # draw it twice, and the first drawing's head could replace a head clicked on the second
            model.input(self.forget_grid, [model, clock], [*outputs, *map_outputs, drawn], api_name=False)
            for number in (layer, head):
                number.submit(self.drawn_head_map, [drawn, layer, head, clock], map_outputs, api_name=False,
                              concurrency_id="live")
            # the API's head map names its input: any sentence, drawn or not
            gr.Button("Show head", size="sm", visible=False).click(
                self.head_map, map_inputs, map_outputs, api_name="head_map", concurrency_id="live")
            grid.select(self.pick_head, [drawn, layer, head], [layer, head], api_name=False).then(
                self.drawn_head_map, [drawn, layer, head, clock], map_outputs, api_name=False,
                concurrency_id="live")

    def _run_tab(self, tab_name: str, demo: gr.Blocks) -> None:
        spec = tab_spec(tab_name)
        key = spec.key
        tab = tab_name
        with gr.Tab(tab, id=key) as tab_block:
            gr.Markdown(spec.intro, elem_id=f"{key}-intro")
            if tab == CLASSIFIER_TAB:
                self._classifier_card(demo)
            with gr.Row():
                model = gr.Dropdown(label="model (run directory)", choices=[], allow_custom_value=True,
                                    elem_id=f"{key}-model")
                task = gr.Dropdown(label="task", choices=[], allow_custom_value=True, elem_id=f"{key}-task")
                refresh = gr.Button("Refresh", size="sm")
            message = gr.Markdown(elem_id=f"{key}-message")
            outputs = [message]
            for stem in (artifact.stem for artifact in tab_artifacts(tab)):
                with gr.Group(visible=False) as group:
                    title = gr.Markdown()
                    image = gr.Image(show_label=False, type="filepath", interactive=False,
                                     elem_id=f"{key}-{stem}-image")
                    table = gr.Dataframe(interactive=False, max_height=320, elem_id=f"{key}-{stem}-table")
                    notes = gr.Markdown(elem_id=f"{key}-{stem}-notes")  # what the table alone does not say
                    # one file list per artifact (CSV, PNG, SVG): three buttons each would triple the page config
                    files = gr.File(label="download", file_count="multiple", interactive=False,
                                    elem_id=f"{key}-{stem}-files")
                outputs += [group, title, image, table, files, notes]

            api = key.replace("-", "_")

            def show(model_name, task_name, tab=tab):
                return self.show_artifacts(tab, model_name, task_name)

            def choose(model_name, task_name, tab=tab):
                return self.run_choices(tab, model_name, task_name)

            demo.load(choose, [model, task], [model, task], api_name=False)
            tab_block.select(choose, [model, task], [model, task], api_name=False).then(
                show, [model, task], outputs, api_name=False)
            refresh.click(choose, [model, task], [model, task], api_name=False).then(
                show, [model, task], outputs, api_name=False)
            model.input(choose, [model, task], [model, task], api_name=False).then(
                show, [model, task], outputs, api_name=False)
            task.input(show, [model, task], outputs, api_name=api)

    def _classifier_card(self, demo: gr.Blocks) -> None:
        """The shipped checkpoint's record: labeled set, cross-validated scores, per-class F1, confusion matrix,
        and the tables as CSV files."""
        gr.Markdown("#### The shipped pattern classifier")
        try:
            card = classifier_card(read_metadata())
        except AttnpatError as exc:
            gr.Markdown(_message(str(exc), "error"), elem_id="classifier-card-summary")
            return
        gr.Markdown(f"{card.summary} Retrain it with `attnpat train --data {SHIPPED_LABELED_SET}`.",
                    elem_id="classifier-card-summary")
        tables = (("scores", card.scores, "macro F1 against the baselines (95% intervals: <score>_ci_low, _ci_high)"),
                  ("per-class", card.per_class, "per-class F1 (95% intervals: f1_ci_low, f1_ci_high)"),
                  ("confusion", card.confusion, "confusion (out-of-fold; rows: true class, columns: predicted)"))
        for row in (tables[:1], tables[1:2], tables[2:]):  # each its own row: the scores' bounds widen it
            with gr.Row():
                for name, frame, label in row:
                    if frame is not None:
                        gr.Dataframe(display_table(frame), label=label, interactive=False,
                                     elem_id=f"classifier-card-{name}")
        files = gr.File(label="download (CSV, full precision)", file_count="multiple", interactive=False,
                        elem_id="classifier-card-files")
        # written on each page load: a file given at build time would be served from gradio's cache, which
        # delete_cache empties after an hour
        demo.load(self.classifier_card_files, None, files, api_name=False)

    def classifier_card_files(self) -> list[str] | None:
        """The shipped classifier's card tables as CSV files: classifier_<scores|per_class|confusion>.csv."""
        try:
            card = classifier_card(read_metadata())
        except AttnpatError:  # the card says why
            return None
        folder = self.scratch.new_dir()
        return [str(save_table(frame, folder / f"classifier_{name}.csv")) for name, frame in card.tables().items()]

    def _runs_tab(self, demo: gr.Blocks) -> None:
        with gr.Tab("Runs", id="runs") as tab_block:
            gr.Markdown(RUNS_INTRO, elem_id="runs-intro")
            refresh = gr.Button("Refresh", size="sm")
            table = gr.Dataframe(label="runs", interactive=False, elem_id="runs-table")
            runs_csv = gr.File(label="runs CSV", interactive=False, elem_id="runs-csv")
            with gr.Row():
                picked = gr.Dropdown(label="run", choices=[], allow_custom_value=True, elem_id="runs-pick")
            # shown as text: gr.JSON would treat path strings in the manifest as files to serve
            manifest = gr.Code(label="manifest.json", language="json", interactive=False, max_lines=24,
                               elem_id="runs-manifest")
            gr.Markdown("#### Start a batch job\nRuns `attnpat <verb> --model ... --task ... --n ...` into this "
                        "app's run directory, one job at a time for the run directory: every browser on it sees, "
                        "watches and may stop the running job, and the last job (its log, how it ended) is shown "
                        "after a restart and by other apps on the same folder. Options the form lacks (`--force`, "
                        "`--out`, ...) are the terminal's: `attnpat <verb> --help`.")
            verbs = list(cli_verbs())
            with gr.Row():
                verb = gr.Dropdown(verbs, value=verbs[0] if verbs else None, label="job", elem_id="job-verb")
                model = gr.Textbox(value=DEFAULT_MODEL, label="model", elem_id="job-model")
                task = gr.Dropdown(list(ALL_TASKS), value="sst2", label="task", elem_id="job-task")
                # no precision: gradio would round 1.5 to 2 unseen; BatchJobs.arguments refuses it in one line
                count = gr.Number(value=32, minimum=1, step=1, label="examples (n)", elem_id="job-n")
            with gr.Row():
                start = gr.Button("Start job", variant="primary", elem_id="job-start")
                watch = gr.Button("Watch progress", elem_id="job-watch")
                stop = gr.Button("Stop job", variant="stop", elem_id="job-stop")
            job_status = gr.Markdown(elem_id="job-status")
            job_log = gr.Textbox(label="job log", lines=10, max_lines=20, autoscroll=True, interactive=False,
                                 elem_id="job-log")

            for trigger in (tab_block.select, refresh.click):
                api_name = "list_runs" if trigger == refresh.click else False
                trigger(self.runs_table, picked, [table, picked], api_name=api_name).then(
                    self.manifest, picked, manifest, api_name=False).then(
                    self.runs_file, None, runs_csv, api_name=False)
            picked.input(self.manifest, picked, manifest, api_name="manifest")
            # the last job on this runs folder, also one started before a restart or by another app on it
            tab_block.select(self.job_state, None, [job_log, job_status], api_name=False)
            job_outputs = [job_log, job_status, table, picked, manifest]
            # the runs CSV follows the table, which a finished job refreshes
            start.click(self.start_job, [verb, model, task, count, picked], job_outputs, api_name="start_job",
                        concurrency_limit=None).then(self.runs_file, None, runs_csv, api_name=False)
            watch.click(self.watch_job, picked, job_outputs, api_name="watch_job", concurrency_limit=None).then(
                self.runs_file, None, runs_csv, api_name=False)
            stop.click(self.stop_job, None, job_status, api_name="stop_job")
            del demo


def build_app(runs_dir: str | Path | None = None, explorer: LiveExplorer | None = None, *,
              allow_any_model: bool = False) -> tuple[gr.Blocks, WebApp]:
    web = WebApp(runs_dir, explorer, allow_any_model=allow_any_model)
    return web.build(), web


def warm_up(web: WebApp, model: str = DEFAULT_MODEL) -> None:
    """Load the default model and the classifier in the background, so the first Explore click is fast."""
    def load():
        try:
            web.explorer.models.get(model)
            web.explorer.classifier()
        except AttnpatError as exc:
            log.warning("warm-up: %s", exc)

    threading.Thread(target=load, daemon=True, name="attnpat-warm-up").start()


def launch(host: str = "127.0.0.1", port: int = 7860, runs_dir: str | Path | None = None, *, block: bool = True,
           explorer: LiveExplorer | None = None, quiet: bool = False, warm: bool = True, allow_any_model: bool = False):
    """Serve the app on host:port (offline: no analytics, no share link). Returns (demo, web) when not blocking."""
    check_address(host, port)  # before the models load; an unknown host would otherwise surface as a port error
    # Live inputs are small: one thread per request, several requests in parallel, beats every request
    # fighting over all cores (bench/bench_explore.py: 0.1-0.3 s with 1 thread vs 2+ s with 2 on a busy machine).
    torch.set_num_threads(1)
    demo, web = build_app(runs_dir, explorer, allow_any_model=allow_any_model)
    demo.queue(default_concurrency_limit=8, max_size=256)
    try:
        demo.launch(server_name=host, server_port=int(port), share=False, prevent_thread_lock=True,
                    allowed_paths=[str(web.runs.root.resolve()), str(web.scratch.root)], quiet=quiet,
                    ssr_mode=False, show_error=True)
    except OSError as exc:
        raise AttnpatError(f"cannot serve on {host}:{port} ({exc}); pick another --port") from exc
    # the warm-up starts once the port is ours: a failed launch exiting while a thread is inside torch's model
    # loading aborted the interpreter (SIGABRT, exit 134) instead of the one-line error
    if warm:
        warm_up(web)
    if block:
        demo.block_thread()
    return demo, web
