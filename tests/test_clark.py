"""Clark et al. analyses: JS divergence and clustering, gradient importance, the surface pass and the CLI verbs."""
import json
import math
import warnings
from dataclasses import asdict

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import (
    AttentionInterface,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    DistilBertConfig,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from analysis import clustering
from analysis.clustering import (
    DEFAULT_THRESHOLDS,
    compute_head_distances,
    distance_intervals,
    head_clusters,
    head_js_divergences,
    js_divergence,
    kruskal_points_within,
    kruskal_reading,
    kruskal_stress,
    layout_radii,
    mds_embedding,
    pair_matrix,
    pair_values,
    plot_spread,
    position_stability,
    procrustes_align,
    smooth,
    split_half_correlation,
    stress_interval,
)
from analysis.data import Example, TaskData, load_data
from analysis.errors import AttnpatError
from analysis.figures import close
from analysis.gradients import (
    GRAD_TARGETS,
    attention_gradients,
    compute_grad_importance,
    example_generator,
    grad_importance,
    gradient_by_key_type,
    key_type_means,
    load_gradient_model,
    mask_tokens,
    per_example_mlm_loss,
)
from analysis.models import load_model
from analysis.rundir import RunDir
from analysis.stream import check_has_text, encode_examples, iter_batches
from analysis.surface import SURFACE_METRICS, compute_surface, entropy_figure, surface_figure, surface_statistics
from app import cli_clark
from app.cli import main
from app.cli_clark import _stress_line
from app.display import layer_interval_lines
from app.run_browser import cluster_fit_notes
from tests.test_importance import half_written
from tests.tiny import minilm_tokenizer, save_tiny_model, tiny_config, wrap_bundle

SENTENCES = [
    Example("a", "The cat sat on the mat, and the dog barked.", "It was late."),
    Example("b", "Attention heads look at [SEP] a lot.", "Do they?"),
    Example("c", "Short one.", "Another, longer, second segment follows here."),
]


def head_array(table, metric):
    """(L, H) array of one metric from a long surface table."""
    return table[table.metric == metric].pivot(index="layer", columns="head", values="value").to_numpy()


# ---------------------------------------------------------------- JS divergence and clustering

def test_js_divergence_identical_is_zero_and_disjoint_is_near_log2():
    p = torch.softmax(torch.randn(5, 7), -1)
    assert torch.allclose(js_divergence(p, p), torch.zeros(5), atol=1e-7)
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    # smoothing keeps it just below log 2, the maximum for disjoint distributions
    assert math.log(2) - 0.01 < float(js_divergence(a, b)) < math.log(2)
    assert float(js_divergence(a, b)) == pytest.approx(float(js_divergence(b, a)))


def test_js_divergence_without_smoothing_is_exact_on_hand_made_rows_with_zeros():
    """Unsmoothed, one-hot rows with a zero in common (0 log 0, and 0 / 0 in the mixture) give the textbook values:
    0 for identical rows, log 2 for disjoint ones, and the hand-computed value for a half overlap (before: NaN)."""
    one, two = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    half = torch.tensor([0.5, 0.5, 0.0])
    assert float(js_divergence(one, one, smoothing=0)) == 0
    assert float(js_divergence(one, two, smoothing=0)) == pytest.approx(math.log(2), abs=1e-6)
    # m = (0.75, 0.25, 0): (1 log(1 / 0.75) + 0.5 log(0.5 / 0.75) + 0.5 log(0.5 / 0.25)) / 2
    by_hand = (math.log(1 / 0.75) + 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)) / 2
    assert float(js_divergence(one, half, smoothing=0)) == pytest.approx(by_hand, abs=1e-6)
    # heads as (K, n, n) maps: every query row of head 0 is one-hot and disjoint from head 1's, equal to head 2's
    maps = torch.stack([torch.eye(3), torch.eye(3)[[1, 2, 0]], torch.eye(3)])
    matrix = head_js_divergences(maps, smoothing=0)
    assert torch.isfinite(matrix).all()
    assert matrix[0, 1] == pytest.approx(math.log(2), abs=1e-6) and matrix[0, 2] == pytest.approx(0, abs=1e-7)


def test_smoothing_matches_clark():
    p = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert smooth(p).tolist() == pytest.approx([0.999 + 0.001 / 4, 0.001 / 4, 0.001 / 4, 0.001 / 4])


def test_head_js_divergences_match_pairwise_definition():
    torch.manual_seed(0)
    maps = torch.softmax(torch.randn(5, 6, 6) * 3, -1)
    maps[3] = maps[1]  # two identical heads
    matrix = head_js_divergences(maps)
    expected = torch.stack([torch.stack([js_divergence(maps[i], maps[j]).mean() for j in range(5)]) for i in range(5)])
    assert torch.allclose(matrix, expected.double(), atol=1e-5)
    assert matrix[1, 3] == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(matrix, matrix.T)
    assert (matrix[~torch.eye(5, dtype=torch.bool)] >= 0).all()


def test_mds_places_identical_heads_together():
    distances = np.array([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=float)
    points = mds_embedding(distances)
    assert points.shape == (4, 2)
    assert np.linalg.norm(points[0] - points[1]) < 0.1 * np.linalg.norm(points[0] - points[2])
    with pytest.raises(AttnpatError):
        mds_embedding(np.ones((3, 4)))


def test_kruskal_stress_is_zero_for_an_exact_layout_and_the_hand_computed_gap_otherwise():
    square = np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    exact = np.linalg.norm(square[:, None] - square[None], axis=-1)
    assert kruskal_stress(exact, square) == pytest.approx(0, abs=1e-12)
    assert kruskal_stress(exact, mds_embedding(exact)) < 1e-4  # a 2-D configuration: MDS recovers it
    # two heads 2 apart drawn 1 apart: sqrt((2 - 1)^2 / 2^2)
    assert kruskal_stress(np.array([[0.0, 2.0], [2.0, 0.0]]), square[:2]) == pytest.approx(0.5)
    # four equidistant heads have no exact 2-D layout: the best one misses part of the distances
    simplex = 1 - np.eye(4)
    assert 0.05 < kruskal_stress(simplex, mds_embedding(simplex)) < 0.5
    assert kruskal_stress(np.zeros((3, 3)), np.zeros((3, 2))) == 0
    rounding = pair_matrix(np.full(3, 1e-7), 3)  # heads alike but for float32 rounding: the one-point layout is exact
    assert kruskal_stress(rounding, mds_embedding(rounding)) == 0
    # examples that all agree: every bootstrap draw has the full-data divergences, so the interval is one point
    per_example = np.tile(pair_values(torch.from_numpy(simplex)).numpy(), (5, 1))
    points = mds_embedding(simplex)
    bounds = stress_interval(per_example, np.stack([points] * 20))
    assert bounds == pytest.approx([kruskal_stress(simplex, points)] * 2)


@pytest.mark.parametrize("stress, reading", [
    (0.0, "perfect"), (0.01, "excellent"), (0.025, "excellent"), (0.03, "excellent to good"),
    (0.05, "excellent to good"), (0.07, "good to fair"), (0.1, "good to fair"),
    (0.15, "fair to poor"), (0.2, "fair to poor"), (0.35, "poor"),
])
def test_kruskal_reading_bands_stress_between_the_guides_points(stress, reading):
    assert kruskal_reading(stress) == reading


def test_a_stress_interval_straddles_the_guides_points_where_its_ends_read_apart():
    for low, high in ((0.02, 0.04), (0.06, 0.1), (0.11, 0.19), (0.19, 0.21), (0.04, 0.12), (0.1, 0.12), (0.3, 0.4)):
        straddled = kruskal_points_within(low, high)
        assert (kruskal_reading(low) != kruskal_reading(high)) == bool(straddled), (low, high)
    assert kruskal_points_within(0.04, 0.12) == (0.05, 0.1)
    assert kruskal_points_within(0.19, 0.21) == (0.2,)
    assert kruskal_points_within(0.02, 0.04) == (0.025,)


def test_the_cli_and_the_web_app_read_the_stress_with_the_same_words_of_kruskals_whole_guide():
    """The cluster verb's stress line gave the number with no reading, and the guide without 0.025 excellent and
    0 perfect; it and the web app's fit note now end in analysis.clustering.stress_reading's words."""
    record = {"mds_stress": 0.0312, "mds_stress_interval": [0.021, 0.043]}
    words = ("excellent to good by Kruskal's guide (0 perfect, 0.025 excellent, 0.05 good, 0.1 fair, 0.2 poor; "
             "its interval straddles 0.025)")
    assert _stress_line(record).endswith(", " + words)
    assert cluster_fit_notes({"analyses": {"clusters": record}})[0].endswith(", " + words)
    assert _stress_line({"mds_stress": 0.0, "mds_stress_interval": None}).endswith(
        "perfect by Kruskal's guide (0 perfect, 0.025 excellent, 0.05 good, 0.1 fair, 0.2 poor)")


def test_mds_of_heads_that_all_attend_alike_is_one_point_without_warnings():
    """One head, or heads whose divergences are all 0, made scikit-learn's MDS divide by a zero total distance
    thousands of times (RuntimeWarnings on the terminal). Every head now lies at the origin, the exact embedding."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mds_embedding(np.zeros((4, 4))).tolist() == [[0.0, 0.0]] * 4
        assert mds_embedding(np.full((3, 3), 1e-8) - np.diag([1e-8] * 3)).tolist() == [[0.0, 0.0]] * 3
        assert mds_embedding(np.zeros((1, 1))).tolist() == [[0.0, 0.0]]


def test_head_distance_stability_split_half_and_pair_intervals():
    """Clark's clustering carried no uncertainty. The split-half correlation is near 1 when every example shows
    the same distances and near 0 for noise; each pair's bootstrap interval holds its mean; both need 2 examples."""
    rng = np.random.default_rng(0)
    structure = rng.random(28)  # 8 heads: 28 pairs
    steady = structure + 0.01 * rng.standard_normal((40, 28))
    assert split_half_correlation(steady) > 0.99
    assert abs(split_half_correlation(rng.random((40, 28)))) < 0.5
    assert math.isnan(split_half_correlation(steady[:1]))
    assert math.isnan(split_half_correlation(np.zeros((6, 28))))  # all heads alike: r undefined
    bounds = distance_intervals(steady, 8)
    mean = pair_matrix(steady.mean(0), 8)
    assert bounds.shape == (8, 8, 2) and (np.diagonal(bounds, axis1=0, axis2=1) == 0).all()
    off = ~np.eye(8, dtype=bool)
    assert (bounds[..., 0][off] < mean[off]).all() and (mean[off] < bounds[..., 1][off]).all()
    assert np.array_equal(bounds, bounds.transpose(1, 0, 2))
    assert np.isnan(distance_intervals(steady[:1], 8)[off]).all()


def test_procrustes_alignment_recovers_a_rotated_reflected_and_shifted_copy_exactly():
    """MDS fixes positions only up to a rotation, reflection and translation: the alignment undoes any of them
    (and does not rescale)."""
    points = np.random.default_rng(1).standard_normal((9, 2))
    angle = 0.7
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    for motion in (rotation, rotation @ np.diag([1.0, -1.0])):  # a rotation, then a rotation with a reflection
        moved = points @ motion + np.array([3.0, -2.0])
        assert np.allclose(procrustes_align(moved, points), points, atol=1e-12)
    shrunk = procrustes_align(0.5 * points, points)  # no scaling: half the spread stays half
    assert plot_spread(shrunk) == pytest.approx(0.5 * plot_spread(points))


def head_groups_per_example(noise: float, examples: int = 40, seed: int = 0) -> np.ndarray:
    """(E, P) per-example divergences of 9 heads in three well-separated groups, plus per-example noise."""
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, 0.9]])
    positions = np.repeat(centres, 3, axis=0) + 0.03 * rng.standard_normal((9, 2))
    distances = np.linalg.norm(positions[:, None] - positions[None], axis=-1)
    return np.abs(pair_values(torch.tensor(distances)).numpy() + noise * rng.standard_normal((examples, 36)))


def test_position_radii_are_small_for_separated_groups_and_large_for_noise():
    """The MDS positions had no stability of their own. Each head's bootstrap radius (aligned MDS refits over
    resampled examples) is now small against the plot's spread when three groups are well separated, and of the
    spread's size when the distances are noise; one example gives no radius."""
    grouped = head_groups_per_example(noise=0.05)
    noise_only = np.random.default_rng(2).random((40, 36))
    relative = {}
    for name, per_example in (("grouped", grouped), ("noise", noise_only)):
        points = mds_embedding(pair_matrix(per_example.mean(0), 9))
        radii = position_stability(per_example, points, n_boot=20)
        assert radii.shape == (9,) and (radii > 0).all()
        relative[name] = np.median(radii) / plot_spread(points)
    assert relative["grouped"] < 0.1 < 0.5 < relative["noise"]
    assert np.isnan(position_stability(grouped[:1], np.zeros((9, 2)))).all()


def test_position_radii_measure_the_data_not_which_local_optimum_a_random_start_reaches():
    """MDS of near-equal distances has many near-equal optima: refitted from other random starts, the same
    distances move the heads (layout radii > 0). Examples that all agree leave nothing to resample, so the
    bootstrap radii, refitted from the full-data positions, stay at 0 (before, refits from random starts gave
    them the optimiser's ambiguity)."""
    distances = np.random.default_rng(2).random(66)  # 12 heads, distances without a 2-D shape
    per_example = np.tile(distances, (20, 1))  # every example the same: no sampling uncertainty at all
    points = mds_embedding(pair_matrix(distances, 12))
    layout = layout_radii(pair_matrix(distances, 12), points)
    assert layout.shape == (12,) and np.median(layout) > 0.3 * plot_spread(points)
    # positions from another start's optimum: refits from random starts (seed 0) would land far from them
    other = procrustes_align(mds_embedding(pair_matrix(distances, 12), seed=1), points)
    assert np.linalg.norm(other - points, axis=1).max() > 0.3 * plot_spread(points)  # some heads sit elsewhere
    for reference in (points, other):
        assert np.allclose(position_stability(per_example, reference, n_boot=5), 0, atol=1e-4)
    assert np.allclose(layout_radii(np.zeros((9, 9)), np.zeros((9, 2))), 0)


def test_layout_radii_refit_from_starts_other_than_the_reference_seeds():
    """With --seed 3 the layout radii come from seeds 4-8: none repeats the reference's own starts (before, the
    fixed seeds 1-5 included 3, a refit identical to the reference, so one of the five counted for nothing)."""
    distances = pair_matrix(np.random.default_rng(2).random(66), 12)
    points = mds_embedding(distances, seed=3)
    moved = [np.linalg.norm(procrustes_align(mds_embedding(distances, seed), points) - points, axis=1)
             for seed in range(4, 9)]
    assert np.allclose(layout_radii(distances, points, seed=3), np.max(moved, axis=0))
    assert all(np.median(radii) > 0 for radii in moved)  # every refit is another start's layout


def test_cluster_verb_on_heads_that_attend_alike_and_one_example(tmp_path, capsys):
    """`attnpat cluster --n 1` on a model whose heads all attend uniformly (zero queries): exit 0, no sklearn
    warnings; the output says every head lies at one point and that stability needs 2 examples."""
    torch.manual_seed(0)
    model = BertModel(tiny_config(), add_pooling_layer=False)
    for layer in model.encoder.layer:  # q = 0: every score equal, every row uniform, every head alike
        torch.nn.init.zeros_(layer.attention.self.query.weight)
        torch.nn.init.zeros_(layer.attention.self.query.bias)
    model.save_pretrained(tmp_path / "same")
    minilm_tokenizer().save_pretrained(tmp_path / "same")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert main(["cluster", "--model", str(tmp_path / "same"), "--task", "wiki", "--n", "1", "-q",
                     "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "all heads embedded at one point" in out and "stability: needs at least 2 examples" in out
    assert "positions: no radius (needs at least 2 examples" in out
    assert "MDS fit: Kruskal stress-1 0.000 (RMS gap" in out  # no interval from one example
    clusters = pd.read_csv(tmp_path / "runs" / "same" / "wiki" / "clusters.csv")
    assert (clusters[["x", "y"]].to_numpy() == 0).all() and not clusters.certain.any()
    assert clusters.position_radius.isna().all()
    distances = pd.read_csv(tmp_path / "runs" / "same" / "wiki" / "head_distances.csv")
    assert (distances.value.abs() < 1e-6).all()


def test_head_clusters_on_a_tiny_model_write_the_tables(tokenizer, tmp_path):
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    data = TaskData("toy", "validation", "test", SENTENCES)
    run = RunDir(bundle.slug, "toy", tmp_path)
    clusters = head_clusters(bundle, data, run, progress=False)
    assert list(clusters.columns) == ["layer", "head", "x", "y", "position_radius", "behaviour", "statistic",
                                      "value", "ci_low", "ci_high", "threshold", "certain"]
    assert len(clusters) == 8 and np.isfinite(clusters[["x", "y"]].to_numpy()).all()
    distances = pd.read_csv(run.file("head_distances.csv"))
    assert len(distances) == 64
    assert (distances.query("layer == other_layer and head == other_head").value == 0).all()
    # every pair's divergence carries its bootstrap interval over the 3 examples, and the run its split-half r
    off = distances.query("layer != other_layer or head != other_head")
    assert (off.ci_low <= off.value + 1e-9).all() and (off.value <= off.ci_high + 1e-9).all()
    assert (off.ci_high > off.ci_low).all()
    record = run.manifest()["analyses"]["clusters"]
    assert -1 <= record["split_half_correlation"] <= 1 and not record["all_identical"]
    # each head's position carries its bootstrap radius, summarised against the plot's spread
    assert (clusters.position_radius > 0).all() and np.isfinite(clusters.position_radius).all()
    assert record["median_position_radius"] == pytest.approx(clusters.position_radius.median())
    assert record["median_radius_to_spread"] == pytest.approx(record["median_position_radius"] / record["plot_spread"])
    assert record["median_layout_radius"] >= 0 and "other random starts" in record["layout_note"]
    assert sum(record["label_counts"].values()) == 8
    for suffix in ("png", "svg"):
        assert run.file(f"clusters.{suffix}").stat().st_size > 0
    # the thresholds behind the behaviour column are recorded, as surface records them
    assert run.manifest()["analyses"]["clusters"]["thresholds"] == asdict(DEFAULT_THRESHOLDS)


def test_head_distances_cover_every_real_query_row_and_no_padding(tokenizer):
    """As documented: each input's divergences are the mean over its real rows, [CLS] and [SEP] included, and
    padding (batched with longer inputs) changes nothing."""
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(initializer_range=0.5), add_pooling_layer=False))
    data = TaskData("toy", "validation", "test", SENTENCES)
    alone, padded = (compute_head_distances(bundle, data, batch_size=size, progress=False).per_example
                     for size in (1, 3))
    assert np.allclose(alone, padded, atol=1e-5)
    batch = next(iter_batches(bundle, SENTENCES[:1], batch_size=1))
    maps = bundle.model(**{key: value for key, value in batch.__dict__.items()
                           if key in ("input_ids", "attention_mask", "token_type_ids")},
                        output_attentions=True).attentions
    every_row = torch.stack(maps, 1)[0].reshape(8, *maps[0].shape[-2:])  # (K, n, n), [CLS] ... [SEP] [SEP]
    assert batch.input_ids[0, 0] == tokenizer.cls_token_id and batch.input_ids[0, -1] == tokenizer.sep_token_id
    first = compute_head_distances(bundle, TaskData("toy", "validation", "test", SENTENCES[:1]), progress=False)
    assert np.allclose(first.per_example[0], pair_values(head_js_divergences(every_row.detach())).numpy(), atol=1e-5)
    assert any(np.allclose(first.per_example[0], row, atol=1e-5) for row in padded)  # the stream orders by length


def test_cluster_reports_the_layouts_stress_and_is_the_same_run_to_run(tmp_path):
    """The MDS is seeded: two runs write identical positions; the manifest's stress is the figure's layout's."""
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    data = TaskData("toy", "validation", "test", SENTENCES)
    runs = [RunDir(bundle.slug, "toy", tmp_path / name) for name in ("one", "two")]
    first, second = (head_clusters(bundle, data, run, progress=False) for run in runs)
    pd.testing.assert_frame_equal(first, second)
    pairs = pd.read_csv(runs[0].file("head_distances.csv"))
    distances = pairs.value.to_numpy().reshape(len(first), len(first))
    record = runs[0].manifest()["analyses"]["clusters"]
    stress = record["mds_stress"]
    assert stress == pytest.approx(kruskal_stress(distances, first[["x", "y"]].to_numpy()), abs=1e-6)
    assert 0 < stress < 1
    low, high = record["mds_stress_interval"]  # over the bootstrap draws of the examples
    assert 0 < low < high < 1 and record == runs[1].manifest()["analyses"]["clusters"] | {
        key: record[key] for key in ("command", "started", "finished", "elapsed_seconds")}


def stream_stopped_after(monkeypatch, batches: int) -> None:
    """Make the cluster pass's map stream raise Ctrl-C once ``batches`` batches were consumed (their divergences
    kept): a stop between two batches."""
    stream = clustering.stream_maps

    def stopping(*args, **kwargs):
        for position, map_batch in enumerate(stream(*args, **kwargs)):
            if position == batches:
                raise KeyboardInterrupt
            yield map_batch

    monkeypatch.setattr(clustering, "stream_maps", stopping)


def divergence_calls(monkeypatch) -> list[int]:
    """One entry per example whose head divergences are computed from now on."""
    compute, calls = clustering.head_js_divergences, []

    def counting(maps, *args, **kwargs):
        calls.append(1)
        return compute(maps, *args, **kwargs)

    monkeypatch.setattr(clustering, "head_js_divergences", counting)
    return calls


def batches_streamed(monkeypatch) -> list[list[int]]:
    """The example indices of every batch of maps the cluster pass streams from now on."""
    stream, streamed = clustering.stream_maps, []

    def counting(*args, **kwargs):
        for map_batch in stream(*args, **kwargs):
            streamed.append(map_batch.batch.indices)
            yield map_batch

    monkeypatch.setattr(clustering, "stream_maps", counting)
    return streamed


def test_cluster_stopped_and_rerun_resumes_to_the_tables_of_one_run(tmp_path, monkeypatch, capsys):
    """`attnpat cluster` stopped by Ctrl-C after 2 of 4 batches: the rerun computes the divergences of the other 4
    inputs only, says 4 were resumed, and writes the CSVs of an uninterrupted run byte for byte; a stopped run
    leaves no table, manifest entry or temporary file. Kept batches of other settings (--max-length) are
    discarded, not resumed (before, every stop started over)."""
    model = str(save_tiny_model(tmp_path / "tiny", initializer_range=0.5))
    args = ["cluster", "--model", model, "--task", "wiki", "--n", "8", "--batch-size", "2", "-q"]

    def cluster(runs: str, *extra: str) -> int:
        return main([*args, "--runs-dir", str(tmp_path / runs), *extra])

    def tables(runs: str) -> list[bytes]:
        return [(tmp_path / runs / "tiny" / "wiki" / f"{name}.csv").read_bytes()
                for name in ("clusters", "head_distances")]

    assert cluster("whole") == 0
    capsys.readouterr()
    stream_stopped_after(monkeypatch, 2)
    for runs, extra in (("stopped", ()), ("other", ("--max-length", "64"))):
        assert cluster(runs, *extra) == 130
        folder = tmp_path / runs / "tiny" / "wiki"
        assert not (folder / "clusters.csv").exists() and half_written(folder) == []
        assert "clusters" not in RunDir("tiny", "wiki", tmp_path / runs).manifest().get("analyses", {})
        assert len(list((folder / ".clusters").glob("v-*.json"))) == 2
    monkeypatch.undo()
    calls, streamed = divergence_calls(monkeypatch), batches_streamed(monkeypatch)
    capsys.readouterr()
    assert cluster("stopped") == 0
    assert len(calls) == 4 and "resumed: the divergences and surface statistics of 4 of the 8 inputs" in \
        capsys.readouterr().out
    assert len(streamed) == 2  # the maps of the 2 batches not kept only
    assert not (tmp_path / "stopped" / "tiny" / "wiki" / ".clusters").exists()  # the finished run's kept batches
    assert tables("stopped") == tables("whole")
    assert RunDir("tiny", "wiki", tmp_path / "stopped").manifest()["analyses"]["clusters"]["resumed_examples"] == 4
    calls.clear()
    assert cluster("other") == 0  # the kept batches were made with another --max-length: computed again
    assert len(calls) == 8 and "resumed:" not in capsys.readouterr().out
    assert tables("other") == tables("whole") and half_written(tmp_path / "other") == []


def test_a_resumed_cluster_pass_streams_only_the_batches_it_lacks(tokenizer, tmp_path, monkeypatch):
    """The kept batches hold the surface statistics beside the divergences, so a rerun streams the maps of the
    batches it lacks only (before, every map again: 3 of 3 batches here), and measures what one pass does, to the
    bit; a record of an attnpat that kept the divergences only is streamed again."""
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    data = TaskData("toy", "validation", "test", SENTENCES)
    folder = tmp_path / ".clusters"
    streamed = batches_streamed(monkeypatch)
    whole = compute_head_distances(bundle, data, batch_size=1, progress=False, resume_folder=folder)
    order = list(streamed)
    assert len(order) == 3 and whole.n_resumed == 0
    (folder / "v-batch-1.json").unlink()  # a run stopped before its second batch was kept
    streamed.clear()
    resumed = compute_head_distances(bundle, data, batch_size=1, progress=False, resume_folder=folder)
    assert streamed == [order[1]] and resumed.n_resumed == 2
    for name in ("mean", "intervals", "per_example"):
        assert np.array_equal(getattr(resumed, name), getattr(whole, name)), name
    pd.testing.assert_frame_equal(resumed.labels, whole.labels, check_exact=True)
    assert (resumed.uniform_entropy, resumed.split_half_r) == (whole.uniform_entropy, whole.split_half_r)
    older = json.loads((folder / "v-batch-2.json").read_text())
    del older["surface"]
    (folder / "v-batch-2.json").write_text(json.dumps(older))
    streamed.clear()
    again = compute_head_distances(bundle, data, batch_size=1, progress=False, resume_folder=folder)
    assert streamed == [order[2]] and again.n_resumed == 2
    pd.testing.assert_frame_equal(again.labels, whole.labels, check_exact=True)
    streamed.clear()
    assert compute_head_distances(bundle, data, batch_size=1, progress=False, resume_folder=folder).n_resumed == 3
    assert streamed == []


def test_a_finished_cluster_run_removes_its_kept_batches_and_a_failed_one_keeps_them(tokenizer, tmp_path,
                                                                                     monkeypatch):
    """`.clusters/` was left in the run folder after a finished run; it now goes when the tables and figure land,
    and stays (for the rerun to resume) when the run fails after its maps were streamed, the figure unwritten."""
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    data = TaskData("toy", "validation", "test", SENTENCES)
    run = RunDir(bundle.slug, "toy", tmp_path)
    kept = run.file(clustering.RESUME_FOLDER)
    failing = {"figure": True}
    figure = clustering.cluster_figure

    def cluster_figure(*args, **kwargs):
        if failing["figure"]:
            raise OSError("disk full")
        return figure(*args, **kwargs)

    monkeypatch.setattr(clustering, "cluster_figure", cluster_figure)
    with pytest.raises(OSError, match="disk full"):
        head_clusters(bundle, data, run, batch_size=1, progress=False)
    assert len(list(kept.glob("v-batch-*.json"))) == 3 and not run.file("clusters.csv").exists()
    failing["figure"] = False
    streamed = batches_streamed(monkeypatch)
    head_clusters(bundle, data, run, batch_size=1, progress=False)
    assert streamed == [] and run.manifest()["analyses"]["clusters"]["resumed_examples"] == 3
    assert run.file("clusters.csv").is_file() and run.file("clusters.png").is_file() and not kept.exists()


def test_the_cluster_figure_draws_each_heads_position_radius_as_a_round_circle_on_stretched_layouts():
    """The circles are what the title says, each head's 95% position radius around its point, and stay circles
    when the layout is 7 times wider than tall: both panels scale x and y alike (equal aspect)."""
    rng = np.random.default_rng(0)
    clusters = pd.DataFrame({"layer": np.repeat(np.arange(4), 6), "head": np.tile(np.arange(6), 4),
                             "x": rng.normal(0, 1.0, 24), "y": rng.normal(0, 0.15, 24),
                             "position_radius": rng.uniform(0.02, 0.2, 24),
                             "behaviour": rng.choice(["broad", "prev", "other"], 24)})
    fig = clustering.cluster_figure(clusters, 0.12)
    fig.canvas.draw()
    try:
        assert "circles: each head's 95% position radius" in fig._suptitle.get_text()
        wanted = sorted(zip(clusters.x, clusters.y, clusters.position_radius))
        for ax in fig.axes[:2]:
            origin, right, up = ax.transData.transform([(0, 0), (1, 0), (0, 1)])
            assert right[0] - origin[0] == pytest.approx(up[1] - origin[1])  # one data unit is as long in x as in y
            drawn = sorted((*circle.center, circle.radius) for circle in ax.patches if hasattr(circle, "radius"))
            assert np.allclose(drawn, wanted)
    finally:
        close(fig)


# ---------------------------------------------------------------- gradient importance

def test_mask_tokens_masks_only_maskable_and_at_least_one():
    ids = torch.arange(10, 30).reshape(2, 10)
    maskable = torch.zeros(2, 10, dtype=torch.bool)
    maskable[0, 1:9] = True
    maskable[1, 1:3] = True
    masked, labels = mask_tokens(ids, maskable, 103, 0.01, [example_generator(0, i) for i in range(2)])
    chosen = labels != -100
    assert (chosen <= maskable).all() and chosen.any(1).all()
    assert torch.equal(masked[chosen], torch.full((int(chosen.sum()),), 103))
    assert torch.equal(masked[~chosen], ids[~chosen]) and torch.equal(labels[chosen], ids[chosen])
    with pytest.raises(AttnpatError):
        mask_tokens(ids, maskable, 103, 0.0, [torch.Generator()] * 2)
    # a row's draw is its own: the same row padded wider, alone or beside another row, gets the same tokens masked
    wide_ids = torch.cat([ids, ids], 1)
    wide_maskable = torch.cat([maskable, torch.zeros(2, 10, dtype=torch.bool)], 1)
    for seed in range(20):
        beside, _ = mask_tokens(ids, maskable, 103, 0.5, [example_generator(seed, i) for i in range(2)])
        for row in range(2):
            alone, _ = mask_tokens(wide_ids[row:row + 1], wide_maskable[row:row + 1], 103, 0.5,
                                   [example_generator(seed, row)])
            assert torch.equal(alone[0, :10], beside[row]) and torch.equal(alone[0, 10:], wide_ids[row, 10:])


def _perturbed_eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention plus an additive perturbation of the attention weights (set per layer by the test)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.size(-1) ** -0.5)
    weights = torch.softmax(scores + (attention_mask if attention_mask is not None else 0), -1)
    weights = weights + PERTURBATION.get(module.layer_idx, 0)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


PERTURBATION: dict = {}


def test_attention_gradients_predict_the_loss_change(tokenizer):
    """Perturbing attention weights changes the MLM loss by gradient . perturbation (finite differences)."""
    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_config()).double().eval()
    batch = next(iter_batches(wrap_bundle(model), SENTENCES[:2], batch_size=2))
    masked, labels = mask_tokens(batch.input_ids, batch.attention_mask.bool(), tokenizer.mask_token_id, 0.3,
                                 [example_generator(1, i) for i in range(2)])
    batch.input_ids = masked
    grads = attention_gradients(model, batch, "mlm", torch.device("cpu"), labels)
    assert grads.shape == (2, 2, 4, *batch.input_ids.shape[1:2] * 2)
    assert torch.isfinite(grads).all() and grads.abs().sum() > 0

    @torch.no_grad()
    def loss():
        out = model(**batch.model_inputs())
        return float(per_example_mlm_loss(out.logits, labels).sum())

    unperturbed = loss()

    AttentionInterface.register("attnpat_test_perturbed", _perturbed_eager)
    # the eager mask for that name too: without it padded keys are not masked as the eager model masks them
    AttentionMaskInterface.register("attnpat_test_perturbed", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation("attnpat_test_perturbed")
    try:
        direction = torch.randn(2, 4, *grads.shape[-2:], dtype=torch.float64) * batch.attention_mask[:, None, None, :]
        eps = 1e-5
        assert loss() == pytest.approx(unperturbed, abs=1e-12)  # the test's attention is the eager one
        PERTURBATION[1] = eps * direction
        plus = loss()
        PERTURBATION[1] = -eps * direction
        minus = loss()
    finally:
        PERTURBATION.clear()
        model.set_attn_implementation("eager")
    predicted = float((grads[:, 1].double() * direction).sum())
    assert (plus - minus) / (2 * eps) == pytest.approx(predicted, rel=1e-5)


def test_gradient_by_key_type_averages_over_the_right_weights():
    grads = torch.zeros(1, 2, 1, 3, 3)
    grads[0, 0, 0, :, 2] = -2.0  # layer 0: every row's gradient on key 2 ([SEP])
    grads[0, 1, 0, :2, 0] = 1.0  # layer 1: rows 0-1 on key 0 (other)
    keys = {"sep": torch.tensor([[False, False, True]]), "other": torch.tensor([[True, True, False]])}
    real = torch.ones(1, 3, dtype=torch.bool)
    out = gradient_by_key_type(grads, keys, real)
    assert out["sep"][0].tolist() == [[6.0, 0.0]] and out["sep"][1].tolist() == [3]
    assert out["other"][0].tolist() == [[0.0, 2.0]] and out["other"][1].tolist() == [6]


def test_grad_importance_with_mlm_and_task_objectives(tokenizer):
    torch.manual_seed(0)
    data = TaskData("toy", "validation", "test", [Example(e.id, e.text, e.text_pair, label) for e, label in
                                                   zip(SENTENCES, (0, 1, 1))])
    mlm = wrap_bundle(BertForMaskedLM(tiny_config()))
    values, _, _ = compute_grad_importance(mlm, data, "mlm", progress=False)
    for target in ("sep", "punct", "other"):
        assert values[target].shape == (2,) and np.isfinite(values[target]).all() and (values[target] > 0).all()
    classifier = wrap_bundle(BertForSequenceClassification(tiny_config(num_labels=2)))
    task_values, _, _ = compute_grad_importance(classifier, data, "task", progress=False)
    assert all(np.isfinite(v).all() and (v > 0).all() for v in task_values.values())
    unlabelled = TaskData("toy", "validation", "test", SENTENCES)
    with pytest.raises(AttnpatError, match="labelled"):
        compute_grad_importance(classifier, unlabelled, "task", progress=False)


def test_grad_importance_is_batch_size_independent(tokenizer):
    torch.manual_seed(0)
    bundle = wrap_bundle(BertForSequenceClassification(tiny_config(num_labels=2)))
    data = TaskData("toy", "validation", "test", [Example(e.id, e.text, e.text_pair, 1) for e in SENTENCES])
    together, _, _ = compute_grad_importance(bundle, data, "task", progress=False, batch_size=3)
    alone, _, _ = compute_grad_importance(bundle, data, "task", progress=False, batch_size=1)
    for target in together:
        assert np.allclose(together[target], alone[target], rtol=1e-4)
    # the MLM loss too: each example's masked tokens are its own, whatever the batch around it
    mlm = wrap_bundle(BertForMaskedLM(tiny_config()))
    together, _, _ = compute_grad_importance(mlm, data, "mlm", progress=False, batch_size=3, mask_probability=0.3)
    alone, _, _ = compute_grad_importance(mlm, data, "mlm", progress=False, batch_size=1, mask_probability=0.3)
    other_seed, _, _ = compute_grad_importance(mlm, data, "mlm", progress=False, batch_size=1, mask_probability=0.3,
                                            seed=5)
    for target in together:
        assert np.allclose(together[target], alone[target], rtol=1e-4)
    assert not all(np.allclose(other_seed[target], alone[target], rtol=1e-4) for target in alone)


@pytest.mark.parametrize("config_class", [DistilBertConfig, BertConfig], ids=["distilbert", "bert"])
def test_a_fine_tuned_classifier_is_never_given_a_random_mlm_head(tmp_path, config_class):
    """A fine-tuned classifier's checkpoint has no MLM head. DistilBERT names its head's weights vocab_*, not
    *predictions* or lm_head, so its classifier loaded as an MLM with a freshly initialised head, and
    grad-importance reported the gradients of a random head's loss; it now takes the classifier's task loss."""
    tokenizer = minilm_tokenizer()
    sizes = dict(dim=32, n_layers=2, n_heads=4, hidden_dim=37) if config_class is DistilBertConfig else \
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    config = config_class(vocab_size=tokenizer.vocab_size, num_labels=2, **sizes)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    bundle, objective = load_gradient_model(str(tmp_path), device="cpu")
    assert objective == "task" and bundle.model.__class__.__name__.endswith("ForSequenceClassification")
    with pytest.raises(AttnpatError, match="no masked-language-model head"):
        load_model(str(tmp_path), kind="mlm", device="cpu")


@pytest.mark.parametrize("probability", ["0", "1.5", "nan"])
def test_a_mask_probability_outside_0_to_1_is_refused_before_the_model_loads(probability, tmp_path, capsys,
                                                                              monkeypatch):
    # the masks are drawn batch by batch: checked there, a bad share was refused only after the model and data loaded
    monkeypatch.setattr(cli_clark, "load_gradient_model", lambda *a, **k: pytest.fail("the model loaded first"))
    runs = tmp_path / "runs"
    assert main(["grad-importance", "--mask-probability", probability, "--runs-dir", str(runs), "-q"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("error: --mask-probability is the share of tokens masked, above 0 and at most 1; "
                     f"got {float(probability)}")
    assert not runs.exists()
    with pytest.raises(AttnpatError, match="--mask-probability"):  # a Python caller: before the run folder
        grad_importance(wrap_bundle(BertForMaskedLM(tiny_config())), TaskData("toy", "validation", "test", SENTENCES),
                        RunDir("tiny", "toy", runs), "mlm", mask_probability=0.0)
    assert not any(path.is_file() for path in runs.rglob("*"))


def test_gradient_importance_unavailable_for_minilm_says_so():
    with pytest.raises(AttnpatError, match="unavailable.*no masked-language-model head"):
        load_gradient_model("minilm", device="cpu")


def test_grad_importance_cli_writes_each_layers_mean_with_a_bootstrap_interval(tmp_path, capsys):
    """grad_importance.csv, its figure and the printout carried bare per-layer means; each now has its percentile
    bootstrap 95% interval over the examples (the ratio of the resampled |gradient| sums over their weight counts)."""
    model = save_tiny_model(tmp_path / "tiny-mlm", kind="mlm")
    runs = tmp_path / "runs"
    assert main(["grad-importance", "--model", str(model), "--task", "wiki", "--n", "6", "--runs-dir", str(runs),
                 "-q"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    run = RunDir("tiny-mlm", "wiki", runs)
    table = run.read_table("grad_importance")
    assert list(table.columns) == ["layer", "target", "value", "ci_low", "ci_high"] and len(table) == 2 * 3
    assert (table.ci_low <= table.value).all() and (table.value <= table.ci_high).all()
    assert (table.ci_high > table.ci_low).all()
    for layer, row in enumerate(rows):
        for column, target in enumerate(GRAD_TARGETS):
            cell = table[(table.layer == layer) & (table.target == target)].iloc[0]
            assert row[1 + 3 * column:4 + 3 * column] == [f"{cell.value:.2e}", f"[{cell.ci_low:.2e},",
                                                          f"{cell.ci_high:.2e}]"]
    assert run.file("grad_importance.png").is_file() and "bootstrap" in run.manifest()["analyses"]["grad_importance"][
        "interval"]


def test_key_type_means_are_ratios_of_sums_with_their_bootstrap_interval():
    """A target's per-layer value is the ratio of the examples' |gradient| sums over their weight counts; its interval
    resamples examples and takes the same ratio, so an example with no such weight (count 0) adds nothing."""
    rng = np.random.default_rng(0)
    counts = {"sep": rng.integers(0, 4, 40).astype(float), "other": rng.integers(5, 30, 40).astype(float)}
    sums = {target: rng.random((40, 3)) * count[:, None] for target, count in counts.items()}
    values, intervals = key_type_means(sums, counts)
    draws = np.random.default_rng(0).integers(0, 40, size=(1000, 40))
    for target in sums:
        assert values[target] == pytest.approx(sums[target].sum(0) / counts[target].sum())
        ratios = sums[target][draws].sum(1) / counts[target][draws].sum(1)[:, None]  # (draws, L)
        assert intervals[target] == pytest.approx(np.percentile(ratios, [2.5, 97.5], axis=0).T)
    empty, _ = key_type_means({"punct": np.zeros((3, 2))}, {"punct": np.zeros(3)})
    assert np.isnan(empty["punct"]).all()


def test_a_masked_period_is_an_other_key_not_punctuation(tokenizer):
    """Key types were read from the input before masking, so attention to a '.' or ',' replaced by [MASK] counted
    as attention to punctuation. They are now the masked input's: with every text token masked the model sees no
    '.' or ',', so punct has no weight (NaN) while [SEP] (never masked) and other keep theirs."""
    torch.manual_seed(0)
    bundle = wrap_bundle(BertForMaskedLM(tiny_config()))
    data = TaskData("toy", "validation", "test", SENTENCES)
    values, _, _ = compute_grad_importance(bundle, data, "mlm", progress=False, mask_probability=1.0)
    assert np.isnan(values["punct"]).all()
    assert np.isfinite(values["sep"]).all() and np.isfinite(values["other"]).all() and (values["other"] > 0).all()
    masked_some, _, _ = compute_grad_importance(bundle, data, "mlm", progress=False, mask_probability=0.15)
    assert np.isfinite(masked_some["punct"]).all()  # unmasked periods and commas are punctuation keys


def test_an_example_of_special_tokens_only_is_refused_before_any_work(tokenizer, tmp_path, capsys):
    """A text such as "[SEP]" is tokenised as the special tokens themselves ([CLS] [SEP] [SEP]). surface and
    cluster averaged its maps into every head's statistics and labels, and grad-importance masked none of its
    tokens: its MLM loss was 0, and its zero gradients pulled every layer's mean down (two such texts beside two
    sentences lowered [SEP]'s by 44%). Each verb now refuses it with one error line, before any work."""
    data = TaskData("toy", "validation", "test", [*SENTENCES, Example("d", "[CLS] [SEP]")])
    torch.manual_seed(0)
    only_special = r"example d has only special tokens \(\[CLS\] \[CLS\] \[SEP\] \[SEP\]\), no text"
    with pytest.raises(AttnpatError, match=only_special):
        compute_surface(wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False)), data, progress=False)
    with pytest.raises(AttnpatError, match=only_special):
        compute_grad_importance(wrap_bundle(BertForMaskedLM(tiny_config())), data, "mlm", progress=False)
    # [UNK] stands for text the vocabulary lacks: an input of it alone is text
    check_has_text(tokenizer, encode_examples(tokenizer, [Example("e", "\N{GRINNING FACE}")]))
    base, mlm = save_tiny_model(tmp_path / "tiny"), save_tiny_model(tmp_path / "tiny-mlm", kind="mlm")
    capsys.readouterr()  # the models' saving progress
    file = tmp_path / "special.jsonl"
    file.write_text('{"text": "A real sentence."}\n{"text": "[SEP]"}\n')
    runs = tmp_path / "runs"
    for verb, model in (("surface", base), ("cluster", base), ("grad-importance", mlm)):
        assert main([verb, "--model", str(model), "--task", str(file), "-q", "--runs-dir", str(runs)]) == 2, verb
        err = capsys.readouterr().err.strip()
        assert err == "error: example special-1 has only special tokens ([CLS] [SEP] [SEP]), no text to analyse"
    assert not [path for path in runs.rglob("*") if path.is_file() and path.suffix in (".csv", ".png", ".json")]


# ---------------------------------------------------------------- surface pass

def test_surface_statistics_on_a_tiny_model_writes_every_artifact(tokenizer, tmp_path):
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    data = TaskData("toy", "validation", "test", SENTENCES)
    run = RunDir(bundle.slug, "toy", tmp_path)
    table, per_layer = surface_statistics(bundle, data, run, progress=False)
    assert set(table.metric) == set(SURFACE_METRICS) and len(table) == 8 * len(SURFACE_METRICS)
    # the per-layer table: each layer's mean over its heads with its interval
    layer_means = table.pivot_table(index="layer", columns="metric", values="value", aggfunc="mean")
    for metric in SURFACE_METRICS:
        assert per_layer[metric].to_numpy() == pytest.approx(layer_means[metric].to_numpy(), abs=1e-9, nan_ok=True)
        defined = per_layer.dropna(subset=[metric])
        assert (defined[f"{metric}_ci_low"] <= defined[metric] + 1e-12).all()
        assert (defined[metric] <= defined[f"{metric}_ci_high"] + 1e-12).all()
    entropy = head_array(table, "entropy")
    uniform = run.manifest()["analyses"]["surface"]["uniform_entropy"]
    # a random tiny model attends nearly uniformly: entropy just under the uniform entropy
    assert (entropy <= uniform + 1e-6).all() and (entropy > uniform - 0.5).all()
    labels = pd.read_csv(run.file("head_labels.csv"))
    assert len(labels) == 8 and (labels.label == "broad").sum() == 0  # tiny inputs are under 3.8 nats
    # each label with the statistic that decided it and its interval (before: the label alone)
    assert list(labels.columns) == ["layer", "head", "label", "statistic", "value", "ci_low", "ci_high",
                                    "threshold", "certain"]
    decided = labels[labels.label != "other"]
    assert (decided.ci_low <= decided.value + 1e-9).all() and (decided.value <= decided.ci_high + 1e-9).all()
    counts = run.manifest()["analyses"]["surface"]["certain_label_counts"]
    assert sum(counts.values()) == labels.certain.sum()
    # every head's mean carries its bootstrap 95% interval over the examples (before: bare means)
    written = pd.read_csv(run.file("surface.csv"))
    assert list(written.columns) == ["layer", "head", "metric", "value", "ci_low", "ci_high"]
    defined = written.dropna(subset=["value"])
    assert (defined.ci_low <= defined.value + 1e-12).all() and (defined.value <= defined.ci_high + 1e-12).all()
    for name in ("surface.csv", "head_labels.csv", "surface.png", "surface.svg", "surface_entropy.png",
                 "surface_entropy.svg"):
        assert run.file(name).is_file()


def test_surface_statistics_of_one_padded_batch_equal_those_of_one_example_at_a_time(tokenizer):
    """Inputs of 3 to over 100 tokens, pairs (a second [SEP]) among them, padded into one batch: every per-head
    statistic, its interval and the uniform-attention entropy equal those streamed one example at a time (a padded
    query row or key column entering a mean would move them)."""
    torch.manual_seed(0)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    long_text = " ".join(["the film , in a word , is a mess ."] * 10)
    examples = [Example("one-word", "no"), Example("long", long_text),
                Example("pair", "a film .", text_pair="no , not"),
                Example("long-pair", long_text, text_pair="it is , all the same , first rate ."),
                Example("short", "bad ."), Example("mid", "the acting , costumes and music are all first rate")]
    lengths = [len(item) for item in encode_examples(tokenizer, examples)]
    assert min(lengths) == 3 and max(lengths) > 100
    data = TaskData("toy", "validation", "test", examples)
    one_at_a_time = compute_surface(bundle, data, batch_size=1, progress=False)
    padded = compute_surface(bundle, data, batch_size=len(examples), progress=False)
    for metric in SURFACE_METRICS:
        np.testing.assert_allclose(padded[0][metric], one_at_a_time[0][metric], rtol=0, atol=1e-6, err_msg=metric)
        np.testing.assert_allclose(padded[1][metric], one_at_a_time[1][metric], rtol=0, atol=1e-6, err_msg=metric)
    assert padded[3] == pytest.approx(one_at_a_time[3], abs=1e-12)
    assert padded[3] == pytest.approx(np.mean(np.log(lengths)))  # uniform attention over each input's real tokens


def test_surface_figures_of_a_statistic_measured_on_no_example_draw_no_line_and_warn_nothing():
    """A tokenizer with no [CLS] or [SEP] leaves cls, sep, sep_sep and cls_entropy NaN for every head; before, the
    figures' layer means printed numpy's "Mean of empty slice" RuntimeWarning once per such panel."""
    rng = np.random.default_rng(0)
    values = {metric: rng.uniform(0, 1, (3, 4)) for metric in SURFACE_METRICS}
    for metric in ("cls", "sep", "sep_sep", "cls_entropy"):
        values[metric] = np.full((3, 4), np.nan)
    values["prev"][1, 2] = np.nan  # one head unmeasured: its layer's mean is over the others
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figures = [surface_figure(values), entropy_figure(values, 2.0)]
    panels = {ax.get_title(): ax for figure in figures for ax in figure.axes}
    layer_line = {title: next(line for line in ax.get_lines() if line.get_color() == "k").get_ydata()  # the black
                  for title, ax in panels.items() if ax.get_lines()}
    assert np.isnan(layer_line["[CLS]"]).all() and np.isnan(layer_line["entropy of the [CLS] row"]).all()
    np.testing.assert_allclose(layer_line["previous token"],
                               [values["prev"][0].mean(), np.delete(values["prev"][1], 2).mean(),
                                values["prev"][2].mean()])
    for figure in figures:
        close(figure)


def test_surface_statistics_of_no_examples_are_one_error_before_any_work(tokenizer, tmp_path):
    """Before, an empty data set streamed nothing and stopped in a KeyError ('prev') from the accumulator."""
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    run = RunDir(bundle.slug, "toy", tmp_path)
    with pytest.raises(AttnpatError, match="no examples to compute surface statistics on"):
        surface_statistics(bundle, TaskData("toy", "validation", "test", []), run, progress=False)
    assert not run.file("surface.csv").exists() and "surface" not in run.manifest().get("analyses", {})


def test_surface_prints_each_layer_mean_with_the_interval_the_analysis_computes(tmp_path, capsys):
    """`attnpat surface` printed bare layer means while surface.csv carried intervals. Each printed layer mean now
    carries the bootstrap 95% interval over the examples that analysis.surface computes (the mean over the heads of
    surface.csv's values)."""
    model = save_tiny_model(tmp_path / "tiny")
    assert main(["surface", "--model", str(model), "--task", "wiki", "--n", "6", "-q", "--runs-dir",
                 str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "layer means over the heads [bootstrap 95% interval over the examples]" in out
    _, _, per_layer, _, _ = compute_surface(load_model(str(model), device="cpu"), load_data("wiki", n=6),
                                            progress=False)
    for metrics in (SURFACE_METRICS[:5], SURFACE_METRICS[5:]):
        for line in layer_interval_lines(per_layer, {metric: metric for metric in metrics}):
            assert line in out.splitlines()
    written = pd.read_csv(tmp_path / "runs" / "tiny" / "wiki" / "surface.csv")
    first = written[(written.layer == 0) & (written.metric == "cls")].value.mean()
    low, high = per_layer.loc[0, ["cls_ci_low", "cls_ci_high"]]
    assert f"{first:.3f} [{low:.3f}, {high:.3f}]" in out and low < first < high


# ---------------------------------------------------------------- CLI on the real embedded model

@pytest.mark.slow
def test_cli_surface_cluster_and_grad_on_minilm(tmp_path, capsys):
    runs = str(tmp_path)
    assert main(["surface", "--task", "wiki", "--n", "16", "--quiet", "--runs-dir", runs]) == 0
    out = capsys.readouterr().out
    assert "uniform-attention entropy" in out and "head labels" in out
    surface = pd.read_csv(tmp_path / "minilm" / "wiki" / "surface.csv")
    assert len(surface) == 6 * 12 * 10
    cls = head_array(surface, "cls")
    assert cls[1:5].mean() > cls[0].mean()  # MiniLM's middle layers look at [CLS] (seen on wiki segments)
    assert main(["cluster", "--task", "wiki", "--n", "4", "--quiet", "--runs-dir", runs]) == 0
    clusters = pd.read_csv(tmp_path / "minilm" / "wiki" / "clusters.csv")
    assert len(clusters) == 72 and set(clusters.behaviour) <= {"next", "prev", "broad", "cls", "sep", "punct", "other"}
    radius = clusters.position_radius.median()
    assert f"positions: median 95% radius {radius:.4f} = " in capsys.readouterr().out
    assert main(["grad-importance", "--n", "2", "--quiet", "--runs-dir", runs]) == 2
    assert "unavailable" in capsys.readouterr().err


def test_real_wiki_data_surface_values_are_probabilities(tmp_path):
    """The packaged wiki segments through the tiny-model path: every share in [0, 1]."""
    data = load_data("wiki", n=4)
    torch.manual_seed(1)
    bundle = wrap_bundle(BertModel(tiny_config(), add_pooling_layer=False))
    table, _ = surface_statistics(bundle, data, RunDir("tiny", "wiki", tmp_path), progress=False)
    shares = table[~table.metric.isin(["entropy", "cls_entropy"])].value
    assert shares.between(0, 1).all()
    # [SEP] -> [SEP] exists for every wiki segment pair (two [SEP]s)
    assert head_array(table, "sep_sep").min() > 0


def test_surface_and_cluster_say_when_no_head_can_attend_broadly(tmp_path, capsys):
    """On short inputs uniform attention's entropy is under Clark's 3.8 nats, so no head can be 'broad' and the
    count of 0 said nothing of why. Both verbs now say so, and stay quiet once the threshold is reachable."""
    model = save_tiny_model(tmp_path / "tiny")
    data = tmp_path / "short.jsonl"
    data.write_text('{"text": "A short one."}\n{"text": "Another short sentence here."}\n')
    for verb in ("surface", "cluster"):
        for threshold, noted in (("3.8", True), ("1.0", False)):
            assert main([verb, "--model", str(model), "--task", str(data), "--broad-threshold", threshold, "-q",
                         "--runs-dir", str(tmp_path / "runs")]) == 0
            assert ("note: no head can attend broadly here" in capsys.readouterr().out) == noted, (verb, threshold)
