"""classify over several tasks on a cluster works one task ahead (classifier.distributed.TasksAhead): the next
task's counts are computed in a thread while the driver writes the current task. Here the cluster's counting is
replaced by one-process counts in that thread, to check the order of work and the errors: results equal one
process's, a task's error comes back as itself once the earlier tasks are written, and an error in the driver
stops the task running ahead. Equality on a real Ray cluster is in tests/test_ray.py."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pandas as pd
import pytest

import classifier.classify as classify_module
import classifier.distributed as distributed_module
from analysis.errors import AttnpatError
from analysis.rundir import RunDir
from classifier.classify import classify_tasks, head_class_counts
from classifier.predict import load_classifier
from tests.tiny import tiny_bundle

TASKS = ["sst2", "mrpc", "rte"]
N = 6
FAKE_CLUSTER = SimpleNamespace(manifest=lambda: {"engine": "stand-in"})


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny_bundle(tmp_path_factory.mktemp("tiny"), layers=2, heads=3, hidden=24)


@pytest.fixture
def counted(monkeypatch):
    """distributed_class_counts replaced by one-process counts; records (task size, thread name) per call and
    lets a test add behaviour per call through ``hooks`` (call number -> function of the stop event)."""
    calls, hooks = [], {}

    def fake(cluster, bundle, examples, classifier, *, encoded, stop, **options):
        assert cluster is FAKE_CLUSTER and len(encoded) == len(examples)
        calls.append(threading.current_thread().name)
        if len(calls) in hooks:
            hooks[len(calls)](stop)
        return head_class_counts(bundle, examples, classifier, encoded=encoded, **options)

    monkeypatch.setattr(distributed_module, "distributed_class_counts", fake)
    return SimpleNamespace(calls=calls, hooks=hooks)


def ahead_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("classify-ahead")]


def classify_record(bundle, root, task):
    return RunDir(bundle.slug, task, root).manifest().get("analyses", {}).get("classify")


def test_tasks_worked_ahead_equal_one_process(bundle, counted, tmp_path):
    cnn = load_classifier()
    for name, cluster in (("one", None), ("ahead", FAKE_CLUSTER)):
        classify_tasks(bundle, TASKS, cnn, n=N, batch_size=4, root=tmp_path / name, progress=False, cluster=cluster)
    assert len(counted.calls) == len(TASKS) and all(name.startswith("classify-ahead") for name in counted.calls)
    for task in TASKS:
        for table in ("patterns.csv", "pattern_ratios.csv"):
            pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "one" / bundle.slug / task / table),
                                          pd.read_csv(tmp_path / "ahead" / bundle.slug / task / table))
        assert classify_record(bundle, tmp_path / "ahead", task)["cluster"] == {"engine": "stand-in"}
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "one" / bundle.slug / "all" / "pattern_ratios_by_task.csv"),
                                  pd.read_csv(tmp_path / "ahead" / bundle.slug / "all" / "pattern_ratios_by_task.csv"))
    assert not ahead_threads()


def test_an_error_on_the_cluster_comes_back_once_the_earlier_tasks_are_written(bundle, counted, tmp_path):
    def fail(stop):
        raise AttnpatError("worker lost its model")

    counted.hooks[2] = fail  # the second task, counted while the driver writes the first
    with pytest.raises(AttnpatError, match="worker lost its model"):
        classify_tasks(bundle, TASKS, load_classifier(), n=N, batch_size=4, root=tmp_path, progress=False,
                       cluster=FAKE_CLUSTER)
    assert classify_record(bundle, tmp_path, "sst2")["n_maps"] == N * 2 * 3
    assert classify_record(bundle, tmp_path, "mrpc") is None and classify_record(bundle, tmp_path, "rte") is None
    assert not ahead_threads()


def test_an_error_in_the_driver_stops_the_task_running_ahead(bundle, counted, monkeypatch, tmp_path):
    running, stopped = threading.Event(), []

    def wait_for_stop(stop):
        running.set()
        stopped.append(stop.wait(60))
        raise AttnpatError("classification stopped")

    def failing_figure(*args, **kwargs):
        assert running.wait(60)  # the second task is on the "cluster" while the first one is written
        raise OSError("disk full")

    counted.hooks[2] = wait_for_stop
    monkeypatch.setattr(classify_module, "ratio_figure", failing_figure)
    with pytest.raises(OSError, match="disk full"):
        classify_tasks(bundle, TASKS, load_classifier(), n=N, batch_size=4, root=tmp_path, progress=False,
                       cluster=FAKE_CLUSTER)
    assert stopped == [True] and not ahead_threads()
    assert all(classify_record(bundle, tmp_path, task) is None for task in TASKS)

