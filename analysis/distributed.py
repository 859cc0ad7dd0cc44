"""The analyses cut into jobs for the workers of analysis.cluster, and their results merged as one process
computes them.

- extract: one job per shard file (the length-sorted groups of analysis.extract). A worker computes and
  compresses its shard, the driver writes it, so the run folder needs no file system shared with the workers;
  the shards already written are the resume state.
- disabling sweeps: one job per group of variants that share their first changed layer, the very groups the
  fast engine (analysis.sweeps.fast_sweep) stacks into one forward pass; each worker runs the fast engine on
  its group, and the driver hands every variant's logits to the caller as the one-process sweep does (the
  ``disable`` verb persists them in its .sweep-* folder, its resume state).
- importance: one job per run of batches; workers return each example's gradients, and the driver hands each run
  to the caller (to keep it) as soon as its job comes back.

A job's batches are the one-process run's batches, so results are equal to it (counts identical, logits equal
up to float rounding). Every worker loads the driver's model once (:func:`model_loader`) and must hold the
same revision.
"""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from analysis.cluster import Cluster, Job, WorkerPool
from analysis.data import Example
from analysis.disable import check_mode
from analysis.errors import AttnpatError
from analysis.importance import example_importance
from analysis.mapstore import SavedMap, write_shard
from analysis.models import load_model
from analysis.rundir import atomic_write
from analysis.stream import Encoded, TokenBatch, stream_maps
from analysis.sweeps import BASELINE, OnVariant, Variant, _chunks_by_start, fast_sweep, seeded_classifier

JOBS_PER_WORKER = 4  # importance: batches are cut into about this many jobs per worker, for balance


# ---------------------------------------------------------------- the driver's model on every worker

def model_ref(bundle) -> str:
    """The name a worker loads the driver's model by: the absolute folder of a local or model-store model, else
    its name (an embedded alias or a hub id, resolved on the worker's node)."""
    return bundle.source.path if bundle.source.kind in {"local", "store"} else bundle.name


def model_loader(bundle, kind: str = "base") -> functools.partial:
    """A picklable loader giving a worker the driver's model: ``kind`` base (with the bundle's map kind) or
    classifier (the sweeps' seeded classification head, same size)."""
    if kind == "classifier":
        return functools.partial(seeded_classifier, model_ref(bundle), int(bundle.config.num_labels))
    return functools.partial(load_model, model_ref(bundle), kind=kind, map_kind=bundle.map_kind)


def _revision(bundle) -> str:
    return bundle.revision


def check_same_model(revisions: Sequence[str], bundle) -> None:
    """Every worker must hold the driver's model revision (a node with other files would give other results)."""
    other = sorted({revision for revision in revisions if revision != bundle.revision})
    if other:
        raise AttnpatError(f"a Ray worker loaded model '{bundle.name}' at revision {other[0]}, not the driver's "
                           f"{bundle.revision}; every node needs the same model files")


def worker_pool(cluster: Cluster, bundle, kind: str = "base") -> WorkerPool:
    """The cluster's workers holding ``bundle``'s model (started on first use, then reused)."""
    pool = cluster.pool(model_loader(bundle, kind))
    check_same_model(pool.each(_revision), bundle)
    return pool


def local_items(items: Sequence[Encoded], examples: Sequence[Example]) -> tuple[list[Encoded], list[Example]]:
    """A shard's examples numbered 0..k-1 in their length-sorted order (which renumbering keeps), with their
    Example objects, so a job carries only its own examples."""
    return [replace(item, index=i) for i, item in enumerate(items)], [examples[item.index] for item in items]


def padded_cost(items: Sequence[Encoded]) -> float:
    """Expected work of a batch of examples: rows times the padded length squared (attention's cost)."""
    return float(len(items) * max(len(item) for item in items) ** 2)


# ---------------------------------------------------------------- extract

def shard_bytes(bundle, items: list[Encoded], examples: list[Example], model_slug: str, task: str,
                batch_size: int, max_length: int) -> bytes:
    """Job: one shard's maps (every head of every example, length-sorted) as the bytes of its map file."""
    saved = []
    for map_batch in stream_maps(bundle, examples, max_length=max_length, batch_size=batch_size, encoded=items):
        for i, item in enumerate(map_batch.batch.items):
            types = item.token_type_ids if item.token_type_ids is not None else [0] * len(item)
            saved.append(SavedMap(item.example_id, map_batch.example_maps(i).numpy(), item.tokens, np.asarray(types),
                                  model_slug, task))
    with tempfile.TemporaryDirectory() as folder:
        return write_shard(Path(folder) / "shard.npz", saved, bundle.revision).read_bytes()


def extract_shards(cluster: Cluster, bundle, data, shards: dict[Path, Sequence[Encoded]], *, batch_size: int,
                   max_length: int, progress: bool = False) -> None:
    """Compute ``shards`` ({file: its examples, length-sorted}) on the workers; each file is written
    (atomically) as soon as its job is done, so a killed run resumes from the files written."""
    pool = worker_pool(cluster, bundle)
    jobs = []
    for path, items in shards.items():
        numbered, examples = local_items(items, data.examples)
        jobs.append(Job(str(path), shard_bytes, (numbered, examples, bundle.slug, data.task, batch_size, max_length),
                        cost=padded_cost(items), size=len(items)))

    def write(path: str, content: bytes) -> None:
        atomic_write(path, lambda tmp: tmp.write_bytes(content))

    pool.run(jobs, progress="extract" if progress else False, unit="ex", on_result=write)


# ---------------------------------------------------------------- disabling sweeps

def sweep_group(bundle, batches: list[TokenBatch], variants: list[Variant], mode: str, include_baseline: bool,
                per_pass: int) -> dict[str, torch.Tensor]:
    """Job: the fast engine on one group of variants; {name: logits (N, C)}."""
    return fast_sweep(bundle, batches, variants, mode, include_baseline=include_baseline, variants_per_pass=per_pass)


def groups_for_workers(variants: Sequence[Variant], per_pass: int, workers: int) -> int:
    """Variants per group: the fast engine's (``per_pass``, one layer's heads), halved while there are fewer
    groups than two per worker, so that a large cluster has work for every worker (each extra group recomputes
    the layers below its start once)."""
    per_pass = max(1, per_pass)
    while per_pass > 1 and len(_chunks_by_start(variants, per_pass)) < 2 * workers:
        per_pass = (per_pass + 1) // 2
    return per_pass


def sweep_jobs(variants: Sequence[Variant], mode: str, num_layers: int, per_pass: int, baseline: bool,
               batches_ref) -> list[Job]:
    """One job per group of the fast engine (same first changed layer, at most ``per_pass`` variants); the
    baseline rides with the group that starts highest, whose cached layers it reuses."""
    groups = _chunks_by_start(variants, per_pass)
    if not groups:
        return [Job(BASELINE, sweep_group, (batches_ref, [], mode, True, per_pass), cost=num_layers, size=1)] \
            if baseline else []
    highest = max(range(len(groups)), key=lambda g: groups[g][0])
    jobs = []
    for g, (start, group) in enumerate(groups):
        with_baseline = baseline and g == highest
        layers_run = min(start, num_layers) + len(group) * max(num_layers - start, 0)
        jobs.append(Job(g, sweep_group, (batches_ref, list(group), mode, with_baseline, per_pass),
                        cost=layers_run + (num_layers - min(start, num_layers) if with_baseline else 0),
                        size=len(group) + int(with_baseline)))
    return jobs


def distributed_sweep(cluster: Cluster, bundle, batches: Sequence[TokenBatch], variants: Sequence[Variant],
                      mode: str, *, skip: set[str] = frozenset(), include_baseline: bool = True,
                      variants_per_pass: int | None = None, on_variant: OnVariant | None = None,
                      progress: bool | str = False) -> dict[str, torch.Tensor]:
    """analysis.sweeps.fast_sweep with its groups of variants spread over the cluster's workers; same
    arguments, same results. ``on_variant(name, logits)`` runs in the driver as each group comes back."""
    check_mode(mode)
    batches = list(batches)
    if not batches:
        raise AttnpatError("no examples to sweep over")
    pool = worker_pool(cluster, bundle, "classifier")
    pending = [variant for variant in variants if variant.name not in skip]
    per_pass = variants_per_pass or groups_for_workers(pending, bundle.num_heads, len(pool.actors))
    jobs = sweep_jobs(pending, mode, bundle.num_layers, per_pass, include_baseline and BASELINE not in skip,
                      cluster.put(batches))
    results: dict[str, torch.Tensor] = {}

    def merge(key, logits: dict[str, torch.Tensor]) -> None:
        for name, values in logits.items():
            results[name] = values
            if on_variant is not None:
                on_variant(name, values)

    pool.run(jobs, progress=progress if isinstance(progress, str) else ("sweep" if progress else False),
             unit="variants", on_result=merge)
    return results


# ---------------------------------------------------------------- head importance

def importance_parts(bundle, batches: list[TokenBatch], keep: np.ndarray | None) -> np.ndarray:
    """Job: |dL/d gate| of each of the batches' examples (n, L, H)."""
    return example_importance(bundle, batches, keep=keep)


def distributed_importance(cluster: Cluster, bundle, batches: Sequence[TokenBatch], *,
                           keep: np.ndarray | None = None, progress: bool | str = False,
                           per_example: bool = False,
                           on_batch: Callable[[int, np.ndarray], None] | None = None) -> np.ndarray:
    """analysis.importance.head_importance with runs of batches spread over the workers: (L, H); with
    ``per_example``, analysis.importance.example_importance's (N, L, H) instead, in the batches' order.
    ``on_batch(position, gradients (B, L, H))`` is called in the driver for each batch of a run as soon as that
    run's job comes back (to persist it), so a run stopped, or ended by a lost worker, keeps what came back."""
    batches = list(batches)
    if not batches:
        raise AttnpatError("no examples to compute head importance on")
    pool = worker_pool(cluster, bundle, "classifier")
    parts = min(len(batches), JOBS_PER_WORKER * len(pool.actors))
    edges = np.linspace(0, len(batches), parts + 1).round().astype(int)
    jobs = []
    for part in range(parts):
        run = batches[edges[part]:edges[part + 1]]
        jobs.append(Job(part, importance_parts, (run, keep),
                        cost=sum(padded_cost(batch.items) for batch in run), size=sum(len(b.items) for b in run)))

    def returned(part: int, gradients: np.ndarray) -> np.ndarray:
        """A run's gradients (n, L, H), handed to ``on_batch`` batch by batch."""
        if on_batch is not None:
            rows = np.cumsum([0] + [len(batch.items) for batch in batches[edges[part]:edges[part + 1]]])
            for offset in range(len(rows) - 1):
                on_batch(int(edges[part]) + offset, gradients[rows[offset]:rows[offset + 1]])
        return gradients

    found = pool.run(jobs, progress=progress if isinstance(progress, str) else ("importance" if progress else False),
                     unit="ex", on_result=returned)
    gradients = np.concatenate([found[part] for part in range(parts)])
    return gradients if per_example else gradients.mean(0)
