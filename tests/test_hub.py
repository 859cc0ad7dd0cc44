"""Models from a hub, end to end through the real CLI against a fake hub on 127.0.0.1 (tests/fakehub.py): download
and analyse, the cache with the hub down, one error line for each way the hub can say no, and no request at all
when only the embedded model is named."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from transformers import GPT2Config, GPT2Model

from analysis import models
from analysis.errors import AttnpatError
from tests.fakehub import FakeHub
from tests.tiny import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(tiny BERT folder, tiny GPT-2 folder, a three-sentence data file)."""
    base = tmp_path_factory.mktemp("hub-models")
    bert = save_tiny_model(base / "tiny-bert", layers=2, heads=4)
    GPT2Model(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50)).save_pretrained(base / "tiny-gpt2")
    data = base / "data.jsonl"
    data.write_text('{"text": "The cat sat on the mat."}\n{"text": "A dog barked, loudly."}\n'
                    '{"text": "Birds fly south."}\n')
    return bert, base / "tiny-gpt2", data


def attnpat(home: Path, endpoint: str, *args: str) -> subprocess.CompletedProcess:
    """`attnpat surface ...` in a subprocess whose hub is ``endpoint``, with its own HF cache and attnpat home."""
    env = {key: value for key, value in os.environ.items()
           if key not in {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"}}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home / "hf"), ATTNPAT_HOME=str(home),
               GRADIO_ANALYTICS_ENABLED="False", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "app.cli", "surface", *args, "--n", "3", "-q"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_hub_model_downloads_runs_and_runs_again_from_the_cache_with_the_hub_down(tmp_path, folders):
    """Before, every hub model failed: attnpat probed huggingface.co, not $HF_ENDPOINT, and then read the revision
    from config._commit_hash, which transformers 5 no longer sets (`cannot access org/tiny-bert`)."""
    bert, _, data = folders
    hub = FakeHub()
    commit = hub.add("org/tiny-bert", bert)
    first = attnpat(tmp_path, hub.url, "--model", "org/tiny-bert", "--task", str(data))
    hub.stop()
    assert first.returncode == 0, first.stderr
    assert f"GET /org/tiny-bert/resolve/{commit}/model.safetensors" in hub.requests
    run = tmp_path / "runs" / "org__tiny-bert"
    assert list(run.rglob("*.csv")) and commit in "".join(path.read_text() for path in run.rglob("*.json"))
    again = attnpat(tmp_path, hub.url, "--model", "org/tiny-bert", "--task", str(data))
    assert again.returncode == 0 and again.stderr == "", again.stderr


def test_each_way_the_hub_says_no_is_one_error_line(tmp_path, folders):
    """Before: `could not load model '…' from the Hugging Face hub or a local path (OSError); offline, use …`
    for all of them, with the hub answering; GPT-2's config warnings printed before its refusal."""
    bert, gpt2, data = folders
    with FakeHub() as hub:
        hub.add("org/gated-bert", bert, gated=True)
        hub.add("org/tiny-gpt2", gpt2)
        expected = {
            "org/nope": f"the hub {hub.url} (reachable) has no such model",
            "org/gated-bert": f"it is gated on the hub {hub.url}: accept its terms",
            "org/tiny-gpt2": "is a gpt2 model, not a BERT-family encoder",
            "org/tiny-gpt2@v1": "not an alias, a model-store name, a model folder or a hub id",
        }
        for model, message in expected.items():
            result = attnpat(tmp_path, hub.url, "--model", model, "--task", str(data))
            assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
            assert result.stderr.startswith("error: ") and model in result.stderr and message in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_hub_model_not_cached_with_the_hub_down_says_both(tmp_path, folders):
    hub = FakeHub()
    hub.stop()
    result = attnpat(tmp_path, hub.url, "--model", "org/tiny-bert", "--task", str(folders[2]))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert (f"could not load model 'org/tiny-bert': it is not in the local Hugging Face cache and the hub {hub.url} "
            "is unreachable; offline, use --model minilm") in result.stderr


def test_the_embedded_model_contacts_no_hub(tmp_path, folders):
    with FakeHub() as hub:
        result = attnpat(tmp_path, hub.url, "--model", "minilm", "--task", str(folders[2]))
    assert result.returncode == 0, result.stderr
    assert hub.requests == []


def test_the_hub_probe_asks_the_configured_hub_only(monkeypatch):
    """Before, huggingface.co:443 was probed whatever $HF_ENDPOINT said."""
    with FakeHub() as hub:
        monkeypatch.setattr(models, "hub_endpoint", lambda: hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        assert models.hub_reachable(timeout=3.0)
    assert not models.hub_reachable(timeout=3.0)  # stopped: its port refuses
    assert models.endpoint_address("https://hub.example.org") == ("hub.example.org", 443)


def test_a_hub_that_never_answers_is_one_error_after_the_timeout(monkeypatch):
    """Before, the repo-info request transformers 5 makes had no timeout: a hub that accepted the connection and
    never answered hung the command forever."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections are accepted by the kernel, and never answered
        monkeypatch.setattr(models, "HUB_TIMEOUT_S", 1.0)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(AttnpatError, match=f"the hub {endpoint} accepted the connection but did not answer"):
            models.check_hub_model("org/tiny-bert", endpoint)


def test_hub_requests_without_a_timeout_get_one():
    unbounded = httpx2.Client().build_request("GET", "http://127.0.0.1/", timeout=None)
    models.bound_hub_timeouts(unbounded)
    assert set(unbounded.extensions["timeout"].values()) == {models.HUB_TIMEOUT_S}
    etag = httpx2.Client().build_request("HEAD", "http://127.0.0.1/", timeout=10)
    models.bound_hub_timeouts(etag)
    assert set(etag.extensions["timeout"].values()) == {10}
    assert models.bound_hub_timeouts in models.bounded_hub_client().event_hooks["request"]
