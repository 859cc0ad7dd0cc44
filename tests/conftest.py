"""Shared fixtures: the MiniLM tokenizer (at the end), and those of the Label Studio tests
(tests/test_annotation_server.py, tests/test_browser_annotation.py).

One real Label Studio server per test session, from the set-up's venv (.ls-venv, `make label-studio`), on a
free loopback port with its data in a temporary folder; it is always stopped at the end of the session.
For quick iterations, ATTNPAT_TEST_LABEL_STUDIO=<folder> keeps a server in that folder running across
sessions (started on first use, reused after; stop it with annotation.server.stop(folder)).
"""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import numpy as np
import pytest

from analysis.patterns import CLASSES
from annotation import server
from annotation.sample import SampledMap, write_sample
from classifier.synthetic import synthetic_map
from tests.tiny import minilm_tokenizer


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def label_studio(tmp_path_factory):
    """Credentials (admin, with a personal access token) of a running Label Studio; root folder in .root."""
    kept = os.environ.get("ATTNPAT_TEST_LABEL_STUDIO")
    root = Path(kept) if kept else tmp_path_factory.mktemp("label-studio")
    server.label_studio_bin()  # a clear failure (not a skip) when the set-up's server venv is missing
    try:
        # a kept server is reused on its own port (serve refuses to move a running server to another one)
        port = None if kept and server.running_pid(root) is not None else free_port()
        credentials = server.serve(port=port, root=root, timeout=600, log=lambda message: None)
        credentials.root = root
        yield credentials
    finally:
        if not kept:
            server.stop(root)


@pytest.fixture(scope="session")
def synthetic_sample(tmp_path_factory):
    """make(name, n_maps) -> a sample folder (index.jsonl, maps.npz, PNGs) of synthetic maps of every class."""
    base = tmp_path_factory.mktemp("samples")

    def make(name: str, n_maps: int, seed: int = 0) -> Path:
        """The folder is named <name>-<random> so that project titles are new even on a kept server."""
        name = f"{name}-{uuid.uuid4().hex[:6]}"
        rng = np.random.default_rng(seed)
        maps = []
        for i in range(n_maps):
            n = 9 + i % 4
            tokens = ["[CLS]"] + [f"w{j}" for j in range(n - 3)] + [".", "[SEP]"]
            maps.append(SampledMap(f"synthetic:{name}:ex{i}:L{i % 2}H{i % 3}", "sst2", f"ex{i}", i % 2, i % 3,
                                   tokens, synthetic_map(CLASSES[i % len(CLASSES)], n, rng)))
        return write_sample(base / name, maps)

    return make


@pytest.fixture(scope="session")
def annotate_task():
    """annotate(client, task_id, label, **fields): submit an annotation choosing ``label``, as an annotator does."""

    def annotate(client, task_id: int, label: str, **fields):
        result = [{"from_name": "pattern", "to_name": "image", "type": "choices", "value": {"choices": [label]}}]
        return client.annotations.create(id=task_id, result=result, **fields)

    return annotate


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded MiniLM's tokenizer, shared by the tiny random models of every test module."""
    return minilm_tokenizer()
