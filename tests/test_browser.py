"""The web app in a real browser: Playwright drives Debian chromium (headless, background networking off).

Loads the page, enters a sentence, checks the grid and the large map, switches every tab and saves a
screenshot of each under test-artifacts/browser/.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from test_webapp_support import SENTENCE, browser_page, populate_runs, serve, tiny_model_dir

from analysis.artifacts import TABS as RUN_TABS
from analysis.figures import GridLayout
from app.explore import ViewClock

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser"
TABS = ("Explore", *(tab.name for tab in RUN_TABS), "Runs")

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    model_dir = tiny_model_dir(root)
    populate_runs(root / "runs", model_dir)
    demo, web, url, model = serve(root / "runs", model_dir)
    yield url, Path(model).name, model, web
    demo.close()


@pytest.fixture(scope="module")
def page(app_url):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with browser_page(app_url[0]) as page:
        yield page


def shot(page, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    return path


def status_text(page, elem_id: str, pattern: str) -> str:
    locator = page.locator(f"#{elem_id}")
    locator.filter(has_text=re.compile(pattern)).wait_for()
    return locator.inner_text()


def test_the_page_opens_with_the_example_sentences_grid(page):
    text = status_text(page, "explore-status", r"6 layers x 12 heads")  # no click: computed on load
    assert "13 tokens" in text and "greys are absolute weights" in text
    page.locator("#explore-grid img").wait_for()
    page.locator("#explore-classes").filter(has_text="head 12").wait_for()
    status_text(page, "explore-caption", r"layer 1, head 1")
    assert "Kovaleva et al. 2019" in page.locator("#explore-intro").inner_text()
    shot(page, "explore-on-load")


def click_head(page, layer: int, head: int, layers: int = 6, heads: int = 12) -> None:
    """Click the grid's map of ``layer``, ``head`` (1-indexed)."""
    grid = page.locator("#explore-grid img")
    box = grid.bounding_box()
    layout = GridLayout(layers, heads)
    x = layout.margin_left + (head - 1) * layout.pitch_x + layout.cell // 2
    y = layout.margin_top + (layer - 1) * layout.pitch_y + layout.cell // 2
    grid.click(position={"x": x * box["width"] / layout.size[0], "y": y * box["height"] / layout.size[1]})


def test_a_head_clicked_after_editing_the_sentence_is_the_drawn_sentences(page):
    """The sentence edited without Enter, then a head clicked on the grid: the large view shows that head of the
    sentence the grid was drawn from (13 tokens), not of the edited one (5 tokens; before, the edited one's), as
    the note under the inputs says; Enter draws the edited sentence."""
    status_text(page, "explore-status", r"13 tokens, 6 layers x 12 heads")
    assert "press Enter or Show all heads" in page.locator("#explore-notes").inner_text()
    page.locator("#explore-text textarea").fill("Short one.")
    click_head(page, 2, 7)
    assert "13 tokens" in status_text(page, "explore-caption", r"layer 2, head 7 ")
    page.locator("#explore-text textarea").press("Enter")
    status_text(page, "explore-status", r"5 tokens, 6 layers x 12 heads")
    status_text(page, "explore-caption", r"layer 2, head 7 .*5 tokens")


def test_explore_shows_the_grid_and_a_large_map(page):
    page.locator("#explore-text textarea").fill(SENTENCE)
    page.locator("#explore-model input").fill("minilm")
    page.locator("#explore-model input").press("Enter")
    page.locator("#explore-run").click()
    # the test before left a 5-token grid on the page (the same model picked again clears nothing): wait for this one
    status_text(page, "explore-status", r"13 tokens, 6 layers x 12 heads")
    grid = page.locator("#explore-grid img")
    grid.wait_for()
    box = grid.bounding_box()
    assert box["width"] > 300
    # the classes table has a tag for each of the 12 heads of 6 layers
    page.locator("#explore-classes").filter(has_text="head 12").wait_for()
    shot(page, "explore-grid")

    # click the map of layer 3, head 5 (1-indexed): the large map follows the click
    click_head(page, 3, 5)
    status_text(page, "explore-caption", r"layer 3, head 5")
    page.locator("#explore-map img").wait_for()
    shot(page, "explore-large-map")

    page.locator("#explore-words input").check()
    assert "words" in status_text(page, "explore-status", r"\d+ words")
    page.locator("#explore-hide input").check()
    status_text(page, "explore-status", r"11 words")  # 13 words minus [CLS] and [SEP]
    status_text(page, "explore-caption", r"layer 3, head 5 .*11 words without \[CLS\]/\[SEP\]")  # map follows
    shot(page, "explore-words-hidden-specials")


def test_explore_bad_input_shows_a_message(page):
    page.locator("#explore-text textarea").fill("")
    page.locator("#explore-run").click()
    assert "empty" in status_text(page, "explore-status", "error:")
    shot(page, "explore-empty-input")
    page.locator("#explore-text textarea").fill("A sentence again.")
    page.locator("#explore-run").click()
    status_text(page, "explore-status", r"\d+ (tokens|words), 6 layers")  # the toggles of the test before stay on


def test_another_model_clears_the_grid_and_the_large_view(page, app_url):
    """The head boxes still name layer 3, head 5 of MiniLM: picking the 2-layer, 4-head model empties the grid and
    the large view (before, MiniLM's head stayed there), and its grid brings the boxes into its range."""
    # a fresh page, its drawing and the head asked for finished: no event of an earlier test can land after the pick
    page.reload()
    status_text(page, "explore-status", r"13 tokens, 6 layers x 12 heads")
    for box, value in (("explore-layer", "3"), ("explore-head", "5")):
        page.locator(f"#{box} input").fill(value)
    page.locator("#explore-head input").press("Enter")
    status_text(page, "explore-caption", r"layer 3, head 5 ")
    page.locator("#explore-model input").fill(app_url[2])
    page.locator("#explore-model input").press("Enter")
    status_text(page, "explore-status", "press Show all heads")
    page.locator("#explore-map img").wait_for(state="detached")
    assert page.locator("#explore-caption").inner_text().strip() == ""
    page.locator("#explore-run").click()
    status_text(page, "explore-status", r"2 layers x 4 heads")
    status_text(page, "explore-caption", r"layer 2, head 4 ")
    page.locator("#explore-map img").wait_for()


def test_a_slow_grid_ending_after_a_model_pick_is_not_shown(page, app_url, monkeypatch):
    """A sentence drawn with MiniLM and, while its grid is computed, the tiny model picked: when the grid ends it
    is dropped, so the page keeps the pick's empty view and its note (before, MiniLM's grid and head appeared
    under the tiny model's name). Checks that every request of a page shares its session's ViewClock."""
    slow = "A sentence whose grid is slow."
    page.reload()
    status_text(page, "explore-status", r"13 tokens, 6 layers x 12 heads")
    status_text(page, "explore-caption", r"layer \d+, head \d+ ")  # the page load's head: nothing is pending
    explorer = app_url[3].explorer
    held, release, judged = threading.Event(), threading.Event(), threading.Event()
    live_maps, show_grid = explorer.live_maps, ViewClock.show_grid

    def slow_live_maps(model, text, *args, **kwargs):
        if text == slow:
            held.set()
            assert release.wait(120)
        return live_maps(model, text, *args, **kwargs)

    def judge(clock, ticket):  # the drawing decides whether it is shown just before it returns
        shown = show_grid(clock, ticket)
        judged.set()
        return shown

    monkeypatch.setattr(explorer, "live_maps", slow_live_maps)
    monkeypatch.setattr(ViewClock, "show_grid", judge)
    page.locator("#explore-text textarea").fill(slow)
    page.locator("#explore-text textarea").press("Enter")
    assert held.wait(60)
    page.locator("#explore-model input").fill(app_url[2])
    page.locator("#explore-model input").press("Enter")
    status_text(page, "explore-status", "press Show all heads")
    release.set()
    assert judged.wait(60)
    # a later request of this page: the page gets its answer after the slow drawing's
    page.locator("#explore-head input").press("Enter")
    status_text(page, "explore-caption", "no grid drawn")
    assert "press Show all heads" in page.locator("#explore-status").inner_text()
    assert page.locator("#explore-grid img").count() == 0 and page.locator("#explore-map img").count() == 0


@pytest.mark.parametrize("tab", TABS[1:-1])
def test_run_tabs_render_what_exists(page, app_url, tab):
    page.get_by_role("tab", name=tab).click()
    key = tab.lower().replace(" ", "-")
    intro = page.locator(f"#{key}-intro").inner_text()
    assert re.search(r"(Kovaleva|Clark|Michel) et al\. 2019", intro), intro  # says which paper it reproduces
    if tab == "Classifier":  # no training run in the test's runs: the shipped checkpoint's record fills the tab
        message = status_text(page, f"{key}-message", "shipped classifier")
        assert "error" not in message and "attnpat train --data annotation/labeled/v5" in message
        assert "%" in page.locator("#classifier-card-scores").inner_text()  # fractions read as percentages
        page.locator("#classifier-card-confusion").filter(has_text="heterogeneous").wait_for()
        summary = page.locator("#classifier-card-summary").inner_text()
        assert "macro_f1" not in summary
        assert re.search(r"macro-F1 0\.\d{3} \[0\.\d{3}, 0\.\d{3}\] \(95% bootstrap intervals", summary), summary
        assert "f1_ci_low" in page.locator("#classifier-card-per-class").inner_text()  # each class's F1 bounded
        page.locator("#classifier-card-files").filter(has_text="classifier_confusion").wait_for()  # stem, ext apart
    else:
        message = status_text(page, f"{key}-message", app_url[1])
    if tab == "Fine-tuning":
        assert "no fine-tuning run" in message and "attnpat special" in message
    elif tab != "Classifier":
        page.locator(f"#{key}-message ~ div img, [id^='{key}-'][id$='-image'] img").first.wait_for()
        assert "not computed yet" not in message
    shot(page, f"tab-{key}")


def test_runs_tab_lists_runs_and_manifests(page, app_url):
    page.get_by_role("tab", name="Runs").click()
    page.locator("#runs-table").filter(has_text=app_url[1]).wait_for()
    page.locator("#runs-manifest").filter(has_text="analyses").wait_for()
    shot(page, "tab-runs")


def test_runs_tab_starts_a_job_and_shows_it_finish(page, app_url):
    page.get_by_role("tab", name="Runs").click()
    page.locator("#job-model textarea, #job-model input").first.fill(app_url[2])
    task = page.locator("#job-task input")
    task.click()
    page.get_by_role("option", name="mrpc", exact=True).click()
    page.wait_for_function("() => document.querySelector('#job-task input').value === 'mrpc'")
    page.locator("#job-n input").fill("4")
    page.locator("#job-start").click()
    status = page.locator("#job-status").filter(has_text=re.compile("finished|failed|stopped"))
    status.wait_for(timeout=180_000)
    shot(page, "tab-runs-job-finished")
    assert "finished" in status.inner_text() and "--task mrpc" in status.inner_text(), status.inner_text()
    assert "per-head table" in page.locator("#job-log textarea").input_value()
    page.locator("#runs-table").filter(has_text="mrpc").wait_for()
