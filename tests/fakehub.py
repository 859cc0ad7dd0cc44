"""A fake Hugging Face hub on 127.0.0.1: enough of the hub's HTTP protocol for ``from_pretrained``.

It serves model folders (saved with ``save_pretrained``) as repos: ``HEAD``/``GET /<repo>/resolve/<rev>/<file>``
with the headers huggingface_hub checks (X-Repo-Commit, ETag, Content-Length) and ``/api/models/<repo>[/...]``
with the repo's commit and file list. Errors carry the hub's X-Error-Code, as the real hub's do: an unknown repo is
a 401 RepoNotFound, a gated one a 401 GatedRepo, a missing file a 404 EntryNotFound, an unknown revision a 404
RevisionNotFound. Every request is recorded in ``requests`` ("HEAD /org/tiny/resolve/main/config.json").

Point a subprocess at it with ``HF_ENDPOINT=<hub.url>`` (huggingface_hub reads it once, at import).
"""
from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<what>revision|tree)/(?P<rev>[^/]+)(?P<sub>/.*)?)?$")


def commit_of(repo: str, revision: str) -> str:
    """A stable 40-hex commit id for a repo's revision (what X-Repo-Commit carries)."""
    return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()


class FakeHub:
    """A hub serving ``add``-ed model folders until ``stop`` (also a context manager)."""

    def __init__(self):
        self.revisions: dict[tuple[str, str], Path] = {}  # (repo, branch or commit) -> folder
        self.gated: set[str] = set()
        self.requests: list[str] = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, repo: str, folder: Path, revision: str = "main", gated: bool = False) -> str:
        """Serve ``folder`` as ``repo`` at branch ``revision`` (and at its commit id); return the commit id."""
        commit = commit_of(repo, revision)
        self.revisions[(repo, revision)] = self.revisions[(repo, commit)] = Path(folder)
        if gated:
            self.gated.add(repo)
        return commit

    def stop(self) -> None:
        """The hub goes down: its port refuses connections from now on."""
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _commit(self, repo: str, revision: str) -> str:
        return revision if len(revision) == 40 else commit_of(repo, revision)

    def answer(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for one request: the whole protocol, free of the socket handling."""
        self.requests.append(f"{method} {path}")
        path = unquote(urlsplit(path).path)
        match = RESOLVE.match(path) or API.match(path)
        if match is None:
            return 404, {}, b"not found"
        repo, revision = match["repo"], match["rev"] or "main"
        if not any(known == repo for known, _ in self.revisions):
            return 401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
        if repo in self.gated:
            return 401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is restricted"}, b""
        folder = self.revisions.get((repo, revision))
        if folder is None:
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b""
        commit = self._commit(repo, revision)
        files = sorted(file for file in folder.iterdir() if file.is_file())
        if path.startswith("/api/"):
            if match["sub"]:  # a listing of a subfolder: the repos served here are flat
                return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b""
            if match["what"] == "tree":
                body = [{"type": "file", "path": file.name, "size": file.stat().st_size,
                         "oid": hashlib.sha1(file.read_bytes()).hexdigest()} for file in files]
            else:
                body = {"id": repo, "modelId": repo, "sha": commit, "private": False, "gated": False,
                        "siblings": [{"rfilename": file.name} for file in files]}
            return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()
        file = folder / match["file"]
        if not file.is_file():
            return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b""
        data = file.read_bytes()
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                     "Content-Type": "application/octet-stream"}, data

    def _handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _reply(self, with_body: bool) -> None:
                status, headers, body = hub.answer(self.command, self.path)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self):  # noqa: N802 (http.server's naming)
                self._reply(with_body=False)

            def do_GET(self):  # noqa: N802
                self._reply(with_body=True)

            def log_message(self, *args):  # quiet: the test reads hub.requests
                pass

        return Handler
