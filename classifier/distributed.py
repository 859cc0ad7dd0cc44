"""Pattern classification across the workers of a Ray cluster (analysis.cluster).

Each worker loads the model and the CNN once; a job is one batch of the length-sorted order that the
one-process run uses (classifier.classify.head_class_counts), so every map is classified on the same padded
batch and the (layers, heads, classes) counts, summed in the driver, are identical to one process's.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from analysis.cluster import Cluster, Job, WorkerPool
from analysis.data import Example
from analysis.distributed import check_same_model, local_items, model_ref, padded_cost
from analysis.errors import AttnpatError
from analysis.models import load_model
from analysis.stream import Encoded, length_sorted_batches
from classifier.classify import head_class_counts
from classifier.predict import PatternClassifier, load_classifier


def load_classify_state(model: str, map_kind: str, classifier_path: str | None, bf16: bool):
    """A worker's state: (model bundle, pattern classifier)."""
    return load_model(model, map_kind=map_kind), load_classifier(classifier_path, bf16)


def classify_loader(bundle, classifier: PatternClassifier) -> functools.partial:
    """The picklable loader giving a worker the driver's model (with its map kind) and CNN."""
    return functools.partial(load_classify_state, model_ref(bundle), bundle.map_kind, classifier.path,
                             classifier.bf16)


def _identity(state) -> tuple[str, str]:
    bundle, classifier = state
    return bundle.revision, repr(sorted(classifier.metadata.items()))


def classify_pool(cluster: Cluster, bundle, classifier: PatternClassifier) -> WorkerPool:
    """The cluster's workers holding the driver's model and CNN (loaded now, once per worker), checked to be
    the same as the driver's."""
    pool = cluster.pool(classify_loader(bundle, classifier))
    identities = pool.each(_identity)
    check_same_model([revision for revision, _ in identities], bundle)
    if any(metadata != _identity((bundle, classifier))[1] for _, metadata in identities):
        raise AttnpatError(f"a Ray worker loaded another pattern classifier than {classifier.path or 'the default'}; "
                           "every node needs the same checkpoint")
    return pool


def batch_class_counts(state, items: list[Encoded], examples: list[Example], batch_size: int,
                       max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Job: (L, H, 5) class counts of one batch of examples, and (B, 5) each example's (stream order)."""
    bundle, classifier = state
    return head_class_counts(bundle, examples, classifier, batch_size=batch_size, max_length=max_length,
                             progress=False, encoded=items, per_example=True)


def distributed_class_counts(cluster: Cluster, bundle, examples: Sequence[Example], classifier: PatternClassifier,
                             *, encoded: Sequence[Encoded], batch_size: int = 32, max_length: int,
                             progress: bool = False, per_example: bool = False):
    """classifier.classify.head_class_counts with its batches spread over the workers: (L, H, 5) counts, and
    with ``per_example`` (E, 5) each example's counts in the same stream order."""
    pool = classify_pool(cluster, bundle, classifier)
    per_example = bundle.num_layers * bundle.num_heads
    jobs = []
    for b, items in enumerate(length_sorted_batches(encoded, batch_size)):
        numbered, own_examples = local_items(items, examples)
        jobs.append(Job(b, batch_class_counts, (numbered, own_examples, batch_size, max_length),
                        cost=padded_cost(items), size=len(items) * per_example))
    results = pool.run(jobs, progress="classify" if progress else False, unit="maps")
    counts = np.sum([results[b][0] for b in range(len(jobs))], axis=0)
    if per_example:
        return counts, np.concatenate([results[b][1] for b in range(len(jobs))])
    return counts
