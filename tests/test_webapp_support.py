"""Shared set-up for the web-app tests: a tiny BERT, a run directory with real and synthetic artifacts,
and the app served on a free 127.0.0.1 port (imported by test_webapp.py and test_browser.py)."""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pandas as pd
import torch

from analysis.data import load_data
from analysis.extract import write_overview
from analysis.figures import close, head_heatmap
from analysis.models import load_model
from analysis.rundir import RunDir, long_table
from app.explore import LiveExplorer, ModelCache
from app.webapp import launch
from classifier.model import PatternCNN
from classifier.predict import PatternClassifier
from tests.tiny import save_tiny_model

SENTENCE = "The cat sat on the mat because it was warm."


def tiny_model_dir(root: Path) -> Path:
    """A randomly initialised 2-layer, 4-head BERT with the MiniLM tokenizer, saved as a local model folder."""
    return save_tiny_model(root / "tiny-bert")


def random_classifier():
    """A real PatternClassifier around an untrained CNN with fixed weights (deterministic predictions)."""
    torch.manual_seed(1)
    return PatternClassifier(PatternCNN().eval(), {"input_size": 32})


def populate_runs(root: Path, model_dir: Path) -> dict:
    """runs/<tiny-bert>/sst2 with a real overview and synthetic artifacts named as analysis.artifacts says.

    Returns what was written: {"model": slug, "task": "sst2"}. Fine-tuning artifacts are left out on purpose.
    """
    bundle = load_model(str(model_dir))
    data = load_data("sst2", n=8)
    run = RunDir(bundle.slug, "sst2", root)
    write_overview(bundle, data, run, progress=False)
    rng = np.random.default_rng(0)
    classes = ["vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous"]
    with run.record("classify", bundle, data):
        rows = [{"layer": layer, "head": head, "class": name, "count": int(c), "fraction": c / 8}
                for layer in range(2) for head in range(4) for name, c in zip(classes, rng.multinomial(8, [0.2] * 5))]
        run.write_table("patterns", pd.DataFrame(rows))
        fig = head_heatmap(rng.random((2, 4)), title="synthetic patterns")
        run.write_figure("patterns", fig)
        close(fig)
        run.write_table("pattern_ratios", pd.DataFrame({"class": classes, "count": [3, 2, 1, 1, 1],
                                                        "fraction": [0.375, 0.25, 0.125, 0.125, 0.125]}))
    by_task = pd.DataFrame({"task": ["sst2"] * 5, "class": classes, "count": [3, 2, 1, 1, 1],
                            "fraction": [0.375, 0.25, 0.125, 0.125, 0.125]})
    RunDir(bundle.slug, "all", root).write_table("pattern_ratios_by_task", by_task)
    with run.record("sweeps", bundle, data):
        run.write_table("disable_heads", long_table({"uniform_delta": rng.normal(size=(2, 4))}))
        run.write_table("pruning", pd.DataFrame({"fraction_pruned": [0.0, 0.5], "n_pruned": [0, 4],
                                                 "metric": [0.9, 0.7]}))
    (run.path / "surface.csv").write_text("layer,head,metric\nnot,a,table\n\"unclosed\n")  # a broken file
    return {"model": bundle.slug, "task": "sst2"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(runs_dir: Path, model_dir: Path):
    """Launch the app on a free port with the tiny model preloaded and the fixed random classifier.

    Returns (demo, web, url, model name); call demo.close() when done.
    """
    explorer = LiveExplorer(ModelCache(capacity=3), classifier_loader=random_classifier)
    explorer.models.get(str(model_dir))
    port = free_port()
    demo, web = launch("127.0.0.1", port, runs_dir, block=False, explorer=explorer, quiet=True, warm=False,
                       allow_any_model=True)  # jobs run on the tiny model's folder
    return demo, web, f"http://127.0.0.1:{port}/", str(model_dir)


CHROMIUM = Path("/usr/bin/chromium")


@contextmanager
def browser_page(url: str, timeout_ms: int = 60_000):
    """A page of Debian chromium (headless, background networking off) on ``url``, driven by Playwright, that
    waits up to ``timeout_ms`` for each step; fails at the end when the page raised JavaScript errors or asked
    for anything beyond the app's own address (a font, a script or an icon from the internet)."""
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 (optional: only the browser tests need it)

    assert CHROMIUM.is_file(), "Debian chromium is missing: run `make browser`"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--headless", "--no-sandbox", "--disable-gpu",
                                          "--disable-background-networking", "--disable-component-update",
                                          "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(timeout_ms)
        errors, outside = [], []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        own = urlsplit(url).netloc
        page.on("request", lambda request: outside.append(request.url)
                if urlsplit(request.url).scheme in {"http", "https", "ws", "wss"}
                and urlsplit(request.url).netloc != own else None)
        page.goto(url)
        page.get_by_role("tab", name="Explore").wait_for()
        yield page
        browser.close()
        assert not errors, f"JavaScript errors in the page: {errors}"
        assert not outside, f"the page asked for addresses beyond the app's: {sorted(set(outside))[:10]}"
