"""The web app: live maps (app.explore) and the grid (analysis.figures), the artifact registry, run browsing
and jobs, every endpoint through gradio_client, and 20 concurrent clients."""
from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd
import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image
from test_webapp_support import SENTENCE, free_port, populate_runs, random_classifier, serve, tiny_model_dir
from typer.testing import CliRunner

import app.run_browser as run_browser
import app.webapp as webapp
from analysis.artifacts import TABS, tab_artifacts
from analysis.data import Example, load_data
from analysis.errors import AttnpatError
from analysis.figures import GridLayout, grid_image, layer_head_figure
from analysis.models import load_model, with_map_kind
from analysis.patterns import CLASS_STYLE, CLASSES
from analysis.rundir import RunDir, long_table
from analysis.stream import encode_examples, stream_maps
from app.cli import app
from app.explore import LiveExplorer, ModelCache, sentence_maps
from app.jobs import BatchJobs, cli_verbs
from app.webapp import WebApp
from classifier.classify import pattern_table, ratio_table, ratio_uncertainty
from tests.tiny import save_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir), device="cpu")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory, tiny_dir) -> Path:
    root = tmp_path_factory.mktemp("runs")
    populate_runs(root, tiny_dir)
    return root


@pytest.fixture(scope="module")
def server(runs_dir, tiny_dir):
    demo, web, url, model = serve(runs_dir, tiny_dir)
    yield web, url, model
    demo.close()


@pytest.fixture(scope="module")
def client(server):
    return Client(server[1], verbose=False)


def is_error(status: str) -> bool:
    return status.startswith("**error:** ")


def is_ok(status: str) -> bool:
    """A success line carries no error:/note: prefix."""
    return bool(status) and not status.startswith("**")


def expected_classes(bundle, text: str, pair: str | None = None) -> list[list[str]]:
    """Classes computed independently of the app: stream_maps on the example, then the same classifier."""
    batch = next(iter(stream_maps(bundle, [Example("x", text, pair)], batch_size=1)))
    maps = batch.example_maps(0)
    layers, heads, n, _ = maps.shape
    names = random_classifier().predict(maps.reshape(layers * heads, n, n))
    return [names[layer * heads:(layer + 1) * heads] for layer in range(layers)]


# ---------------------------------------------------------------- app.explore and the grid

def test_sentence_maps_rejects_empty_and_long_input(tiny):
    for text in ("", "   "):
        with pytest.raises(AttnpatError, match="empty"):
            sentence_maps(tiny, text)
    with pytest.raises(AttnpatError, match="longer than 16 tokens"):
        sentence_maps(tiny, "word " * 20, max_tokens=16)
    with pytest.raises(AttnpatError, match="too long"):
        sentence_maps(tiny, "x" * 5000)


@pytest.mark.parametrize("text, pair, which", [("\u200b\u200b", "", "sentence"), ("\ufeff", "", "sentence"),
                                                ("fine", "\u200b\u202e", "second sentence")])
def test_explore_on_invisible_characters_only_names_the_box_not_an_example_id(tmp_path, tiny_dir, text, pair, which):
    """Zero-width spaces, a byte-order mark or direction marks alone: before, `example live has a text that gives no
    token`, naming an example id the user never gave; a data file's message still names its example."""
    web = WebApp(tmp_path / "runs", LiveExplorer(ModelCache(), classifier_loader=random_classifier),
                 allow_any_model=True)
    status, grid, *_ = web.explore(text, pair, str(tiny_dir), False, False)
    assert status == f"**error:** the {which} gives no token (only spaces or invisible characters)" and grid is None
    caption, image, *_ = web.head_map(text, pair, str(tiny_dir), False, False, 1, 1)
    assert caption == status and image is None
    tokenizer = web.explorer.models.get(str(tiny_dir)).tokenizer
    with pytest.raises(AttnpatError, match=f"^example r7 has a {'text pair' if pair else 'text'} that gives no"):
        encode_examples(tokenizer, [Example("r7", text, pair or None)])


def test_grid_image_draws_every_head_with_its_class_colour():
    maps = torch.zeros(2, 3, 4, 4)
    maps[..., torch.arange(4), torch.arange(4)] = 1.0  # diagonal maps
    maps[1, 2] = 0.0
    maps[1, 2, :, 0] = 1.0  # one vertical map
    classes = [["diagonal"] * 3, ["diagonal", "diagonal", "vertical"]]
    layout = GridLayout(2, 3)
    image = np.asarray(grid_image(maps, classes, layout))
    assert image.shape == (layout.size[1], layout.size[0], 3)
    for layer in range(2):
        for head in range(3):
            left = layout.margin_left + head * layout.pitch_x
            top = layout.margin_top + layer * layout.pitch_y
            cell = image[top:top + layout.cell, left:left + layout.cell, 0]
            band = image[top + layout.cell + layout.band - 2, left + layout.cell - 2]
            assert tuple(band) == CLASS_STYLE[classes[layer][head]][1]
            dark = cell < 128
            if (layer, head) == (1, 2):
                assert dark[:, : layout.cell // 4].all() and not dark[:, layout.cell // 2:].any()
            else:
                assert dark[0, 0] and dark[-1, -1] and not dark[0, -1]
            assert layout.head_at(left + 5, top + 5) == (layer, head)
    assert layout.head_at(1, 1) is None


def test_grid_shrinks_long_maps_keeping_stripes():
    maps = torch.zeros(1, 1, 200, 200)
    maps[..., 137] = 1.0
    image = np.asarray(grid_image(maps))
    layout = GridLayout(1, 1)
    top, left = layout.margin_top, layout.margin_left
    cell = image[top:top + layout.cell, left:left + layout.cell, 0]
    dark_columns = np.flatnonzero((cell < 128).all(0))
    assert len(dark_columns) >= 1 and abs(dark_columns[0] - 137 * layout.cell / 200) <= 1


def test_the_grid_shows_absolute_weights_unless_each_map_is_scaled_to_its_maximum(tmp_path, tiny_dir):
    """A near-uniform map (weights 0.1 +- 0.01 over 10 keys) is light grey in the grid, as on the guideline's scale of
    the large view and the annotators' images (before, every map was scaled to its own maximum, so it was as dark as
    a one-key stripe); the checkbox "scale each map to its maximum" draws it dark, and the status says which."""
    rng = np.random.default_rng(0)
    broad = torch.from_numpy(0.1 + rng.uniform(-0.01, 0.01, (10, 10))).float()
    maps = torch.stack([broad / broad.sum(-1, keepdim=True), torch.eye(10)])[None]  # (1, 2, 10, 10)
    layout = GridLayout(1, 2)
    top = layout.margin_top

    def cells(**options):
        image = np.asarray(grid_image(maps, layout=layout, **options))[..., 0]
        return [image[top:top + layout.cell, layout.margin_left + h * layout.pitch_x:][:, :layout.cell]
                for h in range(2)]

    (broad_absolute, stripe_absolute), (broad_scaled, stripe_scaled) = cells(), cells(scale_each=True)
    expected = 255 * (1 - np.sqrt(maps[0, 0].numpy()))  # the guideline's grey (analysis.rendering.absolute_grey)
    assert abs(broad_absolute.mean() - expected.mean()) < 2 and broad_absolute.min() > 150
    assert broad_scaled.max() < 70  # near-black (its least weight is over 3/4 of its most): its speckle looks dark
    assert stripe_absolute.min() == stripe_scaled.min() == 0  # a weight of 1 is black either way

    web = WebApp(tmp_path / "runs", LiveExplorer(ModelCache(), classifier_loader=random_classifier),
                 allow_any_model=True)
    absolute = web.explore(SENTENCE, "", str(tiny_dir), False, False)
    scaled = web.explore(SENTENCE, "", str(tiny_dir), False, False, "weight", True)
    assert webapp.GRID_SCALES[False] in absolute[0] and "absolute weights" in absolute[0]
    assert webapp.GRID_SCALES[True] in scaled[0] and "own maximum" in scaled[0]
    assert np.asarray(Image.open(absolute[1])).mean() > np.asarray(Image.open(scaled[1])).mean()


def test_model_cache_loads_each_model_once_and_reports_unknown_ones():
    calls = []

    def loader(name):
        calls.append(name)
        if name == "missing":
            raise AttnpatError("no such model")
        time.sleep(0.05)
        return object()

    cache = ModelCache(capacity=1, loader=loader)
    threads = [threading.Thread(target=cache.get, args=("a",)) for _ in range(5)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert calls == ["a"]
    cache.get("b")
    cache.get("a")  # evicted by b (capacity 1): loaded again
    assert calls == ["a", "b", "a"]
    with pytest.raises(AttnpatError, match="no such model"):
        cache.get("missing")
    with pytest.raises(AttnpatError, match="no model chosen"):
        cache.get(" ")


def test_model_cache_reloads_a_model_whose_files_were_rewritten(tmp_path):
    """A store model fine-tuned again (`finetune --force`) while the app runs: Explore must show the new weights,
    not the ones it loaded before."""
    folder = tiny_model_dir(tmp_path / "model")
    cache = ModelCache(capacity=2)
    first = cache.get(str(folder))
    assert cache.get(str(folder)) is first  # unchanged files: the cached bundle
    rewritten = load_model(str(folder), device="cpu")
    with torch.no_grad():
        rewritten.model.embeddings.word_embeddings.weight.mul_(2.0)
    rewritten.model.save_pretrained(folder)
    second = cache.get(str(folder))
    assert second is not first and second.revision != first.revision
    assert torch.equal(second.model.embeddings.word_embeddings.weight,
                       rewritten.model.embeddings.word_embeddings.weight)
    assert cache.get(str(folder)) is second and len(cache.loaded()) == 1


def test_explorer_classifies_every_head_like_the_classifier(tiny, tiny_dir):
    explorer = LiveExplorer(ModelCache(loader=lambda name: tiny), classifier_loader=random_classifier)
    view = explorer.explore(str(tiny_dir), SENTENCE)
    assert view.classes == expected_classes(tiny, SENTENCE)
    assert view.probs.shape == (2, 4, len(CLASSES)) and np.allclose(view.probs.sum(-1), 1, atol=1e-5)
    # the toggles change the display, not the predictions (made on the token-level maps)
    hidden = explorer.explore(str(tiny_dir), SENTENCE, word_level=True, hide_special=True)
    assert hidden.classes == view.classes and hidden.maps.shape[-1] < view.maps.shape[-1]


def test_explorer_without_classifier_draws_the_grid_and_says_why(tiny, tiny_dir):
    def missing():
        raise AttnpatError("checkpoint not found")

    explorer = LiveExplorer(ModelCache(loader=lambda name: tiny), classifier_loader=missing)
    view = explorer.explore(str(tiny_dir), SENTENCE)
    assert view.classes is None and "checkpoint not found" in view.note
    assert view.grid.size == GridLayout(2, 4).size


def test_layer_head_figure_draws_long_tables_only():
    fig = layer_head_figure(long_table({"a": np.ones((2, 3)), "b": np.zeros((2, 3))}))
    assert fig is not None and len([ax for ax in fig.axes if ax.images]) == 2
    assert layer_head_figure(pd.DataFrame({"class": ["x"], "count": [1]})) is None
    # overview, surface, special and linguistic tables carry each value's interval (ci_low, ci_high): the values are
    # still drawn, one panel per metric (before the interval columns, no figure at all)
    bounded = long_table({"a": np.ones((2, 3)), "b": np.zeros((2, 3))},
                         intervals={"a": np.ones((2, 3, 2)), "b": np.zeros((2, 3, 2))})
    fig = layer_head_figure(bounded)
    assert fig is not None and len([ax for ax in fig.axes if ax.images]) == 2


# ---------------------------------------------------------------- app.webapp without a server

def test_job_arguments_are_validated(tmp_path):
    jobs = BatchJobs(tmp_path)
    assert "overview" in cli_verbs()
    argv = jobs.arguments("overview", "minilm", "sst2", 8)
    assert argv[0] == "overview" and argv[argv.index("--n") + 1] == "8"
    assert argv[argv.index("--runs-dir") + 1] == str(tmp_path)
    for bad in [("rm", "minilm", "sst2", 8), ("overview", "--help", "sst2", 8), ("overview", "minilm", "nope", 8),
                ("overview", "minilm", "sst2", 0), ("overview", "minilm", "sst2", 2.5), ("overview", "", "sst2", 8),
                ("overview", "minilm", "sst2", "many"), ("overview", "minilm", "sst2", float("inf")),
                ("overview", "minilm", "sst2", float("nan"))]:
        with pytest.raises(AttnpatError):
            jobs.arguments(*bad)


def test_a_job_checks_its_task_and_split_as_the_cli_does(tmp_path):
    """The job form's task goes through analysis.data's check (before, its own `unknown task 'SST-2'; choose one
    of: ...` with no hint, and a task in capitals refused where the CLI takes it); a data file, which the CLI
    takes, is a path on the server: refused with the terminal command that runs it; a misspelt split is named."""
    jobs = BatchJobs(tmp_path)
    argv = jobs.arguments("overview", "minilm", " SST2 ", 8)
    assert argv[argv.index("--task") + 1] == "sst2"
    with pytest.raises(AttnpatError) as caught:
        jobs.arguments("overview", "minilm", "SST-2", 8)
    assert str(caught.value).startswith("unknown task 'SST-2'; known tasks: sst2,")
    assert str(caught.value).endswith("; did you mean 'sst2'?")
    for path in ("reviews.csv", str(tmp_path / "d.jsonl")):
        with pytest.raises(AttnpatError, match=r"^a batch job runs a built-in task \(sst2, .*\), not a data file; "
                                               r"run `attnpat overview --task FILE` in a terminal for '"):
            jobs.arguments("overview", "minilm", path, 8)
    with pytest.raises(AttnpatError, match="^unknown split 'dev'; .*; did you mean 'validation'\\?$"):
        jobs.arguments("overview", "minilm", "sst2", 8, split="dev")


def test_a_picked_model_clears_the_grid_and_keeps_the_head_selectors_in_its_range(tmp_path, tiny_dir):
    """Picking a model clears the grid (before, the old model's grid stayed, and a click on it was read with the
    new model's layout: another model's head, or none), and the head selectors follow a model with fewer layers
    or heads (before, every redraw ended in "layer 3, head 8 does not exist"); in range they are left as they are
    (set again to the values they had when the redraw began, they would undo a click on the grid made meanwhile)."""
    big = str(save_tiny_model(tmp_path / "big", layers=3, heads=8))
    small = str(tiny_dir)
    web = WebApp(tmp_path / "runs", LiveExplorer(ModelCache(capacity=2), classifier_loader=random_classifier))
    demo = web.build()
    ids = {block.elem_id: block._id for block in demo.blocks.values() if getattr(block, "elem_id", None)}
    fns = demo.fns
    (picked,) = [f for f in fns.values() if (ids["explore-model"], "input") in f.targets]
    assert picked.fn == web.forget_grid
    assert [block.elem_id for block in picked.outputs if getattr(block, "elem_id", None)] == [
        "explore-status", "explore-grid", "explore-classes", "explore-caption", "explore-map"]
    status, grid, classes, *downloads, caption, large, map_png, map_svg, drawn = web.forget_grid(small)
    assert grid is None and "press Show all heads" in status and not classes.visible
    assert drawn is None and isinstance(picked.outputs[-1], gr.State)  # no grid: no drawing to pick a head of
    # the large view goes too (before, the other model's head stayed there, with its caption and downloads)
    assert caption == "" and large is None and not map_png.visible and not map_svg.visible
    assert not any(button.visible for button in downloads)
    run = next(k for k, f in fns.items() if (ids["explore-run"], "click") in f.targets)
    follow = next(f for f in fns.values() if f.trigger_after == run)
    assert follow.fn == web.follow_head
    assert {ids["explore-layer"], ids["explore-head"]} <= {block._id for block in follow.outputs}

    def drawn(model, text=SENTENCE):
        return web.draw(text, "", model, False, False)[-1]

    layer, head, caption, image, *_ = web.follow_head(drawn(big), 3, 8)
    assert layer == head == gr.update() and "layer 3, head 8" in caption and image  # in range: left alone
    layer, head, caption, image, *_ = web.follow_head(drawn(small), 3, 8)
    assert (layer, head) == (2, 4) and is_ok(caption) and "layer 2, head 4" in caption and image
    layer, head, caption, image, *_ = web.follow_head(drawn(small), 0, 2)
    assert (layer, head) == (1, gr.update()) and is_ok(caption) and "layer 1, head 2" in caption
    layer, head, caption, image, *_ = web.follow_head(drawn(small, ""), 3, 8)  # the grid failed
    assert layer == head == gr.update() and is_error(caption) and "empty" in caption and image is None


def test_a_head_picked_on_the_grid_is_shown_for_the_sentence_the_grid_was_drawn_from(tmp_path, tiny_dir):
    """The sentence edited but not drawn (no Enter, no Show all heads), then a head clicked on the grid: before, the
    large view showed that head of the edited sentence, under a grid of the other one. A click, the layer and head
    boxes and the redraw's head now read the inputs the grid was drawn from (kept in a gr.State); the head_map API
    still names its own input."""
    model = str(tiny_dir)
    web = WebApp(tmp_path / "runs", LiveExplorer(ModelCache(), classifier_loader=random_classifier),
                 allow_any_model=True)
    demo = web.build()
    ids = {block.elem_id: block._id for block in demo.blocks.values() if getattr(block, "elem_id", None)}
    fns = list(demo.fns.values())
    (draw,) = [f for f in fns if (ids["explore-run"], "click") in f.targets]
    (state,) = [block for block in draw.outputs if isinstance(block, gr.State)]
    (click,) = [f for f in fns if (ids["explore-grid"], "select") in f.targets]
    after = [f for f in fns if f.trigger_after is not None and demo.fns[f.trigger_after] in (click, draw)]
    boxes = [f for f in fns if {(ids["explore-layer"], "submit"), (ids["explore-head"], "submit")} & set(f.targets)]
    picks = [click, *after, *boxes]
    assert [f.fn for f in picks] == [web.pick_head, web.follow_head, web.drawn_head_map, *[web.drawn_head_map] * 2]
    for fn in picks:
        assert fn.inputs[0] is state and ids["explore-text"] not in {block._id for block in fn.inputs}, fn.fn
    assert draw.fn == web.draw and "explore-notes" in ids

    edited = "A longer sentence, typed after the grid was drawn, and never drawn at all."
    drawn = web.draw(SENTENCE, "", model, False, False)[-1]
    layout = GridLayout(2, 4)
    at = [layout.margin_left + 2 * layout.pitch_x + 3, layout.margin_top + 1 * layout.pitch_y + 3]
    assert web.pick_head(drawn, 1, 1, gr.SelectData(None, {"index": at, "value": None})) == (2, 3)
    caption, image, *_ = web.drawn_head_map(drawn, 2, 3)
    assert caption == web.head_map(SENTENCE, "", model, False, False, 2, 3)[0] and "13 tokens" in caption and image
    assert caption != web.head_map(edited, "", model, False, False, 2, 3)[0]  # what the large view showed before
    drawn = web.draw(SENTENCE, "", model, True, True, "norm")[-1]  # the toggles it was drawn with count too
    assert "norm map" in web.drawn_head_map(drawn, 1, 2)[0] and "11 words without [CLS]" in web.drawn_head_map(
        drawn, 1, 2)[0]
    caption, image, png, _ = web.drawn_head_map(None, 1, 2)  # a model picked since: no grid on screen
    assert caption.startswith("**note:** no grid drawn") and image is None and not png.visible


@pytest.mark.parametrize("layer, shown", [(float("nan"), "got nan"), (float("inf"), "got inf"), (2.5, "got 2.5"),
                                          (0, "got 0"), ("two", "got 'two'"), (None, "enter a layer and a head")])
def test_a_layer_or_head_that_is_not_a_whole_number_from_1_is_one_error_line(tmp_path, tiny_dir, layer, shown):
    """The head boxes (and the head_map API) sent NaN or infinity as an `unexpected error: ValueError` with a
    traceback in the server log, 2.5 was cut to 2 unseen, and 1e300 printed all 301 digits of the layer."""
    web = WebApp(tmp_path / "runs", LiveExplorer(ModelCache(), classifier_loader=random_classifier),
                 allow_any_model=True)
    caption, image, png, svg = web.head_map(SENTENCE, "", str(tiny_dir), False, False, layer, 1)
    assert is_error(caption) and shown in caption and "unexpected" not in caption and "\n" not in caption
    assert image is None and not png.visible
    caption, *_ = web.head_map(SENTENCE, "", str(tiny_dir), False, False, 1e300, 1)
    assert is_error(caption) and "layer 1e+300, head 1 does not exist: the model has 2 layers" in caption


# ---------------------------------------------------------------- every endpoint through gradio_client

def test_client_sees_every_endpoint(client):
    endpoints = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/explore", "/head_map", "/pattern_ratios", "/fine_tuning", "/disabling", "/surface_and_clusters",
            "/list_runs", "/manifest", "/start_job", "/watch_job", "/stop_job"} <= endpoints


def test_explore_endpoint(client, server, tiny):
    _, _, model = server
    status, grid, wide, png, svg, csv = client.predict(SENTENCE, "", model, False, False,
                                                                    api_name="/explore")
    assert is_ok(status) and "2 layers x 4 heads" in status
    layout = GridLayout(2, 4)
    assert Image.open(grid).size == layout.size
    assert Path(png["value"]).read_bytes()[:4] == b"\x89PNG" and "<svg" in Path(svg["value"]).read_text()[:200]
    table = pd.read_csv(csv["value"])
    expected = expected_classes(tiny, SENTENCE)
    assert [[row["class"] for _, row in group.iterrows()] for _, group in table.groupby("layer")] == expected
    assert [row[1:] for row in unwrap(wide)["data"]] == [[CLASS_STYLE[c][0] for c in row] for row in expected]


@pytest.mark.parametrize("text, model, message", [
    ("", None, "empty"),
    ("word " * 400, None, "longer than"),
    ("hello", "no/such-model-anywhere", "could not load model"),
])
def test_explore_bad_input_shows_a_message_and_keeps_serving(client, server, text, model, message):
    status, grid, *_ = client.predict(text, "", model or server[2], False, False, api_name="/explore")
    assert is_error(status) and message in status and grid is None
    assert is_ok(client.predict(SENTENCE, "", server[2], False, False, api_name="/explore")[0])


def test_head_map_endpoint(client, server):
    model = server[2]
    caption, image, png, svg = client.predict(SENTENCE, "", model, True, True, 2, 3, api_name="/head_map")
    assert "layer 2, head 3" in caption and "predicted" in caption and "words without [CLS]/[SEP]" in caption
    assert Path(png["value"]).suffix == ".png" and Path(svg["value"]).read_text().lstrip().startswith("<?xml")
    caption, image, *_ = client.predict(SENTENCE, "", model, False, False, 3, 1, api_name="/head_map")
    assert is_error(caption) and "2 layers x 4 heads" in caption and image is None


def unwrap(value):
    """A component update's value (the client returns {"__type__": "update", "value": ...} for updates)."""
    return value.get("value") if isinstance(value, dict) and value.get("__type__") == "update" else value


def run_tab(client, api_name: str, model: str, task: str):
    """(message, [artifact outputs]) of a run tab; per artifact the API returns title, image, table, the
    downloadable files and the notes under the table (the group's visibility is layout, not an API output; the
    title is empty when missing)."""
    out = [unwrap(value) for value in client.predict(model, task, api_name=api_name)]
    fields = ("title", "image", "table", "files", "notes")
    width = len(fields)
    artifacts = [dict(zip(fields, out[1 + width * k: 1 + width * (k + 1)])) for k in range((len(out) - 1) // width)]
    for artifact in artifacts:
        artifact["suffixes"] = sorted(Path(f).suffix for f in artifact["files"] or [])
    return out[0], artifacts


def test_run_tab_endpoints(client, server, runs_dir):
    model = Path(server[2]).name
    message, (by_task, ratios, patterns, map_kinds) = run_tab(client, "/pattern_ratios", model, "sst2")
    assert message.startswith("**note:** ") and "map kinds (run `attnpat compare-kinds --model" in message
    assert not (map_kinds["image"] or map_kinds["files"])  # compare-kinds has not run here
    assert f"{model}/all" in by_task["title"] and by_task["table"]["data"][0][0] == "sst2"
    assert ratios["suffixes"] == [".csv"] and ratios["image"] is None  # a table only: CSV, no figure
    csv = next(f for f in ratios["files"] if f.endswith(".csv"))
    assert pd.read_csv(csv).fraction.sum() == pytest.approx(1.0)
    assert Path(patterns["image"]).suffix == ".png" and patterns["suffixes"] == [".csv", ".png", ".svg"]
    svg = next(f for f in patterns["files"] if f.endswith(".svg"))
    assert Path(svg).read_text().lstrip().startswith("<?xml")

    message, artifacts = run_tab(client, "/classifier", "classifier", "v1")  # the shipped record stands in
    assert message.startswith("**note:** ") and "attnpat train --data annotation/labeled/v5" in message

    message, artifacts = run_tab(client, "/fine_tuning", model, "sst2")
    assert is_error(message) and f"no fine-tuning run for {model}/sst2" in message
    assert f"attnpat special --model {server[2]} --task sst2" in message  # the model as given, as its manifest says
    assert not any(a["title"] or a["image"] or a["files"] for a in artifacts)

    message, (disable_heads, disable_layers, importance, pruning) = run_tab(client, "/disabling", model, "sst2")
    assert message.startswith("**note:** ") and "also shown here once computed: " in message
    assert "importance" in message and "disable layers" in message and "attnpat prune" not in message
    assert disable_heads["image"] and disable_heads["suffixes"] == [".csv", ".png", ".svg"]  # drawn from the CSV
    assert pruning["title"] and pruning["image"] is None and pruning["suffixes"] == [".csv"]  # not layer x head
    assert not importance["title"] and not disable_layers["title"]

    message, artifacts = run_tab(client, "/surface_and_clusters", model, "sst2")
    assert "surface.csv is not a readable CSV" in message
    stems = [artifact.stem for artifact in tab_artifacts("Surface and clusters")]
    overview = artifacts[stems.index("overview")]
    assert overview["title"] and {"to_cls", "to_sep", "entropy"} <= {row[2] for row in overview["table"]["data"]}

    message, _ = run_tab(client, "/pattern_ratios", model, "nosuchtask")
    assert is_error(message) and f"no run {model}/nosuchtask" in message and "attnpat classify" in message
    message, _ = run_tab(client, "/pattern_ratios", "../..", "sst2")
    assert is_error(message) and "not a run name" in message


def test_runs_and_manifest_endpoints(client, server):
    model = Path(server[2]).name
    table, picked = client.predict(f"{model}/sst2", api_name="/list_runs")
    assert unwrap(picked) == f"{model}/sst2"  # the current pick is kept
    rows = {(row[0], row[1]): row for row in table["data"]}
    assert (model, "sst2") in rows and "overview" in rows[(model, "sst2")][2]
    manifest = json.loads(client.predict(f"{model}/sst2", api_name="/manifest"))
    assert manifest["model"]["layers"] == 2 and "overview" in manifest["analyses"]
    assert "no run" in json.loads(client.predict(f"{model}/mrpc", api_name="/manifest"))["message"]


def test_job_endpoints_reject_bad_jobs(client):
    with pytest.raises(AppError, match="not in the list of choices"):  # the verb dropdown is a whitelist
        client.predict("rm", "minilm", "sst2", 4, "", api_name="/start_job")
    log, status, *_ = client.predict("overview", "-rf", "sst2", 4, "", api_name="/start_job")
    assert is_error(status) and "not a model name" in status
    log, status, *_ = client.predict("overview", "minilm", "sst2", 1.5, "", api_name="/start_job")
    assert is_error(status) and "whole number" in status  # not rounded to 2 and run
    assert "no job" in client.predict(api_name="/stop_job")


@pytest.mark.slow
def test_job_runs_to_the_end_and_its_run_appears(client, server, runs_dir):
    model_dir = server[2]
    log, status, table, picked, manifest = client.predict("overview", model_dir, "mrpc", 4, "",
                                                          api_name="/start_job")
    assert is_ok(status) and "finished" in status, log
    assert (Path(model_dir).name, "mrpc") in {(row[0], row[1]) for row in unwrap(table)["data"]}  # refreshed
    assert json.loads(manifest)["task"] == unwrap(picked).split("/")[1]
    assert (runs_dir / Path(model_dir).name / "mrpc" / "overview.csv").is_file()
    assert "per-head table" in log
    log, status, *_ = client.predict("", api_name="/watch_job")
    assert "finished" in status
    table, _ = client.predict("", api_name="/list_runs")
    assert (Path(model_dir).name, "mrpc") in {(row[0], row[1]) for row in table["data"]}


@pytest.mark.slow
def test_a_running_job_can_be_stopped(client, server):
    job = client.submit("overview", server[2], "sst2", 64, "", api_name="/start_job")
    deadline = time.time() + 60
    while not any("running" in output[1] for output in job.outputs()) and time.time() < deadline:
        time.sleep(0.2)
    # one job at a time for the whole app: a second start (from any browser) is refused with one line
    _, refused, *_ = client.predict("overview", server[2], "mrpc", 4, "", api_name="/start_job")
    assert is_error(refused) and "a job is already running" in refused and "wait for it or stop it" in refused
    assert "job stopped" in client.predict(api_name="/stop_job")
    log, status, *_ = job.result(timeout=60)
    assert is_error(status) is False and status.startswith("**note:** stopped (signal")


@pytest.mark.slow
def test_twenty_concurrent_clients(server, tiny):
    model = server[2]
    sentences = [f"Sentence number {k} is about {'cats dogs birds fish'.split()[k % 4]} and more." for k in range(20)]
    results, errors = {}, []

    def one(k):
        try:
            # a generous timeout: 20 page configs at once on 2 shared cores can take longer than httpx's 5 s
            c = Client(server[1], verbose=False, httpx_kwargs={"timeout": 120})
            status, grid, wide, png, svg, csv = c.predict(sentences[k], "", model, False, bool(k % 2),
                                                              api_name="/explore")
            results[k] = (status, pd.read_csv(csv["value"]))
        except Exception as exc:  # collected, so every failure is reported
            errors.append(f"{k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(k,)) for k in range(20)]
    [t.start() for t in threads]
    [t.join(timeout=240) for t in threads]
    assert not errors and len(results) == 20
    for k, (status, table) in results.items():
        assert is_ok(status)
        expected = expected_classes(tiny, sentences[k])
        assert table["class"].tolist() == [c for row in expected for c in row]


@pytest.mark.slow
def test_minilm_live_view_on_packaged_data():
    example = load_data("sst2", n=1).examples[0]
    explorer = LiveExplorer(classifier_loader=random_classifier)
    view = explorer.explore("minilm", example.text)
    assert view.maps.shape[:2] == (6, 12) and len(view.classes) == 6 and len(view.classes[0]) == 12
    assert view.grid.size == GridLayout(6, 12).size
    attn, labels = explorer.head_map("minilm", example.text, None, 5, 11, word_level=True)
    assert attn.shape == (len(labels), len(labels)) and np.allclose(attn.sum(-1), 1, atol=1e-4)


def test_the_app_sends_no_analytics_whatever_the_environment_says(tmp_path, monkeypatch):
    """GRADIO_ANALYTICS_ENABLED=True in the environment (set for another gradio app) made this one start gradio's
    version check against the network and report its launch (before, the app only set a default)."""
    import gradio.analytics  # noqa: PLC0415

    checked = []
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "True")
    monkeypatch.setattr(gradio.analytics, "version_check", lambda: checked.append("version"))
    demo = WebApp(tmp_path / "runs").build()
    assert demo.analytics_enabled is False and checked == []


def test_cli_app_verb_is_registered():
    result = CliRunner().invoke(app, ["app", "--help"])
    assert result.exit_code == 0 and "--host" in result.output and "--port" in result.output
    assert "--share" not in result.output


def test_the_pattern_ratios_tab_shows_every_ratio_with_its_intervals_and_offers_the_csv(tmp_path):
    """The Pattern ratios tab's table: each share as classified and adjusted, each beside its 95% interval, as
    percentages; per head the Wilson interval; the full-precision CSVs are the downloads."""
    rng = np.random.default_rng(0)
    per_example = rng.multinomial(6, [0.6, 0.1, 0.1, 0.15, 0.05], size=20)  # 20 examples of 2 x 3 heads
    confusion = np.eye(5, dtype=int) * 40 + 2
    folder = tmp_path / "runs" / "m" / "sst2"
    folder.mkdir(parents=True)
    ratio_table(per_example.sum(0).reshape(1, 1, -1), per_example, confusion).to_csv(folder / "pattern_ratios.csv",
                                                                                    index=False)
    pattern_table(rng.multinomial(20, [0.2] * 5, size=(2, 3))).to_csv(folder / "patterns.csv", index=False)
    outputs = WebApp(tmp_path / "runs").show_artifacts("Pattern ratios", "m", "sst2")
    stems = [artifact.stem for artifact in tab_artifacts("Pattern ratios")]
    for stem, columns in (("pattern_ratios", ["fraction", "ci_low", "ci_high", "adjusted", "adjusted_ci_low",
                                              "adjusted_ci_high"]), ("patterns", ["fraction", "ci_low", "ci_high"])):
        table, files = outputs[1 + 6 * stems.index(stem) + 3], outputs[1 + 6 * stems.index(stem) + 4]
        written = pd.read_csv(folder / f"{stem}.csv")
        shown = pd.DataFrame(table.value["data"], columns=table.value["headers"])
        assert shown[columns].values.tolist() == [[f"{value * 100:.1f}%" for value in row]
                                                  for row in written[columns].values]
        assert files == [str(folder / f"{stem}.csv")]


def _disabling_run(root: Path) -> Path:
    """runs/m/sst2 with a disable_heads table and no figure of its own (the tab draws one into its scratch)."""
    folder = root / "m" / "sst2"
    folder.mkdir(parents=True)
    rows = [{"layer": layer, "head": head, "metric": f"uniform_{name}", "value": value}
            for layer in range(2) for head in range(3)
            for name, value in (("delta", 0.01 * (layer - head)), ("delta_ci_low", -0.1), ("delta_ci_high", 0.1),
                                ("p_holm", 0.5))]
    pd.DataFrame(rows).to_csv(folder / "disable_heads.csv", index=False)
    return folder


def test_a_run_tab_survives_a_removed_scratch_folder_and_reports_unreadable_or_damaged_tables(tmp_path,
                                                                                                 monkeypatch):
    """Each failure is the tab's error line, never an exception that blanks the tab (before: the scratch folder
    removed by a /tmp cleaner, a table the server may not read, or an infinite layer index each raised)."""
    folder = _disabling_run(tmp_path / "runs")
    web = WebApp(tmp_path / "runs")
    shutil.rmtree(web.scratch.root)
    outputs = web.show_artifacts("Disabling", "m", "sst2")
    files = outputs[5]  # the first artifact's downloads: its CSV and the heatmap drawn from it
    assert not is_error(outputs[0]) and any(f.endswith(".png") and Path(f).is_file() for f in files)

    real_read_csv = pd.read_csv

    def denied(path, *args, **kwargs):
        if Path(path).name == "disable_heads.csv":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_csv(path, *args, **kwargs)

    monkeypatch.setattr(run_browser.pd, "read_csv", denied)
    message = web.show_artifacts("Disabling", "m", "sst2")[0]
    assert "**error:** disable_heads.csv cannot be read (permission denied)" in message
    monkeypatch.setattr(run_browser.pd, "read_csv", real_read_csv)

    table = real_read_csv(folder / "disable_heads.csv")
    table["layer"] = table["layer"].astype(float)
    table.loc[0, "layer"] = float("inf")
    table.to_csv(folder / "disable_heads.csv", index=False)
    message = web.show_artifacts("Disabling", "m", "sst2")[0]
    assert isinstance(message, str)  # the tab is drawn; the damaged table says so in its own view


def test_a_run_name_typed_too_long_with_control_characters_or_not_text_is_one_error_line(tmp_path):
    """The run tabs' model and task boxes take typed names (and their API any JSON value): one too long for a
    folder name, one with a NUL, or a number is the tab's one error line, before the file system is asked
    (before: OSError 'File name too long' and TypeError tracebacks, the tab left as it was; a NUL read as no run)."""
    _disabling_run(tmp_path / "runs")
    web = WebApp(tmp_path / "runs")
    stems = tab_artifacts("Disabling")
    for model, task, reason in (("m" * 300, "sst2", "300 characters) (a folder name has at most 255 bytes"),
                                ("m", "é" * 200, "200 characters) (a folder name has at most 255 bytes"),
                                ("m\x00", "sst2", "it holds control characters"), (7, "sst2", "int, not text"),
                                ("m", ["sst2"], "list, not text"), ("..", "sst2", "one folder name is needed")):
        outputs = web.show_artifacts("Disabling", model, task)
        assert outputs[0].startswith("**error:** not a run name: ") and outputs[0].endswith(f"({reason})")
        assert "\n" not in outputs[0] and len(outputs[0]) < 200 and len(outputs) == 1 + 6 * len(stems)
        web.run_choices("Disabling", model, task)  # falls back to a run that exists, no exception
    assert not is_error(web.show_artifacts("Disabling", "m", "sst2")[0])


def test_a_job_form_given_a_pasted_page_or_a_value_of_another_type_answers_one_short_line(tmp_path):
    """The job form's (and start_job API's) model, task, job and count each name what was wrong in one short line,
    the value cut to 60 characters with its length, and start no job (before: a 5,000-character name was echoed
    back whole, a number as the model was an AttributeError traceback, and JSON true ran a job of 1 example)."""
    web = WebApp(tmp_path / "runs")
    page = "x" * 5000
    for verb, model, task, n, expected in (
            ("classify", page, "sst2", 8, "not a model name: 'xxx"),
            ("classify", "minilm", page, 8, "unknown task 'xxx"),
            (page, "minilm", "sst2", 8, "unknown job 'xxx"),
            ("classify", "minilm", "sst2", "9" * 5000, "whole number"),
            ("classify", 5, "sst2", 8, "not a model name: 5 "),
            ("classify", "minilm", "sst2", True, "got True")):
        _, status, *_ = next(web.start_job(verb, model, task, n))
        assert status.startswith("**error:** ") and expected in status, status
        assert len(status) < 260 and "\n" not in status
        assert ("(5000 characters)" in status) == (page in (verb, model, task) or n == "9" * 5000)
    assert web.jobs.current() is None  # no job started


def test_explore_given_values_of_another_type_or_a_pasted_page_answers_one_short_line(tmp_path, tiny_dir):
    """Explore's API takes any JSON value in its model box and may be sent a number as the sentence: each is one
    error line naming the box, and a pasted page as the model or map kind is quoted cut to 60 characters (before:
    `unexpected error: AttributeError: 'int' object has no attribute 'strip'` with a traceback in the log, and a
    5,000-character map kind echoed back whole)."""
    web = WebApp(tmp_path / "runs", LiveExplorer(ModelCache(allowed=lambda: [str(tiny_dir)]),
                                                 classifier_loader=random_classifier))
    page = "x" * 5000
    for text, pair, model, kind, expected in (
            ("a cat", "", 5, "weight", "not a model name: 5; pick one from the list"),
            ("a cat", "", ["minilm"], "weight", "not a model name: ['minilm']"),
            (7, "", str(tiny_dir), "weight", "the sentence must be text, got int 7"),
            ("a cat", {"x": 1}, str(tiny_dir), "weight", "the second sentence must be text, got dict"),
            ("a cat", "", page, "weight", "model 'xxx"),
            ("a cat", "", str(tiny_dir), page, "unknown map kind 'xxx")):
        status = web.explore(text, pair, model, False, False, kind)[0]
        caption = web.head_map(text, pair, model, False, False, 1, 1, kind)[0]
        for line in (status, caption):
            assert line.startswith("**error:** ") and expected in line and "unexpected" not in line, line
            assert len(line) < 260 and ("(5000 characters)" in line) == (page in (model, kind))
    assert "model 'xxx" in web.forget_grid(page)[0] and len(web.forget_grid(page)[0]) < 200
    assert not web.explore("a cat", "", str(tiny_dir), False, False, "weight")[0].startswith("**error")


def test_a_port_in_use_is_one_error_and_loads_no_model(tmp_path, monkeypatch):
    """The warm-up (a model load in a thread) starts only once the port is served: a failed launch that exited
    while torch was loading aborted the interpreter (exit 134) instead of giving the one-line error."""
    warmed = []
    monkeypatch.setattr(webapp, "warm_up", lambda web: warmed.append(web))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AttnpatError, match=rf"^cannot serve on 127.0.0.1:{port} .*pick another --port"):
            webapp.launch("127.0.0.1", port, tmp_path / "runs", block=False, quiet=True)
    assert warmed == []
    port = free_port()
    demo, _ = webapp.launch("127.0.0.1", port, tmp_path / "runs", block=False, quiet=True)
    try:
        assert len(warmed) == 1
    finally:
        demo.close()


def test_suggested_commands_name_the_model_as_given_not_its_run_folder(tmp_path, monkeypatch):
    """A run of model 'org/tiny-bert' lives in runs/org__tiny-bert/: the tabs' suggested commands said
    `--model org__tiny-bert` (no such model); now they take the model the run's manifest records (this local
    folder: its absolute path), also for a task not run yet and for the norm-map folder, and fall back to the
    folder's name for a manifest without one."""
    monkeypatch.chdir(tmp_path)
    save_tiny_model(tmp_path / "org" / "tiny-bert")
    bundle = load_model("org/tiny-bert", device="cpu")
    assert bundle.slug == "org__tiny-bert"
    runs = tmp_path / "runs"
    run = RunDir(bundle.slug, "sst2", runs)
    with run.record("sweeps", bundle):
        run.write_table("disable_heads", long_table({"uniform_delta": np.zeros((2, 4))}))
    web = WebApp(runs)
    message = web.show_artifacts("Disabling", "org__tiny-bert", "sst2")[0]
    named = bundle.reference  # a folder typed relative to here: named from anywhere
    assert named == str((tmp_path / "org" / "tiny-bert").resolve())
    assert f"`attnpat importance --model {named} --task sst2`" in message
    assert "org__tiny-bert --task" not in message
    message = web.show_artifacts("Pattern ratios", "org__tiny-bert", "rte")[0]  # no rte run: sst2's manifest names it
    assert message.startswith("**error:** no run org__tiny-bert/rte") and f"--model {named} --task rte" in message
    norm = RunDir("org__tiny-bert@norm", "sst2", runs)
    with norm.record("classify", with_map_kind(bundle, "norm")):
        norm.write_table("patterns", pd.DataFrame({"layer": [0], "head": [0], "class": ["block"], "count": [1],
                                                   "fraction": [1.0]}))
    message = web.show_artifacts("Pattern ratios", "org__tiny-bert@norm", "sst2")[0]
    assert f"`attnpat classify --model {named} --task sst2 --map-kind norm`" in message
    older = runs / "old__model" / "sst2"
    older.mkdir(parents=True)
    (older / "manifest.json").write_text(json.dumps({"task": "sst2", "analyses": {}}))  # no "model" recorded
    message = web.show_artifacts("Pattern ratios", "old__model", "sst2")[0]
    assert "`attnpat classify --model old__model --task sst2`" in message


def test_a_norm_runs_tabs_hint_no_command_that_writes_the_weight_run(tmp_path):
    """On a norm run (runs/m@norm/sst2/) the Fine-tuning tab suggested `attnpat compare --base ... --finetuned m
    ...` and `attnpat finetune ...`, whose verbs take no --map-kind and so write the weight run m/sst2, never this
    one (and the Disabling tab hinted disable, importance and prune the same way). Now a kind run hints only the
    commands with --map-kind <kind>, and says where the rest are."""
    runs = tmp_path / "runs"
    norm = RunDir("m@norm", "sst2", runs)
    norm.write_table("special_tokens", long_table({"to_cls": np.full((2, 3), 0.5)}))
    (norm.path / "manifest.json").write_text(json.dumps({"model": {"name": "m", "source": "store", "path": "/x/m"},
                                                         "analyses": {"special_change": {"base_model": "minilm"}}}))
    web = WebApp(runs)
    message = web.show_artifacts("Fine-tuning", "m@norm", "sst2")[0]
    assert "`attnpat special --model m --base minilm --task sst2 --map-kind norm`" in message
    assert "attnpat compare" not in message and "attnpat finetune" not in message
    assert ("cosine, pattern transitions, finetune eval: not computed on norm maps (`compare`, `finetune` take no "
            "--map-kind); shown in the attention-weight run m/sst2") in message
    message = web.show_artifacts("Disabling", "m@norm", "sst2")[0]
    assert message.startswith("m@norm/sst2: no disabling artifact is computed on norm maps")
    assert "attnpat disable" not in message and "attnpat importance" not in message
    message = web.show_artifacts("Disabling", "m@norm", "rte")[0]  # no such run yet: no command to run either
    assert message.startswith("**error:** no run m@norm/rte in ") and "attnpat" not in message


def test_suggested_commands_name_a_local_model_by_its_absolute_path(tmp_path, monkeypatch):
    """A run of a model typed as `--model ./my-model` was hinted as `attnpat ... --model ./my-model`, which loads
    only from the folder it was typed in; now the hints name the folder's absolute path (the manifest records it),
    and a base typed as a relative path is recorded absolute by compare and special too. Aliases, store names and
    hub ids stay as typed."""
    monkeypatch.chdir(tmp_path)
    save_tiny_model(tmp_path / "my-model")
    bundle = load_model("./my-model", device="cpu")
    assert bundle.reference == str((tmp_path / "my-model").resolve()) and bundle.name == "./my-model"
    runs = tmp_path / "runs"
    run = RunDir(bundle.slug, "sst2", runs)
    with run.record("sweeps", bundle):
        run.write_table("disable_heads", long_table({"uniform_delta": np.zeros((2, 4))}))
    message = WebApp(runs).show_artifacts("Disabling", bundle.slug, "sst2")[0]
    assert f"`attnpat importance --model {bundle.reference} --task sst2`" in message and "./my-model" not in message
    assert load_model("minilm", device="cpu").reference == "minilm"


def test_the_pattern_ratios_tab_shows_classifys_notes_under_the_ratio_table(tmp_path):
    """The notes `classify` prints under a task's ratios, from the run's manifest (ratio_uncertainty): a class whose
    adjusted share was clipped to 0, and adjusted ratios unavailable for a confusion matrix that cannot be inverted
    (before, the tab showed the table alone: a clipped 0.0% read as a measured zero)."""
    counts = np.array([40, 10, 10, 20, 0]).reshape(1, 1, -1)  # no heterogeneous map classified
    confusion = np.eye(5) * 70
    confusion[3, 4] = 30  # 30% of true block maps are classified heterogeneous
    never = np.array([[3, 0, 1, 0, 0], [0, 0, 2, 0, 2], [0, 0, 1, 0, 3], [0, 0, 0, 4, 0], [0, 0, 1, 0, 3]])
    stems = [artifact.stem for artifact in tab_artifacts("Pattern ratios")]
    for task, matrix in (("clipped", confusion), ("singular", never)):
        folder = tmp_path / "runs" / "m" / task
        folder.mkdir(parents=True)
        table = ratio_table(counts, confusion=matrix if task == "clipped" else None)
        table.to_csv(folder / "pattern_ratios.csv", index=False)
        manifest = {"analyses": {"classify": {"ratio_uncertainty": ratio_uncertainty(10, matrix, table)}}}
        (folder / "manifest.json").write_text(json.dumps(manifest))
    web = WebApp(tmp_path / "runs")
    notes = web.show_artifacts("Pattern ratios", "m", "clipped")[1 + 6 * stems.index("pattern_ratios") + 5]
    assert notes.startswith("**note:** adjusted heterogeneous clipped to 0: observed below what the classifier's")
    outputs = web.show_artifacts("Pattern ratios", "m", "singular")
    assert outputs[1 + 6 * stems.index("pattern_ratios") + 5] == (
        "**note:** adjusted ratios unavailable: the checkpoint's cross-validated confusion matrix cannot be inverted: "
        "the classifier never predicted diagonal in cross-validation")
    assert [outputs[1 + 6 * k + 5] for k, stem in enumerate(stems) if stem != "pattern_ratios"] == [""] * 3
    (tmp_path / "runs" / "m" / "singular" / "manifest.json").write_text("{cut off")  # damaged: no notes, no error
    assert web.show_artifacts("Pattern ratios", "m", "singular")[1 + 6 * stems.index("pattern_ratios") + 5] == ""


def test_every_tab_with_no_run_picked_shows_its_message_not_a_crash(tmp_path):
    """With no run yet (model and task None), the Classifier tab raised AttributeError in the note for models
    without a base, and showed nothing, where it shows the shipped classifier's record."""
    web = WebApp(tmp_path / "runs")
    for tab in TABS:
        message = web.show_artifacts(tab.name, None, None)[0]
        expected = "the shipped classifier's record" if tab.name == "Classifier" else "no runs in"
        assert expected in message, (tab.name, message)
