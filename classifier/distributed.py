"""Pattern classification across the workers of a Ray cluster (analysis.cluster).

Each worker loads the model and the CNN once; a job is one batch of the length-sorted order that the
one-process run uses (classifier.classify.head_class_counts), so every map is classified on the same padded
batch and the (layers, heads, classes) counts, summed in the driver, are identical to one process's. Over
several tasks (``classify --task all``) the workers classify the next task while the driver writes the current
one's tables and figures (:class:`TasksAhead`).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from analysis.cluster import Cluster, Job, WorkerPool
from analysis.data import Example, TaskData
from analysis.distributed import check_same_model, local_items, model_ref, padded_cost
from analysis.errors import AttnpatError
from analysis.models import load_model
from analysis.stream import Encoded, encode_examples, length_sorted_batches
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
                             progress: bool = False, per_example: bool = False, stop: threading.Event | None = None):
    """classifier.classify.head_class_counts with its batches spread over the workers: (L, H, 5) counts, and
    with ``per_example`` (E, 5) each example's counts in the same stream order. ``stop``: once set, the run
    ends with an AttnpatError at the next batch that comes back."""
    pool = classify_pool(cluster, bundle, classifier)
    results = pool.run(class_count_jobs(bundle, examples, encoded, batch_size, max_length),
                       progress="classify" if progress else False, unit="maps",
                       on_result=None if stop is None else functools.partial(_unless_stopped, stop))
    return merged_counts(results, per_example)


def class_count_jobs(bundle, examples: Sequence[Example], encoded: Sequence[Encoded], batch_size: int,
                     max_length: int) -> list[Job]:
    """One job per batch of the one-process run's length-sorted order, keyed by its number in that order."""
    maps_per_example = bundle.num_layers * bundle.num_heads
    jobs = []
    for b, items in enumerate(length_sorted_batches(encoded, batch_size)):
        numbered, own_examples = local_items(items, examples)
        jobs.append(Job(b, batch_class_counts, (numbered, own_examples, batch_size, max_length),
                        cost=padded_cost(items), size=len(items) * maps_per_example))
    return jobs


def merged_counts(results: dict, per_example: bool):
    """The (L, H, 5) sum of :func:`batch_class_counts` results keyed by batch number, and with ``per_example``
    the (E, 5) per-example counts concatenated in batch order (the stream order)."""
    order = sorted(results)
    counts = np.sum([results[b][0] for b in order], axis=0)
    if per_example:
        return counts, np.concatenate([results[b][1] for b in order])
    return counts


def _unless_stopped(stop: threading.Event, _key, result):
    if stop.is_set():
        raise AttnpatError("classification stopped")
    return result


class TasksAhead:
    """Counts for classifier.classify.classify_task over several tasks, classified ahead on the cluster.

    ``datas``: the tasks, in the order the driver classifies them. From the first count asked for
    (:meth:`count`), one thread of this process runs every task's batches through one queue of the workers
    (analysis.cluster.WorkerPool.run_groups): a task's batches are handed out once the task before it has no
    batch left to hand out, so no worker idles while another finishes a task's last batch, and the workers keep
    classifying while the driver writes a task's tables and figures. A task's counts come back when all its
    batches are in, in task order, equal to one process's (:func:`merged_counts` of the same batches); its
    progress bar opens when the task before it is complete and counts across all workers. The next task is
    encoded, once for the driver and the cluster (:meth:`encoded`), when it is needed. A task's error (from its
    batches or its encoding) is raised when that task's counts are asked for; leaving the block with an error
    stops the cluster at its next batch.
    """

    def __init__(self, cluster: Cluster, bundle, classifier: PatternClassifier, datas: Sequence[TaskData], *,
                 batch_size: int, max_length: int, progress: bool = False):
        self.cluster, self.bundle, self.classifier, self.datas = cluster, bundle, classifier, list(datas)
        self.batch_size, self.max_length, self.progress = batch_size, max_length, progress
        self._encoded: dict[int, list[Encoded]] = {}
        self._encoding = threading.Lock()  # the driver and the thread both encode tasks
        self._results = [Future() for _ in self.datas]  # per task: {batch number: batch_class_counts result}
        self._stop = threading.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="classify-ahead")
        self._started = False

    def __enter__(self) -> TasksAhead:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if error is not None:
            self._stop.set()
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _index(self, examples: Sequence[Example]) -> int:
        return next(k for k, data in enumerate(self.datas) if data.examples is examples)

    def _encode(self, k: int) -> list[Encoded]:
        with self._encoding:
            if k not in self._encoded:
                self._encoded[k] = encode_examples(self.bundle.tokenizer, self.datas[k].examples, self.max_length)
            return self._encoded[k]

    def encoded(self, data: TaskData) -> list[Encoded]:
        """The task's examples encoded (analysis.stream.encode_examples), encoded once for the driver and the
        cluster."""
        return self._encode(self._index(data.examples))

    def _jobs(self):
        """Each task's batch jobs, built when the pool takes them (a task without examples has none)."""
        for k, data in enumerate(self.datas):
            yield class_count_jobs(self.bundle, data.examples, self._encode(k), self.batch_size,
                                   self.max_length) if data.examples else []

    def _classify(self) -> None:
        """In the thread: every task's batches on the cluster, each task's results handed over when complete."""
        done = 0
        try:
            pool = classify_pool(self.cluster, self.bundle, self.classifier)
            for results in pool.run_groups(self._jobs(), progress="classify" if self.progress else False,
                                           unit="maps", on_result=functools.partial(_unless_stopped, self._stop)):
                self._results[done].set_result(results)
                done += 1
        except BaseException as error:  # the next task's (and so the run's) error, raised at that task's turn
            for future in self._results[done:]:
                future.set_exception(error)

    def count(self, bundle, examples: Sequence[Example], classifier: PatternClassifier, **options):
        """classifier.classify.head_class_counts(..., per_example=True) for one of the tasks (the bundle, the
        classifier and the options are this object's): (L, H, 5) counts and (E, 5) per-example counts."""
        if not self._started:
            self._started = True
            self._thread.submit(self._classify)
        return merged_counts(self._results[self._index(examples)].result(), per_example=True)
