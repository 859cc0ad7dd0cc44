"""The Explore tab's requests racing one another: a slow grid or head request that ends after a newer request or a
model pick changes nothing on screen (app.explore.ViewClock), driven through the handlers with a slow explorer."""
from __future__ import annotations

import copy
import threading
from pathlib import Path

import gradio as gr
import pytest
from test_webapp_support import SENTENCE, random_classifier, tiny_model_dir

from app.explore import LiveExplorer, ModelCache, ViewClock
from app.webapp import WebApp, skipped
from tests.tiny import save_tiny_model

EDITED = "Short one."


class HeldExplorer(LiveExplorer):
    """A LiveExplorer whose maps wait, while ``held(model, text)`` is true, until ``release`` is set: a slow
    request that ends when the test says so."""

    def __init__(self):
        super().__init__(ModelCache(), classifier_loader=random_classifier)
        self.held = lambda model, text: False
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self, held) -> None:
        self.held = held
        self.entered.clear()
        self.release.clear()

    def live_maps(self, model, text, text_pair=None, map_kind="weight"):
        if self.held(model, text):
            self.entered.set()
            assert self.release.wait(120), "the test never released a held request"
        return super().live_maps(model, text, text_pair, map_kind)


def slow(explorer: HeldExplorer, call, *args):
    """Start call(*args) on a thread and wait until it is held in the explorer -> a function that releases it
    and returns its result."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", call(*args)), daemon=True)
    thread.start()
    assert explorer.entered.wait(120), "the request never reached the model"

    def finish():
        explorer.release.set()
        thread.join(120)
        return result["value"]

    return finish


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """(old, new): a 2-layer, 4-head model and a 3-layer, 8-head one."""
    root = tmp_path_factory.mktemp("race")
    return str(tiny_model_dir(root)), str(save_tiny_model(root / "big", layers=3, heads=8))


@pytest.fixture
def web(tmp_path) -> WebApp:
    return WebApp(tmp_path / "runs", HeldExplorer(), allow_any_model=True)


def caption_of(outputs) -> str:
    return outputs[0]


def test_every_explore_handler_that_draws_takes_the_sessions_clock(web):
    """The grid, the large view and a model pick share one ViewClock per session: a gr.State of it, copied afresh
    for each session (gradio deep-copies a State's value), passed by reference to each handler."""
    demo = web.build()
    ids = {block.elem_id: block._id for block in demo.blocks.values() if getattr(block, "elem_id", None)}
    drawing = [f for f in demo.fns.values() if {ids["explore-grid"], ids["explore-map"]} & {b._id for b in f.outputs}
               and f.api_name != "head_map"]  # the head_map API maps the input it names, in no session's view
    clocks = {id(block) for f in drawing for block in f.inputs if isinstance(block, gr.State)
              and isinstance(block.value, ViewClock)}
    assert len(drawing) >= 10 and len(clocks) == 1
    assert {f.fn for f in drawing} == {web.draw, web.follow_head, web.forget_grid, web.drawn_head_map}
    assert all(any(id(block) in clocks for block in f.inputs) for f in drawing)
    clock = ViewClock()
    clock.start_grid()
    fresh = copy.deepcopy(clock)
    assert fresh is not clock and fresh.show_grid(1) is False and fresh.start_grid() == 1


def test_a_slow_grid_of_the_old_model_ending_after_a_model_pick_changes_nothing(web, models):
    """Show all heads, then another model picked while the grid is computed: before, the old model's grid (and the
    DrawnInput a click reads) replaced the cleared view when it ended, and its head was drawn in the large view,
    all under the new model's name; now its result and its follow-up head change nothing."""
    old, new = models
    clock = ViewClock()
    web.explorer.hold(lambda model, text: model == old)
    finish = slow(web.explorer, web.draw, SENTENCE, "", old, False, False, "weight", False, clock)
    cleared = web.forget_grid(new, clock)
    assert "model " + new + " picked" in cleared[0] and cleared[1] is None and cleared[-1] is None
    assert finish() == skipped(7)
    assert web.follow_head(None, 1, 1, clock) == skipped(6)  # the state still holds the pick's "no grid"
    # the new model's grid, drawn then, is shown and followed by its head
    shown = web.draw(SENTENCE, "", new, False, False, "weight", False, clock)
    assert "3 layers x 8 heads" in shown[0] and shown[-1].model == new
    layer, head, caption, image, *_ = web.follow_head(shown[-1], 3, 8, clock)
    assert "layer 3, head 8" in caption and image


def test_a_slow_head_of_the_old_model_ending_after_a_model_pick_changes_nothing(web, models):
    """A head of the old model's grid picked (click or layer and head boxes) and, while it is drawn, another model
    picked: before, that head was drawn in the emptied large view under the new model's name; now it is dropped.
    The same slow head with no pick meanwhile is shown."""
    old, new = models
    clock = ViewClock()
    drawn = web.draw(SENTENCE, "", old, False, False, "weight", False, clock)[-1]
    web.explorer.hold(lambda model, text: model == old)
    finish = slow(web.explorer, web.drawn_head_map, drawn, 2, 3, clock)
    assert "layer 2, head 3" in caption_of(finish())  # nothing came between: shown
    web.explorer.hold(lambda model, text: model == old)
    finish = slow(web.explorer, web.drawn_head_map, drawn, 2, 4, clock)
    web.forget_grid(new, clock)
    assert finish() == skipped(4)


def test_an_earlier_drawing_ending_after_a_newer_one_changes_nothing(web, models):
    """The sentence drawn, edited and drawn again (Enter) while the first drawing is still computed: before, the
    first one's grid, ending last, replaced the edited sentence's grid, and its DrawnInput made a click show the
    old sentence's head; now the newer grid stays, and its head is drawn once."""
    old, _ = models
    clock = ViewClock()
    web.explorer.hold(lambda model, text: text == SENTENCE)
    finish = slow(web.explorer, web.draw, SENTENCE, "", old, False, False, "weight", False, clock)
    newer = web.draw(EDITED, "", old, False, False, "weight", False, clock)
    assert "5 tokens" in newer[0] and newer[-1].text == EDITED
    assert finish() == skipped(7)
    layer, head, caption, *_ = web.follow_head(newer[-1], 1, 2, clock)
    assert "layer 1, head 2" in caption and "5 tokens" in caption
    # the dropped drawing's follow-up reads the same (newest) DrawnInput from the state: it draws nothing again
    assert web.follow_head(newer[-1], 1, 2, clock) == skipped(6)


def test_a_slow_head_of_the_grid_before_a_newer_grid_changes_nothing(web, models):
    """A head picked on a grid, then the sentence edited and drawn while that head is computed: before, the old
    sentence's head landed in the large view under the new grid (until the new grid's own head replaced it, if it
    ended first it stayed); now it is dropped and the new grid's head is shown."""
    old, _ = models
    clock = ViewClock()
    drawn = web.draw(SENTENCE, "", old, False, False, "weight", False, clock)[-1]
    web.follow_head(drawn, 1, 1, clock)
    web.explorer.hold(lambda model, text: text == SENTENCE)
    finish = slow(web.explorer, web.drawn_head_map, drawn, 2, 3, clock)
    newer = web.draw(EDITED, "", old, False, False, "weight", False, clock)
    assert finish() == skipped(4)
    caption = web.follow_head(newer[-1], 2, 3, clock)[2]
    assert "layer 2, head 3" in caption and "5 tokens" in caption


def test_without_a_clock_the_handlers_show_every_result(web, models):
    """The API endpoints and direct calls pass no clock: every result is shown, as before."""
    old, _ = models
    drawn = web.draw(SENTENCE, "", old, False, False)[-1]
    assert drawn.grid == 0
    assert "layer 1, head 1" in web.follow_head(drawn, 1, 1)[2] and "layer 1, head 1" in web.follow_head(drawn, 1, 1)[2]
    assert Path(web.drawn_head_map(drawn, 2, 2)[1]).is_file()
