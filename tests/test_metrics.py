"""GLUE metrics agree with scikit-learn and scipy."""
import math

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from analysis.errors import AttnpatError
from analysis.metrics import (
    accuracy,
    confusion_metric,
    f1,
    matthews,
    metric_name,
    pearson,
    pearson_spearman,
    spearman,
    task_metric,
)


@pytest.fixture(params=range(5))
def binary(request):
    rng = np.random.default_rng(request.param)
    labels = rng.integers(0, 2, size=57)
    predictions = np.where(rng.random(57) < 0.7, labels, 1 - labels)
    return predictions, labels


def test_classification_metrics_match_sklearn(binary):
    predictions, labels = binary
    assert accuracy(predictions, labels) == pytest.approx(accuracy_score(labels, predictions))
    assert f1(predictions, labels) == pytest.approx(f1_score(labels, predictions))
    assert matthews(predictions, labels) == pytest.approx(matthews_corrcoef(labels, predictions))


def test_matthews_multiclass_and_degenerate_cases_match_sklearn():
    rng = np.random.default_rng(7)
    labels, predictions = rng.integers(0, 3, 80), rng.integers(0, 3, 80)
    assert matthews(predictions, labels) == pytest.approx(matthews_corrcoef(labels, predictions))
    constant = np.ones(10, dtype=int)
    assert matthews(constant, rng.integers(0, 2, 10)) == matthews_corrcoef(rng.integers(0, 2, 10), constant) == 0.0
    assert f1(np.zeros(6), np.ones(6)) == f1_score(np.ones(6), np.zeros(6), zero_division=0) == 0.0


def test_correlations_match_scipy_including_ties():
    rng = np.random.default_rng(3)
    labels = rng.integers(0, 6, 90).astype(float)  # STS-B-like scores with many ties
    predictions = labels + rng.normal(0, 1.5, 90)
    predictions[:10] = 2.0  # ties in the predictions too
    assert pearson(predictions, labels) == pytest.approx(pearsonr(predictions, labels)[0])
    assert spearman(predictions, labels) == pytest.approx(spearmanr(predictions, labels)[0])
    expected = (pearsonr(predictions, labels)[0] + spearmanr(predictions, labels)[0]) / 2
    assert pearson_spearman(predictions, labels) == pytest.approx(expected)
    assert math.isnan(pearson(np.ones(5), np.arange(5)))


def test_task_metric_dispatches_by_task_and_name(binary):
    predictions, labels = binary
    assert metric_name("sst2") == "accuracy" and metric_name("MRPC") == "f1"
    assert metric_name("stsb") == "pearson_spearman" and metric_name("cola") == "matthews"
    assert task_metric("mrpc", predictions, labels) == pytest.approx(f1_score(labels, predictions))
    assert task_metric("rte", predictions, labels) == pytest.approx(accuracy_score(labels, predictions))
    assert task_metric("matthews", predictions, labels) == pytest.approx(matthews_corrcoef(labels, predictions))


def test_bad_input_raises_one_line_error():
    with pytest.raises(AttnpatError, match="unknown task or metric"):
        task_metric("bleu", [1], [1])
    with pytest.raises(AttnpatError, match="3 predictions but 2 labels"):
        accuracy([1, 0, 1], [1, 0])
    with pytest.raises(AttnpatError, match="zero examples"):
        accuracy([], [])


@pytest.mark.parametrize("name", ["accuracy", "f1", "matthews"])
@pytest.mark.parametrize("classes", [2, 3])
def test_metrics_of_confusion_counts_equal_the_metrics_of_predictions(name, classes):
    """The vectorised permutation test scores confusion counts: each metric of counts is the metric of the predictions
    they count, exactly (F1 of class 1; a batch of matrices at once; a constant prediction gives Matthews' 0)."""
    rng = np.random.default_rng(classes)
    labels = rng.integers(0, classes, size=(6, 40))
    predictions = np.where(rng.random((6, 40)) < 0.6, labels, rng.integers(0, classes, size=(6, 40)))
    predictions[0] = 0  # constant predictions
    counts = np.stack([np.bincount(gold * classes + predicted, minlength=classes * classes).reshape(classes, classes)
                       for gold, predicted in zip(labels, predictions)]).astype(float)
    scored = confusion_metric(name)(counts, np.arange(classes))
    assert scored.tolist() == [task_metric(name, predicted, gold) for predicted, gold in zip(predictions, labels)]
    with pytest.raises(AttnpatError, match="no function of confusion counts"):
        confusion_metric("stsb")
