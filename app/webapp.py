"""The Gradio web app: explore one sentence live, browse the precomputed runs, start batch jobs.

Thin by design: live maps, head classes and the grid come from analysis.live; every other tab reads the
files that analysis.artifacts names from runs/<model-slug>/<task>/; batch jobs are `attnpat <verb>`
subprocesses. User errors (AttnpatError) appear as a message in the page and the app keeps serving.
"""
from __future__ import annotations

import atexit
import base64
import codecs
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.data import ALL_TASKS  # noqa: E402
from analysis.errors import AttnpatError  # noqa: E402
from analysis.live import CLASS_STYLE, MAX_LIVE_TOKENS, LiveExplorer, class_table, layer_head_figure  # noqa: E402
from analysis.models import DEFAULT_MODEL, EMBEDDED_ALIASES, list_store  # noqa: E402
from analysis.paths import runs_root  # noqa: E402
from analysis.rundir import list_runs, save_figure, save_table  # noqa: E402

log = logging.getLogger("attnpat.webapp")
# pyplot keeps global state: requests served in parallel threads draw their figures one at a time.
FIGURE_LOCK = threading.Lock()

# The run tabs and the artifacts each one shows, in order (names from analysis.artifacts, plus the extra
# figures and tables the analyses write next to them).
RUN_TABS: dict[str, tuple[str, ...]] = {
    "Pattern ratios": ("pattern_ratios_by_task", "pattern_ratios", "patterns"),
    "Fine-tuning": ("cosine", "special_tokens", "finetune_eval", "cls_last_layer", "linguistic"),
    "Disabling": ("disable_heads", "disable_layers", "importance", "pruning"),
    "Surface and clusters": ("surface", "surface_entropy", "overview", "head_labels", "clusters", "head_distances",
                             "grad_importance",
                             "probing_dependency", "probing_dependency_heads", "probing_coref",
                             "probing_coref_baselines"),
    # `attnpat train` writes to runs/classifier/<labeled set>/: model "classifier", task e.g. "v1".
    "Classifier": ("cv_scores", "cv_confusion", "cv_predictions"),
}
# Task picked first in each run tab when it has a run (Clark's statistics run on wiki by default).
PREFERRED_TASK = {"Surface and clusters": "wiki", "Classifier": "v2"}
# Artifacts that live in a fixed task folder whatever task is picked: the per-task comparison in
# runs/<model>/all/ and the WinoBias probe in runs/<model>/winobias/ (analysis.probing.WINOBIAS_TASK).
CROSS_TASK = {"pattern_ratios_by_task": "all", "probing_coref": "winobias", "probing_coref_baselines": "winobias"}
# The command that writes each artifact, for "not computed yet" hints ({model} and {task} filled in).
_STANDARD = "--model {model} --task {task}"
WRITTEN_BY = {
    "overview": f"overview {_STANDARD}", "patterns": f"classify {_STANDARD}", "pattern_ratios": f"classify {_STANDARD}",
    "pattern_ratios_by_task": "classify --model {model} --task all",
    "finetune_eval": "finetune --model <base model> --task {task}",
    "cosine": "compare --base <base model> --finetuned {model} --task {task}",
    "special_tokens": f"special {_STANDARD}", "cls_last_layer": f"special {_STANDARD}",
    "linguistic": f"special {_STANDARD}", "disable_heads": f"disable {_STANDARD}",
    "disable_layers": f"disable {_STANDARD}",
    "importance": f"importance {_STANDARD}", "pruning": f"prune {_STANDARD}", "surface": f"surface {_STANDARD}",
    "surface_entropy": f"surface {_STANDARD}", "head_labels": f"surface {_STANDARD}",
    "clusters": f"cluster {_STANDARD}",
    "head_distances": f"cluster {_STANDARD}",
    "grad_importance": f"grad-importance {_STANDARD}", "probing_dependency": "probe-dep FILE.conllu --model {model}",
    "probing_dependency_heads": "probe-dep FILE.conllu --model {model}", "probing_coref": "probe-coref --model {model}",
    "probing_coref_baselines": "probe-coref --model {model}",
    "cv_scores": "train --data annotation/labeled/{task}", "cv_confusion": "train --data annotation/labeled/{task}",
    "cv_predictions": "train --data annotation/labeled/{task}",
}


def run_hints(stems, model: str, task: str) -> str:
    """The distinct commands that would write ``stems``, as inline code."""
    commands = dict.fromkeys("attnpat " + WRITTEN_BY[stem].format(model=model, task=task) for stem in stems)
    return ", ".join(f"`{command}`" for command in commands)


# Verbs the Runs tab may start (only those the installed CLI really has are offered); verbs that need
# more than model, task and n (compare, probe-dep, train) are left to the command line.
JOB_VERBS = ("overview", "extract", "classify", "special", "disable", "importance", "prune", "surface",
             "grad-importance", "cluster", "probe-coref", "finetune")
JOB_OPTIONS = ("model", "task", "n", "split", "runs_dir")
MODEL_NAME = re.compile(r"^[\w./~][\w.\-/~]{0,299}$")  # argument lists, no shell: only a leading "-" is refused
HIDE_SPECIAL_NOTE = ("Hiding [CLS]/[SEP] drops their rows and columns and renormalises each remaining row to sum to 1, "
                     "so it shows how the weight not spent on special tokens is spread.")


def _slug_label(stem: str) -> str:
    return stem.replace("_", " ")


# ---------------------------------------------------------------- scratch files for downloads

class Scratch:
    """A private temporary folder for per-request downloads; folders older than ``max_age`` s are pruned."""

    def __init__(self, max_age: float = 3600.0):
        self.root = Path(tempfile.mkdtemp(prefix="attnpat-app-"))
        self.max_age = max_age
        self._last_prune = time.time()

    def new_dir(self) -> Path:
        now = time.time()
        if now - self._last_prune > 60:
            self._last_prune = now
            for folder in self.root.glob("req-*"):
                if now - folder.stat().st_mtime > self.max_age:
                    shutil.rmtree(folder, ignore_errors=True)
        folder = self.root / f"req-{uuid.uuid4().hex}"
        folder.mkdir(parents=True)
        return folder

    def figures_dir(self) -> Path:
        folder = self.root / "figures"
        folder.mkdir(exist_ok=True)
        return folder


def png_as_svg(png_path: Path, svg_path: Path, width: int, height: int) -> Path:
    """Wrap a raster image in an SVG file (the grid is a pixel mosaic; a vector redraw would be slow)."""
    data = base64.b64encode(png_path.read_bytes()).decode()
    svg_path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                        f'viewBox="0 0 {width} {height}"><image width="{width}" height="{height}" '
                        f'href="data:image/png;base64,{data}"/></svg>\n')
    return svg_path


# ---------------------------------------------------------------- run directories

@dataclass
class ArtifactView:
    """What exists of one artifact: its CSV table and PNG/SVG figure (paths None when missing)."""

    stem: str
    folder: Path
    csv: Path | None = None
    png: Path | None = None
    svg: Path | None = None
    table: pd.DataFrame | None = None
    error: str = ""

    @property
    def found(self) -> bool:
        return self.csv is not None or self.png is not None


class RunBrowser:
    """Reads runs/<model-slug>/<task>/ for the run tabs; draws a heatmap for a layer x head CSV without figure."""

    def __init__(self, runs_dir: str | Path | None, scratch: Scratch):
        self.root = Path(runs_dir) if runs_dir is not None else runs_root()
        self.scratch = scratch

    def runs(self) -> list[dict]:
        return list_runs(self.root) if self.root.is_dir() else []

    def models(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted({path.parent.name for path in self.root.glob("*/*/") if path.is_dir()})

    def tasks(self, model: str | None) -> list[str]:
        if not model or not (self.root / model).is_dir():
            return []
        return sorted(path.name for path in (self.root / model).iterdir() if path.is_dir())

    def folder(self, model: str, task: str) -> Path:
        for part in (model, task):
            if not part or part in {".", ".."} or "/" in part or "\\" in part:
                raise AttnpatError(f"not a run name: {part!r}")
        return self.root / model / task

    def artifact(self, model: str, task: str, stem: str) -> ArtifactView:
        folder = self.folder(model, CROSS_TASK.get(stem, task))
        view = ArtifactView(stem, folder)
        for suffix in ("csv", "png", "svg"):
            path = folder / f"{stem}.{suffix}"
            if path.is_file():
                setattr(view, suffix, path)
        if view.csv is not None:
            try:
                view.table = pd.read_csv(view.csv)
            except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
                view.error = f"{view.csv.name} is not a readable CSV ({type(exc).__name__})"
                view.table = None
        if view.png is None and view.table is not None:
            view.png, view.svg = self.derived_figure(view)
        return view

    def derived_figure(self, view: ArtifactView) -> tuple[Path | None, Path | None]:
        """Heatmap PNG/SVG for a layer x head table that has no figure of its own, cached by file and mtime."""
        stat = view.csv.stat()
        key = hashlib.sha1(f"{view.csv.resolve()}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:16]
        stem = self.scratch.figures_dir() / f"{view.stem}-{key}"
        png, svg = stem.with_suffix(".png"), stem.with_suffix(".svg")
        with FIGURE_LOCK:
            if not png.is_file():
                fig = layer_head_figure(view.table, f"{_slug_label(view.stem)} (drawn from {view.csv.name})")
                if fig is None:
                    return None, None
                import matplotlib.pyplot as plt

                save_figure(fig, stem)
                plt.close(fig)
        return png, svg


# ---------------------------------------------------------------- batch jobs

def cli_verbs() -> dict[str, set[str]]:
    """Whitelisted verbs the installed CLI has, each with the job options its callback accepts."""
    from app.cli import app as cli_app

    found = {}
    for command in cli_app.registered_commands:
        name = command.name or (command.callback.__name__ if command.callback else None)
        if name in JOB_VERBS and command.callback is not None:
            accepted = set(inspect.signature(command.callback).parameters)
            found[name] = accepted & set(JOB_OPTIONS)
    return {verb: found[verb] for verb in JOB_VERBS if verb in found}


@dataclass
class Job:
    """One `attnpat <verb>` subprocess and its log (tqdm's carriage-return updates overwrite the last line)."""

    argv: list[str]
    process: subprocess.Popen
    started: float = field(default_factory=time.time)
    lines: list[str] = field(default_factory=lambda: [""])
    finished: float | None = None

    def log_text(self, tail: int = 60) -> str:
        return "\n".join(self.lines[-tail:]).strip("\n")

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def status(self) -> str:
        command = " ".join(["attnpat", *self.argv])
        code = self.returncode
        if code is None:
            return f"running for {time.time() - self.started:.0f} s: `{command}`"
        if code == 0:
            return f"finished in {(self.finished or time.time()) - self.started:.0f} s: `{command}`"
        if code < 0:
            return f"stopped (signal {-code}): `{command}`"
        return f"failed (exit status {code}): `{command}`; see the log"


class BatchJobs:
    """Starts whitelisted `attnpat` verbs as subprocesses (argument lists, never a shell); one at a time."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self.job: Job | None = None
        self._lock = threading.Lock()
        atexit.register(self.stop)  # no orphaned job when the app stops (rerunning the job resumes it)

    def arguments(self, verb: str, model: str, task: str, n, split: str = "validation") -> list[str]:
        verbs = cli_verbs()
        if verb not in verbs:
            raise AttnpatError(f"unknown job {verb!r}; choose one of: {', '.join(verbs) or 'none installed'}")
        model = (model or "").strip()
        if not MODEL_NAME.match(model):
            raise AttnpatError(f"not a model name: {model!r} (use minilm, a model-store name or a hub id)")
        if task not in ALL_TASKS:
            raise AttnpatError(f"unknown task {task!r}; choose one of: {', '.join(ALL_TASKS)}")
        try:
            count = int(n)
        except (TypeError, ValueError):
            raise AttnpatError(f"the number of examples must be a whole number, got {n!r}") from None
        if not 1 <= count <= 1_000_000 or count != float(n):
            raise AttnpatError(f"the number of examples must be a whole number from 1 to 1000000, got {n}")
        values = {"model": model, "task": task, "n": str(count), "split": split, "runs_dir": str(self.runs_dir)}
        argv = [verb]
        for option in JOB_OPTIONS:
            if option in verbs[verb]:
                argv += [f"--{option.replace('_', '-')}", values[option]]
        return argv

    def start(self, verb: str, model: str, task: str, n) -> Job:
        argv = self.arguments(verb, model, task, n)
        with self._lock:
            if self.job is not None and self.job.returncode is None:
                raise AttnpatError(f"a job is already running ({self.job.status()}); wait for it or stop it")
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
            process = subprocess.Popen([sys.executable, "-m", "app.cli", *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            self.job = Job(argv, process)
            threading.Thread(target=self._read, args=(self.job,), daemon=True).start()
            return self.job

    @staticmethod
    def _read(job: Job) -> None:
        stream = job.process.stdout
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
        while chunk := stream.read1(4096):
            for piece in re.split(r"(\r|\n)", decoder.decode(chunk)):
                if piece == "\n":
                    job.lines.append("")
                elif piece == "\r":
                    job.lines[-1] = ""
                else:
                    job.lines[-1] += piece
            del job.lines[:-500]
        job.process.wait()
        job.finished = time.time()

    def stop(self) -> str:
        with self._lock:
            if self.job is None or self.job.returncode is not None:
                return "no job is running"
            self.job.process.terminate()
            try:
                self.job.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.job.process.kill()
            return "job stopped (resumable verbs continue where they stopped when rerun)"


# ---------------------------------------------------------------- the app

def _message(text: str, kind: str = "info") -> str:
    """A status line: "**error:** ..." for problems (plain words: headless browsers often lack emoji fonts)."""
    prefix = {"error": "**error:** ", "info": "**note:** ", "ok": ""}[kind]
    return prefix + text


def model_choices() -> list[str]:
    return [*EMBEDDED_ALIASES, *(entry["name"] for entry in list_store())]


class WebApp:
    """Builds the Blocks; the handlers are methods so tests can call them without a browser too."""

    def __init__(self, runs_dir: str | Path | None = None, explorer: LiveExplorer | None = None):
        self.scratch = Scratch()
        self.runs = RunBrowser(runs_dir, self.scratch)
        self.explorer = explorer or LiveExplorer()
        self.jobs = BatchJobs(self.runs.root)

    # -------------------------------------------------------- Explore

    def explore(self, text, text_pair, model, word_level, hide_special):
        """-> status, grid image path, class table, grid PNG, grid SVG, classes CSV."""
        try:
            view = self.explorer.explore(model, text, text_pair, word_level=bool(word_level),
                                         hide_special=bool(hide_special))
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
            csv = save_table(class_table(view.classes, view.probs), folder / "head_classes.csv")
            tags = [[f"{layer + 1}"] + [CLASS_STYLE[c][0] for c in row] for layer, row in enumerate(view.classes)]
            wide = pd.DataFrame(tags, columns=["layer"] + [f"head {h + 1}" for h in range(heads)])
            note = "Tags: " + ", ".join(f"{tag} = {name}" for name, (tag, _) in CLASS_STYLE.items())
        else:
            csv, wide, note = None, None, view.note
        unit = "words" if word_level else "tokens"
        status = _message(f"{len(view.labels)} {unit}, {layers} layers x {heads} heads (1-indexed); "
                          f"click a map for a large view. {note}", "ok")
        return (status, str(png), gr.Dataframe(value=wide, visible=wide is not None),
                gr.DownloadButton(value=str(png), visible=True),
                gr.DownloadButton(value=str(svg), visible=True),
                gr.DownloadButton(value=str(csv) if csv else None, visible=csv is not None))

    def _explore_failure(self, message: str):
        hidden = gr.DownloadButton(value=None, visible=False)
        return _message(message, "error"), None, gr.Dataframe(value=None, visible=False), hidden, hidden, hidden

    def head_map(self, text, text_pair, model, word_level, hide_special, layer, head):
        """-> caption, large map image path, map PNG, map SVG. layer and head are 1-indexed."""
        hidden = gr.DownloadButton(value=None, visible=False)
        try:
            if layer is None or head is None:
                raise AttnpatError("enter a layer and a head (1-indexed)")
            layer, head = int(layer) - 1, int(head) - 1
            attn, labels = self.explorer.head_map(model, text, text_pair, layer, head,
                                                  word_level=bool(word_level), hide_special=bool(hide_special))
            live = self.explorer.live_maps(model, text, text_pair)
            classes, _ = self.explorer.predictions(live)
        except AttnpatError as exc:
            return _message(str(exc), "error"), None, hidden, hidden
        except Exception as exc:
            log.exception("head map failed")
            return _message(f"unexpected error: {type(exc).__name__}: {exc}", "error"), None, hidden, hidden
        from analysis.figures import close, map_figure

        predicted = f": predicted {classes[layer][head]}" if classes is not None else ""
        title = f"layer {layer + 1}, head {head + 1} (1-indexed){predicted}"
        folder = self.scratch.new_dir()
        with FIGURE_LOCK:
            fig = map_figure(attn, labels, size=6.0, all_ticks=len(labels) <= 64, title=title)
            png, svg = save_figure(fig, folder / f"map_L{layer + 1}_H{head + 1}")
            close(fig)
        shown = f"{len(labels)} {'words' if word_level else 'tokens'}{' without [CLS]/[SEP]' if hide_special else ''}"
        return (_message(f"{title}; {shown}. Rows are queries, columns keys; darker = more attention.", "ok"), str(png),
                gr.DownloadButton(value=str(png), visible=True), gr.DownloadButton(value=str(svg), visible=True))

    def pick_head(self, model, layer, head, evt: gr.SelectData):
        """A click on the grid at pixel (x, y) -> the clicked head's (layer, head), 1-indexed."""
        from analysis.live import GridLayout

        if evt is None or not evt.index:
            return layer, head
        try:
            bundle = self.explorer.models.get(model)
        except AttnpatError:
            return layer, head
        hit = GridLayout(bundle.num_layers, bundle.num_heads).head_at(*evt.index[:2])
        return (hit[0] + 1, hit[1] + 1) if hit else (layer, head)

    # -------------------------------------------------------- run tabs

    def run_choices(self, model=None, task=None, preferred_task: str = "sst2"):
        """Model and task dropdown updates: keep the current pick when it still exists."""
        models = self.runs.models()
        if model not in models:
            model = DEFAULT_MODEL if DEFAULT_MODEL in models else (models[0] if models else None)
        tasks = self.runs.tasks(model)
        fallback = next((t for t in (preferred_task, "sst2") if t in tasks), tasks[0] if tasks else None)
        task = task if task in tasks else fallback
        return gr.Dropdown(choices=models, value=model), gr.Dropdown(choices=tasks, value=task)

    def show_artifacts(self, tab: str, model, task):
        """-> message, then per artifact of the tab: group, title, image, table, downloads (5 outputs)."""
        stems = RUN_TABS[tab]
        outputs, missing, problems = [], [], []
        try:
            folder = self.runs.folder(model, task) if model and task else None
        except AttnpatError as exc:
            return [_message(str(exc), "error"), *sum((self._artifact_outputs(None) for _ in stems), [])]
        if folder is not None and not folder.is_dir():
            return [_message(f"no run {model}/{task} in {self.runs.root} yet: run {run_hints(stems, model, task)}",
                             "error"), *sum((self._artifact_outputs(None) for _ in stems), [])]
        for stem in stems:
            try:
                view = self.runs.artifact(model, task, stem) if model and task else None
            except AttnpatError as exc:
                problems.append(str(exc))
                view = None
            if view is None or not view.found:
                missing.append(stem)
                outputs += self._artifact_outputs(None)
                continue
            if view.error:
                problems.append(view.error)
            outputs += self._artifact_outputs(view)
        if not model or not task:
            message = _message(f"no runs in {self.runs.root} yet: start one from the Runs tab or run "
                               "`attnpat demo --no-app`", "error")
        elif len(missing) == len(stems):
            message = _message(f"no {tab.lower()} run for {model}/{task} yet: run {run_hints(stems, model, task)}",
                               "error")
        elif missing:
            message = _message(f"{model}/{task}: not computed yet: {', '.join(_slug_label(s) for s in missing)} "
                               f"(run {run_hints(missing, model, task)})", "info")
        else:
            message = _message(f"{model}/{task}: every {tab.lower()} artifact is here", "ok")
        if problems:
            message += "  \n" + _message("; ".join(problems), "error")
        return [message, *outputs]

    @staticmethod
    def _artifact_outputs(view: ArtifactView | None) -> list:
        """group, title, image, table, downloads (CSV, PNG, SVG that exist) of one artifact."""
        if view is None:
            return [gr.Group(visible=False), "", gr.Image(value=None, visible=False),
                    gr.Dataframe(value=None, visible=False), None]
        where = f"`{view.folder.parent.name}/{view.folder.name}`"
        title = f"#### {_slug_label(view.stem)}  \n<small>{where}</small>"
        files = [str(path) for path in (view.csv, view.png, view.svg) if path is not None]
        image = gr.Image(value=str(view.png) if view.png else None, visible=view.png is not None)
        return [gr.Group(visible=True), title, image,
                gr.Dataframe(value=view.table, visible=view.table is not None), files]

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
            sizes = {entry.get("data", {}).get("n_examples") for entry in analyses.values() if isinstance(entry, dict)}
            rows.append({"model": run["model"], "task": run["task"], "analyses": ", ".join(sorted(analyses)),
                         "examples": ", ".join(str(s) for s in sorted(s for s in sizes if s is not None)),
                         "updated": manifest.get("updated", ""), "path": run["path"]})
        frame = pd.DataFrame(rows, columns=["model", "task", "analyses", "examples", "updated", "path"])
        names = [f"{row['model']}/{row['task']}" for row in rows]
        chosen = picked if picked in names else (names[0] if names else None)
        return frame, gr.Dropdown(choices=names, value=chosen), chosen

    def manifest(self, name) -> str:
        """The picked run's manifest.json as indented JSON text ("model/task" names the run)."""
        if not name or name.count("/") != 1:
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
        job = self.jobs.job
        if job is None:
            yield "", _message("no job started yet"), gr.skip(), gr.skip(), gr.skip()
            return
        yield from self._follow(job, picked)

    def _follow(self, job: Job, picked):
        while job.returncode is None or job.finished is None:
            yield job.log_text(), _message(job.status()), gr.skip(), gr.skip(), gr.skip()
            time.sleep(0.5)
        code = job.returncode
        table, picker, chosen = self.runs_and_pick(picked)
        yield (job.log_text(), _message(job.status(), "ok" if code == 0 else ("info" if code < 0 else "error")),
               table, picker, self.manifest(chosen))

    def stop_job(self):
        return _message(self.jobs.stop())

    # -------------------------------------------------------- layout

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="attnpat: what do BERT attention heads do?", delete_cache=(3600, 3600)) as demo:
            gr.Markdown("## attnpat: what do BERT attention heads do?\nLive maps for one input; everything else "
                        f"from the run directory `{self.runs.root}`.")
            with gr.Tabs():
                self._explore_tab(demo)
                for tab in RUN_TABS:
                    self._run_tab(tab, demo)
                self._runs_tab(demo)
        return demo

    def _explore_tab(self, demo: gr.Blocks) -> None:
        with gr.Tab("Explore", id="explore"):
            with gr.Row():
                text = gr.Textbox(label="Sentence", value="The cat sat on the mat because it was warm.", scale=3,
                                  elem_id="explore-text", max_lines=4)
                pair = gr.Textbox(label="Second sentence (optional)", scale=2, elem_id="explore-pair", max_lines=4)
                model = gr.Dropdown(model_choices(), value=DEFAULT_MODEL, label="Model", allow_custom_value=True,
                                    scale=1, elem_id="explore-model")
            with gr.Row():
                word_level = gr.Checkbox(label="word level (pieces pooled)", value=False, elem_id="explore-words")
                hide_special = gr.Checkbox(label="hide [CLS]/[SEP]", value=False, elem_id="explore-hide")
                run = gr.Button("Show all heads", variant="primary", elem_id="explore-run")
            gr.Markdown(f"<small>Live view for inputs of up to {MAX_LIVE_TOKENS} tokens. {HIDE_SPECIAL_NOTE} "
                        "Classes are predicted on the token-level maps.</small>")
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
            inputs = [text, pair, model, word_level, hide_special]
            map_inputs = [*inputs, layer, head]
            map_outputs = [caption, big, map_png, map_svg]
            outputs = [status, grid, classes, grid_png, grid_svg, classes_csv]
            for trigger in (run.click, text.submit, pair.submit, word_level.input, hide_special.input):
                trigger(self.explore, inputs, outputs, api_name="explore" if trigger == run.click else False,
                        concurrency_limit=4, concurrency_id="live").then(
                    self.head_map, map_inputs, map_outputs, api_name=False, concurrency_limit=4,
                    concurrency_id="live")
            for number in (layer, head):
                number.submit(self.head_map, map_inputs, map_outputs, api_name=False, concurrency_id="live")
            gr.Button("Show head", size="sm", visible=False).click(
                self.head_map, map_inputs, map_outputs, api_name="head_map", concurrency_id="live")
            grid.select(self.pick_head, [model, layer, head], [layer, head], api_name=False).then(
                self.head_map, map_inputs, map_outputs, api_name=False, concurrency_id="live")

    def _run_tab(self, tab: str, demo: gr.Blocks) -> None:
        key = tab.lower().replace(" ", "-")
        with gr.Tab(tab, id=key) as tab_block:
            with gr.Row():
                model = gr.Dropdown(label="model (run directory)", choices=[], allow_custom_value=True,
                                    elem_id=f"{key}-model")
                task = gr.Dropdown(label="task", choices=[], allow_custom_value=True, elem_id=f"{key}-task")
                refresh = gr.Button("Refresh", size="sm")
            message = gr.Markdown(elem_id=f"{key}-message")
            outputs = [message]
            for stem in RUN_TABS[tab]:
                with gr.Group(visible=False) as group:
                    title = gr.Markdown()
                    image = gr.Image(show_label=False, type="filepath", interactive=False,
                                     elem_id=f"{key}-{stem}-image")
                    table = gr.Dataframe(interactive=False, max_height=320, elem_id=f"{key}-{stem}-table")
                    # one file list per artifact (CSV, PNG, SVG): three buttons each would triple the page config
                    files = gr.File(label="download", file_count="multiple", interactive=False,
                                    elem_id=f"{key}-{stem}-files")
                outputs += [group, title, image, table, files]

            api = key.replace("-", "_")

            def show(model_name, task_name, tab=tab):
                return self.show_artifacts(tab, model_name, task_name)

            def choose(model_name, task_name, preferred=PREFERRED_TASK.get(tab, "sst2")):
                return self.run_choices(model_name, task_name, preferred)

            demo.load(choose, [model, task], [model, task], api_name=False)
            tab_block.select(choose, [model, task], [model, task], api_name=False).then(
                show, [model, task], outputs, api_name=False)
            refresh.click(choose, [model, task], [model, task], api_name=False).then(
                show, [model, task], outputs, api_name=False)
            model.input(choose, [model, task], [model, task], api_name=False).then(
                show, [model, task], outputs, api_name=False)
            task.input(show, [model, task], outputs, api_name=api)

    def _runs_tab(self, demo: gr.Blocks) -> None:
        with gr.Tab("Runs", id="runs") as tab_block:
            refresh = gr.Button("Refresh", size="sm")
            table = gr.Dataframe(label="runs", interactive=False, elem_id="runs-table")
            with gr.Row():
                picked = gr.Dropdown(label="run", choices=[], allow_custom_value=True, elem_id="runs-pick")
            # shown as text: gr.JSON would treat path strings in the manifest as files to serve
            manifest = gr.Code(label="manifest.json", language="json", interactive=False, max_lines=24,
                               elem_id="runs-manifest")
            gr.Markdown("#### Start a batch job\nRuns `attnpat <verb> --model ... --task ... --n ...` into this "
                        "app's run directory, one job at a time.")
            verbs = list(cli_verbs())
            with gr.Row():
                verb = gr.Dropdown(verbs, value=verbs[0] if verbs else None, label="job", elem_id="job-verb")
                model = gr.Textbox(value=DEFAULT_MODEL, label="model", elem_id="job-model")
                task = gr.Dropdown(list(ALL_TASKS), value="sst2", label="task", elem_id="job-task")
                count = gr.Number(value=32, precision=0, minimum=1, label="examples (n)", elem_id="job-n")
            with gr.Row():
                start = gr.Button("Start job", variant="primary", elem_id="job-start")
                watch = gr.Button("Watch progress", elem_id="job-watch")
                stop = gr.Button("Stop job", variant="stop", elem_id="job-stop")
            job_status = gr.Markdown(elem_id="job-status")
            job_log = gr.Textbox(label="job log", lines=10, max_lines=20, autoscroll=True, interactive=False,
                                 elem_id="job-log")

            for trigger in (tab_block.select, refresh.click):
                api_name = "list_runs" if trigger == refresh.click else False
                trigger(self.runs_table, picked, [table, picked], api_name=api_name).then(self.manifest, picked, manifest, api_name=False)
            picked.input(self.manifest, picked, manifest, api_name="manifest")
            job_outputs = [job_log, job_status, table, picked, manifest]
            start.click(self.start_job, [verb, model, task, count, picked], job_outputs, api_name="start_job",
                        concurrency_limit=None)
            watch.click(self.watch_job, picked, job_outputs, api_name="watch_job", concurrency_limit=None)
            stop.click(self.stop_job, None, job_status, api_name="stop_job")
            del demo


def build_app(runs_dir: str | Path | None = None, explorer: LiveExplorer | None = None) -> tuple[gr.Blocks, WebApp]:
    web = WebApp(runs_dir, explorer)
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
           explorer: LiveExplorer | None = None, quiet: bool = False, warm: bool = True):
    """Serve the app on host:port (offline: no analytics, no share link). Returns (demo, web) when not blocking."""
    if not 0 < int(port) < 65536:
        raise AttnpatError(f"port must be between 1 and 65535, got {port}")
    import torch

    # Live inputs are small: one thread per request, several requests in parallel, beats every request
    # fighting over all cores (bench/bench_explore.py: 0.1-0.3 s with 1 thread vs 2+ s with 2 on a busy machine).
    torch.set_num_threads(1)
    demo, web = build_app(runs_dir, explorer)
    if warm:
        warm_up(web)
    demo.queue(default_concurrency_limit=8, max_size=256)
    try:
        demo.launch(server_name=host, server_port=int(port), share=False, prevent_thread_lock=not block,
                    allowed_paths=[str(web.runs.root.resolve()), str(web.scratch.root)], quiet=quiet,
                    ssr_mode=False, show_error=True)
    except OSError as exc:
        raise AttnpatError(f"cannot serve on {host}:{port} ({exc}); pick another --port") from exc
    return demo, web
