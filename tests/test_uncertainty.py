"""Bootstrap intervals and adjusted classify-and-count, checked on hand-made cases."""
import numpy as np
import pytest
from scipy import sparse
from scipy.stats import binomtest

from analysis.errors import AttnpatError
from analysis.metrics import confusion_metric, task_metric
from analysis.uncertainty import (
    MIN_RESAMPLED,
    adjusted_ratio_draws,
    adjusted_ratio_interval,
    adjusted_ratios,
    bootstrap_difference_interval,
    bootstrap_draws,
    bootstrap_mean_interval,
    bootstrap_ratio_draws,
    bootstrap_ratio_interval,
    bootstrap_sparse_ratio_interval,
    bootstrap_statistic_interval,
    bootstrap_weighted_mean_interval,
    bounded_share_interval,
    confusion_class_f1,
    confusion_class_f1_interval,
    confusion_difference_interval,
    confusion_permutation_p,
    confusion_rates,
    confusion_score_interval,
    confusion_scores,
    holm_adjust,
    mcnemar_exact,
    paired_permutation_p,
    project_to_simplex,
    redrawn_confusions,
    singular_reason,
    wilson_interval,
    wilson_intervals,
)


def test_adjusted_ratios_recover_the_true_ratios_from_a_hand_made_confusion():
    # A classifier that confuses class 0 with class 1 a fifth of the time, and 2 with 0 a tenth.
    confusion = np.array([[80, 20, 0], [0, 100, 0], [10, 0, 90]])
    true = np.array([0.5, 0.2, 0.3])
    rates = confusion / confusion.sum(1, keepdims=True)
    observed = rates.T @ true  # what it would report: [0.43, 0.30, 0.27]
    assert not np.allclose(observed, true)
    assert adjusted_ratios(observed, confusion) == pytest.approx(true, abs=1e-9)


def test_adjusted_ratios_are_clipped_to_the_simplex():
    confusion = np.array([[90, 10], [10, 90]])
    estimate = adjusted_ratios(np.array([0.05, 0.95]), confusion)  # below what the error rate allows
    assert estimate.min() >= 0 and estimate.sum() == pytest.approx(1)
    assert estimate == pytest.approx([0.0, 1.0])


def test_projection_onto_the_simplex():
    assert project_to_simplex(np.array([0.2, 0.3, 0.5])) == pytest.approx([0.2, 0.3, 0.5])
    assert project_to_simplex(np.array([2.0, 0.0])) == pytest.approx([1.0, 0.0])
    assert project_to_simplex(np.array([0.5, 0.5, -1.0])) == pytest.approx([0.5, 0.5, 0.0])


def test_the_projection_of_many_vectors_at_once_is_each_ones_projection():
    rng = np.random.default_rng(3)
    vectors = rng.normal(0.2, 0.5, size=(40, 5))
    together = project_to_simplex(vectors)
    assert together == pytest.approx(np.array([project_to_simplex(v) for v in vectors]))
    assert together.min() >= 0 and together.sum(1) == pytest.approx(np.ones(40))


# A classifier that confuses class 0 with class 1 a fifth of the time and class 2 with class 0 a tenth, measured on
# 100 labeled maps of each class: rows = true class, columns = predicted, as the checkpoint stores it.
CONFUSION = np.array([[80, 20, 0], [0, 100, 0], [10, 0, 90]])
TRUE = np.array([0.5, 0.2, 0.3])


def _classified_examples(n_examples: int, seed: int) -> np.ndarray:
    """(E, 3) per-example predicted class counts: 72 maps per example, of the TRUE classes, each predicted with
    CONFUSION's rates."""
    rng = np.random.default_rng(seed)
    rates = CONFUSION / CONFUSION.sum(1, keepdims=True)
    true_counts = rng.multinomial(72, TRUE, size=n_examples)
    return np.stack([sum(rng.multinomial(n, rates[i]) for i, n in enumerate(row)) for row in true_counts])


def test_the_adjusted_interval_resamples_examples_and_the_confusion_matrix():
    """Each draw resamples the examples and redraws the confusion matrix's rows from their labeled maps, then
    adjusts: the interval holds the point estimate and the true ratios, every draw is on the simplex, and more
    labeled maps behind the same rates (a surer confusion matrix) give a narrower interval."""
    counts = _classified_examples(300, seed=4)
    estimate = adjusted_ratios(counts.sum(0) / counts.sum(), CONFUSION)
    interval = adjusted_ratio_interval(counts, CONFUSION)
    assert np.all(interval[:, 0] <= estimate) and np.all(estimate <= interval[:, 1])
    assert np.all(interval[:, 0] <= TRUE) and np.all(TRUE <= interval[:, 1])
    assert np.array_equal(adjusted_ratio_interval(counts, CONFUSION), interval)  # seeded
    surer = adjusted_ratio_interval(counts, CONFUSION * 100)
    assert np.all(surer[:, 1] - surer[:, 0] < interval[:, 1] - interval[:, 0])
    # the classified interval ignores the classifier's errors: it misses the true share of class 0
    classified = bootstrap_ratio_interval(counts)
    assert not classified[0, 0] <= TRUE[0] <= classified[0, 1]
    draws = adjusted_ratio_draws(np.tile(counts.sum(0) / counts.sum(), (50, 1)), CONFUSION)
    assert draws.sum(1) == pytest.approx(np.ones(50))  # exact solutions, not projected


def test_a_class_adjusted_to_0_keeps_an_interval_as_wide_as_its_unprojected_draws():
    """Class 0 leaks 5% of its maps into class 1 and 10% into class 2; these examples show the 5% in class 1
    (its true share is 0, its draws straddle 0) and none in class 2 (every draw negative: the rates misfit).
    Projecting each draw pushed class 1's positive draws to 0 along with class 2's negative ones ([0, 0.012]);
    percentiles of the unprojected draws, cut to [0, 1], keep class 1's upper bound, and class 2 keeps a width."""
    confusion = np.array([[85, 5, 10], [5, 90, 5], [5, 5, 90]])
    in_class_1 = np.random.default_rng(0).binomial(20, 0.05, size=100)
    counts = np.stack([20 - in_class_1, in_class_1, np.zeros(100, dtype=int)], axis=1)  # (E, 3)
    estimate = adjusted_ratios(counts.sum(0) / counts.sum(), confusion)
    assert estimate[1] == 0 and estimate[2] == 0
    interval = adjusted_ratio_interval(counts, confusion)
    shares = bootstrap_ratio_draws(counts)  # the interval's own example draws
    draws = adjusted_ratio_draws(shares, confusion)
    assert (draws[:, 1] < 0).any() and (draws[:, 1] > 0).any()
    assert interval[1, 0] == 0 and interval[1, 1] == pytest.approx(np.percentile(draws[:, 1], 97.5))
    assert interval[1, 1] > 0.04
    assert (draws[:, 2] < 0).all() and interval[2, 0] == 0 and interval[2, 1] > 0.04
    assert np.all((interval[:, 0] <= estimate) & (estimate <= interval[:, 1]))
    assert interval.min() >= 0 and interval.max() <= 1



def test_share_bounds_are_cut_to_0_and_1_keeping_half_their_width_past_an_edge():
    bounds = np.array([[0.2, 0.3], [-0.01, 0.02], [-0.03, -0.01], [1.01, 1.05], [0.1, 0.1]])
    assert bounded_share_interval(bounds) == pytest.approx(
        np.array([[0.2, 0.3], [0.0, 0.02], [0.0, 0.01], [0.98, 1.0], [0.1, 0.1]]))

@pytest.mark.parametrize("true", [[0.7, 0.3, 0.0], [0.0, 0.97, 0.03]])
def test_the_adjusted_interval_covers_the_true_ratios_in_simulated_repeats(true):
    """200 repeats, each with its own labeled maps (150 per true class, classified with RATES) and 60 examples
    of 20 maps: the 95% interval holds each true share, a zero one too, in at least 90% of them."""
    rates = np.array([[0.85, 0.10, 0.05], [0.05, 0.90, 0.05], [0.05, 0.10, 0.85]])
    true = np.asarray(true)
    covered = []
    for repeat in range(200):
        rng = np.random.default_rng(repeat)
        confusion = np.stack([rng.multinomial(150, row) for row in rates])
        true_counts = rng.multinomial(20, true, size=60)  # (E, 3)
        counts = np.stack([sum(rng.multinomial(n, rates[i]) for i, n in enumerate(row)) for row in true_counts])
        interval = adjusted_ratio_interval(counts, confusion, n_boot=300, seed=repeat)
        covered.append((interval[:, 0] <= true) & (true <= interval[:, 1]))
    assert np.mean(covered, axis=0).min() >= 0.9


def test_scores_of_a_confusion_matrix_are_those_of_its_maps():
    """Macro-F1 and accuracy of confusion counts equal sklearn's over the maps the counts stand for, for one
    matrix and for a stack of them; the shipped checkpoint's matrix gives its recorded cross-validated scores."""
    import json  # noqa: PLC0415

    from sklearn.metrics import accuracy_score, f1_score  # noqa: PLC0415

    from analysis.paths import repo_root  # noqa: PLC0415

    confusion = np.array([[30, 4, 1], [2, 9, 3], [0, 5, 6]])
    true, predicted = zip(*[(i, j) for i in range(3) for j in range(3) for _ in range(confusion[i, j])])
    expected = [f1_score(true, predicted, average="macro"), accuracy_score(true, predicted)]
    assert confusion_scores(confusion) == pytest.approx(expected)
    assert confusion_scores(np.stack([confusion, np.eye(3) * 5])) == pytest.approx(np.array([expected, [1.0, 1.0]]))
    cv = json.loads((repo_root() / "classifier" / "checkpoints" / "default.json").read_text())["cross_validation"]
    assert confusion_scores(cv["confusion"]) == pytest.approx([cv["macro_f1"], cv["accuracy"]])


def test_the_interval_of_a_confusion_matrix_scores_resamples_its_labeled_maps():
    """The redraws keep each true class's number of maps; the interval holds both scores, is seeded, narrows with
    100 times the maps at the same rates, and is NaN for one map (no spread to show)."""
    confusion = np.array([[30, 4, 1], [2, 9, 3], [0, 5, 6]])
    drawn = redrawn_confusions(confusion, 200, np.random.default_rng(0))
    assert drawn.shape == (200, 3, 3) and np.all(drawn.sum(2) == confusion.sum(1))
    assert len({drawn_matrix.tobytes() for drawn_matrix in drawn}) > 100  # they vary
    interval = confusion_score_interval(confusion)
    scores = confusion_scores(confusion)
    assert np.all(interval[:, 0] < scores) and np.all(scores < interval[:, 1])
    assert np.array_equal(confusion_score_interval(confusion), interval)
    surer = confusion_score_interval(confusion * 100)
    assert np.all(surer[:, 1] - surer[:, 0] < (interval[:, 1] - interval[:, 0]) / 3)
    assert np.isnan(confusion_score_interval(np.array([[1]]))).all()


def test_each_classes_f1_of_a_confusion_matrix_and_its_interval():
    """Per-class F1 of confusion counts equals sklearn's over the maps they stand for; its interval, from the same
    redraws as the macro-F1's, holds each class's F1, is seeded, is wider for the class with fewer maps, and is NaN
    for one map."""
    from sklearn.metrics import f1_score  # noqa: PLC0415

    confusion = np.array([[300, 40, 10], [20, 90, 30], [0, 5, 6]])
    true, predicted = zip(*[(i, j) for i in range(3) for j in range(3) for _ in range(confusion[i, j])])
    f1 = confusion_class_f1(confusion)
    assert f1 == pytest.approx(f1_score(true, predicted, average=None))
    assert confusion_scores(confusion)[0] == pytest.approx(f1.mean())
    interval = confusion_class_f1_interval(confusion)
    assert interval.shape == (3, 2) and np.all(interval[:, 0] < f1) and np.all(f1 < interval[:, 1])
    assert np.array_equal(confusion_class_f1_interval(confusion), interval)
    widths = interval[:, 1] - interval[:, 0]
    assert widths[2] > 2 * widths[0]  # 11 maps against 350
    assert np.isnan(confusion_class_f1_interval(np.array([[1]]))).all()


def test_a_confusion_matrix_that_cannot_be_inverted_is_refused_not_answered():
    """A true class with no labeled map has unknown rates, and a class never predicted or rows that are linearly
    dependent let different true ratios give the same predictions: each is one clear error naming why, never NaN or
    an arbitrary answer (before, dependent rows gave the least-squares minimum-norm solution: 1/K each)."""
    observed = np.array([0.4, 0.3, 0.3])
    with pytest.raises(AttnpatError, match="every true class needs at least one map"):
        adjusted_ratios(observed, np.array([[80, 20, 0], [0, 0, 0], [10, 0, 90]]))
    with pytest.raises(AttnpatError, match="cannot be inverted"):
        adjusted_ratios(observed, np.array([[50, 50, 0], [50, 50, 0], [0, 0, 10]]))
    with pytest.raises(AttnpatError, match="cannot be inverted"):
        adjusted_ratio_interval(np.ones((4, 3)), np.array([[50, 50, 0], [25, 25, 0], [0, 0, 10]]))
    never = np.array([[80, 0, 20], [10, 0, 90], [0, 0, 10]])  # class 1 never predicted: a weak classifier
    assert singular_reason(confusion_rates(never), ["a", "b", "c"]) == ("the classifier never predicted b in "
                                                                          "cross-validation")
    with pytest.raises(AttnpatError, match="cannot be inverted: the classifier never predicted 1"):
        adjusted_ratios(observed, never)
    assert singular_reason(confusion_rates(CONFUSION)) is None


def test_many_wilson_intervals_at_once_are_each_ones_interval():
    successes, n = np.array([[0, 3], [7, 10]]), np.array([10, 10])
    together = wilson_intervals(successes, n)
    assert together.shape == (2, 2, 2)
    for index in np.ndindex(successes.shape):
        assert together[index] == pytest.approx(wilson_interval(int(successes[index]), int(n[index[1]])))


def test_bootstrap_interval_covers_the_ratio_and_shrinks_with_more_examples():
    rng = np.random.default_rng(1)
    small = rng.multinomial(72, [0.6, 0.3, 0.1], size=20)
    large = rng.multinomial(72, [0.6, 0.3, 0.1], size=2000)
    low_s, high_s = bootstrap_ratio_interval(small).T
    low_l, high_l = bootstrap_ratio_interval(large).T
    share = large.sum(0) / large.sum()
    assert np.all(low_l <= share) and np.all(share <= high_l)
    assert np.all(high_l - low_l < high_s - low_s)


def test_identical_examples_give_a_zero_width_interval():
    counts = np.tile([[50, 22]], (30, 1))
    interval = bootstrap_ratio_interval(counts)
    assert interval[:, 0] == pytest.approx(interval[:, 1])


def test_bad_shapes_are_refused():
    with pytest.raises(AttnpatError):
        bootstrap_ratio_interval(np.zeros((0, 5)))
    with pytest.raises(AttnpatError):
        adjusted_ratios(np.ones(3) / 3, np.eye(2))


def test_mcnemar_matches_scipy_binomtest_and_a_hand_case():
    baseline = np.array([1, 1, 1, 1, 1, 1, 0, 0, 1, 0], dtype=bool)
    variant = np.array([0, 0, 0, 0, 0, 1, 0, 1, 1, 0], dtype=bool)  # b = 5 lost, c = 1 gained
    p = mcnemar_exact(baseline, variant)
    assert p == pytest.approx(binomtest(1, 6, 0.5).pvalue)
    assert p == pytest.approx(2 * (1 + 6) / 2 ** 6)  # by hand: 2 * P(X <= 1), X ~ Bin(6, 1/2)
    both = mcnemar_exact(baseline, np.stack([variant, baseline], 1))
    assert both[0] == pytest.approx(p) and both[1] == 1.0  # no discordant pair


def test_the_permutation_test_of_an_accuracy_change_is_the_two_sided_mcnemar_test():
    # swapping a map the two models disagree on moves the accuracy difference by 2/N and swapping an agreed map
    # moves nothing, so the permutation distribution is McNemar's Binomial(discordant, 1/2), sign-flipped
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 2, 200)
    baseline = labels.copy()
    variant = labels.copy()
    baseline[:12] = 1 - labels[:12]  # the variant alone is right on 12 maps
    variant[12:16] = 1 - labels[12:16]  # and alone wrong on 4
    def accuracy(predictions, gold):
        return float((predictions == gold).mean())
    p = paired_permutation_p(accuracy, baseline, np.stack([variant, baseline, 1 - baseline], 1), labels,
                             n_perm=4000, seed=0)
    exact = mcnemar_exact(baseline == labels, variant == labels)
    assert exact == pytest.approx(binomtest(4, 16, 0.5).pvalue)  # 0.077
    assert p[0] == pytest.approx(exact, abs=0.015)
    assert p[1] == 1.0  # identical predictions: nothing to swap
    assert p[2] < 0.001  # always wrong where the baseline is right: no swap reaches it but the identity
    assert paired_permutation_p(accuracy, baseline, variant, labels, n_perm=300).shape == (1,)
    with pytest.raises(AttnpatError, match="equal example counts"):
        paired_permutation_p(accuracy, baseline, variant[:10], labels)


def _disagreeing_predictions(seed: int, classes: int, examples: int = 50) -> tuple[np.ndarray, ...]:
    """labels (E,), baseline (E,) right on about 80%, and (E, 4) variants that change 0%, 10%, 30%, 50% of it."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, examples)
    baseline = np.where(rng.random(examples) < 0.8, labels, rng.integers(0, classes, examples))
    variants = np.stack([np.where(rng.random(examples) < 1 - share, baseline, rng.integers(0, classes, examples))
                         for share in (0.0, 0.1, 0.3, 0.5)], 1)
    return labels, baseline, variants


@pytest.mark.parametrize("metric, classes", [("f1", 2), ("matthews", 2), ("matthews", 3), ("accuracy", 2),
                                             ("accuracy", 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_vectorised_permutation_test_gives_the_loops_p_values(metric, classes, seed):
    """confusion_permutation_p makes the swaps of paired_permutation_p (same seed, drawn chunk by chunk) and scores
    them from confusion counts: the p-values are the same numbers, not close ones."""
    labels, baseline, variants = _disagreeing_predictions(seed, classes)
    slow = paired_permutation_p(lambda predicted, gold: task_metric(metric, predicted, gold), baseline, variants,
                                labels, n_perm=400, seed=seed + 5)
    fast = confusion_permutation_p(confusion_metric(metric), baseline, variants, labels, n_perm=400, seed=seed + 5,
                                   chunk=7)  # 7 does not divide 400: the last chunk is short
    assert fast.tolist() == slow.tolist()
    assert fast[0] == 1.0 and fast[-1] < 1.0  # an unchanged variant, and one that changed half its predictions
    single = confusion_permutation_p(confusion_metric(metric), baseline, variants[:, 2], labels, n_perm=400,
                                     seed=seed + 5)
    assert single.tolist() == [slow[2]]


def test_f1_permutation_test_when_the_positive_class_never_occurs():
    """No example is of class 1, true or predicted: F1 is 0 for every model and every swap, so p = 1."""
    labels, baseline, variants = (2 * part for part in _disagreeing_predictions(3, 2))  # classes 0 and 2
    assert confusion_permutation_p(confusion_metric("f1"), baseline, variants, labels, n_perm=50).tolist() == [1.0] * 4


def test_variants_that_never_differ_from_the_baseline_get_p_1():
    """No example to swap (every variant predicts as the baseline, as in small disabling runs): p = 1 for each, not a
    shape error from the empty product."""
    labels, baseline, _ = _disagreeing_predictions(5, 2, examples=6)
    same = np.stack([baseline, baseline], 1)
    for metric in ("f1", "matthews", "accuracy"):
        p = confusion_permutation_p(confusion_metric(metric), baseline, same, labels, n_perm=30)
        assert p.tolist() == [1.0] * 2


def test_the_vectorised_permutation_test_of_accuracy_agrees_with_mcnemar():
    """On accuracy the permutation distribution is McNemar's (see the test above): with 20,000 permutations the two
    p-values agree to within three Monte Carlo standard errors of the permutation p."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 2, 408)
    baseline = np.where(rng.random(408) < 0.85, labels, 1 - labels)
    variants = np.stack([np.where(rng.random(408) < 1 - share, baseline, 1 - baseline)
                         for share in (0.01, 0.03, 0.05, 0.08)], 1)
    variants[:30, 3] = labels[:30]  # a variant right where the baseline may not be: a change in either direction
    p = confusion_permutation_p(confusion_metric("accuracy"), baseline, variants, labels, n_perm=20_000, seed=0)
    exact = mcnemar_exact(baseline == labels, variants == labels[:, None])
    error = np.sqrt(exact * (1 - exact) / 20_000)
    assert (np.abs(p - exact) <= 3 * error + 1 / 20_001).all(), (p, exact)
    assert (exact < 0.01).any() and (exact > 0.1).any()  # the check spans small and large p


def test_holm_by_hand():
    adjusted = holm_adjust(np.array([0.01, 0.04, 0.03, 0.2]))
    # sorted 0.01, 0.03, 0.04, 0.2 -> 4*0.01, 3*0.03, 2*0.04, 1*0.2, made monotone: 0.04, 0.09, 0.09, 0.2
    assert adjusted == pytest.approx([0.04, 0.09, 0.09, 0.2])


def test_paired_bootstrap_interval_of_an_accuracy_change():
    rng = np.random.default_rng(0)
    change = rng.choice([-1.0, 0.0, 1.0], p=[0.05, 0.9, 0.05], size=(400, 3))
    change[:, 2] = 0.0
    interval = bootstrap_mean_interval(change)
    assert interval.shape == (3, 2)
    assert np.all(interval[:, 0] <= change.mean(0)) and np.all(change.mean(0) <= interval[:, 1])
    assert interval[2] == pytest.approx([0.0, 0.0])
    assert bootstrap_mean_interval(np.ones((5, 2, 3))).shape == (2, 3, 2)


def test_bootstrap_of_a_metric_change_agrees_with_the_mean_bootstrap_for_accuracy():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 400)
    baseline = np.where(rng.random(400) < 0.8, labels, 1 - labels)
    better = np.where(rng.random(400) < 0.5, labels, baseline)  # fixes about half of the baseline's errors
    variants = np.stack([baseline, better, 1 - baseline], 1)

    def accuracy(predictions, gold):
        return float((predictions == gold).mean())

    interval = bootstrap_difference_interval(accuracy, baseline, variants, labels, n_boot=2000)
    correct = (variants == labels[:, None]).astype(float) - (baseline == labels)[:, None]
    reference = bootstrap_mean_interval(correct, n_boot=2000)
    assert interval.shape == (3, 2)
    assert interval == pytest.approx(reference, abs=0.012)  # two bootstraps of one statistic, other draws
    assert interval[0] == pytest.approx([0.0, 0.0])
    assert interval[1, 0] > 0 and interval[2, 1] < 0
    for v in range(3):
        assert interval[v, 0] <= correct[:, v].mean() <= interval[v, 1]


@pytest.mark.parametrize("metric, classes", [("accuracy", 2), ("f1", 2), ("matthews", 2), ("matthews", 3),
                                             ("accuracy", 3), ("f1", 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_vectorised_bootstrap_of_a_metric_change_gives_the_loops_bounds(metric, classes, seed):
    """confusion_difference_interval makes the draws of bootstrap_difference_interval (same seed, drawn chunk by
    chunk) and scores them from confusion counts: the bounds are the same numbers, not close ones."""
    labels, baseline, variants = _disagreeing_predictions(seed, classes)
    slow = bootstrap_difference_interval(lambda predicted, gold: task_metric(metric, predicted, gold), baseline,
                                         variants, labels, n_boot=300, seed=seed + 5)
    fast = confusion_difference_interval(confusion_metric(metric), baseline, variants, labels, n_boot=300,
                                         seed=seed + 5, chunk=7)  # 7 does not divide 300: the last chunk is short
    assert fast.tolist() == slow.tolist()
    assert fast[0].tolist() == [0.0, 0.0] and fast[-1, 0] < fast[-1, 1]  # unchanged variant; one changed by half
    single = confusion_difference_interval(confusion_metric(metric), baseline, variants[:, 2], labels, n_boot=300,
                                           seed=seed + 5)
    assert single.tolist() == slow[2:3].tolist()


def test_the_vectorised_bootstrap_of_a_metric_change_on_tiny_and_degenerate_inputs():
    """As the loop: one example gives NaN bounds (no spread to show); F1 without the positive class is 0 on every
    draw, so its change is [0, 0]; constant predictions make Matthews 0, never NaN."""
    one = confusion_difference_interval(confusion_metric("matthews"), np.array([1]), np.array([[0]]), np.array([1]))
    assert one.shape == (1, 2) and np.isnan(one).all()
    labels, baseline, variants = (2 * part for part in _disagreeing_predictions(3, 2))  # classes 0 and 2
    assert confusion_difference_interval(confusion_metric("f1"), baseline, variants, labels,
                                         n_boot=50).tolist() == [[0.0, 0.0]] * 4
    labels, baseline, _ = _disagreeing_predictions(4, 2, examples=12)
    constant = np.zeros((12, 1), dtype=int)
    fast = confusion_difference_interval(confusion_metric("matthews"), baseline, constant, labels, n_boot=200)
    slow = bootstrap_difference_interval(lambda predicted, gold: task_metric("matthews", predicted, gold), baseline,
                                         constant, labels, n_boot=200)
    assert fast.tolist() == slow.tolist() and not np.isnan(fast).any()
    with pytest.raises(AttnpatError, match="equal example counts"):
        confusion_difference_interval(confusion_metric("f1"), np.zeros(3), np.zeros((4, 2)), np.zeros(3))


def test_bootstrap_of_a_metric_change_refuses_unpaired_inputs():
    with pytest.raises(AttnpatError, match="equal example counts"):
        bootstrap_difference_interval(lambda p, g: 0.0, np.zeros(3), np.zeros((4, 2)), np.zeros(3))


def test_bootstrap_of_any_statistic_agrees_with_the_mean_bootstrap_and_leaves_out_undefined_draws():
    values = np.random.default_rng(3).random(300)
    interval = bootstrap_statistic_interval(lambda draw: values[draw].mean(), len(values), n_boot=2000)
    assert interval.shape == (2,)
    assert interval == pytest.approx(bootstrap_mean_interval(values, n_boot=2000), abs=0.01)
    assert interval[0] <= values.mean() <= interval[1]
    flags = np.arange(10) == 0  # item 0 is missing from about a third of the draws of 10

    def statistic(draw):  # [mean of the draw, 1 where item 0 was drawn else undefined, never defined]
        return [values[draw].mean(), 1.0 if flags[draw].any() else np.nan, np.nan]

    bounds = bootstrap_statistic_interval(statistic, 10, n_boot=200)
    assert bounds.shape == (3, 2) and bounds[1] == pytest.approx([1.0, 1.0]) and np.isnan(bounds[2]).all()
    with pytest.raises(AttnpatError, match="at least one item"):
        bootstrap_statistic_interval(lambda draw: 0.0, 0)


def test_bootstrap_draws_of_another_size_draw_that_many_of_the_items():
    """m-out-of-n: each draw holds ``size`` indices of the n items, and the interval is built on the same draws."""
    draws = bootstrap_draws(lambda draw: [len(draw), draw.min(), draw.max()], 7, size=50, n_boot=30)
    assert draws.shape == (30, 3) and (draws[:, 0] == 50).all() and draws[:, 1].min() == 0 and draws[:, 2].max() == 6
    values = np.random.default_rng(4).random(40)
    means = bootstrap_draws(lambda draw: values[draw].mean(), 40, n_boot=500, seed=2)
    np.testing.assert_allclose(np.percentile(means, [2.5, 97.5]), bootstrap_statistic_interval(
        lambda draw: values[draw].mean(), 40, n_boot=500, seed=2))
    assert np.std(bootstrap_draws(lambda draw: values[draw].mean(), 40, size=5, n_boot=500)) > 2 * np.std(means)
    with pytest.raises(AttnpatError, match="a bootstrap draw needs at least one item, got 0"):
        bootstrap_draws(lambda draw: 0.0, 7, size=0)


def test_ratio_bootstrap_in_chunks_makes_the_same_draws_as_all_at_once():
    """Memory stays chunk x examples x classes; the interval is the same for any chunk size."""
    counts = np.random.default_rng(4).integers(0, 6, size=(301, 5))
    whole = bootstrap_ratio_interval(counts, n_boot=230, seed=2, chunk=230)
    for chunk in (1, 7, 50):
        assert np.array_equal(bootstrap_ratio_interval(counts, n_boot=230, seed=2, chunk=chunk), whole)


def test_the_sparse_ratio_bootstrap_is_the_weighted_mean_bootstrap_without_a_dense_copy():
    """Per input, summed attention and counts of each token (most inputs lack most tokens): the same intervals as
    the weighted mean bootstrap of sums / counts with counts as weights, in any block size; a token in no drawn
    input is left out of that draw, and a token of no input has NaN bounds."""
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 3, size=(40, 9)) * (rng.random((40, 9)) < 0.3)
    counts[:, 8] = 0  # a token no input holds
    counts[:, 7] = 0
    counts[3, 7] = 2  # a token of one input
    sums = counts * rng.random((40, 9))
    means = np.divide(sums, counts, out=np.zeros(sums.shape), where=counts > 0)
    dense = bootstrap_weighted_mean_interval(means, counts, n_boot=300, seed=3)
    for block in (1, 4, 4096):
        sparse_bounds = bootstrap_sparse_ratio_interval(sparse.csr_matrix(sums), sparse.csr_matrix(counts),
                                                        n_boot=300, seed=3, block=block)
        assert np.allclose(sparse_bounds, dense, equal_nan=True)
    assert np.isnan(dense[8]).all() and np.isnan(dense[7]).all()  # test_an_interval_of_one_example_is_nan
    with pytest.raises(AttnpatError, match="equal"):
        bootstrap_sparse_ratio_interval(sums, counts[:, :3])


def test_wilson_interval_matches_its_formula_and_always_holds_the_share():
    assert wilson_interval(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)  # the textbook 95% case
    z2 = 1.959964 ** 2
    assert wilson_interval(0, 4).tolist() == pytest.approx([0.0, z2 / (4 + z2)])  # exactly 0 below, not 1e-17
    assert wilson_interval(4, 4).tolist() == pytest.approx([4 / (4 + z2), 1.0])
    for n in range(1, 41):
        for k in range(n + 1):
            low, high = wilson_interval(k, n)
            assert 0 <= low <= k / n <= high <= 1, (k, n)


def test_an_interval_of_one_example_is_nan():
    """A mean over one example (or counted on one) got the zero-width bootstrap interval [v, v], which reads as
    certainty; every bootstrap of a mean or ratio over examples now gives NaN bounds with fewer than 2 examples
    (MIN_RESAMPLED) to resample, and finite ones from 2 examples on."""
    rng = np.random.default_rng(6)
    one, two = rng.random((1, 2, 3)), rng.random((2, 2, 3))
    assert MIN_RESAMPLED == 2
    assert np.isnan(bootstrap_mean_interval(one)).all()
    assert np.isfinite(bootstrap_mean_interval(two)).all()
    # weighted: counted examples are the units, whatever E is; per weight group
    values = rng.random((5, 2, 3))
    weights = np.array([[0, 1], [0, 1], [1, 0], [0, 0], [0, 0]], dtype=float)  # group 0: one example, group 1: two
    bounds = bootstrap_weighted_mean_interval(values, weights)
    assert np.isnan(bounds[0]).all() and np.isfinite(bounds[1]).all()
    assert np.isnan(bootstrap_weighted_mean_interval(values[:, 0, 0], weights[:, 0])).all()
    # sparse ratios: a cell held by one input, and one held by two
    counts = np.array([[2, 1], [0, 3], [0, 0]], dtype=float)
    sums = counts * rng.random((3, 2))
    ratio_bounds = bootstrap_sparse_ratio_interval(sparse.csr_matrix(sums), sparse.csr_matrix(counts))
    assert np.isnan(ratio_bounds[0]).all() and np.isfinite(ratio_bounds[1]).all()
    # class ratios: one example with maps, then two
    assert np.isnan(bootstrap_ratio_interval(np.array([[3, 1], [0, 0]]))).all()
    assert np.isfinite(bootstrap_ratio_interval(np.array([[3, 1], [1, 3]]))).all()
