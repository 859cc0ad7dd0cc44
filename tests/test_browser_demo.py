"""The demo fills every tab: `attnpat demo --quick` (the real pipeline at reduced sizes, on the embedded MiniLM
and packaged data) into a temporary workspace, then the web app in Debian chromium: each tab shows a figure
or a table, with no "error:" and no "not computed yet". Screenshots go to test-artifacts/browser-demo/.
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from analysis.artifacts import TABS as RUN_TABS
from app.cli import main
from app.webapp import launch
from tests.conftest import free_port
from tests.test_webapp_support import browser_page

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "browser-demo"
TABS = ("Explore", *(tab.name for tab in RUN_TABS), "Runs")

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """The quick demo's runs folder; the workspace (model store included) is a temporary ATTNPAT_HOME."""
    home = tmp_path_factory.mktemp("demo-home")
    patch = pytest.MonkeyPatch()
    patch.setenv("ATTNPAT_HOME", str(home))
    runs = home / "runs"
    assert main(["demo", "--quick", "--no-app", "-q", "--runs-dir", str(runs)]) == 0
    yield runs
    patch.undo()


@pytest.fixture(scope="module")
def page(demo_runs):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    demo, _ = launch("127.0.0.1", port, demo_runs, block=False, quiet=True, warm=False)
    with browser_page(f"http://127.0.0.1:{port}/", timeout_ms=120_000) as page:
        yield page
    demo.close()


def test_the_demo_wrote_what_every_tab_needs(demo_runs):
    tuned = demo_runs / "minilm-sst2-demo-quick" / "sst2"
    for name in ("finetune_eval", "cosine", "special_tokens", "linguistic", "disable_heads", "disable_layers",
                 "importance", "pruning"):
        assert (tuned / f"{name}.csv").is_file(), name
    cosine = pd.read_csv(tuned / "cosine.csv")
    assert set(cosine.metric) == {f"cosine_{mode}{part}" for mode in ("cropped", "padded")
                                  for part in ("", "_ci_low", "_ci_high")}
    linguistic = pd.read_csv(tuned / "linguistic.csv")
    assert {"noun", "verb", "pronoun", "subject", "object"} <= set(linguistic.feature)  # the tagger ran
    dependency = pd.read_csv(demo_runs / "minilm" / "wiki" / "probing_dependency.csv")
    assert set(dependency.parses) == {"silver parses (spaCy en_core_web_sm 3.8.0)"}


@pytest.mark.parametrize("tab", TABS)
def test_every_tab_shows_a_figure_or_table_without_errors(page, tab):
    page.get_by_role("tab", name=tab).click()
    panel = page.locator("[role='tabpanel']:visible").first
    if tab == "Explore":  # the example sentence's grid is computed on load
        page.locator("#explore-grid img").wait_for()
        page.locator("#explore-status").filter(has_text=re.compile(r"6 layers x 12 heads")).wait_for()
    else:
        key = tab.lower().replace(" ", "-")
        if tab not in ("Classifier", "Runs"):
            page.locator(f"#{key}-message").filter(has_text=re.compile(r"\S")).wait_for()
        panel.locator("img:visible, table:visible").first.wait_for()
    if tab == "Runs":
        page.locator("#runs-table").filter(has_text="minilm-sst2-demo-quick").wait_for()
    text = panel.inner_text()
    assert "error:" not in text.lower() and "not computed yet" not in text.lower(), text[:2000]
    page.screenshot(path=str(ARTIFACTS / f"{tab.lower().replace(' ', '-')}.png"), full_page=True)
