"""What the app shows on first load: readable numbers, the shipped classifier's record, the run each tab opens
on, and the table titles that say where values come from."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.artifacts import tab, tab_artifacts
from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from analysis.rundir import RunDir, long_table
from analysis.uncertainty import confusion_class_f1_interval, confusion_score_interval
from app.classifier_card import classifier_card, read_metadata
from app.display import display_table, readable
from app.run_browser import RunBrowser, Scratch
from app.webapp import WebApp
from classifier.checkpoint import DEFAULT_CHECKPOINT
from classifier.evaluate import baseline_comparison


@pytest.mark.parametrize("value, fraction, shown", [
    (0.6798611111111111, True, "68.0%"),
    (0.6798611111111111, False, "0.680"),
    (0.0005, True, "0.1%"),
    (1.0, True, "100.0%"),
    (12.3456, False, "12.3"),
    (100.2, False, "100"),
    (-0.012345, False, "-0.0123"),
    (123456.7, False, "123,457"),
    (3.2e-07, False, "3.20e-07"),
    (0.0, False, "0"),
    (7, False, "7"),
    (np.int64(42), False, "42"),
    (float("nan"), False, ""),
    ("vertical", False, "vertical"),
])
def test_readable_numbers(value, fraction, shown):
    assert readable(value, fraction) == shown


def test_display_table_formats_fractions_by_column_and_by_metric_and_keeps_the_frame():
    ratios = pd.DataFrame({"class": ["vertical", "block"], "count": [3, 1], "fraction": [0.75, 0.25]})
    shown = display_table(ratios)
    assert shown["fraction"].tolist() == ["75.0%", "25.0%"] and shown["count"].tolist() == [3, 1]
    assert ratios["fraction"].tolist() == [0.75, 0.25]  # the source (and so the CSV) keeps full precision
    overview = long_table({"to_cls": np.full((1, 2), 0.123456), "entropy": np.full((1, 2), 2.71828)})
    values = dict(zip(display_table(overview).metric, display_table(overview).value))
    assert values == {"to_cls": "12.3%", "entropy": "2.72"}
    scores = pd.DataFrame({"model": ["cnn"], "metric": ["macro_f1"], "class": [""], "value": [0.6798611111111111]})
    assert display_table(scores).value.tolist() == ["68.0%"]
    probabilities = pd.DataFrame({"p_vertical": [0.5], "delta": [-0.0125]})
    assert display_table(probabilities).iloc[0].tolist() == ["50.0%", "-0.0125"]
    assert display_table(None) is None


def test_intervals_read_like_their_estimate_and_p_values_are_not_percentages():
    """A table's ci_low/ci_high are in the unit of the value they bound (before: the disabling delta and the
    classifier's F1 difference as 3 significant digits, their intervals as percentages; a coreference head's
    accuracy as a percentage, its interval as 3 digits), and a p-value is a p-value, not a share shown as "0.0%"."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=40)
    results = {"cnn": np.where(rng.random(40) < 0.8, labels, (labels + 1) % 3), "majority": np.zeros(40, int)}
    comparison = baseline_comparison(results, labels, reference="cnn", n_boot=200)
    for source, shown in zip(comparison.itertuples(), display_table(comparison).itertuples()):
        assert not shown.difference.endswith("%") and not shown.ci_low.endswith("%")
        assert not shown.ci_high.endswith("%")
        assert shown.p_value == readable(source.p_value) and shown.p_holm == readable(source.p_holm)
    layers = pd.DataFrame({"layer": [0], "mode": ["zero"], "metric": ["accuracy"], "delta": [-0.0125],
                           "ci_low": [-0.03], "ci_high": [0.004], "p_mcnemar": [0.0004], "p_holm": [0.0008]})
    shown = display_table(layers).iloc[0]
    assert [shown.delta, shown.ci_low, shown.ci_high] == [readable(v) for v in (-0.0125, -0.03, 0.004)]
    assert shown.p_holm == readable(0.0008) != "0.1%"
    coref = long_table({"accuracy": np.full((1, 1), 0.68), "accuracy_ci_low": np.full((1, 1), 0.6),
                        "accuracy_ci_high": np.full((1, 1), 0.75)})
    assert display_table(coref).iloc[0, 3:].tolist() == [readable(v, True) for v in (0.68, 0.6, 0.75)]
    # a long table's ci_low, ci_high columns bound its value: percentages in a share's rows, digits in entropy's
    overview = long_table({"to_cls": np.full((1, 1), 0.4), "entropy": np.full((1, 1), 2.5)},
                          intervals={"to_cls": np.array([[[0.35, 0.45]]]), "entropy": np.array([[[2.25, 2.75]]])})
    shown = display_table(overview)
    assert shown[["value", "ci_low", "ci_high"]].values.tolist() == [["40.0%", "35.0%", "45.0%"],
                                                                     ["2.50", "2.25", "2.75"]]
    ratios = pd.DataFrame({"class": ["block"], "count": [3], "fraction": [0.375], "ci_low": [0.2],
                           "ci_high": [0.5], "adjusted": [0.4], "adjusted_ci_low": [0.25],
                           "adjusted_ci_high": [0.55]})  # the pattern ratios: shares, intervals too
    assert display_table(ratios).iloc[0, 2:].tolist() == [readable(v, True)
                                                          for v in (0.375, 0.2, 0.5, 0.4, 0.25, 0.55)]
    dependency = pd.DataFrame({"relation": ["obj"], "accuracy": [0.782], "ci_low": [0.722], "ci_high": [0.84],
                               "baseline_accuracy": [0.379], "baseline_ci_low": [0.315], "baseline_ci_high": [0.443],
                               "head_minus_baseline": [0.403], "head_minus_baseline_ci_low": [0.316],
                               "head_minus_baseline_ci_high": [0.484], "p_value": [0.001], "held_out_count": [211]})
    shown = display_table(dependency).iloc[0]  # a <name>_ci_low/_ci_high column reads like <name>: here, shares
    assert shown.iloc[1:10].tolist() == [readable(v, True) for v in dependency.iloc[0, 1:10]]
    assert shown.p_value == readable(0.001) != "0.1%" and shown.held_out_count == 211
    predictions = pd.DataFrame({f"p_{name}": [1 / len(CLASSES)] for name in CLASSES})  # class probabilities
    assert display_table(predictions).iloc[0].tolist() == [readable(1 / len(CLASSES), True)] * len(CLASSES)


def test_each_interval_of_a_long_table_is_shown_beside_its_estimate():
    """In a long CSV an interval is two rows of its own, <key>_ci_low and <key>_ci_high, which in a layer x head
    table lie 2 x L x H rows below the estimate (before, the tab showed them there: a head's disabling delta, its
    cosine similarity or its raw importance with the interval out of sight). The tab folds them into ci_low,
    ci_high columns of the estimate's row; the CSV keeps its layout."""
    rng = np.random.default_rng(1)
    delta, low, high = rng.normal(size=(2, 3)), rng.normal(size=(2, 3)) - 1, rng.normal(size=(2, 3)) + 1
    heads = long_table({"uniform_delta": delta, "uniform_metric": np.full((2, 3), 0.8),
                        "uniform_delta_ci_low": low, "uniform_delta_ci_high": high,
                        "uniform_p_holm": np.full((2, 3), 0.02)})
    written = heads.copy()
    shown = display_table(heads)
    assert heads.equals(written)  # the source (and so the CSV) is left as it was
    assert list(shown.columns) == ["layer", "head", "metric", "value", "ci_low", "ci_high"]
    assert len(shown) == 3 * 6 and "uniform_delta_ci_low" not in set(shown.metric)
    for row in shown[shown.metric == "uniform_delta"].itertuples():
        assert row.value == readable(delta[row.layer, row.head])
        assert (row.ci_low, row.ci_high) == (readable(low[row.layer, row.head]), readable(high[row.layer, row.head]))
    others = shown[shown.metric != "uniform_delta"]  # the metric and p-values have no interval: empty bounds
    assert set(others.ci_low) == set(others.ci_high) == {""} and set(others.value) == {"0.800", "0.0200"}
    scores = pd.DataFrame({"metric": ["accuracy", "accuracy_ci_low", "accuracy_ci_high", "n_eval"],
                           "value": [0.491, 0.458, 0.524, 872.0]})  # a fine-tuned model's finetune_eval
    assert display_table(scores).values.tolist() == [["accuracy", "49.1%", "45.8%", "52.4%"], ["n_eval", "872", "", ""]]
    orphan = scores[scores.metric != "accuracy"]  # a damaged table: an interval without its estimate
    assert display_table(orphan).metric.tolist() == ["accuracy_ci_low", "accuracy_ci_high", "n_eval"]


def test_an_estimate_without_an_interval_shows_empty_bounds():
    """A head mean over one input has NaN bounds (analysis.uncertainty.MIN_RESAMPLED): the tab shows its value
    beside empty bounds, in a long table's folded columns and in a wide table's bounded columns alike."""
    linguistic = long_table({"negation": np.full((1, 2), 0.25)},
                            intervals={"negation": np.full((1, 2, 2), np.nan)}, key="feature")
    shown = display_table(linguistic)
    assert shown[["value", "ci_low", "ci_high"]].values.tolist() == [["25.0%", "", ""]] * 2
    tokens = pd.DataFrame({"token": ["."], "mean_attention": [0.4], "ci_low": [np.nan], "ci_high": [np.nan]})
    assert display_table(tokens).iloc[0].tolist() == [".", readable(0.4, True), "", ""]  # a share, as written


def test_classifier_card_shows_the_shipped_checkpoints_record():
    meta = json.loads(DEFAULT_CHECKPOINT.with_suffix(".json").read_text())
    card = classifier_card(read_metadata())
    cv = meta["cross_validation"]
    assert meta["trained_on"] in card.summary and str(meta["n_maps"]) in card.summary
    cnn = card.scores.iloc[0]
    assert cnn.macro_f1 == cv["macro_f1"] and cnn.accuracy == cv["accuracy"]
    assert len(card.scores) == 1 + len(cv["baselines_macro_f1"])
    versus = card.scores.set_index("model")["cnn_minus_baseline"]
    for name, entry in cv["vs_baselines"].items():  # the paired comparison, as `attnpat train` recorded it
        assert versus[f"baseline: {name}"].endswith(f": {entry['verdict']}")
        assert f"{entry['difference']:+.3f}" in versus[f"baseline: {name}"]
    assert display_table(card.scores).cnn_minus_baseline.iloc[0] == ""  # the CNN's own row: empty, not "NaN"
    assert card.per_class["class"].tolist() == list(CLASSES)
    assert card.per_class.set_index("class")["f1"].to_dict() == cv["per_class_f1"]
    assert card.confusion[list(CLASSES)].to_numpy().tolist() == cv["confusion"]
    assert int(card.confusion[list(CLASSES)].to_numpy().sum()) == meta["n_maps"]


def test_the_classifier_card_gives_the_cross_validated_scores_with_their_intervals(tmp_path):
    """The card's macro-F1, accuracy and per-class F1 carry the 95% bootstrap interval over the out-of-fold
    confusion matrix (before: bare values, while the demo summary and the CLI gave the interval), in the summary,
    the tables, the page's formatting and the CSV downloads; a baseline's score has none (no confusion recorded)."""
    cv = read_metadata()["cross_validation"]
    card = classifier_card(read_metadata())
    (f1_low, f1_high), (accuracy_low, accuracy_high) = confusion_score_interval(cv["confusion"])
    cnn = card.scores.iloc[0]
    assert (cnn.macro_f1_ci_low, cnn.macro_f1_ci_high) == (f1_low, f1_high)
    assert (cnn.accuracy_ci_low, cnn.accuracy_ci_high) == (accuracy_low, accuracy_high)
    assert f1_low < cnn.macro_f1 < f1_high and accuracy_low < cnn.accuracy < accuracy_high
    assert f"macro-F1 {cv['macro_f1']:.3f} [{f1_low:.3f}, {f1_high:.3f}]" in card.summary
    assert "95% bootstrap intervals over its 1229 labeled maps" in card.summary
    assert card.scores.iloc[1:][["macro_f1_ci_low", "macro_f1_ci_high"]].isna().all().all()
    shown = display_table(card.scores).iloc[0]
    assert shown.macro_f1_ci_low == readable(f1_low, True) and shown.accuracy_ci_high == readable(accuracy_high, True)
    per_class = card.per_class.set_index("class")
    bounds = confusion_class_f1_interval(cv["confusion"])
    assert per_class[["f1_ci_low", "f1_ci_high"]].to_numpy().tolist() == bounds.tolist()
    assert (per_class.f1_ci_low < per_class.f1).all() and (per_class.f1 < per_class.f1_ci_high).all()
    web = WebApp(tmp_path / "runs")
    files = {Path(path).name: Path(path) for path in web.classifier_card_files()}
    written = pd.read_csv(files["classifier_per_class.csv"]).set_index("class")
    assert written[["f1_ci_low", "f1_ci_high"]].to_numpy() == pytest.approx(bounds)
    assert pd.read_csv(files["classifier_scores.csv"]).macro_f1_ci_low[0] == pytest.approx(f1_low)


def test_a_classifier_card_without_a_usable_confusion_matrix_says_why_it_has_no_interval(tmp_path, monkeypatch):
    """A checkpoint from before the confusion matrix was kept, or with an edited one, shows its scores with `no
    interval` and the reason (an edited matrix is not drawn); metadata of the wrong shape is one AttnpatError,
    which the tab shows in place of the card (before: a pandas ValueError or AttributeError stopped the app
    building)."""
    old = {"cross_validation": {"folds": 5, "macro_f1": 0.8, "accuracy": 0.85, "per_class_f1": {"block": 0.7}}}
    card = classifier_card(old)
    assert "macro-F1 0.800 (no interval: the checkpoint records no confusion matrix)" in card.summary
    assert card.scores.iloc[0][["macro_f1_ci_low", "accuracy_ci_high"]].isna().all()
    assert card.per_class.f1_ci_low.isna().all()
    edited = {"cross_validation": {**old["cross_validation"], "confusion": [[1, 2], [3, 4]]}}
    card = classifier_card(edited)
    assert "no interval: the recorded confusion matrix is not 5 x 5" in card.summary and card.confusion is None
    # a class no map was labeled: no interval, with the class named, and the (valid) matrix still drawn; before,
    # cross_validation_intervals refused it as an error and the card hid the matrix
    confusion = [[3, 1, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 2, 0, 0], [0, 0, 0, 2, 0], [0, 0, 0, 0, 2]]
    card = classifier_card({"cross_validation": {**old["cross_validation"], "confusion": confusion}})
    assert ("macro-F1 0.800 (no interval: no labeled map of diagonal in the cross-validation, so the confusion "
            "matrix cannot be redrawn)") in card.summary
    assert card.confusion is not None and card.confusion[list(CLASSES)].to_numpy().tolist() == confusion
    assert card.scores.iloc[0][["macro_f1_ci_low", "accuracy_ci_high"]].isna().all()
    assert card.per_class.f1_ci_low.isna().all() and card.per_class.f1_ci_high.isna().all()
    for damaged in ([], {"cross_validation": {"per_class_f1": [0.5]}}, {"cross_validation": {"vs_baselines": {
            "rules": {}}, "baselines_macro_f1": {"rules": 0.5}}}):
        with pytest.raises(AttnpatError, match="^the classifier metadata cannot be shown .*attnpat train"):
            classifier_card(damaged)
    monkeypatch.setattr("app.webapp.read_metadata", lambda: {"cross_validation": {"per_class_f1": [0.5]}})
    web = WebApp(tmp_path / "runs")
    demo = web.build()  # the app starts, its Classifier tab saying why there is no card
    (summary,) = [block for block in demo.blocks.values() if block.elem_id == "classifier-card-summary"]
    assert summary.value.startswith("**error:** the classifier metadata cannot be shown")
    assert web.classifier_card_files() is None


def test_the_classifier_cards_tables_can_be_downloaded_as_csv(tmp_path):
    """The Classifier tab's card showed its scores, per-class F1 and confusion matrix as page tables only (before,
    the one record on the tab that could not be downloaded); a page load now writes them as CSV at full precision."""
    cv = json.loads(DEFAULT_CHECKPOINT.with_suffix(".json").read_text())["cross_validation"]
    web = WebApp(tmp_path / "runs")
    demo = web.build()
    (files_id,) = [block._id for block in demo.blocks.values() if block.elem_id == "classifier-card-files"]
    assert any(f.fn == web.classifier_card_files and files_id in {block._id for block in f.outputs}
               for f in demo.fns.values())
    files = {Path(path).name: Path(path) for path in web.classifier_card_files()}
    assert set(files) == {"classifier_scores.csv", "classifier_per_class.csv", "classifier_confusion.csv"}
    scores = pd.read_csv(files["classifier_scores.csv"])
    assert scores.macro_f1[0] == cv["macro_f1"] and scores.accuracy[0] == cv["accuracy"]  # not "90.6%"
    assert pd.read_csv(files["classifier_confusion.csv"])[list(CLASSES)].to_numpy().tolist() == cv["confusion"]
    per_class = pd.read_csv(files["classifier_per_class.csv"]).set_index("class")["f1"].to_dict()
    assert per_class == cv["per_class_f1"]


def test_the_runs_table_can_be_downloaded_as_csv(tmp_path):
    """The Runs tab's table of run folders was the one table in the app with no CSV (before: page only); opening
    the tab, Refresh, and a job that ends write it as runs.csv, the table's rows and columns."""
    for task, stem in (("sst2", "overview"), ("wiki", "surface")):
        run = RunDir("minilm", task, tmp_path)
        with run.record(stem):  # a manifest: what the Runs tab lists
            run.write_table(stem, long_table({"x": np.zeros((1, 1))}))
    web = WebApp(tmp_path)
    demo = web.build()
    (csv_id,) = [block._id for block in demo.blocks.values() if block.elem_id == "runs-csv"]
    writers = [f for f in demo.fns.values() if f.fn == web.runs_file and csv_id in {b._id for b in f.outputs}]
    assert len(writers) == 4  # tab opened, Refresh, a started job ended, a watched job ended
    written = pd.read_csv(web.runs_file(), keep_default_na=False, dtype=str)
    shown = web.runs_table()[0].astype(str)
    assert written.columns.tolist() == shown.columns.tolist() == ["model", "task", "analyses", "examples", "updated",
                                                                  "path"]
    assert written.to_numpy().tolist() == shown.to_numpy().tolist()
    assert sorted(written.task) == ["sst2", "wiki"]
    assert WebApp(tmp_path / "empty").runs_file() is None  # no run: no file to offer


def test_a_figure_kept_without_its_svg_can_still_be_saved_as_svg(tmp_path):
    """A run folder whose figure has a PNG and no SVG (copied without it, or written by an older version) offered
    the PNG only (before); the tab now offers an SVG wrapping that PNG, named after the figure. A PNG that is no
    image is offered as it is, with no SVG and no error."""
    import base64  # noqa: PLC0415

    from PIL import Image  # noqa: PLC0415

    folder = tmp_path / "minilm" / "sst2"
    folder.mkdir(parents=True)
    pd.DataFrame({"class": list(CLASSES), "count": [1] * 5, "fraction": [0.2] * 5}).to_csv(
        folder / "pattern_ratios.csv", index=False)
    Image.new("RGB", (30, 20), "white").save(folder / "pattern_ratios.png")
    browser = RunBrowser(tmp_path, Scratch())  # kept: its scratch folder goes when it is collected
    view = browser.artifact("minilm", "sst2", "pattern_ratios")
    assert view.svg is not None and view.svg.name == "pattern_ratios.svg" and view.svg.parent != folder
    text = view.svg.read_text()
    assert 'width="30" height="20"' in text
    assert base64.b64encode((folder / "pattern_ratios.png").read_bytes()).decode() in text
    files = WebApp(tmp_path).show_artifacts("Pattern ratios", "minilm", "sst2")
    assert any(str(name).endswith("pattern_ratios.svg") for group in files if isinstance(group, list)
               for name in group)
    (folder / "pattern_ratios.png").write_bytes(b"not an image")
    view = browser.artifact("minilm", "sst2", "pattern_ratios")
    assert view.png is not None and view.svg is None and not view.error


def test_classifier_card_without_scores_and_a_missing_file(tmp_path):
    card = classifier_card({"trained_on": "synthetic maps"})
    assert "synthetic maps" in card.summary and card.scores is None and card.confusion is None
    with pytest.raises(Exception, match="attnpat train --data annotation/labeled/v5"):
        read_metadata(tmp_path / "missing.json")


def write_artifacts(root, model: str, task: str, stems) -> None:
    run = RunDir(model, task, root)
    for stem in stems:
        run.write_table(stem, long_table({"x": np.zeros((1, 1))}))


def test_each_tab_opens_on_the_run_holding_most_of_its_artifacts(tmp_path):
    write_artifacts(tmp_path, "minilm", "sst2", ["special_tokens", "linguistic", "overview", "patterns"])
    write_artifacts(tmp_path, "minilm", "wiki", ["surface", "head_labels", "overview"])
    write_artifacts(tmp_path, "minilm", "rte", ["patterns"])
    write_artifacts(tmp_path, "minilm-sst2-quick", "sst2", ["cosine", "special_tokens", "linguistic",
                                                            "disable_heads", "importance"])
    browser = RunBrowser(tmp_path, Scratch())
    assert browser.best_run(tab("Fine-tuning"), default_model="minilm") == ("minilm-sst2-quick", "sst2")
    assert browser.best_run(tab("Disabling"), default_model="minilm") == ("minilm-sst2-quick", "sst2")
    assert browser.best_run(tab("Surface and clusters"), default_model="minilm") == ("minilm", "wiki")
    assert browser.best_run(tab("Pattern ratios"), default_model="minilm") == ("minilm", "sst2")  # tie: sst2
    assert browser.best_run(tab("Fine-tuning"), "minilm", "minilm") == ("minilm", "sst2")  # within one model
    assert RunBrowser(tmp_path / "none", Scratch()).best_run(tab("Classifier")) == (None, None)
    assert browser.best_run(tab("Classifier"), default_model="minilm") == (None, None)  # only runs/classifier/
    write_artifacts(tmp_path, "classifier", "v1", ["cv_scores"])
    write_artifacts(tmp_path, "classifier", "v2", ["cv_scores"])
    assert browser.best_run(tab("Classifier"), default_model="minilm") == ("classifier", "v2")

    web = WebApp(tmp_path)
    model, task = web.run_choices("Disabling")
    assert (model.value, task.value) == ("minilm-sst2-quick", "sst2")
    model, task = web.run_choices("Disabling", "minilm", "rte")  # a pick that exists is kept
    assert (model.value, task.value) == ("minilm", "rte")
    model, task = web.run_choices("Surface and clusters", "minilm", "mrpc")  # a task the model lacks
    assert (model.value, task.value) == ("minilm", "wiki")


def test_run_tab_titles_say_where_values_come_from_and_tables_read_as_people_read(tmp_path):
    run = RunDir("minilm", "wiki", tmp_path)
    run.write_table("probing_dependency", pd.DataFrame({
        "relation": ["nsubj"], "direction": ["dependent->head"], "best_layer": [3], "best_head": [1],
        "accuracy": [0.6798611111111111], "baseline_offset": [1], "baseline_accuracy": [0.25], "count": [144],
        "parses": ["silver parses (spaCy en_core_web_sm 3.8.0)"]}))
    web = WebApp(tmp_path)
    message, *outputs = web.show_artifacts("Surface and clusters", "minilm", "wiki")
    stems = [entry.stem for entry in tab_artifacts("Surface and clusters")]
    index = stems.index("probing_dependency")
    title, table = outputs[6 * index + 1], outputs[6 * index + 3]
    assert "probing dependency: silver parses (spaCy en_core_web_sm 3.8.0)" in title
    assert table.value["data"][0][4] == "68.0%" and table.value["data"][0][6] == "25.0%"
    assert message.startswith("**note:** ") and "also shown here once computed" in message
    assert "error" not in message


def test_a_silver_parse_probing_table_heads_its_scores_agreement_and_a_gold_one_accuracy(tmp_path):
    """Silver parses measure only agreement with spaCy's parser (analysis.probing.score_name), but the tab headed
    the column "accuracy" on either parses; now the shown headers say agreement on silver runs, and the CSV download
    keeps its columns."""
    from analysis.parsing import GOLD_PARSES, SILVER_PARSES  # noqa: PLC0415
    row = {"relation": ["(all)"], "direction": ["dependent->head"], "best_layer": [0], "best_head": [1],
           "accuracy": [0.5], "ci_low": [0.4], "ci_high": [0.6], "baseline_offset": [1], "baseline_accuracy": [0.25],
           "in_sample_accuracy": [0.55]}
    heads = {"layer": [0], "head": [1], "direction": ["dependent->head"], "relation": ["(all)"], "accuracy": [0.5],
             "ci_low": [0.4], "ci_high": [0.6], "count": [10]}
    for task, parses in (("wiki", SILVER_PARSES), ("gold", GOLD_PARSES)):
        run = RunDir("minilm", task, tmp_path)
        run.write_table("probing_dependency", pd.DataFrame({**row, "parses": [parses]}))
        run.write_table("probing_dependency_heads", pd.DataFrame({**heads, "parses": [parses]}))
    stems = [entry.stem for entry in tab_artifacts("Surface and clusters")]
    web = WebApp(tmp_path)
    shown = {}
    for task in ("wiki", "gold"):
        _, *outputs = web.show_artifacts("Surface and clusters", "minilm", task)
        shown[task] = {stem: outputs[6 * stems.index(stem) + 3].value for stem in
                       ("probing_dependency", "probing_dependency_heads")}
    silver = shown["wiki"]["probing_dependency"]["headers"]
    assert [name for name in silver if "agreement" in name or "accuracy" in name] == [
        "agreement", "baseline_agreement", "in_sample_agreement"]
    assert "agreement" in shown["wiki"]["probing_dependency_heads"]["headers"]
    assert "accuracy" not in shown["wiki"]["probing_dependency_heads"]["headers"]
    assert shown["wiki"]["probing_dependency"]["data"][0][silver.index("agreement")] == "50.0%"  # still a share
    for stem in ("probing_dependency", "probing_dependency_heads"):
        gold = shown["gold"][stem]["headers"]
        assert "accuracy" in gold and not any("agreement" in name for name in gold)
        assert "accuracy" in pd.read_csv(tmp_path / "minilm" / "wiki" / f"{stem}.csv").columns  # the CSV stays


def test_a_heatmap_drawn_for_a_table_downloads_under_the_tables_name(tmp_path):
    """A layer x head table without a figure of its own gets one drawn in the tab (before, its downloads were
    named linguistic-709b1588971d10ad.png and .svg; the run folder's own figures are <stem>.png)."""
    run = RunDir("minilm", "sst2", tmp_path)
    run.write_table("linguistic", long_table({"negation": np.full((2, 3), 0.25)}, key="feature"))
    web = WebApp(tmp_path)
    outputs = web.show_artifacts("Fine-tuning", "minilm", "sst2")[1:]
    index = [entry.stem for entry in tab_artifacts("Fine-tuning")].index("linguistic")
    image, files = outputs[6 * index + 2], outputs[6 * index + 4]
    assert sorted(Path(path).name for path in files) == ["linguistic.csv", "linguistic.png", "linguistic.svg"]
    assert Path(image.value["path"]).read_bytes()[:4] == b"\x89PNG"
    assert web.show_artifacts("Fine-tuning", "minilm", "sst2")[1:][6 * index + 4] == files  # drawn once, then kept


def test_fine_tuning_tab_hints_the_paired_tables_only_where_they_can_be_written(tmp_path, monkeypatch):
    """cosine, pattern transitions, finetune eval and linguistic change are written in a fine-tuned model's run. On a
    base model's run the tab hinted `attnpat special --model minilm --task sst2` for linguistic change (and `compare
    --base minilm --finetuned minilm`), which can never write them there; now it says where they come from. A
    fine-tuned model's run gets commands naming its base, from the model store or from the run's manifest."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    runs = tmp_path / "runs"
    feature_table = long_table({"negation": np.full((2, 3), 0.25)}, key="feature")
    RunDir("minilm", "sst2", runs).write_table("linguistic", feature_table)
    web = WebApp(runs)
    message = web.show_artifacts("Fine-tuning", "minilm", "sst2")[0]
    assert "(run `attnpat special --model minilm --task sst2`)" in message  # its own special tokens: still hinted
    assert ("linguistic change: shown in the run of a model fine-tuned from this one (minilm has no base model "
            "recorded); `attnpat finetune --model minilm --task sst2 --split-dev` makes one") in message
    assert "--finetuned minilm" not in message and "--base" not in message
    for stem in ("special_tokens", "cls_last_layer"):
        RunDir("minilm", "sst2", runs).write_table(stem, feature_table)
    message = web.show_artifacts("Fine-tuning", "minilm", "sst2")[0]
    assert message.startswith("minilm/sst2: every fine-tuning artifact of a model without a base is here")
    message = web.show_artifacts("Fine-tuning", "minilm", "rte")[0]  # no run yet
    assert "`attnpat special --model minilm --task rte`" in message and "--finetuned" not in message
    assert "has no base model recorded" in message

    store_model = tmp_path / "models" / "tuned"  # fine-tuned by attnpat: its record names the base
    store_model.mkdir(parents=True)
    (store_model / "config.json").write_text("{}")
    (store_model / "attnpat.json").write_text(json.dumps({"base_model": "mpnet", "task": "sst2"}))
    RunDir("tuned", "sst2", runs).write_table("linguistic", feature_table)
    message = web.show_artifacts("Fine-tuning", "tuned", "sst2")[0]
    assert "`attnpat special --model tuned --base mpnet --task sst2`" in message
    assert "`attnpat compare --base mpnet --finetuned tuned --task sst2`" in message
    assert "no base model recorded" not in message

    paired = RunDir("org__tuned", "sst2", runs)  # a hub model, paired with its base by an earlier compare
    with paired.record("compare", base_model="org/base"):
        paired.write_table("cosine", long_table({"cosine_cropped": np.ones((2, 3))}))
    message = web.show_artifacts("Fine-tuning", "org__tuned", "sst2")[0]
    assert "`attnpat special --model org__tuned --base org/base --task sst2`" in message


def test_disabling_tab_says_which_effects_survive_holm(tmp_path):
    run = RunDir("tuned", "sst2", tmp_path)
    run.write_table("disable_heads", long_table({
        "zero_delta": np.array([[0.0, -0.25]]), "zero_delta_ci_low": np.array([[-0.05, -0.4]]),
        "zero_delta_ci_high": np.array([[0.05, -0.1]]), "zero_p_mcnemar": np.array([[1.0, 0.0005]]),
        "zero_p_holm": np.array([[1.0, 0.001]])}))
    message, *_ = WebApp(tmp_path).show_artifacts("Disabling", "tuned", "sst2")
    assert "zero, single heads (1 of 2 survive Holm, p < 0.05): L1-H2 -0.2500 [-0.4000, -0.1000]" in message
    message, *_ = WebApp(tmp_path).show_artifacts("Fine-tuning", "tuned", "sst2")
    assert "Holm" not in message


def test_clusters_show_the_mds_fit_stability_and_position_radius_from_the_manifest(tmp_path):
    """`cluster` kept the layout's Kruskal stress-1 (with its interval), the split-half r and the median position
    radius in the manifest, but the tab showed the figure and table alone: the MDS picture with no word on how well
    it fits. Now one note under clusters says them; a run made before they were kept shows none."""
    stems = [entry.stem for entry in tab_artifacts("Surface and clusters")]
    notes_at = 1 + 6 * stems.index("clusters") + 5
    records = {
        "full": {"mds_stress": 0.1344, "mds_stress_interval": [0.121, 0.1512], "split_half_correlation": 0.98712,
                 "median_position_radius": 0.01, "plot_spread": 0.24, "median_radius_to_spread": 0.0417},
        "one_example": {"mds_stress": 0.0, "mds_stress_interval": None, "split_half_correlation": None,
                        "median_radius_to_spread": None},
        "older": {"label_counts": {"broad": 2}},  # an attnpat that kept none of them
        "damaged": {"mds_stress": "0.1", "mds_stress_interval": [0.1], "median_radius_to_spread": float("nan")},
    }
    for task, record in records.items():
        folder = tmp_path / "m" / task
        folder.mkdir(parents=True)
        pd.DataFrame({"layer": [0, 0], "head": [0, 1], "x": [0.1, -0.1], "y": [0.0, 0.0],
                      "position_radius": [0.01, 0.02], "behaviour": ["broad", "prev"]}).to_csv(
            folder / "clusters.csv", index=False)
        (folder / "manifest.json").write_text(json.dumps({"analyses": {"clusters": record}}))
    web = WebApp(tmp_path)
    outputs = web.show_artifacts("Surface and clusters", "m", "full")
    assert outputs[notes_at] == (
        "**note:** MDS fit: Kruskal stress-1 0.134 [0.121, 0.151] (95% over bootstrap draws), fair to poor by "
        "Kruskal's guide (0 perfect, 0.025 excellent, 0.05 good, 0.1 fair, 0.2 poor); split-half r = 0.987 "
        "(distances of the even- vs "
        "odd-numbered examples); median position radius 4.2% of the plot's spread")
    assert [outputs[1 + 6 * k + 5] for k, stem in enumerate(stems) if stem != "clusters"] == [""] * (len(stems) - 1)
    straddling = {**records["full"], "mds_stress": 0.204, "mds_stress_interval": [0.193, 0.219]}
    (tmp_path / "m" / "full" / "manifest.json").write_text(json.dumps({"analyses": {"clusters": straddling}}))
    assert web.show_artifacts("Surface and clusters", "m", "full")[notes_at].startswith(
        "**note:** MDS fit: Kruskal stress-1 0.204 [0.193, 0.219] (95% over bootstrap draws), poor by Kruskal's guide "
        "(0 perfect, 0.025 excellent, 0.05 good, 0.1 fair, 0.2 poor; its interval straddles 0.2); split-half r = 0.987")
    assert web.show_artifacts("Surface and clusters", "m", "one_example")[notes_at] == (
        "**note:** MDS fit: Kruskal stress-1 0.000, perfect by Kruskal's guide (0 perfect, 0.025 excellent, 0.05 good, "
        "0.1 fair, 0.2 poor); "
        "split-half r: none (needs at least 2 examples and 2 heads that differ)")
    assert web.show_artifacts("Surface and clusters", "m", "older")[notes_at] == ""
    assert web.show_artifacts("Surface and clusters", "m", "damaged")[notes_at] == ""
    (tmp_path / "m" / "full" / "manifest.json").write_text("{cut off")  # damaged file: no note, no error
    message, *outputs = web.show_artifacts("Surface and clusters", "m", "full")
    assert outputs[notes_at - 1] == "" and "error" not in message


def test_the_scratch_folder_goes_with_the_app():
    scratch = Scratch()
    download = scratch.new_dir() / "heads_grid.png"
    download.write_bytes(b"png")
    root = scratch.root
    del scratch
    gc.collect()
    assert not root.exists()
    # and at exit of a process that still holds it (an app stopped with Ctrl-C)
    code = "from app.run_browser import Scratch; s = Scratch(); (s.new_dir() / 'x').write_text('x'); print(s.root)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert not Path(done.stdout.strip()).exists()
