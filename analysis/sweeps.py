"""Head and layer disabling sweeps (Kovaleva et al. Figures 8-9): a fast engine, the naive reference, resume.

A *variant* is one setting of the (L, H) keep mask (1 keeps a head, 0 disables it, see analysis.disable);
its first changed layer is its ``start``. The fast engine gives the same logits as the naive reference (one
full forward pass per variant, inputs padded to the maximum length, as the original research code did) but:

- the input hidden states of each layer are computed once per batch by the unchanged (baseline) model and
  reused: a variant starting at layer l runs only layers l..L-1 (a rolling cache holds one layer's inputs);
- the variants with the same start are stacked along the batch dimension and share one forward pass;
- batches are length-sorted and dynamically padded (analysis.stream.iter_batches).

Each variant's metric and per-example predictions are persisted atomically as soon as they are known (one JSON
per variant under runs/<model>/<task>/.sweep-<mode>-<unit>/), so a killed sweep resumes where it stopped.

Every change against the baseline carries a test (:func:`effect_statistics`): a paired bootstrap 95% interval over
the examples, a p-value of the metric's own change (accuracy: exact McNemar of per-example correctness; F1 and
Matthews correlation: a paired permutation test) and Holm's correction across the heads (and, separately, the
layers) of a sweep.

Shapes: ``N`` examples, ``B`` rows of a batch, ``T`` padded length, ``D`` hidden size, ``C`` logits,
``V`` stacked variants, ``L`` layers, ``H`` heads.
"""
from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from torch import nn

from analysis.disable import (
    MODES,
    check_mode,
    check_supported,
    encoder_layers,
    first_changed_layer,
    gated,
    head_gates,
    keep_mask,
    layer_container,
    layer_keep_mask,
    mask_gates,
    stacked_gates,
)
from analysis.errors import AttnpatError, check_choice
from analysis.figures import close, panel_heatmaps
from analysis.metrics import confusion_metric, metric_name, task_metric
from analysis.models import check_head_labels, holds_classification_head, load_model
from analysis.progress import progress_bar
from analysis.rundir import atomic_write_json, long_table, table_to_array
from analysis.stream import DEFAULT_MAX_LENGTH, Encoded, TokenBatch, collate, encode_examples, iter_batches
from analysis.uncertainty import (
    bootstrap_difference_interval,
    bootstrap_mean_interval,
    confusion_difference_interval,
    confusion_permutation_p,
    holm_adjust,
    mcnemar_exact,
)

BASELINE = "baseline"
UNITS = ("head", "layer")
TABLE_INPUTS = ".disable-inputs.json"  # beside the disabling tables: what each mode's rows were computed on
ALPHA = 0.05  # family-wise error rate of the Holm-corrected tests
# Metrics over class predictions, functions of the confusion counts, each with a test of its change; the others
# are correlations over scores (STS-B), where only the bootstrap interval is given.
CLASS_METRICS = ("accuracy", "f1", "matthews")
# Permutations of the F1 / Matthews test: its smallest p is 1 / (PERMUTATIONS + 1) = 5e-5, so a head can survive
# Holm's correction across up to 1,000 heads (BERT-large has 384: its first threshold is 0.05 / 384 = 1.3e-4)
PERMUTATIONS = 20_000
OnVariant = Callable[[str, torch.Tensor], None]


# ---------------------------------------------------------------- variants

@dataclass(frozen=True, eq=False)
class Variant:
    """A named keep mask (L, H); ``start`` is the first layer it changes (L when it changes nothing)."""

    name: str
    keep: np.ndarray

    @property
    def start(self) -> int:
        return first_changed_layer(self.keep)


def head_variants(num_layers: int, num_heads: int) -> list[Variant]:
    """One variant per head: 'head-<layer>-<head>' (0-indexed) with only that head disabled."""
    return [Variant(f"head-{layer}-{head}", keep_mask(num_layers, num_heads, [(layer, head)]))
            for layer in range(num_layers) for head in range(num_heads)]


def layer_variants(num_layers: int, num_heads: int) -> list[Variant]:
    """One variant per layer: 'layer-<layer>' with all its heads disabled."""
    return [Variant(f"layer-{layer}", layer_keep_mask(num_layers, num_heads, layer)) for layer in range(num_layers)]


def unit_variants(unit: str, num_layers: int, num_heads: int) -> list[Variant]:
    make = {"head": head_variants, "layer": layer_variants}[check_choice(unit, UNITS, "unit")]
    return make(num_layers, num_heads)


def recompute_share(variants: Sequence[Variant], num_layers: int) -> float:
    """Layer evaluations of the fast engine over those of the naive loop (baseline included in both).

    Naive: every variant and the baseline run all L layers. Fast: the baseline runs L layers once, each
    variant runs L - start layers. For single-head sweeps this tends to (L + 1) / (2L).
    """
    fast = num_layers + sum(num_layers - variant.start for variant in variants)
    naive = num_layers * (len(variants) + 1)
    return fast / naive


# ---------------------------------------------------------------- running part of the encoder

class _Captured(Exception):
    """Raised by a hook to stop a forward pass once the wanted hidden states are known."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("captured")
        self.hidden = hidden


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    """A layer's call arguments with its input hidden states replaced (positional first, as every encoder does)."""
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    for name in ("hidden_states", "x"):
        if name in kwargs:
            return args, {**kwargs, name: hidden}
    raise AttnpatError("cannot find the hidden states among an encoder layer's arguments")


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        return args[0]
    for name in ("hidden_states", "x"):
        if name in kwargs:
            return kwargs[name]
    raise AttnpatError("cannot find the hidden states among an encoder layer's arguments")


@contextmanager
def _layers_from(model: nn.Module, start: int) -> Iterator[None]:
    """Temporarily leave layers 0..start-1 out of the encoder, so a forward pass skips them."""
    if start == 0:
        yield
        return
    container = layer_container(model)
    full = container.layer
    container.layer = nn.ModuleList(list(full)[start:])
    try:
        yield
    finally:
        container.layer = full


def forward_from(model: nn.Module, inputs: dict, *, start: int = 0, hidden: torch.Tensor | None = None,
                 stop: int | None = None) -> torch.Tensor:
    """Run the model from the input of layer ``start``.

    inputs: model inputs (B, T) (the embeddings still run on them, cheaply, and the attention mask comes from
    them); hidden: (B, T, D) input hidden states of layer ``start`` (None only for start 0).
    Returns the logits (B, C), or with ``stop`` (start < stop <= L) the hidden states (B, T, D) that enter
    layer ``stop`` (for stop = L, that leave the last layer).
    """
    layers = encoder_layers(model)
    if not 0 <= start < len(layers):
        raise AttnpatError(f"start layer {start} is outside a model of {len(layers)} layers")
    if (hidden is None) != (start == 0):
        raise AttnpatError("hidden states are needed exactly when starting above layer 0")
    handles = []
    if start > 0:
        handles.append(layers[start].register_forward_pre_hook(
            lambda module, args, kwargs: _with_hidden(args, kwargs, hidden), with_kwargs=True))
    if stop is not None:
        if not start < stop <= len(layers):
            raise AttnpatError(f"stop layer {stop} must lie in ({start}, {len(layers)}]")
        if stop < len(layers):
            def capture_input(module, args, kwargs):
                raise _Captured(_hidden_of(args, kwargs))
            handles.append(layers[stop].register_forward_pre_hook(capture_input, with_kwargs=True))
        else:
            def capture_output(module, args, output):
                raise _Captured(output[0] if isinstance(output, tuple) else output)
            handles.append(layers[-1].register_forward_hook(capture_output))
    try:
        with _layers_from(model, start):
            outputs = model(**inputs)
    except _Captured as captured:
        return captured.hidden
    finally:
        for handle in handles:
            handle.remove()
    if stop is not None:
        raise AttnpatError("the forward pass ended before reaching the requested layer")
    return outputs.logits


def _repeat_rows(tensor: torch.Tensor, times: int) -> torch.Tensor:
    """(B, ...) -> (times * B, ...): variant-major stacking (rows v*B .. v*B+B-1 belong to variant v)."""
    return tensor.repeat(times, *([1] * (tensor.dim() - 1))) if times > 1 else tensor


# ---------------------------------------------------------------- the fast engine

def fast_sweep(bundle, batches: Sequence[TokenBatch], variants: Sequence[Variant], mode: str, *,
               skip: set[str] = frozenset(), include_baseline: bool = True, variants_per_pass: int | None = None,
               on_variant: OnVariant | None = None, progress: bool | str = False) -> dict[str, torch.Tensor]:
    """Logits (N, C) of every variant (and of the unchanged model, key 'baseline'), in example order.

    batches: the data as length-sorted, dynamically padded TokenBatch objects (analysis.stream.iter_batches);
    ``skip``: names already done (not computed); ``variants_per_pass``: how many variants with the same start
    share one forward pass (default: the number of heads); ``on_variant(name, logits)`` is called as soon as
    a variant's logits for the whole data are known (e.g. to persist them).
    """
    check_mode(mode)
    model, device = bundle.model, bundle.device
    num_layers = len(encoder_layers(model))
    batches = list(batches)
    if not batches:
        raise AttnpatError("no examples to sweep over")
    order = torch.tensor([index for batch in batches for index in batch.indices])
    inputs = [batch.model_inputs(device) for batch in batches]
    pending = [variant for variant in variants if variant.name not in skip]
    per_pass = max(1, variants_per_pass or int(model.config.num_attention_heads))
    chunks = _chunks_by_start(pending, per_pass)
    want_baseline = include_baseline and BASELINE not in skip
    results: dict[str, torch.Tensor] = {}

    def finish(name: str, pieces: list[torch.Tensor]) -> None:
        logits = torch.empty((len(order), pieces[0].shape[-1]), dtype=torch.float32)
        logits[order] = torch.cat(pieces).float().cpu()
        results[name] = logits
        if on_variant is not None:
            on_variant(name, logits)

    if not chunks and not want_baseline:
        return results
    bar = progress_bar(len(batches) * (len(chunks) + 1), progress, "sweep", unit="pass")
    cache_layer, cache = 0, [None] * len(batches)  # cache[b]: input hidden states of layer cache_layer
    unchanged = []  # variants that disable nothing equal the baseline
    with gated(model), torch.inference_mode():
        for start, chunk in chunks:
            if start >= num_layers:
                unchanged.extend(chunk)
                continue
            if start > cache_layer:
                cache = [forward_from(model, inputs[b], start=cache_layer, hidden=cache[b], stop=start)
                         for b in range(len(batches))]
                cache_layer = start
            keeps = np.stack([variant.keep for variant in chunk])
            pieces: list[list[torch.Tensor]] = [[] for _ in chunk]
            for b, batch_inputs in enumerate(inputs):
                rows = len(batches[b].items)
                stacked = {key: _repeat_rows(value, len(chunk)) for key, value in batch_inputs.items()}
                hidden = None if cache[b] is None else _repeat_rows(cache[b], len(chunk))
                with head_gates(model, stacked_gates(keeps, rows), mode):
                    logits = forward_from(model, stacked, start=start, hidden=hidden)
                for v in range(len(chunk)):
                    pieces[v].append(logits[v * rows:(v + 1) * rows])
                if bar is not None:
                    bar.update(1)
            for variant, variant_pieces in zip(chunk, pieces):
                finish(variant.name, variant_pieces)
        if want_baseline or unchanged:
            baseline = [forward_from(model, inputs[b], start=cache_layer, hidden=cache[b]) for b in range(len(batches))]
            if bar is not None:
                bar.update(len(batches))
            for variant in unchanged:
                finish(variant.name, baseline)
            if want_baseline:
                finish(BASELINE, baseline)
    if bar is not None:
        bar.close()
    return results


def _chunks_by_start(variants: Sequence[Variant], per_pass: int) -> list[tuple[int, list[Variant]]]:
    """Group variants by first changed layer (ascending), at most ``per_pass`` to a group."""
    by_start: dict[int, list[Variant]] = {}
    for variant in variants:
        by_start.setdefault(variant.start, []).append(variant)
    return [(start, group[i:i + per_pass]) for start, group in sorted(by_start.items())
            for i in range(0, len(group), per_pass)]


# ---------------------------------------------------------------- the naive reference

def padded_batches(bundle, encoded: Sequence[Encoded], *, width: int = DEFAULT_MAX_LENGTH,
                   batch_size: int = 32) -> list[TokenBatch]:
    """Batches in example order, every one padded to ``width`` tokens (what fixed-length research code does)."""
    pad_id = bundle.tokenizer.pad_token_id if bundle.tokenizer.pad_token_id is not None else 0
    batches = []
    for begin in range(0, len(encoded), batch_size):
        batch = collate(encoded[begin:begin + batch_size], pad_id)
        extra = width - batch.input_ids.shape[1]
        if extra > 0:
            pad = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value)  # noqa: E731, B023 (used in this iteration)
            batch.input_ids = pad(batch.input_ids, pad_id)
            batch.attention_mask = pad(batch.attention_mask, 0)
            if batch.token_type_ids is not None:
                batch.token_type_ids = pad(batch.token_type_ids, 0)
        batches.append(batch)
    return batches


def naive_sweep(bundle, encoded: Sequence[Encoded], variants: Sequence[Variant], mode: str, *,
                width: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                include_baseline: bool = True) -> dict[str, torch.Tensor]:
    """The reference: for each variant, one full forward pass over the data, batches of ``batch_size`` in
    example order padded to ``width`` tokens, the variant's heads gated. Returns {name: logits (N, C)}."""
    check_mode(mode)
    model, device = bundle.model, bundle.device
    batches = padded_batches(bundle, encoded, width=width, batch_size=batch_size)
    everything = ([Variant(BASELINE, keep_mask(bundle.num_layers, bundle.num_heads))] if include_baseline else [])
    results = {}
    with gated(model), torch.inference_mode():
        for variant in everything + list(variants):
            with head_gates(model, mask_gates(variant.keep), mode):
                logits = [model(**batch.model_inputs(device)).logits.float().cpu() for batch in batches]
            results[variant.name] = torch.cat(logits)
    return results


# ---------------------------------------------------------------- metrics and resumable sweeps

def predictions(logits: torch.Tensor) -> np.ndarray:
    """Class ids (argmax) or, for a single regression output, the scores. logits: (N, C) -> (N,)."""
    logits = logits.detach().float().cpu()
    return logits[:, 0].numpy() if logits.shape[-1] == 1 else logits.argmax(-1).numpy()


def task_labels(data) -> np.ndarray:
    """(N,) gold labels of a TaskData; a clear error when the task has none (e.g. wiki)."""
    labels = [example.label for example in data.examples]
    if not labels or any(label is None for label in labels):
        raise AttnpatError(f"task '{data.task}' has examples without labels; disabling and pruning need a labelled "
                           "task (sst2, mrpc, rte...)")
    return np.asarray(labels, dtype=float)


def _stored_json(path: Path):
    """A stored JSON value, or None when the file is damaged: the store recomputes what it cannot read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None


class SweepStore:
    """One small JSON per finished variant in ``folder``; results of another configuration are discarded.

    ``fingerprint``: what the results depend on (model revision, data, mode, lengths...); it is kept in
    folder/sweep.json and a mismatch clears the folder's variant files.
    """

    def __init__(self, folder: str | Path, fingerprint: dict):
        self.folder = Path(folder)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "sweep.json"
        stored = _stored_json(config) if config.is_file() else None  # a damaged one counts as another configuration
        self.discarded = 0
        if stored != self.fingerprint:
            for old in self.folder.glob("v-*.json"):
                old.unlink()
                self.discarded += 1
            atomic_write_json(config, self.fingerprint)

    def _path(self, name: str) -> Path:
        return self.folder / f"v-{name}.json"

    def results(self) -> dict[str, dict]:
        found = {}
        for path in sorted(self.folder.glob("v-*.json")):
            record = _stored_json(path)
            if isinstance(record, dict) and isinstance(record.get("variant"), str):
                found[record["variant"]] = record  # a damaged record (not written by save) is recomputed
        return found

    def save(self, name: str, record: dict) -> None:
        atomic_write_json(self._path(name), {"variant": name, **record})

    def predictions(self, names: Sequence[str]) -> np.ndarray:
        """(N, V) stored per-example predictions of the variants ``names`` (class ids or scores)."""
        found = self.results()
        missing = [name for name in names if "predictions" not in found.get(name, {})]
        if missing:
            raise AttnpatError(f"the sweep in {self.folder} has no predictions for {', '.join(missing[:3])}")
        return np.stack([np.asarray(found[name]["predictions"], dtype=float) for name in names], 1)


def run_sweep(bundle, data, variants: Sequence[Variant], mode: str, store: SweepStore, *,
              max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32, variants_per_pass: int | None = None,
              progress: bool | str = False, on_variant: Callable[[str, float], None] | None = None,
              cluster=None, encoded: Sequence[Encoded] | None = None) -> dict[str, float]:
    """Task metric of the baseline and every variant, resuming from ``store``. Returns {name: metric}.
    ``cluster`` (analysis.cluster.Cluster): the fast engine's groups of variants run on its workers;
    ``encoded``: the examples already encoded with ``max_length`` (default: encoded here).

    Each variant's per-example predictions are stored too (:meth:`SweepStore.predictions`); a stored result
    without them (an older sweep) is computed again. ``on_variant(name, metric)`` is called after each newly
    finished variant has been persisted.
    """
    labels = task_labels(data)
    metric = metric_name(data.metric or data.task)
    # a record of another example count (a store mixed by an older attnpat) is computed again, not stacked
    done = {name: record for name, record in store.results().items()
            if len(record.get("predictions", ())) == len(labels)}

    def persist(name: str, logits: torch.Tensor) -> None:
        predicted = predictions(logits)
        value = task_metric(metric, predicted, labels)
        store.save(name, {"metric": value, "metric_name": metric, "n": int(len(labels)),
                          "predictions": predicted.tolist()})
        done[name] = {"metric": value}
        if on_variant is not None:
            on_variant(name, value)

    if any(variant.name not in done for variant in variants) or BASELINE not in done:
        batches = list(iter_batches(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                    encoded=encoded))
        sweep = fast_sweep
        if cluster is not None:
            from analysis.distributed import distributed_sweep  # noqa: PLC0415 (it builds on this module)

            sweep = functools.partial(distributed_sweep, cluster)
        sweep(bundle, batches, variants, mode, skip=set(done), variants_per_pass=variants_per_pass,
              on_variant=persist, progress=progress)
    return {name: float(done[name]["metric"]) for name in [BASELINE] + [variant.name for variant in variants]}


def sweep_fingerprint(bundle, data, mode: str, unit: str, max_length: int) -> dict:
    """What a sweep's stored results depend on: the model, the settings and every example's text and label
    (the same data file read with another label or text column gives other results).

    The batch size is left out: it changes only how much padding each example gets, which moves the logits by
    float32 rounding (at most 3e-6 on a tiny model over batch sizes 1 to 24), so a stored prediction can differ
    only on a float-rounding tie between two classes; keeping it would make a rerun with another --batch-size
    start over for nothing."""
    return {"model": bundle.name, "revision": bundle.revision, "data": data.manifest(),
            "examples": data.examples_digest(), "mode": mode, "unit": unit, "max_length": max_length}


# ---------------------------------------------------------------- tables

def head_deltas(metrics: dict[str, float], num_layers: int, num_heads: int) -> np.ndarray:
    """(L, H) metric change with each single head disabled (from 'head-<l>-<h>' results)."""
    base = metrics[BASELINE]
    return np.array([[metrics[f"head-{layer}-{head}"] - base for head in range(num_heads)]
                     for layer in range(num_layers)])


def layer_deltas(metrics: dict[str, float], num_layers: int) -> np.ndarray:
    """(L,) metric change with each whole layer disabled."""
    return np.array([metrics[f"layer-{layer}"] - metrics[BASELINE] for layer in range(num_layers)])


def effect_statistics(baseline: np.ndarray, variants: np.ndarray, labels: np.ndarray, metric: str, *,
                      seed: int = 0, n_perm: int = PERMUTATIONS) -> dict[str, np.ndarray]:
    """How sure each variant's metric change is, on the same examples as the baseline.

    baseline: (N,) predictions of the unchanged model; variants: (N, V) predictions of each variant (class ids,
    or scores for a correlation metric); labels: (N,). Returns {name: (V,)}:
    - ci_low, ci_high: paired percentile bootstrap 95% interval of the change over the examples (accuracy: the
      mean of per-example correctness differences; F1 and Matthews: recomputed from each draw's confusion counts,
      analysis.uncertainty.confusion_difference_interval; correlations recomputed on every draw);
    - the raw p-value, named by its test (:func:`raw_p_column`): p_mcnemar, accuracy's exact two-sided McNemar
      test of per-example correctness; p_permutation, F1's or Matthews' paired permutation test of the metric's
      own change (``n_perm`` permutations, seed ``seed``; analysis.uncertainty.confusion_permutation_p); for score
      metrics p_mcnemar, all NaN (their predictions are never simply right, no test is made);
    - p_holm: the raw p with Holm's correction across the V variants (one family: the heads, or the layers).
    """
    metric = metric_name(metric)
    baseline, variants, labels = np.asarray(baseline), np.asarray(variants), np.asarray(labels)
    correct_base, correct = baseline == labels, variants == labels[:, None]
    if metric == "accuracy":  # McNemar is exact here, and it needs no permutations
        p = mcnemar_exact(correct_base, correct)
    elif metric in CLASS_METRICS:
        p = confusion_permutation_p(confusion_metric(metric), baseline, variants, labels, n_perm=n_perm, seed=seed)
    else:
        p = np.full(variants.shape[1], np.nan)
    p_holm = holm_adjust(p) if metric in CLASS_METRICS else p.copy()
    if metric == "accuracy":
        interval = bootstrap_mean_interval(correct.astype(float) - correct_base[:, None], seed=seed)
    elif metric in CLASS_METRICS:  # the same bounds as bootstrap_difference_interval's, vectorised
        interval = confusion_difference_interval(confusion_metric(metric), baseline, variants, labels, seed=seed)
    else:  # correlations are no function of confusion counts: recomputed draw by draw
        interval = bootstrap_difference_interval(lambda predicted, gold: task_metric(metric, predicted, gold),
                                                 baseline, variants, labels, seed=seed)
    return {"ci_low": interval[:, 0], "ci_high": interval[:, 1], raw_p_column(metric): p, "p_holm": p_holm}


def raw_p_column(metric: str) -> str:
    """The column of a disabling or pruning table holding the uncorrected p-value, named by its test: p_mcnemar
    for accuracy (and, empty, for score metrics, which get no test), p_permutation for F1 and Matthews."""
    name = metric_name(metric)
    return "p_permutation" if name in CLASS_METRICS and name != "accuracy" else "p_mcnemar"


def significance_note(metric: str) -> str:
    """What the tests behind a disabling table are (for the manifest)."""
    name = metric_name(metric)
    if name == "accuracy":
        test = "exact McNemar test of per-example correctness"
    elif name in CLASS_METRICS:
        test = (f"two-sided paired permutation test of the {metric} change (the two models' predictions swapped on "
                f"a random half of the examples, {PERMUTATIONS:,} times; smallest p {1 / (PERMUTATIONS + 1):.1g})")
    else:
        test = f"no McNemar test ({metric} scores are never simply right)"
    return (f"ci: paired percentile bootstrap 95% interval of the {metric} change over the examples; "
            f"{raw_p_column(metric)}: {test}; p_holm: Holm's correction across the heads of a sweep, and separately "
            f"across its layers; significant: p_holm < {ALPHA}")


def holm_criterion(metric: str, raw_column: str | None = None) -> str:
    """What a star in the disabling figures, and a 'survives Holm' line, stands for: on accuracy tasks McNemar's
    test; on F1 and Matthews tasks a permutation test of the change drawn beside it, which the words name.

    raw_column: the raw p column behind the stars' p_holm, as a table holds it (default :func:`raw_p_column`,
    what this version writes); p_mcnemar on an F1 or Matthews task is from a table written before the permutation
    test, whose stars McNemar's test of the accuracy change set, and the words say so."""
    criterion = f"Holm-adjusted p < {ALPHA}"
    name = metric_name(metric)
    if (raw_column or raw_p_column(metric)) == "p_permutation":
        return f"{metric} change, permutation test, {criterion}"
    old_f1_table = name in CLASS_METRICS and name != "accuracy"
    return f"accuracy change, McNemar test, {criterion}" if old_f1_table else criterion


def star_criteria(metric: str, raw_columns: dict[str, str | None]) -> dict[str, str]:
    """{mode: :func:`holm_criterion`} of each tested mode, from {mode: its raw p column in the table, None when it
    holds none}; a table merged from runs of two versions can hold p_mcnemar for one mode, p_permutation for
    another."""
    return {mode: holm_criterion(metric, column) for mode, column in raw_columns.items()}


def mode_star_texts(criteria: dict[str, str], modes: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """What a disabling figure says of its stars, from {tested mode: :func:`holm_criterion`}: the one criterion all
    tested modes share (None when none is tested, or they differ), and per mode of ``modes`` the line naming its
    own test where they differ ("\n*: <criterion>"; "" otherwise), for its panel title or legend entry."""
    shared = next(iter(criteria.values())) if len(set(criteria.values())) == 1 else None
    return shared, {mode: f"\n*: {criteria[mode]}" if mode in criteria and shared is None else "" for mode in modes}


def held_raw_p_column(values: dict[str, np.ndarray]) -> str | None:
    """p_permutation or p_mcnemar: the raw p column that holds a p-value among one mode's ``values`` ({column
    name: its values}; a name ending in the column, as zero_p_permutation), p_permutation first; None when
    neither does."""
    for column in ("p_permutation", "p_mcnemar"):
        if any(str(name).endswith(column) and not np.isnan(np.asarray(held, dtype=float)).all()
               for name, held in values.items()):
            return column
    return None


def significant_effects(names: Sequence[tuple[int, ...]], deltas: np.ndarray, stats: dict[str, np.ndarray],
                        alpha: float = ALPHA) -> list[dict]:
    """The variants whose change survives Holm's correction, strongest first.

    names: (layer,) or (layer, head) per variant (0-indexed); deltas: (V,) metric changes; stats: from
    :func:`effect_statistics`. Returns rows layer[, head], delta, ci_low, ci_high, the raw p (p_mcnemar or
    p_permutation, :func:`raw_p_column`), p_holm.
    """
    keys = ("layer", "head")
    rows = [{**dict(zip(keys, name)), "delta": float(deltas[v]), **{column: float(values[v])
                                                                     for column, values in stats.items()}}
            for v, name in enumerate(names) if stats["p_holm"][v] < alpha]
    return sorted(rows, key=lambda row: (row["p_holm"], -abs(row["delta"])))


def extreme_heads(deltas: np.ndarray, k: int = 5) -> dict[str, list[dict]]:
    """The k heads whose disabling helps most ('best') and hurts most ('worst'). deltas: (L, H).

    A NaN change (no metric without the head: e.g. a correlation of constant predictions, STS-B) ranks nowhere:
    NaN compares false with everything, so sorting it would scatter it among the ranks. Those heads are listed
    under 'unranked' (layer, head rows) so that the rankings can say what they leave out."""
    flat = [(float(deltas[layer, head]), layer, head) for layer in range(deltas.shape[0])
            for head in range(deltas.shape[1])]
    ranked = sorted((item for item in flat if not np.isnan(item[0])), key=lambda item: (-item[0], item[1], item[2]))
    as_rows = lambda items: [{"layer": layer, "head": head, "delta": delta} for delta, layer, head in items]  # noqa: E731
    return {"best": as_rows(ranked[:k]), "worst": as_rows(list(reversed(ranked[-k:]))),
            "unranked": [{"layer": layer, "head": head} for delta, layer, head in flat if np.isnan(delta)]}


def merge_mode_rows(old, new, column: str, keep_values: Sequence[str]):
    """Old long-table rows whose ``column`` is not in ``keep_values`` (other modes' results), plus ``new``."""
    if old is None or old.empty or column not in old.columns:
        return new
    return pd.concat([old[~old[column].isin(list(keep_values))], new], ignore_index=True)


def sweep_inputs(bundle, data, max_length: int) -> dict:
    """What a disabling table's rows were computed on (model, revision, every example, length limit), as
    recorded per unit in the mode's manifest entry: two modes' rows share a table only when these are equal."""
    inputs = {key: value for key, value in sweep_fingerprint(bundle, data, "", "", max_length).items()
              if key not in ("mode", "unit")}
    return json.loads(json.dumps(inputs, default=str))


def recorded_inputs(manifest: dict, mode: str) -> dict:
    """{unit: sweep_inputs} that ``mode``'s manifest entry records for its rows ({} for none, or for an entry
    written before they were recorded)."""
    entry = (manifest.get("analyses") or {}).get(f"disable_{mode}") or {}
    inputs = entry.get("inputs") if isinstance(entry, dict) else None
    return {unit: value for unit, value in inputs.items() if unit in UNITS} if isinstance(inputs, dict) else {}


def table_inputs(run) -> dict:
    """{mode: {unit: sweep_inputs}}: what each mode's rows in the disabling tables of ``run`` were computed on.
    Written beside the tables under the same lock, around each table write (:func:`record_table_inputs`: the
    writer's rows as unknown before, as made on its inputs after), so it describes the rows a merge reads even
    while another mode's run has not yet landed its manifest entry; for a
    mode with no record there (a folder from before it was kept), its manifest entry's ``inputs``. Read it under
    ``run.updating()``."""
    path = run.file(TABLE_INPUTS)
    try:
        stored = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        stored = {}  # unreadable (damaged by hand): as for a folder without it, the manifest entries say
    stored = stored if isinstance(stored, dict) else {}
    manifest = run.manifest()
    return {mode: stored[mode] if isinstance(stored.get(mode), dict) else recorded_inputs(manifest, mode)
            for mode in MODES}


def record_table_inputs(run, known: dict, mode: str, unit: str, inputs: dict | None,
                        dropped: Sequence[str]) -> None:
    """``mode``'s rows of ``unit`` were made on ``inputs`` (None: unknown, before they are written), and
    ``dropped`` modes have no rows of ``unit`` left. ``known``: :func:`table_inputs` as read for the merge (under
    the same lock)."""
    known = {other: dict(units) for other, units in known.items()}
    if inputs is None:
        known[mode].pop(unit, None)
    else:
        known[mode][unit] = inputs
    for other in dropped:
        known[other].pop(unit, None)
    atomic_write_json(run.file(TABLE_INPUTS), known)


def modes_made_otherwise(known: dict, mode: str, unit: str, inputs: dict) -> list[str]:
    """The other disabling modes whose rows of ``unit`` were computed on other :func:`sweep_inputs` than
    ``inputs`` (other data, another model revision or length limit, or not recorded), by ``known``
    (:func:`table_inputs`): they leave the tables."""
    return [other for other in MODES if other != mode and (known.get(other) or {}).get(unit) != inputs]


def modes_in(table, unit: str) -> set[str]:
    """The disabling modes with rows in ``table`` (a disable_heads or disable_layers frame, or None)."""
    if table is None or table.empty:
        return set()
    if unit == "head":
        return {mode for mode in MODES if table["metric"].str.startswith(f"{mode}_").any()}
    return set(table["mode"]) & set(MODES)


def without_modes(table, modes: Sequence[str], unit: str):
    """``table`` (a disable_heads or disable_layers frame, or None) without the rows of ``modes``."""
    if table is None or not modes:
        return table
    if unit == "head":
        return table[~table["metric"].str.startswith(tuple(f"{mode}_" for mode in modes))]
    return table[~table["mode"].isin(list(modes))]


# ---------------------------------------------------------------- figures

def head_delta_figure(table, *, metric: str, task: str, model: str):
    """Kovaleva Figure 8: layer x head heatmaps of metric changes (1-indexed axes), one panel per disabling mode.

    table: the long disable_heads rows (layer, head, metric, value) with ``<mode>_delta`` and ``<mode>_metric``
    per mode, optionally ``<mode>_p_holm``: heads whose change survives Holm's correction are outlined and starred;
    the title names the test (by each mode's ``<mode>_p_permutation`` or ``<mode>_p_mcnemar``), and when the modes'
    tests differ (rows of an older run kept beside newer ones) each panel's title names its own. Every panel
    shares one colour scale, symmetric around 0, so the modes compare by eye."""
    modes = sorted(name[:-len("_delta")] for name in table["metric"].unique() if name.endswith("_delta"))
    if not modes:
        raise AttnpatError("the disable_heads table has no <mode>_delta rows to draw")
    deltas = {mode: table_to_array(table, f"{mode}_delta") * 100 for mode in modes}
    baselines = {mode: float(np.nanmean(table_to_array(table, f"{mode}_metric") - deltas[mode] / 100))
                 for mode in modes}
    spread = max(float(np.nanmax(np.abs(values))) for values in deltas.values()) or 1.0
    p_holm = {mode: table_to_array(table, f"{mode}_p_holm") for mode in modes
              if f"{mode}_p_holm" in set(table["metric"])}
    tested = [mode for mode, values in p_holm.items() if not np.isnan(values).all()]  # score metrics: no test
    criteria = star_criteria(metric, {mode: held_raw_p_column(
        {name: rows["value"].to_numpy() for name, rows in table.groupby("metric") if name.startswith(f"{mode}_")})
        for mode in tested})
    shared, panel_test = mode_star_texts(criteria, modes)
    stars = (f"   (outlined *: {shared})" if shared
             else f"   (outlined *: Holm-adjusted p < {ALPHA}; the modes differ in test, each named above its panel)"
             if criteria else "")
    fig = panel_heatmaps({f"{mode} (baseline {baselines[mode]:.3f}){panel_test[mode]}": deltas[mode]
                          for mode in modes},
                         title=f"{model} on {task}: {metric} change (points) with one head disabled" + stars,
                         label=f"{metric} change x 100", cmap="RdBu", vmin=-spread, vmax=spread)
    for ax, mode in zip(fig.axes[:len(modes)], modes):  # the panels come first, their colorbars after
        if mode not in tested:
            continue
        for layer, head in zip(*np.nonzero(p_holm[mode] < ALPHA)):
            ax.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.6))
            ax.text(head, layer, "*", ha="center", va="center", fontsize=11, fontweight="bold")
    return fig


def layer_delta_figure(table, *, metric: str, baseline: dict[str, float], task: str, model: str):
    """Kovaleva Figure 9: bars of the metric change per disabled layer, one bar group per mode.

    table: rows of layer, mode, metric, delta [, ci_low, ci_high, p_holm]: with the interval, error bars; a star
    above the bars whose change survives Holm's correction (the title names the test only when a mode has one:
    score metrics such as STS-B's get intervals, no test; when the modes' tests differ, by their p_mcnemar or
    p_permutation values, each mode's legend entry names its own)."""
    modes = sorted(table["mode"].unique())
    tested = ([mode for mode in modes if table.loc[table["mode"] == mode, "p_holm"].notna().any()]
              if "p_holm" in table.columns else [])
    criteria = star_criteria(metric, {mode: held_raw_p_column(
        {name: table.loc[table["mode"] == mode, name].to_numpy() for name in table.columns}) for mode in tested})
    shared, legend_test = mode_star_texts(criteria, modes)
    layers = sorted(table["layer"].unique())
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(layers) + 2), 3.2))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rows = table[table["mode"] == mode].set_index("layer").reindex(layers)
        x = np.arange(len(layers)) + (i - (len(modes) - 1) / 2) * width
        ax.bar(x, rows["delta"] * 100, width,
               label=f"{mode} (baseline {baseline.get(mode, float('nan')):.3f}){legend_test[mode]}")
        if {"ci_low", "ci_high"} <= set(rows.columns) and rows["ci_low"].notna().all():
            ax.errorbar(x, rows["delta"] * 100, yerr=[(rows["delta"] - rows["ci_low"]) * 100,
                                                      (rows["ci_high"] - rows["delta"]) * 100],
                        fmt="none", ecolor="black", elinewidth=0.8, capsize=2)
        if "p_holm" in rows.columns:
            for xpos, high, p in zip(x, rows[["delta", "ci_high"]].max(axis=1) * 100, rows["p_holm"]):
                if p < ALPHA:
                    ax.text(xpos, max(high, 0), "*", ha="center", va="bottom", fontsize=11, fontweight="bold")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xticks(range(len(layers)), [str(layer + 1) for layer in layers])
    ax.set_xlabel("disabled layer (1-indexed)")
    ax.set_ylabel(f"{metric} change x 100")
    tests = (f"; *: {shared}" if shared
             else f"; *: Holm-adjusted p < {ALPHA}, each mode's test in the legend" if criteria else "")
    # two lines: the test named in full does not fit beside the model and task in a figure of 6 layers
    ax.set_title(f"{model} on {task}: whole layer disabled\n(95% bootstrap intervals{tests})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- the `disable` analysis

def seeded_classifier(name: str, num_labels: int, device=None, label_names: Sequence[str] | None = None):
    """The model as a sequence classifier with ``num_labels`` outputs. A head that the checkpoint lacks is
    initialised after torch.manual_seed(0), so reruns, resumed sweeps and benchmarks see the same head.
    ``label_names``: the data's class of id 0, 1, ..., checked against a trained head's own names."""
    check_head_labels(name, num_labels, label_names=label_names)
    torch.manual_seed(0)
    return load_model(name, kind="classifier", num_labels=num_labels, device=device)


def classifier_head_note(bundle, task: str | None = None) -> str | None:
    """A warning when the classification head may be untrained (metric values then mean nothing) or was
    trained on another task than the one evaluated."""
    if bundle.source.kind == "embedded":
        return (f"model '{bundle.name}' has no fine-tuned classification head: the head is random (seeded), so "
                "metric values only test the machinery; fine-tune it first (attnpat finetune)")
    if not holds_classification_head(bundle.config):
        # the loader knows: a checkpoint of a base or masked-LM model gets a freshly made head
        held = ", ".join(bundle.config.architectures or []) or "no named architecture"
        return (f"model '{bundle.name}' has no classification head in its checkpoint ({held}): the head is random "
                "(seeded), so metric values only test the machinery; fine-tune it first (attnpat finetune)")
    trained_on = bundle.meta.get("task")
    if not trained_on:
        return (f"model '{bundle.name}' has no attnpat fine-tuning record: its classification head is the "
                f"checkpoint's, trained on a task attnpat cannot check{f' (is it {task}?)' if task else ''}")
    if task is not None and trained_on != task:
        return f"model '{bundle.name}' was fine-tuned on {trained_on}, not on {task}"
    return None


def disable_analysis(bundle, data, run, *, mode: str, units: Sequence[str], max_length: int = DEFAULT_MAX_LENGTH,
                     batch_size: int = 32, progress: bool = False,
                     on_variant: Callable[[str, float], None] | None = None, cluster=None) -> dict:
    """Sweep single heads and/or whole layers with ``mode`` disabling; write disable_heads / disable_layers
    tables and figures into ``run`` and record the run (manifest entry disable_<mode>). Returns a summary
    (baseline, metric name, best/worst heads and layer deltas with their 95% intervals, the model note).
    ``cluster``: see :func:`run_sweep` (recorded in the manifest)."""
    check_mode(mode)
    # inputs the sweeps would refuse are refused here, before the record and the sweep stores touch the run folder
    check_supported(bundle.model, "disable")
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)
    units = list(units)
    current = sweep_inputs(bundle, data, max_length)
    with run.record(f"disable_{mode}", bundle, data, mode=mode, units=units, max_length=max_length,
                    model_note=classifier_head_note(bundle, data.task)) as entry:
        # per unit: this mode's rows of a unit not run now stay in the tables, with what they were computed on
        # (read once this mode's lock is held: no other run of it can change them now)
        with run.updating():
            entry["inputs"] = {**table_inputs(run)[mode], **{unit: current for unit in units}}
        if cluster is not None:
            entry["cluster"] = cluster.manifest()
        entry["n_truncated"] = sum(item.truncated for item in encoded)
        summary = _disable_sweeps(bundle, data, run, mode=mode, units=units, max_length=max_length,
                                  batch_size=batch_size, progress=progress, on_variant=on_variant, cluster=cluster,
                                  inputs=current, encoded=encoded)
        entry.update({key: summary[key] for key in ("baseline", "metric_name", "outputs", "best", "worst",
                                                    "unranked", "layer_deltas", "layer_intervals", "significant",
                                                    "tests",
                                                    "dropped_modes")
                      if key in summary})
    return summary


def _disable_sweeps(bundle, data, run, *, mode: str, units: Sequence[str], max_length: int, batch_size: int,
                    progress: bool, on_variant: Callable[[str, float], None] | None, cluster=None,
                    inputs: dict, encoded: Sequence[Encoded] | None = None) -> dict:
    """The sweeps of :func:`disable_analysis`; ``inputs``: this run's :func:`sweep_inputs`; ``encoded``: the
    examples encoded with ``max_length``."""
    check_mode(mode)
    labels = task_labels(data)  # fail before any work when the task has no labels
    metric = metric_name(data.metric or data.task)
    L, H = bundle.num_layers, bundle.num_heads
    summary: dict = {"metric_name": metric, "mode": mode, "outputs": [],
                     "model_note": classifier_head_note(bundle, data.task), "tests": significance_note(metric),
                     "significant": {}}
    @contextmanager
    def merging(stem: str, unit: str):
        """Under the run folder's lock: yields the table's rows that stay (other modes' rows of ``unit`` computed
        on the same inputs, judged by what the folder says now, not when this run started: another mode may
        have landed meanwhile); after the block has written the table, records what its rows were made on."""
        with run.updating():
            old, known = _read_optional(run, stem), table_inputs(run)
            dropped = sorted(modes_in(old, unit) & set(modes_made_otherwise(known, mode, unit, inputs)))
            if dropped:
                summary.setdefault("dropped_modes", {})[unit] = dropped
            # first: this mode's rows of the unit count as made on unknown inputs, so that a run stopped after
            # the table is written (while its figure is drawn) leaves rows that other modes drop, never keep
            record_table_inputs(run, known, mode, unit, None, dropped)
            yield without_modes(old, dropped, unit)
            record_table_inputs(run, known, mode, unit, inputs, dropped)
        if str(run.file(TABLE_INPUTS)) not in summary["outputs"]:  # one record for both units
            summary["outputs"].append(str(run.file(TABLE_INPUTS)))

    for unit in units:
        variants = unit_variants(unit, L, H)
        store = SweepStore(run.file(f".sweep-{mode}-{unit}"), sweep_fingerprint(bundle, data, mode, unit, max_length))
        started = time.time()
        metrics = run_sweep(bundle, data, variants, mode, store, max_length=max_length, batch_size=batch_size,
                            progress=f"disable {unit}s ({mode})" if progress else False, on_variant=on_variant,
                            cluster=cluster, encoded=encoded)
        summary[f"{unit}_seconds"] = round(time.time() - started, 2)
        summary["baseline"] = metrics[BASELINE]
        summary["recompute_share_" + unit] = round(recompute_share(variants, L), 4)
        predicted = store.predictions([BASELINE] + [variant.name for variant in variants])
        stats = effect_statistics(predicted[:, 0], predicted[:, 1:], labels, metric)
        if unit == "head":
            deltas = head_deltas(metrics, L, H)
            absolute = deltas + metrics[BASELINE]
            columns = {f"{mode}_delta": deltas, f"{mode}_metric": absolute,
                       **{f"{mode}_{'delta_' if name.startswith('ci') else ''}{name}": values.reshape(L, H)
                          for name, values in stats.items()}}
            with merging("disable_heads", unit) as kept:  # the figure too: it draws every mode's rows
                table = merge_mode_rows(kept, long_table(columns), "metric", list(columns))
                run.write_table("disable_heads", table, merged=True)
                fig = head_delta_figure(table, metric=metric, task=data.task, model=bundle.name)
                summary["outputs"] += [str(p) for p in run.write_figure("disable_heads", fig, merged=True)]
                close(fig)
            summary.update(extreme_heads(deltas))
            for row in summary["best"] + summary["worst"]:  # a reported change carries its interval
                index = row["layer"] * H + row["head"]
                row.update(ci_low=float(stats["ci_low"][index]), ci_high=float(stats["ci_high"][index]))
            summary["significant"]["heads"] = significant_effects(
                [(layer, head) for layer in range(L) for head in range(H)], deltas.ravel(), stats)
            summary["outputs"].append(str(run.file("disable_heads.csv")))
        else:
            deltas = layer_deltas(metrics, L)
            new = pd.DataFrame({"layer": np.arange(L), "mode": mode, "metric": deltas + metrics[BASELINE],
                                "delta": deltas, **stats})
            summary["significant"]["layers"] = significant_effects([(layer,) for layer in range(L)], deltas, stats)
            with merging("disable_layers", unit) as kept:  # the figure too: it draws every mode's rows
                table = merge_mode_rows(kept, new, "mode", [mode])
                run.write_table("disable_layers", table, merged=True)
                baselines = {m: float((rows["metric"] - rows["delta"]).iloc[0]) for m, rows in table.groupby("mode")}
                fig = layer_delta_figure(table, metric=metric, baseline=baselines, task=data.task, model=bundle.name)
                summary["outputs"] += [str(p) for p in run.write_figure("disable_layers", fig, merged=True)]
                close(fig)
            summary["layer_deltas"] = [float(d) for d in deltas]
            summary["layer_intervals"] = [[float(low), float(high)]
                                          for low, high in zip(stats["ci_low"], stats["ci_high"])]
            summary["outputs"].append(str(run.file("disable_layers.csv")))
    if metric not in CLASS_METRICS:
        del summary["significant"]  # score metrics get intervals only: no test, so no list of survivors
    return summary


def _read_optional(run, name: str):
    path = run.file(f"{name}.csv")
    return pd.read_csv(path) if path.is_file() else None


def _effect_text(row, name: str) -> str:
    return (f"{name} {row['delta']:+.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}], "
            f"p_holm {row['p_holm']:.2g}")


def _tested_change(folder: Path, mode: str, raw_column: str) -> str:
    """The words naming the test behind a mode's p_holm, by the table's raw p column: '' for p_mcnemar on an accuracy
    task; for p_permutation that it is a permutation test of the metric's change; for p_mcnemar on an F1 or Matthews
    task (tables written before the permutation test; the metric from ``mode``'s manifest entry in ``folder``)
    that McNemar tested the accuracy change. An unreadable manifest leaves the metric unnamed or, for p_mcnemar,
    says nothing."""
    try:
        entry = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["analyses"][f"disable_{mode}"]
        metric = metric_name(str(entry["metric_name"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttnpatError):
        metric = None
    if raw_column == "p_permutation":
        return f"; permutation test of the {metric or 'metric'} change"
    return "" if metric in (None, "accuracy") or metric not in CLASS_METRICS else \
        f"; McNemar tests the accuracy change, the {metric} change is shown"


def _raw_p_of(rows: pd.DataFrame) -> str:
    """p_permutation when a mode's rows (a wide table) hold that test's p-values, else p_mcnemar."""
    held = [column for column in rows.columns if str(column).endswith("p_permutation")]
    return "p_permutation" if held and rows[held].notna().to_numpy().any() else "p_mcnemar"


def significance_lines(folder: str | Path, alpha: float = ALPHA) -> list[str]:
    """One line per mode and unit of a run folder's disabling tables: the heads and layers whose change survives
    Holm's correction (layers and heads 1-indexed, change with its 95% interval), or that none does; for an F1 or
    Matthews task the line names the test (:func:`_tested_change`: a permutation test of that metric's change, or
    in tables written before it, McNemar's of the accuracy change).
    Tables written before the tests existed give no line."""
    folder = Path(folder)
    lines = []
    heads_path, layers_path = folder / "disable_heads.csv", folder / "disable_layers.csv"
    if heads_path.is_file():
        heads = pd.read_csv(heads_path)
        for mode in sorted(m[:-len("_p_holm")] for m in heads["metric"].unique() if m.endswith("_p_holm")):
            wide = heads[heads["metric"].str.startswith(f"{mode}_")].pivot_table(
                index=["layer", "head"], columns="metric", values="value").reset_index()
            wide = wide.rename(columns={f"{mode}_{name}": short for name, short in (
                ("delta", "delta"), ("delta_ci_low", "ci_low"), ("delta_ci_high", "ci_high"), ("p_holm", "p_holm"))})
            if "p_holm" not in wide or wide["p_holm"].isna().all():  # a score metric (STS-B): intervals, no test
                continue
            kept = wide[wide["p_holm"] < alpha].sort_values(["p_holm", "layer", "head"])
            found = "; ".join(_effect_text(row, f"L{int(row['layer']) + 1}-H{int(row['head']) + 1}")
                              for _, row in kept.iterrows())
            lines.append(f"{mode}, single heads ({len(kept)} of {len(wide)} survive Holm, p < {alpha}"
                         f"{_tested_change(folder, mode, _raw_p_of(wide))}): "
                         + (found or "none"))
    if layers_path.is_file():
        layers = pd.read_csv(layers_path)
        if "p_holm" in layers.columns:
            for mode, rows in layers.dropna(subset=["p_holm"]).groupby("mode"):
                kept = rows[rows["p_holm"] < alpha].sort_values(["p_holm", "layer"])
                found = "; ".join(_effect_text(row, f"layer {int(row['layer']) + 1}") for _, row in kept.iterrows())
                lines.append(f"{mode}, whole layers ({len(kept)} of {len(rows)} survive Holm, p < {alpha}"
                             f"{_tested_change(folder, mode, _raw_p_of(rows))}): "
                             + (found or "none"))
    return lines
