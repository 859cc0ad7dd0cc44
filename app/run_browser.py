"""The run tabs' data: what exists of each artifact in runs/<model-slug>/<task>/, and private scratch folders
for per-request downloads.

Which files a tab shows, and which folder holds each, comes from analysis.artifacts.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from PIL import Image

from analysis.artifacts import Tab, split_kind_folder, tab_artifacts
from analysis.artifacts import artifact as registered
from analysis.clustering import stress_reading
from analysis.errors import AttnpatError, os_error_reason, quoted
from analysis.figures import close, layer_head_figure, png_as_svg
from analysis.models import recorded_base
from analysis.parsing import SILVER_PARSES
from analysis.paths import runs_root
from analysis.rundir import list_runs, readable_manifest, save_figure
from app.display import display_table, ratio_notes

# pyplot keeps global state: requests served in parallel threads draw their figures one at a time.
FIGURE_LOCK = threading.Lock()


def slug_label(stem: str) -> str:
    """An artifact's name as a person reads it: "disable_heads" -> "disable heads"."""
    return stem.replace("_", " ")


def read_manifest(manifest_path: Path) -> dict:
    """A run folder's manifest, or {} when it is missing or damaged (the Runs tab reports a damaged one)."""
    return readable_manifest(manifest_path) or {}


def recorded_model_name(manifest_path: Path) -> str | None:
    """The model a run manifest records, as a command run from any folder can name it: a local folder's absolute
    path (``model.path``; the name it was typed as, ``./my-model``, loads only from where it was typed), else
    ``model.name`` as given (an alias, store name or hub id); None for a missing, damaged or older manifest."""
    model = read_manifest(manifest_path).get("model")
    if not isinstance(model, dict):
        return None
    path = model.get("path")
    if model.get("source") == "local" and isinstance(path, str) and Path(path).is_absolute():
        return path
    name = model.get("name")
    return name if isinstance(name, str) and name.strip() else None


def manifest_base(manifest: dict) -> str | None:
    """The base model a run manifest pairs its model with (the base_model of compare's or special's paired change
    entry); None when no entry names one."""
    analyses = manifest.get("analyses")
    for entry in analyses.values() if isinstance(analyses, dict) else ():
        base = entry.get("base_model") if isinstance(entry, dict) else None
        if isinstance(base, str) and base.strip():
            return base
    return None


def pattern_ratio_notes(manifest: dict) -> list[str]:
    """`classify`'s notes under pattern_ratios (clipped classes, adjusted ratios unavailable) from its manifest."""
    analyses = manifest.get("analyses")
    entry = analyses.get("classify") if isinstance(analyses, dict) else None
    uncertainty = entry.get("ratio_uncertainty") if isinstance(entry, dict) else None
    return ratio_notes(uncertainty) if isinstance(uncertainty, dict) else []


def _finite(value) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None (missing, null or damaged)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)


def _stress_text(record: dict) -> str | None:
    """'MDS fit: Kruskal stress-1 0.123 [0.110, 0.140] ..., fair to poor ...' from a clusters record; None without
    mds_stress (a run made before it was kept)."""
    stress = _finite(record.get("mds_stress"))
    if stress is None:
        return None
    bounds = record.get("mds_stress_interval")
    bounds = [_finite(bound) for bound in bounds] if isinstance(bounds, list) and len(bounds) == 2 else [None]
    if None in bounds:
        return f"MDS fit: Kruskal stress-1 {stress:.3f}, {stress_reading(stress)}"
    return (f"MDS fit: Kruskal stress-1 {stress:.3f} [{bounds[0]:.3f}, {bounds[1]:.3f}] (95% over bootstrap draws), "
            f"{stress_reading(stress, bounds)}")


def _split_half_text(record: dict) -> str | None:
    """'split-half r = 0.987 ...' from a clusters record; None when the run did not keep it."""
    if "split_half_correlation" not in record:
        return None
    r = _finite(record["split_half_correlation"])
    if r is None:
        return "split-half r: none (needs at least 2 examples and 2 heads that differ)"
    return f"split-half r = {r:.3f} (distances of the even- vs odd-numbered examples)"


def _radius_text(record: dict) -> str | None:
    """'median position radius 4.2% of the plot's spread' from a clusters record; None where not kept."""
    share = _finite(record.get("median_radius_to_spread"))
    return None if share is None else f"median position radius {share:.1%} of the plot's spread"


def cluster_fit_notes(manifest: dict) -> list[str]:
    """`cluster`'s note under clusters: how well the MDS figure fits the divergences (Kruskal stress-1 with its
    interval and reading), how stable the distances are (split-half r) and the heads' positions (median position
    radius), from the manifest's clusters entry; [] for a run made before any of them was kept."""
    analyses = manifest.get("analyses")
    record = analyses.get("clusters") if isinstance(analyses, dict) else None
    if not isinstance(record, dict):
        return []
    parts = [text for text in (_stress_text(record), _split_half_text(record), _radius_text(record)) if text]
    return ["; ".join(parts)] if parts else []


# Artifacts shown with notes from their run's manifest: stem -> notes(manifest), lines of text under the table.
ARTIFACT_NOTES = {"pattern_ratios": pattern_ratio_notes, "clusters": cluster_fit_notes}


def measured_headers(table: pd.DataFrame) -> dict[str, str]:
    """{column: shown header} for a dependency probing table: on silver parses its accuracy columns measure only
    agreement with the parser (as analysis.probing.score_name says), so accuracy, baseline_accuracy and
    in_sample_accuracy are shown as agreement, baseline_agreement, in_sample_agreement; {} on gold parses (or a
    table of both)."""
    if "parses" not in table.columns or set(table["parses"].dropna().astype(str)) != {SILVER_PARSES}:
        return {}
    return {column: column.replace("accuracy", "agreement") for column in table.columns if "accuracy" in column}


# Artifacts whose shown headers depend on their values: stem -> headers(table), {CSV column: shown header}.
ARTIFACT_HEADERS = {"probing_dependency": measured_headers, "probing_dependency_heads": measured_headers}


# The longest file name most file systems take (NAME_MAX), in bytes.
NAME_MAX = 255


def run_name_problem(part) -> str:
    """Why ``part`` cannot name a run folder or task folder (not text, empty, a path, control characters, too
    long for a file name); '' when it can."""
    if not isinstance(part, str):
        return f"{type(part).__name__}, not text"
    if not part or part in {".", ".."} or "/" in part or "\\" in part:
        return "one folder name is needed"
    if not part.isprintable():
        return "it holds control characters"
    if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
        return f"a folder name has at most {NAME_MAX} bytes"
    return ""


class Scratch:
    """A private temporary folder for per-request downloads; folders older than ``max_age`` s are pruned, and
    the whole folder goes when the Scratch is collected or the process exits."""

    def __init__(self, max_age: float = 3600.0):
        self.root = Path(tempfile.mkdtemp(prefix="attnpat-app-"))
        self.max_age = max_age
        # every app start (and every test that builds one) made a folder that outlived the process
        weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self._last_prune = time.time()

    def new_dir(self) -> Path:
        now = time.time()
        if now - self._last_prune > 60:
            self._last_prune = now
            for folder in self.root.glob("req-*"):
                try:
                    stale = now - folder.stat().st_mtime > self.max_age
                except FileNotFoundError:  # another request's prune took it first
                    continue
                if stale:
                    shutil.rmtree(folder, ignore_errors=True)
        folder = self.root / f"req-{uuid.uuid4().hex}"
        folder.mkdir(parents=True)
        return folder

    def figures_dir(self) -> Path:
        folder = self.root / "figures"
        folder.mkdir(parents=True, exist_ok=True)  # the scratch root itself may have been removed (a /tmp cleaner)
        return folder


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
    notes: list[str] = field(default_factory=list)  # what the table alone does not say (ARTIFACT_NOTES)
    headers: dict[str, str] = field(default_factory=dict)  # {CSV column: header shown} (ARTIFACT_HEADERS)

    @property
    def found(self) -> bool:
        return self.csv is not None or self.png is not None

    def displayed_table(self) -> pd.DataFrame | None:
        """The table as the tab shows it: numbers readable (app.display.display_table), headers renamed (headers);
        the CSV download keeps its own columns."""
        shown = display_table(self.table)
        return None if shown is None else shown.rename(columns=self.headers)


class RunBrowser:
    """Reads runs/<model-slug>/<task>/ for the run tabs; draws a heatmap for a layer x head CSV without figure."""

    def __init__(self, runs_dir: str | Path | None, scratch: Scratch):
        self.root = runs_root(runs_dir)
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

    def found(self, model: str, task: str, tab: Tab) -> int:
        """How many of ``tab``'s artifacts kept in runs/<model>/<task>/ itself exist there."""
        folder = self.root / model / task
        return sum(any((folder / name).is_file() for name in entry.files())
                   for entry in tab_artifacts(tab.name) if entry.folder is None)

    def best_run(self, tab: Tab, model: str | None = None, default_model: str = "") -> tuple[str | None, str | None]:
        """The (model, task) a run tab opens on: the run folder holding most of the tab's artifacts (of ``model``
        when given), ties going to ``default_model`` and then to the tab's preferred task."""
        models = [model] if model else [name for name in self.models() if tab.model in (None, name)]
        candidates = [(self.found(name, task, tab), name == default_model, task == tab.preferred_task, name, task)
                      for name in models for task in self.tasks(name)]
        if not candidates:
            return (model or None), None
        *_, name, task = max(candidates, key=lambda candidate: candidate[:3])
        return name, task

    def folder(self, model: str, task: str) -> Path:
        """runs/<model>/<task>; a name that is no single folder name (a one-line AttnpatError) is refused before
        the file system is asked: the tabs' dropdowns take typed names, and the API any value."""
        for part in (model, task):
            problem = run_name_problem(part)
            if problem:
                raise AttnpatError(f"not a run name: {quoted(part)} ({problem})")
        return self.root / model / task

    def model_name(self, model: str | None, task: str | None = None) -> str | None:
        """The model as the user named it for run folder ``model`` ('org/model' for org__model, 'tiny@v2' for
        tiny_at_v2), as the folder's manifests record it: the picked task's first, then its other tasks'. None when
        none records one (a run from before manifests named the model): the folder's name stands in for it."""
        if not model:
            return None
        try:
            base = self.folder(model, task or "_")
        except AttnpatError:
            return None
        manifests = [base / "manifest.json"] if task else []
        manifests += sorted(self.root.joinpath(model).glob("*/manifest.json"))
        return next(filter(None, map(recorded_model_name, manifests)), None)

    def base_model(self, model: str | None, task: str | None) -> str | None:
        """The base model that run folder ``model``'s model was fine-tuned from: as the picked run's manifest pairs
        them, else as the model store records it; None for a model with no base recorded (a pre-trained one)."""
        if not model or not task:
            return None
        try:
            folder = self.folder(model, task)
        except AttnpatError:
            return None
        return (manifest_base(read_manifest(folder / "manifest.json"))
                or recorded_base(self.model_name(model, task) or split_kind_folder(model)[0]))

    def artifact(self, model: str, task: str, stem: str) -> ArtifactView:
        folder = self.folder(model, registered(stem).folder or task)
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
            except OSError as exc:  # permission denied, removed meanwhile...
                view.error = f"{view.csv.name} cannot be read ({os_error_reason(exc)})"
                view.table = None
        if view.png is None and view.table is not None:
            view.png, view.svg = self.derived_figure(view)
        elif view.png is not None and view.svg is None:  # a figure kept without its SVG (copied, or older)
            view.svg = self.svg_beside(view.png, stem)
        if view.table is not None and stem in ARTIFACT_HEADERS:
            view.headers = ARTIFACT_HEADERS[stem](view.table)
        if view.table is not None and stem in ARTIFACT_NOTES:
            view.notes = ARTIFACT_NOTES[stem](read_manifest(folder / "manifest.json"))
        return view

    def svg_beside(self, png: Path, stem: str) -> Path | None:
        """<stem>.svg wrapping the run's ``png`` (analysis.figures.png_as_svg), so that a figure kept without its
        SVG can still be saved as one; cached by file and mtime. None when the PNG cannot be read as an image."""
        try:
            stat = png.stat()
            with Image.open(png) as image:
                width, height = image.size
        except (OSError, ValueError, Image.DecompressionBombError):  # unreadable, or not an image
            return None
        key = hashlib.sha1(f"{png.resolve()}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:16]
        svg = self.scratch.figures_dir() / key / f"{stem}.svg"
        with FIGURE_LOCK:  # one writer: a request in parallel would otherwise serve a half-written file
            if not svg.is_file():
                svg.parent.mkdir(exist_ok=True)
                png_as_svg(png, svg, width, height)
        return svg

    def derived_figure(self, view: ArtifactView) -> tuple[Path | None, Path | None]:
        """Heatmap PNG/SVG for a layer x head table that has no figure of its own, cached by file and mtime.

        Saved as <key>/<stem>.png and .svg: a download is named after its table, as the run folder's figures are
        (not <stem>-<key>.png)."""
        stat = view.csv.stat()
        key = hashlib.sha1(f"{view.csv.resolve()}:{stat.st_mtime_ns}:{stat.st_size}".encode()).hexdigest()[:16]
        stem = self.scratch.figures_dir() / key / view.stem
        png, svg = stem.with_suffix(".png"), stem.with_suffix(".svg")
        with FIGURE_LOCK:
            if not png.is_file():
                stem.parent.mkdir(exist_ok=True)
                fig = layer_head_figure(view.table, f"{slug_label(view.stem)} (drawn from {view.csv.name})")
                if fig is None:
                    return None, None
                save_figure(fig, stem)
                close(fig)
        return png, svg
