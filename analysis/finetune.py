"""Fine-tune an encoder on a GLUE task, evaluate it with the task's metric, keep it in the model store.

The recipe is BERT's standard one (AdamW, learning rate 2e-5, batch 32, 3 epochs, maximum length 128,
linear decay after 10% warm-up). Training batches come from ``analysis.stream.iter_batches``
(length-sorted, dynamically padded); their order is shuffled per epoch with a seeded RNG, so a resumed
run sees exactly the batches an uninterrupted run would.

Store layout: ``models/<NAME>/`` holds the Hugging Face model + tokenizer and ``attnpat.json``;
``models/<NAME>/.checkpoint/state.pt`` holds the training state while a run is unfinished. A finished run
builds its model whole in ``models/.<NAME>.landing/`` and swaps it in for ``models/<NAME>/``
(:func:`analysis.rundir.swap_in_folder`); the folder it replaces (an older model, the checkpoint, the
``--force`` marker) goes by way of ``models/.<NAME>.replaced/``.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import get_linear_schedule_with_warmup

from analysis.data import (
    GLUE_TASKS,
    OFFLINE_GLUE,
    Example,
    NoTaskSource,
    TaskData,
    is_data_file,
    load_data,
    offline_splits,
    seeded_sample,
)
from analysis.errors import AttnpatError, write_failure_reason
from analysis.metrics import METRICS, metric_name, task_metric
from analysis.models import (
    EMBEDDED_ALIASES,
    FETCHED_ALIASES,
    _store_meta,
    load_model,
    model_revision,
    model_slug,
    quiet_transformers,
    resolve_model,
)
from analysis.paths import model_store
from analysis.progress import progress_bar
from analysis.rundir import RunDir, atomic_write, json_text, locked, swap_in_folder
from analysis.stream import DEFAULT_MAX_LENGTH, TokenBatch, encode_examples, iter_batches
from analysis.uncertainty import bootstrap_statistic_interval, wilson_interval

CHECKPOINT_DIR = ".checkpoint"
FORCE_PENDING = ".force-pending"  # a --force run is training a replacement (finetune)
STATE_FILE = "state.pt"
META_FILE = "attnpat.json"
# what a finetune entry of the run manifest copies from the store model's attnpat.json
RECORDED = ("task", "split", "recipe", "data_sha256", "metric", "metric_value")


@dataclass
class Recipe:
    """Training hyper-parameters (recorded in attnpat.json; a resumed run must use the same ones)."""

    learning_rate: float = 2e-5
    batch_size: int = 32
    epochs: int = 3
    max_length: int = DEFAULT_MAX_LENGTH
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    seed: int = 0

    def check(self) -> None:
        if not 0 < self.learning_rate < float("inf"):  # also refuses NaN
            raise AttnpatError(f"learning rate must be positive, got {self.learning_rate}")
        if self.epochs < 1:
            raise AttnpatError(f"epochs must be at least 1, got {self.epochs}")
        if self.batch_size < 1:
            raise AttnpatError(f"batch size must be positive, got {self.batch_size}")
        if not 0 <= self.warmup_ratio < 1:
            raise AttnpatError(f"warm-up ratio must be in [0, 1), got {self.warmup_ratio}")


@dataclass
class TrainResult:
    """losses: the training loss of every step run in this call (a resumed run starts mid-way); final_loss: the
    last step's loss, whichever call ran it (kept in the checkpoint, so a run resumed after its last step has it)."""

    steps: int
    total_steps: int
    losses: list[float] = field(default_factory=list)
    resumed_from: int = 0
    train_seconds: float = 0.0
    final_loss: float | None = None


# ---------------------------------------------------------------- data

def check_task(task: str) -> str:
    """The GLUE task name ``task`` stands for (trimmed, lower case), or an AttnpatError naming it as given."""
    name = task.strip().lower()
    if name not in GLUE_TASKS:
        why = "; a data file cannot be fine-tuned on" if is_data_file(task) else ""
        raise AttnpatError(f"fine-tuning needs a GLUE task ({', '.join(GLUE_TASKS)}), got '{task}'{why}")
    return name


def finetune_splits(task: str, *, split_dev: bool = False, train_share: float = 0.5, seed: int = 0,
                    n_train: int | None = None, allow_hub: bool | None = None) -> tuple[TaskData, TaskData, dict]:
    """(train data, evaluation data, split info) for a GLUE task.

    Without ``split_dev``: the train split (hub, or the offline source) and the full dev set. With it: a
    seeded ``train_share`` of the dev set to train on and the rest to evaluate on (for tasks whose only
    offline split is the dev set).
    """
    task = check_task(task)
    if split_dev:
        if not 0 < train_share < 1:
            raise AttnpatError(f"--train-share must be between 0 and 1, got {train_share}")
        try:
            dev = load_data(task, "validation", allow_hub=allow_hub)
        except NoTaskSource as exc:
            if task in OFFLINE_GLUE:  # packaged, but its package is missing: the error names the pip command
                raise
            raise AttnpatError(f"{exc.reason}; {task} has no packaged data: fine-tuning on it needs the hub") from exc
        order = list(range(len(dev.examples)))
        random.Random(seed).shuffle(order)
        cut = int(round(train_share * len(order)))
        if cut < 1 or cut >= len(order):
            raise AttnpatError(f"a train share of {train_share} leaves nothing to train or evaluate on "
                               f"({len(order)} dev examples)")
        train_ids, eval_ids = sorted(order[:cut]), sorted(order[cut:])
        # the training share, not what was trained on: --n may sample it further
        note = f"--split-dev: the dev set split into {len(train_ids)} training examples (share {train_share}, " \
               f"seed {seed}) and {len(eval_ids)} held out for evaluation"
        train = TaskData(task, "validation[train-share]", dev.source, [dev.examples[i] for i in train_ids],
                         dev.num_labels, dev.metric, [note], label_names=dev.label_names)
        evaluation = TaskData(task, "validation[held-out]", dev.source, [dev.examples[i] for i in eval_ids],
                              dev.num_labels, dev.metric, [note], label_names=dev.label_names)
        info = {"mode": "split-dev", "train_share": train_share, "seed": seed, "note": note}
    else:
        try:
            train = load_data(task, "train", allow_hub=allow_hub)
        except AttnpatError as exc:
            # --split-dev helps only where the dev set itself can be loaded without the hub
            advice = ("use --split-dev to fine-tune on a share of the dev set instead"
                      if "validation" in offline_splits(task) else
                      f"{task} has no packaged data: fine-tuning on it needs the hub")
            raise AttnpatError(f"{_without_data_file_advice(exc)}; {advice}") from exc
        evaluation = load_data(task, "validation", allow_hub=allow_hub)
        info = {"mode": "train/validation"}
    if n_train is not None:
        if n_train < 1:
            raise AttnpatError(f"--n must be positive, got {n_train}")
        # refused, not capped: the capped run would train on the whole set yet record --n as asked, so its rerun
        # (and one without --n, which trains the same examples) would be told the model had other settings
        if n_train > len(train.examples):
            raise AttnpatError(f"--n {n_train} is more than the {len(train.examples)} training examples of {task} "
                               f"({train.split}); give at most {len(train.examples)}, or leave --n out to train "
                               "on them all")
        # a seeded sample, not the first N: source files can be ordered by label (the SST snippets are)
        train.examples = seeded_sample(train.examples, n_train, seed)
        train.notes = train.notes + [f"--n: a seeded sample (seed {seed}) of {len(train.examples)} training examples"]
    info.update(train_source=train.source, train_split=train.split, n_train=len(train.examples),
                eval_source=evaluation.source, eval_split=evaluation.split, n_eval=len(evaluation.examples),
                notes=train.notes)
    if any(example.label is None for example in train.examples + evaluation.examples):
        raise AttnpatError(f"task '{task}' has examples without labels; cannot fine-tune on it")
    check_labels_fit(task, train.examples + evaluation.examples, GLUE_TASKS[task].num_labels)
    return train, evaluation, info


def trained_example_ids(meta: dict) -> set[str]:
    """The ids of the dev examples a ``--split-dev`` fine-tune (its attnpat.json ``meta``) trained on, drawn again
    from its recorded task, share, seed and --n; empty for a fine-tune on a train split, or one whose draw no longer
    gives the examples it recorded (their sha256 differs)."""
    split = meta.get("split") if isinstance(meta.get("split"), dict) else {}
    recipe = meta.get("recipe") if isinstance(meta.get("recipe"), dict) else {}
    if split.get("mode") != "split-dev" or meta.get("task") not in GLUE_TASKS or "seed" not in recipe:
        return set()
    sampled = any(str(note).startswith("--n:") for note in split.get("notes") or [])
    train, _, _ = finetune_splits(meta["task"], split_dev=True, train_share=split.get("train_share", 0.5),
                                  seed=recipe["seed"], n_train=split.get("n_train") if sampled else None)
    recorded = (meta.get("data_sha256") or {}).get("train")
    return {example.id for example in train.examples} if train.examples_digest() == recorded else set()


def without_trained_examples(data: TaskData, meta: dict, n: int | None = None) -> tuple[TaskData, int]:
    """The first ``n`` (None: all) of ``data``'s examples that the fine-tuned model (attnpat.json ``meta``) was not
    trained on (a --split-dev share of this very dev set: its maps on those would be in-sample), and how many it was
    trained on were left out on the way to them."""
    return _first_held_out(data, _trained_ids_of_split(data, meta), n)


def _first_held_out(data: TaskData, trained: set[str], n: int | None) -> tuple[TaskData, int]:
    """:func:`without_trained_examples` given the ids trained on."""
    kept, left_out = [], 0
    for example in data.examples:
        if n is not None and len(kept) == n:
            break
        if example.id in trained:
            left_out += 1
        else:
            kept.append(example)
    if not left_out:
        return (data if len(kept) == len(data.examples) else replace(data, examples=kept)), 0
    if not kept:
        raise AttnpatError(f"every one of the {len(data.examples)} examples was trained on (--split-dev); raise --n "
                           "to reach the held-out ones")
    note = f"{left_out} example(s) the fine-tuned model was trained on (--split-dev) left out"
    if n is not None and len(kept) < n:
        note += f"; only {len(kept)} it was not trained on remain, fewer than --n {n}"
    return replace(data, examples=kept, notes=[*data.notes, note]), left_out


def held_out_data(first: TaskData, meta: dict, n: int | None,
                  load_whole: Callable[[], TaskData]) -> tuple[TaskData, int]:
    """The first ``n`` examples of a split that the fine-tuned model (``meta``) was not trained on, and how many it was
    trained on were left out on the way: ``first`` holds the split's first n examples (all for None), and
    ``load_whole()`` loads the whole split, called only where ``first`` holds some it was trained on, so that n are
    compared wherever the split has them (before, the trained ones were left out of the first n: fewer than n)."""
    trained = _trained_ids_of_split(first, meta)
    more = n is not None and len(first.examples) == n  # fewer than n: ``first`` is the whole split already
    if more and any(example.id in trained for example in first.examples):
        return _first_held_out(load_whole(), trained, n)
    return _first_held_out(first, trained, n)


def _trained_ids_of_split(data: TaskData, meta: dict) -> set[str]:
    """The ids of ``data``'s split that the fine-tuned model was trained on (empty unless it is the dev set of the
    model's task)."""
    if data.task != meta.get("task") or data.split != "validation":
        return set()
    return trained_example_ids(meta)


def label_fits(label, num_labels: int) -> bool:
    """Whether ``label`` is one the task's head can learn: a finite score for regression (num_labels 1), else a
    class index 0 .. num_labels - 1 (a GLUE test split's -1, or a 3-class label for a 2-class task, is not)."""
    try:
        value = float(label)
    except (TypeError, ValueError):
        return False
    if num_labels == 1:
        return np.isfinite(value)
    return value.is_integer() and 0 <= value < num_labels


def check_labels_fit(task: str, examples: Sequence[Example], num_labels: int) -> None:
    """An AttnpatError naming the first example whose label the task's head cannot take, before any training."""
    bad = [example for example in examples if not label_fits(example.label, num_labels)]
    if bad:
        wanted = "finite scores" if num_labels == 1 else f"class indices 0-{num_labels - 1}"
        raise AttnpatError(f"task '{task}' has {len(bad)} example(s) whose label does not fit its {wanted} "
                           f"(e.g. {bad[0].label!r} in example {bad[0].id}); cannot fine-tune on it")


def _without_data_file_advice(exc: AttnpatError) -> str:
    """A load error's message without the advice to save the split as a data file: no data file is fine-tuned on."""
    return exc.reason if isinstance(exc, NoTaskSource) else str(exc)


def label_tensor(batch: TokenBatch, num_labels: int) -> torch.Tensor:
    """(B,) labels as the loss needs them: float for regression (num_labels 1), long otherwise."""
    if batch.labels is None:
        raise AttnpatError("a training batch has examples without labels")
    return batch.labels.float() if num_labels == 1 else batch.labels.long()


def epoch_order(num_batches: int, seed: int, epoch: int) -> list[int]:
    """The shuffled order of the length-sorted batches in one epoch (same for a resumed run)."""
    order = list(range(num_batches))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


# ---------------------------------------------------------------- checkpoints

def save_checkpoint(path: Path, state: dict) -> None:
    """Write the training state atomically (a killed job leaves the previous checkpoint intact); a full or
    read-only disk is one error line naming ``path``."""
    try:
        atomic_write(path, lambda tmp: _save_into_file(state, tmp))
    except RuntimeError as exc:  # torch's stream writer wraps the OSError of a full disk
        reason = write_failure_reason(exc)
        if reason is None:
            raise
        raise AttnpatError(f"cannot write {path}: {reason}") from exc


def _save_into_file(state: dict, path: Path) -> None:
    """torch.save through a Python file object: saved to a path, a failed write is a RuntimeError that keeps no
    trace of its OSError (so no reason could be told)."""
    with open(path, "wb") as file:
        torch.save(state, file)


def load_checkpoint(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise AttnpatError(f"the checkpoint {path} is unreadable ({type(exc).__name__}); rerun with --force") from exc


def _settings_text(made_with: dict) -> str:
    """A checkpoint's settings as one line: its recipe, example count and identity (base, task...)."""
    identity = made_with.get("identity") or {}
    parts = [f"{made_with.get('recipe')}", f"{made_with.get('n_examples')} examples"]
    parts += [f"{key} {identity[key]}" for key in ("base_model", "task") if key in identity]
    return ", ".join(parts) if identity else ", ".join(parts) + ", no record of its base model and task"


def training_identity(bundle, task: str, num_labels: int, train) -> dict:
    """What a fine-tuning run is besides its recipe: the base (EncoderBundle.reference) and its revision, the
    task, the label count and a digest of the training examples (``train``: TaskData). A checkpoint of another
    run (another base under the same store name, another --split-dev share) is never resumed."""
    return {"base_model": bundle.reference, "base_revision": bundle.revision, "task": task,
            "num_labels": num_labels, "examples": train.examples_digest()}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- training

def finetune_encoder(bundle, examples: Sequence[Example], recipe: Recipe, checkpoint: Path, *, num_labels: int,
                     checkpoint_every: int = 50, progress: bool = True,
                     on_step: Callable[[int, float], None] | None = None,
                     identity: dict | None = None) -> TrainResult:
    """Train ``bundle.model`` (a sequence classifier) in place, resuming from ``checkpoint`` when it exists.

    The checkpoint (model, optimizer, scheduler, RNG, step) is written every ``checkpoint_every`` steps and
    at each epoch end. ``on_step(step, loss)`` is called after every optimizer step. ``identity``: what else the
    run is (base model and revision, task, the training examples' digest: :func:`training_identity`); a
    checkpoint is resumed only when it was made with the same recipe, example count and identity.
    """
    recipe.check()
    model, device = bundle.model, bundle.device
    encoded = encode_examples(bundle.tokenizer, examples, recipe.max_length)
    batches = list(iter_batches(bundle, examples, max_length=recipe.max_length, batch_size=recipe.batch_size,
                                encoded=encoded))
    steps_per_epoch = len(batches)
    total_steps = steps_per_epoch * recipe.epochs
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=recipe.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(recipe.warmup_ratio * total_steps), total_steps)

    step, elapsed, final_loss = 0, 0.0, None
    state = load_checkpoint(checkpoint)
    if state is not None:
        made_with = {key: state.get(key) for key in ("recipe", "n_examples", "identity")}
        if made_with != {"recipe": asdict(recipe), "n_examples": len(examples), "identity": identity}:
            raise CheckpointMismatch(f"the checkpoint in {checkpoint.parent} was made with other settings "
                                     f"({_settings_text(made_with)}); rerun with --force to restart")
        try:
            model.load_state_dict(state["model"])
        except (RuntimeError, KeyError, ValueError) as exc:  # another architecture or head size
            raise CheckpointMismatch(f"the checkpoint in {checkpoint.parent} does not fit this model "
                                     f"({type(exc).__name__}); rerun with --force to restart") from exc
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        step, elapsed, final_loss = state["step"], state["train_seconds"], state.get("final_loss")
    else:
        torch.manual_seed(recipe.seed)
    result = TrainResult(step, total_steps, resumed_from=step, final_loss=final_loss)

    def snapshot() -> None:
        save_checkpoint(checkpoint, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "rng": _rng_state(), "step": step, "train_seconds": elapsed + time.time() - started,
            "final_loss": result.final_loss,
            "recipe": asdict(recipe), "n_examples": len(examples), "identity": identity,
        })

    bar = progress_bar(total_steps, progress, "fine-tuning", unit="step", initial=step)
    started = time.time()
    model.train()
    try:
        while step < total_steps:
            epoch, position = divmod(step, steps_per_epoch)
            batch = batches[epoch_order(steps_per_epoch, recipe.seed, epoch)[position]]
            outputs = model(**batch.model_inputs(device), labels=label_tensor(batch, num_labels).to(device))
            outputs.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss = result.final_loss = float(outputs.loss.detach())
            result.losses.append(loss)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", epoch=f"{epoch + 1}/{recipe.epochs}")
            if step % checkpoint_every == 0 or step % steps_per_epoch == 0:
                snapshot()
            if on_step is not None:
                on_step(step, loss)
    finally:
        model.eval()
        if bar is not None:
            bar.close()
    result.steps = step
    result.train_seconds = elapsed + time.time() - started
    return result


# ---------------------------------------------------------------- evaluation

def predict(bundle, examples: Sequence[Example], *, num_labels: int, max_length: int = DEFAULT_MAX_LENGTH,
            batch_size: int = 64, progress: bool = False) -> np.ndarray:
    """(N,) predictions in the order of ``examples``: class ids, or scores for regression."""
    predictions = np.zeros(len(examples), dtype=float)
    bar = progress_bar(len(examples), progress, "evaluating")
    try:
        with torch.inference_mode():
            for batch in iter_batches(bundle, examples, max_length=max_length, batch_size=batch_size):
                logits = bundle.model(**batch.model_inputs(bundle.device)).logits.float().cpu()
                values = logits[:, 0] if num_labels == 1 else logits.argmax(-1)
                predictions[batch.indices] = values.numpy()
                if bar is not None:
                    bar.update(len(batch.indices))
    finally:
        if bar is not None:
            bar.close()
    return predictions


def metric_interval(name: str, predictions: Sequence, labels: Sequence, *, level: float = 0.95) -> tuple[float, float]:
    """The 95% interval of metric ``name`` over (N,) predictions and (N,) labels: Wilson's score interval for
    accuracy (a proportion of examples), a seeded percentile bootstrap over the examples for the others (F1 and
    correlations are no mean over examples). NaN bounds where the metric is undefined in every draw."""
    predictions, labels = np.asarray(predictions, dtype=float), np.asarray(labels, dtype=float)
    if name == "accuracy":
        low, high = wilson_interval(int((predictions == labels).sum()), len(labels), level=level)
    else:
        low, high = bootstrap_statistic_interval(lambda draw: METRICS[name](predictions[draw], labels[draw]),
                                                 len(labels), level=level)
    return float(low), float(high)


def evaluate(bundle, data: TaskData, *, num_labels: int, max_length: int = DEFAULT_MAX_LENGTH,
             batch_size: int = 64, progress: bool = False) -> dict[str, float]:
    """The task's GLUE metric (key ``metric``/``value``) plus accuracy or the correlation parts, each with its 95%
    interval (``scores``: <name>_ci_low, <name>_ci_high beside every <name>)."""
    labels = np.asarray([example.label for example in data.examples], dtype=float)
    predictions = predict(bundle, data.examples, num_labels=num_labels, max_length=max_length, batch_size=batch_size,
                          progress=progress)
    name = metric_name(data.task)
    scores = {name: task_metric(name, predictions, labels)}
    extras = ("pearson", "spearman") if num_labels == 1 else ("accuracy", "f1") if num_labels == 2 else ("accuracy",)
    for extra in extras:
        scores.setdefault(extra, METRICS[extra](predictions, labels))
    with_intervals = {}
    for metric, value in scores.items():  # every reported score carries its uncertainty, right after it
        low, high = metric_interval(metric, predictions, labels)
        with_intervals.update({metric: value, f"{metric}_ci_low": low, f"{metric}_ci_high": high})
    scores = with_intervals
    return {"metric": name, "value": scores[name], "scores": scores, "n_eval": len(labels)}


# ---------------------------------------------------------------- the model store

def store_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise AttnpatError(f"model-store names are plain folder names, got '{name}'")
    if name in EMBEDDED_ALIASES:  # --model <name> would still load the embedded model, never this one
        raise AttnpatError(f"'{name}' is the embedded model's name; choose another --name")
    path = model_store() / name
    if name in FETCHED_ALIASES or "fetched" in _read_meta(path):  # --force would overwrite the fetched model
        raise AttnpatError(f"'{name}' is the name of a fetched model (`attnpat models fetch`); choose another --name")
    return path


def _read_meta(path: Path) -> dict:
    """A store folder's attnpat.json, or {} when it has none (or an unreadable one: resolve_model reports it)."""
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _check_same_model(meta: dict, name: str, base: str, task: str) -> None:
    """An AttnpatError when the finished store model ``name`` (its attnpat.json ``meta``) is not a fine-tune of
    ``base`` on ``task``: it is kept, never handed back as the one asked for."""
    other = _made_otherwise(meta, base, task)
    if other:
        raise AttnpatError(f"the model store already holds '{name}' and {other}; choose another --name, "
                           "or --force to replace it")


def _made_otherwise(meta: dict, base: str, task: str) -> str | None:
    """Why the finished store model ``meta`` is not a fine-tune of ``base`` on ``task`` (None when it is, or
    cannot be told: a base recorded as a relative path by an older attnpat, from another folder)."""
    if meta.get("task") not in (None, task):
        return f"it was fine-tuned on {meta['task']}, not {task}"
    stored = meta.get("base_model")
    if not stored:
        return None
    try:
        requested = resolve_model(base)
    except AttnpatError:
        return None  # the request itself fails later, with its own message
    stored_path = Path(stored).expanduser()
    if stored_path.is_dir():  # a folder (recorded absolute since bases are; or relative, found from here)
        stored = str(stored_path.resolve())
    elif stored.startswith((".", "~")):  # a relative folder recorded by an older attnpat, not found from here
        return None
    # else an absolute folder (perhaps moved since), an alias, a store name or a hub id: compared as recorded
    asked = requested.path if requested.kind == "local" else base
    if stored != asked:
        return f"it was fine-tuned from {meta['base_model']}, not {base}"
    return _base_changed(meta, requested)


def _base_changed(meta: dict, requested) -> str | None:
    """Why the base ``requested`` (a ModelSource) no longer holds the weights the store model ``meta`` was fine-tuned
    from: a folder (or store model) whose files were rewritten since. None when it holds them, or cannot be told (no
    revision recorded; a hub model, whose commit is known only once it is loaded)."""
    recorded = meta.get("base_revision")
    if not recorded or requested.kind == "hub":
        return None
    current = model_revision(requested)
    return None if current == recorded else (f"it was fine-tuned from {meta['base_model']} at revision {recorded}, "
                                             f"which that model no longer holds (now {current})")


class CheckpointMismatch(AttnpatError):
    """A fine-tuning checkpoint made with other settings than the run that found it."""


def is_finished(path: Path) -> bool:
    """A complete store model that no `--force` run is replacing (an interrupted one resumes on any rerun)."""
    return (path / "config.json").is_file() and (path / META_FILE).is_file() and not (path / FORCE_PENDING).exists()


def is_foreign_model(path: Path) -> bool:
    """A model in the store folder ``path`` that no fine-tune wrote: config.json without attnpat.json or a
    checkpoint to resume (a model copied in by hand). Training would replace it."""
    return ((path / "config.json").is_file() and not (path / META_FILE).is_file()
            and not (path / CHECKPOINT_DIR / STATE_FILE).is_file())


def landing_folder(path: Path) -> Path:
    """Where the new model for the store folder ``path`` is built before it takes ``path``'s name."""
    return path.parent / f".{path.name}.landing"


def replaced_folder(path: Path) -> Path:
    """Where the folder a new model replaced (old model, checkpoint, --force marker) waits to be removed."""
    return path.parent / f".{path.name}.replaced"


def write_store(bundle, path: Path, meta: dict) -> None:
    """Save model + tokenizer + attnpat.json as the store folder ``path``: built whole beside it, then swapped in
    (:func:`analysis.rundir.swap_in_folder`), so a reader (the web app's Explore) loads the old model or the new
    one, never a mix; what ``path`` held (an old model's files, the checkpoint, the --force marker) is removed."""
    landing, replaced = landing_folder(path), replaced_folder(path)
    shutil.rmtree(landing, ignore_errors=True)
    shutil.rmtree(replaced, ignore_errors=True)
    try:
        try:
            with quiet_transformers():  # no "Writing model shards" bar under attnpat's own
                bundle.model.save_pretrained(landing)
                bundle.tokenizer.save_pretrained(landing)
            # a plain write: the landing folder as a whole is what lands atomically
            (landing / META_FILE).write_text(json_text(meta), encoding="utf-8")
            swap_in_folder(landing, path, replaced)
        except Exception as exc:  # a full disk, a read-only store: one line naming the store folder, not the landing
            reason = write_failure_reason(exc)
            if reason is None:
                raise
            raise AttnpatError(f"cannot save the fine-tuned model as {path}: {reason}; the training is kept in "
                               "its checkpoint: rerun the same command to save it") from exc
    except BaseException:  # the store folder as it was, its checkpoint kept; no half-built landing folder
        recover_store(path)
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def recover_store(path: Path) -> None:
    """Undo what a landing (:func:`write_store`) stopped by SIGKILL left: the old folder moved aside but no new one
    in its place is put back (with its checkpoint, so the rerun lands the same model again); a half-built new
    model, or a replaced folder not yet removed, is deleted."""
    replaced = replaced_folder(path)
    if replaced.is_dir() and not path.exists():
        replaced.rename(path)
    shutil.rmtree(landing_folder(path), ignore_errors=True)
    shutil.rmtree(replaced, ignore_errors=True)


def eval_table(meta: dict):
    """The finetune_eval table (metric, value) from a store model's attnpat.json."""
    rows = [{"metric": metric, "value": value} for metric, value in meta.get("scores", {}).items()]
    rows += [{"metric": key, "value": meta[key]} for key in ("n_eval", "steps", "elapsed_seconds") if key in meta]
    return pd.DataFrame(rows, columns=["metric", "value"])


def other_settings(name: str, base: str, task: str, recipe: Recipe, n_train: int) -> str | None:
    """How the finished store model ``name`` differs from what `finetune` of ``base`` on ``task`` with ``recipe``
    on a seeded sample of ``n_train`` training examples (no --split-dev) would train; None when it does not
    (training is seeded: the same settings train the same model)."""
    meta = _read_meta(model_store() / name)
    other = _made_otherwise(meta, base, task)
    if other:
        return other
    if not all(isinstance(meta.get(key), dict) for key in ("split", "recipe")):  # cannot be told: not taken
        return "its attnpat.json records no training settings"
    differing = settings_differences(meta, recipe, split_dev=False, train_share=0.5, n_train=n_train)
    return f"it was trained with {'; '.join(differing)}" if differing else None


RECIPE_OPTIONS = {"learning_rate": "--lr", "batch_size": "--batch-size", "epochs": "--epochs",
                  "max_length": "--max-length", "seed": "--seed"}  # the others have no option: named as fields


def settings_differences(meta: dict, recipe: Recipe, *, split_dev: bool, train_share: float,
                         n_train: int | None) -> list[str]:
    """How the finished store model ``meta`` (its attnpat.json) was trained otherwise than asked, one
    '<option> <recorded>, not <asked>' per setting; [] when it was not, or cannot be told (a record without it)."""
    split = meta.get("split") if isinstance(meta.get("split"), dict) else {}
    stored = meta.get("recipe") if isinstance(meta.get("recipe"), dict) else {}
    differences = [f"{RECIPE_OPTIONS.get(key, key)} {stored[key]}, not {value}"
                   for key, value in asdict(recipe).items() if key in stored and stored[key] != value]
    flags = {"split-dev": "--split-dev", "train/validation": "no --split-dev"}
    asked = "split-dev" if split_dev else "train/validation"
    if split.get("mode") in flags and split["mode"] != asked:
        differences.append(f"{flags[split['mode']]}, not {flags[asked]}")
    elif split_dev and split.get("train_share") not in (None, train_share):
        differences.append(f"--train-share {split['train_share']}, not {train_share}")
    recorded_n = split.get("n_train")
    sampled = any(str(note).startswith("--n:") for note in split.get("notes") or [])
    if recorded_n is not None and n_train is None and sampled:
        differences.append(f"--n {recorded_n}, not all")
    # fewer recorded than asked without a recorded --n: the whole training set, as --n (capped at it) also gives
    elif recorded_n is not None and n_train is not None and recorded_n != n_train \
            and (sampled or recorded_n > n_train):
        differences.append(f"--n {recorded_n}, not {n_train}")
    return differences


def write_eval_record(name: str, task: str, runs_dir: str | Path | None = None) -> dict:
    """Write runs/<name>/<task>/finetune_eval.csv and its manifest entry from the finished store model's
    attnpat.json, as its fine-tune did (for a runs folder that lacks them); returns that metadata."""
    path = model_store() / name
    meta = _read_meta(path)
    run = RunDir(name, task, runs_dir)
    with run.record("finetune", store=str(path), from_store=True) as entry:
        run.write_table("finetune_eval", eval_table(meta))
        entry.update({key: meta[key] for key in RECORDED if key in meta})
    return meta


def finetune(base: str, task: str, *, name: str | None = None, recipe: Recipe | None = None,
             split_dev: bool = False, train_share: float = 0.5, n_train: int | None = None, force: bool = False,
             checkpoint_every: int = 50, progress: bool = True, device: str | None = None,
             allow_hub: bool | None = None, on_step: Callable[[int, float], None] | None = None,
             runs_dir: str | Path | None = None) -> dict:
    """Fine-tune ``base`` on ``task`` into the model store (``name`` defaults to '<base slug>-<task>'); write
    finetune_eval.csv into runs/<name>/<task>/ under ``runs_dir`` and record the run there.

    Returns the metadata written to attnpat.json plus ``path`` and ``skipped`` (True when the model was
    already finished and ``force`` is off).
    """
    recipe = recipe or Recipe()
    recipe.check()
    if checkpoint_every < 1:  # the step loop takes it modulo: 0 stopped the run in a ZeroDivisionError
        raise AttnpatError(f"the checkpoint interval must be at least 1 step, got {checkpoint_every}")
    task = check_task(task)  # before the default store name is made of it (a path would be a bad name)
    name = name or f"{model_slug(base)}-{task}"
    path = store_path(name)

    def asked_otherwise(meta: dict) -> list[str]:  # a finished model is kept, but not passed off as the one asked
        return settings_differences(meta, recipe, split_dev=split_dev, train_share=train_share, n_train=n_train)

    # one fine-tune per store name at a time (its checkpoint and landing folder are shared), whatever its task
    with locked(path.parent / f".{path.name}.lock", f"the model store entry {path}"):
        recover_store(path)
        if is_finished(path) and not force:
            meta = _store_meta(resolve_model(name))
            _check_same_model(meta, name, base, task)
            other = asked_otherwise(meta)
            # this runs folder (another --runs-dir, a fresh one) lacks the model's evaluation: written from its record
            # rather than trained again, so the command the app hints for it does write it
            missing_eval = not other and not RunDir(name, task, runs_dir).file("finetune_eval.csv").is_file()
            if missing_eval:
                write_eval_record(name, task, runs_dir)
            return {**meta, "path": str(path), "skipped": True, "other_settings": other,
                    "eval_written": missing_eval}
        if not force and is_foreign_model(path):
            raise AttnpatError(f"the model store already holds '{name}', a model attnpat did not fine-tune (no "
                               f"{META_FILE}); choose another --name, or --force to replace it")
        if force:  # train afresh; the finished model stays usable (the web app's Explore) until the new one lands
            shutil.rmtree(path / CHECKPOINT_DIR, ignore_errors=True)
        run = RunDir(name, task, runs_dir)
        made_here = not path.exists()
        try:
            with run.record("finetune", store=str(path)) as entry:
                meta = _train_into_store(base, task, path, recipe, split_dev=split_dev, train_share=train_share,
                                         n_train=n_train, checkpoint_every=checkpoint_every, progress=progress,
                                         device=device, allow_hub=allow_hub, on_step=on_step)
                run.write_table("finetune_eval", eval_table(meta))
                entry.update({key: meta[key] for key in RECORDED})
        except CheckpointMismatch:
            if force or not (path / META_FILE).is_file():
                raise
            # a stopped --force run with other settings left its checkpoint: the finished model still stands,
            # if it is the one asked for
            meta = _store_meta(resolve_model(name))
            _check_same_model(meta, name, base, task)
            return {**meta, "path": str(path), "skipped": True, "other_settings": asked_otherwise(meta)}
        except BaseException:
            # failed before its first checkpoint (a bad --max-length, an unknown base...): no empty store folder
            if made_here and path.is_dir() and not any(path.iterdir()):
                path.rmdir()
            raise
    return meta


def data_digests(train: TaskData, evaluation: TaskData) -> dict[str, str]:
    """sha256 of the examples trained on and of those evaluated on (TaskData.examples_digest): what a store
    model was made from, as its attnpat.json and the run manifest record it."""
    return {"train": train.examples_digest(), "eval": evaluation.examples_digest()}


def _train_into_store(base: str, task: str, path: Path, recipe: Recipe, *, split_dev: bool, train_share: float,
                      n_train: int | None, checkpoint_every: int, progress: bool, device: str | None,
                      allow_hub: bool | None, on_step: Callable[[int, float], None] | None) -> dict:
    """Train a fresh classifier on ``task``, evaluate it, and write it with its attnpat.json to ``path``."""
    train, evaluation, split_info = finetune_splits(task, split_dev=split_dev, train_share=train_share,
                                                    seed=recipe.seed, n_train=n_train, allow_hub=allow_hub)
    num_labels = GLUE_TASKS[task].num_labels
    torch.manual_seed(recipe.seed)  # the fresh classification head's initialisation
    bundle = load_model(base, kind="classifier", num_labels=num_labels, device=device)
    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").is_file():  # replacing a finished model: not done again until the new one lands
        (path / FORCE_PENDING).touch()
    checkpoint = path / CHECKPOINT_DIR / STATE_FILE
    result = finetune_encoder(bundle, train.examples, recipe, checkpoint, num_labels=num_labels,
                              checkpoint_every=checkpoint_every, progress=progress, on_step=on_step,
                              identity=training_identity(bundle, task, num_labels, train))
    eval_started = time.time()
    scores = evaluate(bundle, evaluation, num_labels=num_labels, max_length=recipe.max_length, progress=progress)
    meta = {
        "base_model": bundle.reference, "base_revision": bundle.revision, "task": task,
        "num_labels": num_labels,
        "metric": scores["metric"], "metric_value": scores["value"], "scores": scores["scores"],
        "split": split_info, "data_sha256": data_digests(train, evaluation), "seed": recipe.seed,
        "epochs": recipe.epochs, "learning_rate": recipe.learning_rate,
        "batch_size": recipe.batch_size, "max_length": recipe.max_length, "recipe": asdict(recipe),
        "train_source": train.source, "n_eval": scores["n_eval"], "steps": result.steps,
        "resumed_from_step": result.resumed_from,
        "final_loss": result.final_loss,
        "elapsed_seconds": round(result.train_seconds, 1), "eval_seconds": round(time.time() - eval_started, 1),
        "device": str(bundle.device),
        "threads": torch.get_num_threads(),
    }
    write_store(bundle, path, meta)  # the checkpoint and the --force marker leave with the folder it replaces
    return {**meta, "path": str(path), "skipped": False, "losses": result.losses, "other_settings": []}
