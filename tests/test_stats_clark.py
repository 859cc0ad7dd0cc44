"""Clark selector masks and surface statistics on hand-made maps with known answers."""
import math

import numpy as np
import pytest
import torch

from analysis.errors import AttnpatError
from analysis.stats import (
    PROFILE_NAMES,
    HeadMeans,
    attention_on,
    attention_to,
    key_selector,
    map_profile,
    next_token_selector,
    offset_selector,
    previous_token_selector,
    same_token_selector,
)
from analysis.surface import LabelThresholds, head_labels, label_evidence, measured_label_evidence, surface_batch
from analysis.uncertainty import bootstrap_weighted_mean_interval


def one_hot_rows(targets, width):
    """(n, width) map whose row i puts all weight on key targets[i]."""
    rows = torch.zeros(len(targets), width)
    rows[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return rows


def roles_for(kinds, width):
    """token_roles-style masks from a list of kinds per position ('cls', 'sep', '.', ',', 'w'); padding after."""
    def mask(kind):
        out = torch.zeros(1, width, dtype=torch.bool)
        for i, k in enumerate(kinds):
            out[0, i] = k == kind if kind != "real" else True
        return out

    return {"cls": mask("cls"), "sep": mask("sep"), "period": mask("."), "comma": mask(","), "real": mask("real")}


def test_offset_selectors_pick_the_right_pairs_inside_real_length():
    lengths = torch.tensor([3])
    prev = previous_token_selector(lengths, 4)[0]
    nxt = next_token_selector(lengths, 4)[0]
    same = same_token_selector(lengths, 4)[0]
    assert prev.nonzero().tolist() == [[1, 0], [2, 1]]
    assert nxt.nonzero().tolist() == [[0, 1], [1, 2]]  # (2, 3) is padding
    assert same.nonzero().tolist() == [[0, 0], [1, 1], [2, 2]]
    assert torch.equal(offset_selector(lengths, 4, -1), previous_token_selector(lengths, 4))


def test_key_selector_is_sep_to_sep():
    sep = torch.tensor([[False, True, False, True]])
    selector = key_selector(sep, sep)[0]
    assert selector.nonzero().tolist() == [[1, 1], [1, 3], [3, 1], [3, 3]]


def test_attention_on_previous_token_and_sep_sep_known_values():
    # head 0 looks at the previous token (row 0 at itself); head 1 spreads row i evenly over [SEP]s 2 and 4
    prev_map = one_hot_rows([0, 0, 1, 2, 3], 5)
    sep_map = torch.zeros(5, 5)
    sep_map[:, 2] = sep_map[:, 4] = 0.5
    attn = torch.stack([prev_map, sep_map])[None, None]  # (1, 1, 2, 5, 5)
    lengths = torch.tensor([5])
    prev = attention_on(attn, previous_token_selector(lengths, 5))[0, 0]
    assert prev.tolist() == pytest.approx([1.0, 0.5 / 4])  # head 1: only row 3's previous token (2) is a [SEP]
    sep = torch.tensor([[False, False, True, False, True]])
    sep_sep = attention_on(attn, key_selector(sep, sep))[0, 0]
    # head 0: row 2 -> key 1 (no sep), row 4 -> key 3 (no sep) => 0; head 1: all on seps => 1
    assert sep_sep.tolist() == pytest.approx([0.0, 1.0])
    real = torch.ones(1, 5, dtype=torch.bool)
    assert attention_to(attn, sep, real)[0, 0].tolist() == pytest.approx([1 / 5, 1.0])  # head 0: row 3 -> [SEP] 2


def test_surface_batch_known_answers_and_padding_invariance():
    kinds = ["cls", "w", ".", "w", "sep"]
    prev_map = one_hot_rows([0, 0, 1, 2, 3], 5)  # previous token (row 0 itself)
    cls_map = one_hot_rows([0] * 5, 5)  # everything on [CLS]
    uniform = torch.full((5, 5), 0.2)
    attn = torch.stack([prev_map, cls_map, uniform])[None, None]  # (1, 1, 3, 5, 5)
    stats = surface_batch(attn, roles_for(kinds, 5), torch.tensor([5]))
    value = {name: values[0, 0].tolist() for name, (values, _) in stats.items()}
    assert value["prev"] == pytest.approx([1.0, 0.25, 0.2])  # head 1: row 1's previous token is [CLS]
    assert value["next"] == pytest.approx([0.0, 0.0, 0.2])
    assert value["self"] == pytest.approx([0.2, 0.2, 0.2])  # head 0: only row 0 attends to itself
    assert value["cls"] == pytest.approx([0.4, 1.0, 0.2])  # head 0: rows 0 and 1 hit [CLS]
    assert value["period"] == pytest.approx([0.2, 0.0, 0.2])  # row 3 -> '.'
    assert value["comma"] == pytest.approx([0.0, 0.0, 0.0])
    assert value["sep_sep"] == pytest.approx([0.0, 0.0, 0.2])
    assert value["entropy"] == pytest.approx([0.0, 0.0, math.log(5)], abs=1e-6)
    assert value["cls_entropy"] == pytest.approx([0.0, 0.0, math.log(5)], abs=1e-6)

    # the same example padded to 7 next to a longer one gives identical statistics
    padded = torch.zeros(2, 1, 3, 7, 7)
    padded[0, :, :, :5, :5] = attn[0]
    padded[1] = torch.full((1, 3, 7, 7), 1 / 7)
    roles = {name: torch.cat([torch.nn.functional.pad(mask, (0, 2)), torch.zeros(1, 7, dtype=torch.bool)])
             for name, mask in roles_for(kinds, 5).items()}
    roles["real"][1] = True
    batch = surface_batch(padded, roles, torch.tensor([5, 7]))
    for name, (values, _) in stats.items():
        assert torch.allclose(batch[name][0][0], values[0], atol=1e-6), name


def random_maps(shape, seed=0, sharpness=4.0):
    """Softmax rows of random scores, (..., n, n), with one exact-zero row of cells (a one-hot row) per map."""
    generator = torch.Generator().manual_seed(seed)
    maps = torch.softmax(torch.randn(*shape, generator=generator) * sharpness, -1)
    maps[..., 0, :] = 0.0
    maps[..., 0, 0] = 1.0
    return maps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_surface_statistics_of_half_precision_maps_are_computed_in_float32(dtype):
    # stored map shards are float16: their statistics must be those of the same values in float32
    width = 120
    attn = random_maps((2, 2, 3, width, width)).to(dtype)
    kinds = ["cls", *["w", ".", ","] * ((width - 2) // 3), "sep"]
    roles = {name: mask.expand(2, -1) for name, mask in roles_for(kinds, width).items()}
    lengths = torch.tensor([width, width])
    low = surface_batch(attn, roles, lengths)
    exact = surface_batch(attn.float(), roles, lengths)
    for name, (values, _) in exact.items():
        assert low[name][0].dtype == torch.float32, name
        torch.testing.assert_close(low[name][0], values, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_map_profile_of_half_precision_maps_is_the_float32_profile(dtype):
    maps = random_maps((4, 30, 30), seed=1).to(dtype)  # row 0 one-hot: cells of exactly 0
    profile = map_profile(maps)
    assert not torch.isnan(profile).any()  # before: float16 flushed the log's 1e-30 floor to 0, NaN broadness
    torch.testing.assert_close(profile, map_profile(maps.float()), rtol=0, atol=1e-6)


def test_map_profile_band_averages_over_all_rows_as_documented():
    n = 8
    previous = one_hot_rows([0, *range(n - 1)], n)  # all mass on the previous token, row 0 on itself
    profile = dict(zip(PROFILE_NAMES, map_profile(previous[None])[0].tolist()))
    assert profile["band-1"] == pytest.approx((n - 1) / n)  # row 0 has no previous token and counts 0
    assert profile["band+0"] == pytest.approx(1 / n)
    assert profile["band+1"] == 0.0
    # analysis.surface's prev averages over the rows that have a previous token
    kinds = ["cls", *["w"] * (n - 2), "sep"]
    stats = surface_batch(previous[None, None, None], roles_for(kinds, n), torch.tensor([n]))
    assert stats["prev"][0].item() == pytest.approx(1.0)


def test_head_labels_follow_thresholds_and_clark_precedence():
    zeros = np.zeros((1, 6))
    values = {name: zeros.copy() for name in ("prev", "next", "cls", "sep", "period", "comma")}
    values["entropy"] = np.full((1, 6), 1.0)
    values["next"][0, 0] = 0.6
    values["prev"][0, 1] = 0.6
    values["entropy"][0, 2] = 4.0
    values["cls"][0, 3] = 0.7
    values["period"][0, 4], values["comma"][0, 4] = 0.4, 0.3  # together above 0.6
    values["prev"][0, 5], values["sep"][0, 5] = 0.9, 0.9  # [SEP] overrides prev (Clark's order)
    labels = head_labels(values)
    assert labels.tolist() == [["next", "prev", "broad", "cls", "punct", "sep"]]
    strict = head_labels(values, LabelThresholds(broad=5.0, position=0.95, special=0.95))
    assert strict.tolist() == [["other"] * 6]


def test_label_evidence_is_certain_only_when_no_value_in_the_intervals_changes_the_label():
    """head_labels.csv and clusters.csv carried a bare label. Each label now carries the statistic that decided it
    with its interval, and is certain only when no value inside the rules' intervals gives another label."""
    names = ("prev", "next", "cls", "sep", "period", "comma", "punct", "entropy")
    values = {name: np.zeros((1, 5)) for name in names}
    values["entropy"][:] = 1.0
    intervals = {name: np.stack([values[name], values[name]], -1) for name in names}

    def head(index, name, value, low, high):
        values[name][0, index] = value
        intervals[name][0, index] = (low, high)

    head(0, "prev", 0.8, 0.7, 0.9)  # prev, clear of 0.5 and of every later rule: certain
    head(1, "prev", 0.55, 0.45, 0.65)  # prev, but its interval reaches below 0.5
    head(2, "sep", 0.58, 0.50, 0.70)  # other, but [SEP] may pass 0.6
    head(3, "prev", 0.8, 0.7, 0.9)
    head(3, "sep", 0.3, 0.2, 0.61)  # prev for sure, but the later [SEP] rule may override it
    head(4, "entropy", 4.2, 3.9, 4.5)  # broad; an earlier rule's interval does not matter
    head(4, "next", 0.45, 0.40, 0.55)
    table = label_evidence(values, intervals)
    assert table.label.tolist() == ["prev", "prev", "other", "prev", "broad"]
    assert table.certain.tolist() == [True, False, False, False, True]
    assert table.statistic.tolist() == ["prev", "prev", "", "prev", "entropy"]
    assert table.loc[0, ["value", "ci_low", "ci_high", "threshold"]].tolist() == pytest.approx([0.8, 0.7, 0.9, 0.5])
    assert np.isnan(table.loc[2, "value"]) and np.isnan(table.loc[2, "threshold"])
    # one example: a bootstrap measures nothing, so no interval and no certain label
    one = measured_label_evidence(values, intervals, 1)
    assert not one.certain.any() and one.loc[0, ["ci_low", "ci_high"]].isna().all()
    assert one.label.tolist() == table.label.tolist()


# ---------------------------------------------------------------- HeadMeans: means with bootstrap intervals

def direct_bootstrap(values, weights, n_boot=1000, seed=0):
    """The percentile bootstrap written out: (n_boot, E) example draws, the weighted mean of each draw (the ratio of
    the resampled sums), its 2.5th and 97.5th percentiles. values: (E, ...); weights: (E,). Returns (..., 2)."""
    draws = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
    picked = np.where(weights[:, None, None] > 0, values, 0.0)[draws] * weights[draws][:, :, None, None]
    means = picked.sum(1) / weights[draws].sum(1)[:, None, None]
    return np.moveaxis(np.percentile(means, [2.5, 97.5], axis=0), 0, -1)


def streamed(values, include=None, batch=7):
    """HeadMeans fed (E, L, H) values batch by batch, as a map stream feeds it."""
    means = HeadMeans()
    for start in range(0, len(values), batch):
        part = None if include is None else torch.from_numpy(include[start:start + batch])
        means.add("stat", torch.from_numpy(values[start:start + batch]), include=part)
    return means


def test_head_means_interval_contains_the_mean_narrows_with_examples_and_is_the_percentile_bootstrap():
    """overview, special and surface reported bare per-head means; each now carries a percentile bootstrap 95%
    interval over the examples, the one a direct bootstrap with the same seed gives."""
    rng = np.random.default_rng(0)
    values = rng.beta(2, 5, size=(400, 2, 3))  # (E, L, H) skewed shares
    few, many = streamed(values[:25]), streamed(values)
    for means, part in ((few, values[:25]), (many, values)):
        mean, interval = means.result()["stat"], means.intervals()["stat"]
        assert mean == pytest.approx(part.mean(0), abs=1e-12) and interval.shape == (2, 3, 2)
        assert np.all(interval[..., 0] < mean) and np.all(mean < interval[..., 1])
        assert interval == pytest.approx(direct_bootstrap(part, np.ones(len(part))), abs=1e-12)
    widths = [np.diff(means.intervals()["stat"], axis=-1) for means in (few, many)]
    assert np.all(widths[1] < 0.6 * widths[0])  # 16x the examples: about a quarter of the width
    # each layer's mean over its heads: the per-example layer means on the same draws
    layers = many.layer_intervals()["stat"]
    assert layers.shape == (2, 2)
    assert layers == pytest.approx(direct_bootstrap(values.mean(-1)[:, :, None], np.ones(400))[:, 0], abs=1e-12)


def test_the_model_wide_mean_and_the_layer_table_carry_the_same_draws_intervals():
    """special printed the mean over every head and surface each layer's mean as bare numbers; HeadMeans now gives
    their intervals: the per-example means over the heads (or layers and heads), bootstrapped on the same draws,
    counting only the examples that have the feature."""
    rng = np.random.default_rng(2)
    values = rng.beta(2, 5, size=(80, 3, 4))  # (E, L, H)
    include = rng.random(80) < 0.5
    for means, weights in ((streamed(values), np.ones(80)), (streamed(values, include), include.astype(float))):
        overall = means.model_intervals()["stat"]
        counted_mean = values[weights > 0].mean()
        assert overall.shape == (2,) and overall[0] < counted_mean < overall[1]
        per_example = values.mean((1, 2))[:, None, None]
        assert overall == pytest.approx(direct_bootstrap(per_example, weights)[0, 0], abs=1e-12)
        table = means.layer_table()
        assert list(table.columns) == ["layer", "stat", "stat_ci_low", "stat_ci_high"] and len(table) == 3
        assert table.stat.to_numpy() == pytest.approx(means.result()["stat"].mean(1), abs=1e-12)
        layers = direct_bootstrap(values.mean(-1)[:, :, None], weights)[:, 0]
        assert table[["stat_ci_low", "stat_ci_high"]].to_numpy() == pytest.approx(layers, abs=1e-12)


def test_include_masked_statistics_resample_only_counted_examples():
    """A statistic counted only on the examples that have a feature: each draw takes the ratio of the resampled
    sums of the counted examples; what the other examples hold (here NaN or huge) never enters the interval."""
    rng = np.random.default_rng(1)
    values = rng.random((60, 2, 2))
    include = rng.random(60) < 0.3
    counted = values[include]
    noisy = values.copy()
    noisy[~include] = np.nan
    noisy[np.flatnonzero(~include)[:5]] = 1e6
    means = streamed(noisy, include)
    interval = means.intervals()["stat"]
    assert means.result()["stat"] == pytest.approx(counted.mean(0), abs=1e-12)
    assert interval == pytest.approx(direct_bootstrap(values, include.astype(float)), abs=1e-12)
    assert np.all(counted.min(0) <= interval[..., 0]) and np.all(interval[..., 1] <= counted.max(0))
    assert np.all(interval[..., 0] <= counted.mean(0)) and np.all(counted.mean(0) <= interval[..., 1])
    # none counted: no interval (one counted: test_head_means_of_one_counted_example_have_no_interval)
    assert np.isnan(streamed(values, np.zeros(60, bool)).intervals()["stat"]).all()


def test_head_means_of_one_counted_example_have_no_interval():
    """A mean counted on one example (a feature of one input, surface --n 1) got the zero-width interval [v, v]
    (every draw that holds the example gives its value), which reads as certainty; now its bounds are NaN, as
    cls_last_layer.csv leaves a token of one input, for every head, layer and the model-wide mean. Two counted
    examples give finite bounds."""
    values = np.random.default_rng(3).random((6, 2, 3))
    single, pair = np.zeros(6, bool), np.zeros(6, bool)
    single[4] = True
    pair[[1, 4]] = True
    for means, value in ((streamed(values, single), values[4]), (streamed(values[:1]), values[0])):
        assert means.result()["stat"] == pytest.approx(value)  # the mean stays
        for intervals in (means.intervals(), means.layer_intervals(), means.model_intervals()):
            assert np.isnan(intervals["stat"]).all()
        assert means.layer_table()[["stat_ci_low", "stat_ci_high"]].isna().all().all()
    bounds = streamed(values, pair).intervals()["stat"]
    assert np.isfinite(bounds).all() and (bounds[..., 0] < bounds[..., 1]).all()


def test_statistics_of_the_same_examples_share_the_draws():
    rng = np.random.default_rng(2)
    values = rng.random((30, 1, 2))
    means = HeadMeans()
    means.add("a", torch.from_numpy(values))
    means.add("b", torch.from_numpy(values * 2))
    intervals = means.intervals()
    assert intervals["b"] == pytest.approx(2 * intervals["a"], abs=1e-12)
    with pytest.raises(AttnpatError, match="do not lead"):
        bootstrap_weighted_mean_interval(values, np.ones(29))
