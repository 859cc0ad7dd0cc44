"""A person's path through the labeling UI: Playwright drives Debian chromium to log in to the real Label Studio
(tests/conftest.py), pick a choice on a pushed map and submit; pull then returns that label for that exact map.
Screenshots land in test-artifacts/.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.mapstore import read_single_maps
from analysis.rendering import cell_size
from annotation import labelstudio as ls
from annotation.instructions import GALLERY, gallery_entries

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def task_page(label_studio, project_id: int, task_id: int, *, height: int):
    """A 1400-pixel-wide Chromium page logged in to the test's Label Studio server and opened on one task of a
    project; the browser closes on leaving."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 (optional: only the browser tests need it)

    assert Path(CHROMIUM).is_file(), "Debian chromium is missing: run `make browser`"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": height})
            page.set_default_timeout(90_000)  # a busy 2-core machine renders the labeling app slowly
            page.goto(f"{label_studio.url}/user/login/")
            page.fill("input[name=email]", label_studio.email)
            page.fill("input[name=password]", label_studio.password)
            page.click("button[type=submit], input[type=submit]")
            page.wait_for_url(lambda url: "/user/login" not in url)
            page.goto(f"{label_studio.url}/projects/{project_id}/data?task={task_id}")
            yield page
        finally:
            browser.close()


def test_label_a_map_in_the_browser_and_pull_it(label_studio, synthetic_sample, tmp_path):
    from playwright.sync_api import expect  # noqa: PLC0415 (optional: only the browser tests need it)

    sample, state = synthetic_sample("browser", 2), tmp_path / "projects.json"
    report = ls.push(label_studio, sample, state_file=state, progress=False, log=lambda m: None)
    tasks = ls.existing_tasks(ls.connect(label_studio), label_studio.url, report.project_id)
    map_id = sorted(tasks)[0]
    task = tasks[map_id]
    predicted = task["predictions"][0]["result"][0]["value"]["choices"][0]
    choice = next(name for name in ("diagonal", "block") if name != predicted)  # differs from the pre-annotation
    ARTIFACTS.mkdir(exist_ok=True)

    with task_page(label_studio, report.project_id, task["id"], height=1100) as page:
        # each choice is a checkbox named after its value, labelled "<value>[hotkey]"
        box = page.locator(f"input[type=checkbox][name='{choice}']")
        page.wait_for_load_state("networkidle")  # the labeling app re-renders while it loads the task
        page.locator("label", has=box).click()  # Playwright re-finds the element and scrolls to it
        expect(box).to_be_checked()
        page.screenshot(path=str(ARTIFACTS / "browser-annotation-choice.png"))
        with page.expect_response(lambda r: "/annotations" in r.url and r.request.method == "POST") as posted:
            page.get_by_role("button", name="Submit").click()
        assert posted.value.status == 201
        page.screenshot(path=str(ARTIFACTS / "browser-annotation-submitted.png"))

    out = tmp_path / "labeled"
    pulled = ls.pull(label_studio, sample, out, state_file=state)
    assert pulled.labeled == 1 and pulled.class_counts == {choice: 1}
    labeled = read_single_maps(out / "maps.npz")
    assert list(labeled) == [map_id]
    assert np.array_equal(labeled[map_id], read_single_maps(sample / "maps.npz")[map_id])
    row = pd.read_csv(out / "labels.csv").iloc[0]
    assert (row.map_id, row.label, row.annotator, row.prediction) == (map_id, choice, label_studio.email, predicted)


def test_every_gallery_map_in_the_instructions_keeps_three_pixels_per_token(label_studio, synthetic_sample, tmp_path):
    """The instructions panel of a pushed project, opened as an annotator opens it: every gallery map is shown
    at three screen pixels per token or more, as the guideline promises (in the old four-column tables a
    128-token map was 60 pixels wide), and is scaled without smoothing."""
    sample = synthetic_sample("gallery", 1)
    report = ls.push(label_studio, sample, state_file=tmp_path / "projects.json", progress=False, log=lambda m: None)
    tasks = ls.existing_tasks(ls.connect(label_studio), label_studio.url, report.project_id)
    task_id = next(iter(tasks.values()))["id"]
    tokens = {entry.image: int(entry.cues.split()[1]) for entry in gallery_entries(GALLERY.read_text())}
    ARTIFACTS.mkdir(exist_ok=True)
    with task_page(label_studio, report.project_id, task_id, height=1000) as page:
        page.wait_for_load_state("networkidle")
        page.get_by_role("button", name="Instructions").click()
        gallery = page.locator("img[src*='local-files']")
        gallery.last.wait_for()
        page.wait_for_function("() => [...document.querySelectorAll(\"img[src*='local-files']\")]"
                               ".every(image => image.complete && image.naturalWidth > 0)")
        shown = page.evaluate("() => [...document.querySelectorAll(\"img[src*='local-files']\")].map(image => "
                              "[image.src.split('/').pop(), image.naturalWidth,"
                              " image.getBoundingClientRect().width, getComputedStyle(image).imageRendering])")
        page.screenshot(path=str(ARTIFACTS / "browser-instructions-gallery.png"))
    assert sorted({name for name, *_ in shown}) == sorted(tokens)
    for name, natural, width, rendering in shown:
        assert cell_size(tokens[name]) * width / natural >= 3, (name, width)
        assert rendering == "pixelated", name


def test_a_task_image_is_shown_at_its_natural_size(label_studio, synthetic_sample, tmp_path):
    """Label Studio fitted each task's image to its panel (653 pixels drawn, 811 shown at a 1400-pixel window), so a
    one-token column was no whole number of screen pixels; the labeling view's Image tag now asks for the image's
    own size (defaultZoom="original"), one screen pixel per image pixel."""
    sample = synthetic_sample("natural", 2)
    report = ls.push(label_studio, sample, state_file=tmp_path / "projects.json", progress=False, log=lambda m: None)
    tasks = ls.existing_tasks(ls.connect(label_studio), label_studio.url, report.project_id)
    ARTIFACTS.mkdir(exist_ok=True)
    for task in tasks.values():
        with task_page(label_studio, report.project_id, task["id"], height=1100) as page:
            page.wait_for_load_state("networkidle")
            # the labeling view's image (its style is set visible once its size and zoom are computed), not the
            # data manager's 100-pixel thumbnail of it
            script = ("() => [...document.querySelectorAll('img')].filter(image => "
                      "image.complete && image.naturalWidth > 0 && image.style.visibility === 'visible' && "
                      "image.getBoundingClientRect().width > 100)"
                      ".map(image => [image.naturalWidth, image.naturalHeight, image.getBoundingClientRect().width,"
                      " image.getBoundingClientRect().height])")
            page.wait_for_function(f"() => ({script})().length > 0")
            shown = page.evaluate(script)
            page.screenshot(path=str(ARTIFACTS / "browser-task-image-natural-size.png"))
        assert len(shown) == 1, shown
        natural_width, natural_height, width, height = shown[0]
        assert (width, height) == pytest.approx((natural_width, natural_height), abs=0.01), shown
