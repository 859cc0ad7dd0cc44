"""The run directory: the contract between the batch side and the app (its files are listed in analysis/artifacts.py).

runs/<model-slug>/<task>/manifest.json, <analysis>.csv (long tables: layer, head, [key], value),
<analysis>.png/.svg. All writes are atomic: a temporary name in the same folder, then os.replace.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.errors import AttnpatError, os_error_message, os_error_reason
from analysis.paths import runs_root

PACKAGES = ("torch", "transformers", "numpy", "scikit-learn", "gradio", "label-studio-sdk", "attnpat")
# Advisory lock files (removed when released): a run folder's .lock guards its read-merge-write updates (the
# manifest, tables that several modes share); .lock-<analysis> is held while that analysis runs.
LOCK_FILE = ".lock"
STAGING = ".staging"  # .staging-<analysis>-<random>/: a running analysis's tables and figures (RunDir.record)

log = logging.getLogger(__name__)


def writable_path(path: str | Path) -> Path:
    """``path`` as a Path if a file can be written there later (it is not a folder, and its nearest existing parent
    is a writable folder), else a one-line AttnpatError. Long jobs call it before they start, so a mistyped output
    path fails at once instead of after the work."""
    path = Path(path)
    if path.is_dir():
        raise AttnpatError(f"cannot write {path}: it is a folder")
    existing = next(parent for parent in path.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise AttnpatError(f"cannot write {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AttnpatError(f"cannot write {path}: permission denied on {existing}")
    return path


def _umask() -> int:
    """The process's umask: from /proc (Linux), else read by setting it (once per process, since another
    thread creating a file in that instant would get the interim mask)."""
    global _UMASK
    if _UMASK is None:
        try:
            status = Path("/proc/self/status").read_text(encoding="ascii", errors="replace")
            _UMASK = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
        except (OSError, StopIteration, IndexError, ValueError):
            _UMASK = os.umask(0o022)
            os.umask(_UMASK)
    return _UMASK


_UMASK: int | None = None


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``: readers never see a half-written file."""
    return atomic_write_together({Path(path): write})[0]


def atomic_write_together(writes: dict[Path, Callable[[Path], None]]) -> list[Path]:
    """:func:`atomic_write` for files that belong together (a checkpoint's weights and its .json): every temporary
    file is written first, then all are renamed with Ctrl-C and SIGTERM held back (for more than one file), so a
    failed write or a stop never leaves one new file beside the others' old versions. Returns the paths."""
    temporaries: list[Path] = []
    path = None
    try:
        for path, write in writes.items():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # held until the temporary is listed: a stop landing between its creation and the list left it behind
                with signals_held():
                    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
                    temporaries.append(Path(tmp))
            except FileExistsError as exc:  # mkdir met a file where a folder should be
                raise AttnpatError(f"cannot write {path}: {exc.filename} is a file, not a folder") from exc
            except OSError as exc:  # a read-only or full disk...: one line naming the user's path, not the temporary
                raise AttnpatError(f"cannot write {path}: {os_error_reason(exc)}") from exc
            os.close(fd)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are ordinary files, as the umask wants
            write(Path(tmp))
        with signals_held() if len(writes) > 1 else nullcontext():
            for path, tmp in zip(writes, temporaries, strict=True):
                os.replace(tmp, path)
    except BaseException as exc:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise AttnpatError(os_error_message(exc, f"cannot write {path}" if exc.filename is None
                                                else "cannot write")) from exc
        raise
    return list(writes)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, data) -> Path:
    return atomic_write_text(path, json_text(data))


def json_text(data) -> str:
    """``data`` as the JSON text attnpat writes (indented, numpy values and paths as plain ones)."""
    return json.dumps(data, indent=2, default=_json_default) + "\n"


@contextmanager
def locked(path: str | Path, what: str, wait: bool = False) -> Iterator[None]:
    """Hold an exclusive advisory lock on the file ``path`` for the block. The file is removed when the block ends
    (with the folders made for it, when they are left empty), so a failed command leaves nothing behind. The lock
    dies with its process: a holder killed by SIGKILL leaves an unlocked file that the next process takes.

    wait=False: when another process holds it, one AttnpatError saying that ``what`` is being written by that
    process (its pid), so a second writer of the same output stops before any work instead of mixing its
    results with the first one's. wait=True: block until it is free (for short read-merge-write updates).
    On a file system without locks the block runs unlocked."""
    path = Path(path)
    made = [folder for folder in path.parents if not folder.exists()]  # deepest first
    attempts = 0
    while True:
        attempts += 1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held for the block)
        except FileExistsError as exc:
            raise AttnpatError(f"cannot write {path}: {exc.filename} is a file, not a folder") from exc
        except FileNotFoundError as exc:
            if attempts < 10:  # another holder removed the folder, left empty, between our mkdir and open
                continue
            raise AttnpatError(os_error_message(exc, "cannot lock")) from exc
        except PermissionError as exc:  # another user's lock file, in a folder we share
            if attempts < 10 and _remove_stale_lock(path, what, wait):
                continue
            raise AttnpatError(os_error_message(exc, "cannot lock")) from exc
        except OSError as exc:
            raise AttnpatError(os_error_message(exc, "cannot lock")) from exc
        try:
            if wait:
                _wait_for_lock(handle, what)
            else:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise _held_by_another(what, holder) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                handle.close()
                raise AttnpatError(os_error_message(exc, f"cannot lock {path}")) from exc  # flock names no file
            log.warning("no file locks on %s (%s): two writers at once are not detected", path, exc.strerror)
            break
        try:  # the holder before us may have removed the file after we opened it: then lock the new one
            if _is_open_file(path, handle):
                break
        except FileNotFoundError:
            pass
        handle.close()
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a process that opened it meanwhile sees the change
        handle.close()
        for folder in made:
            try:
                folder.rmdir()  # only if empty: the block wrote nothing there
            except OSError:
                break


WAIT_NOTE_SECONDS = 5.0  # a wait longer than the usual read-merge-write says on stderr whom it waits for


def _wait_for_lock(handle, what: str) -> None:
    """Take the exclusive lock on the open file ``handle``, blocking; when it is still held after
    WAIT_NOTE_SECONDS, one line on stderr names the holder (its pid), so a command stuck behind a stopped or
    hung one does not sit silent."""
    deadline = time.monotonic() + WAIT_NOTE_SECONDS
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    handle.seek(0)
    holder = handle.read().strip()
    by = f" (pid {holder})" if holder.isdigit() else ""
    print(f"waiting: {what} is being written by another attnpat process{by}", file=sys.stderr, flush=True)
    fcntl.flock(handle, fcntl.LOCK_EX)


def _is_open_file(path: Path, handle) -> bool:
    """Whether ``path`` still names the file ``handle`` has open (not one made anew since; FileNotFoundError when
    it is gone)."""
    return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino


def _held_by_another(what: str, holder: str) -> AttnpatError:
    """The one line a second writer gets; ``holder``: the lock file's content, the first writer's pid."""
    return AttnpatError(f"{what} is being written by another attnpat process"
                        f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it to finish, "
                        "or write somewhere else")


def _remove_stale_lock(path: Path, what: str, wait: bool) -> bool:
    """A lock file we may not write (another user's, left by a killed run, or held by their running one): when no
    process holds it, remove it and return True so the caller makes its own; when one does, the usual error
    naming it (wait=True: wait for it first). False when it cannot even be read or removed."""
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 (flock needs no write access)
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = handle.read().strip()
            raise _held_by_another(what, holder) from None
        except OSError:
            return False
        try:
            if _is_open_file(path, handle):  # still the file we hold, not a new one
                path.unlink()  # unheld: stale (its process is gone); the folder is ours to write
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return True


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back for a short block that must not stop halfway: they are delivered after it.

    Python runs signal handlers in the main thread whichever thread the kernel picked (numpy's and tqdm's
    threads included), so the handlers are swapped for ones that only remember the signal; a thread mask would
    not do. Elsewhere than in the main thread, where handlers cannot be set, the block just runs."""
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {number: signal.getsignal(number) for number in held}
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    arrived: list[int] = []
    try:  # installing runs pending handlers: one may raise here, and every handler must still be restored
        for number in held:
            signal.signal(number, lambda number, frame: arrived.append(number))
        yield
    finally:
        raised = None
        for number, handler in previous.items():
            try:
                signal.signal(number, handler)
            except BaseException as exc:  # a signal landing between two restores: restore the rest first
                raised = raised or exc
        if raised is not None:
            raise raised
        for number in dict.fromkeys(arrived):
            signal.raise_signal(number)


_AT_FDCWD = -100  # Linux: paths relative to the working folder
_RENAME_EXCHANGE = 2  # renameat2 flag: swap two existing paths in one step


def exchange_paths(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 with RENAME_EXCHANGE): True when done, False where
    the OS, its C library or the file system cannot (another OS, an old kernel, some network file systems)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a C library without renameat2
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def swap_in_folder(new: Path, path: Path, replaced: Path) -> None:
    """Give the finished folder ``new`` the name ``path``; whatever held that name ends at ``replaced`` (which must
    not exist; the caller removes it). Where the file system allows, one exchange: a reader of ``path`` finds the
    old folder or the new one, never a mix and never nothing. Elsewhere two renames (``path`` to ``replaced``, then
    ``new`` to ``path``): for a moment ``path`` is missing, and a process killed in between leaves the old folder
    at ``replaced`` for the caller to put back. Ctrl-C and SIGTERM wait until the renames are done."""
    with signals_held():
        if path.exists() and exchange_paths(new, path):
            os.rename(new, replaced)  # new's name now holds the old folder
            return
        if path.exists():
            os.rename(path, replaced)
        os.rename(new, path)


def read_json(path: str | Path, what: str, remedy: str = "delete it to start over"):
    """A JSON file attnpat wrote (a manifest, an index, a state file). A damaged one (cut off, edited,
    not UTF-8) or an unreadable one is one AttnpatError saying what it is and what to do."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AttnpatError(os_error_message(exc, f"cannot read {what}")) from exc
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise AttnpatError(f"{what} {path} is damaged ({type(exc).__name__}); {remedy}") from exc


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


FIGURE_DPI = 130  # every saved figure's resolution (analysis.figures.map_figure sizes its map in these pixels)


def save_figure(fig, stem: str | Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save a matplotlib figure as stem.png and stem.svg, atomically."""
    stem = Path(stem)
    written = []
    with warnings.catch_warnings():  # a CJK file name in a title: boxes, not a screenful of warnings
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        for fmt in formats:
            written.append(atomic_write(stem.with_suffix(f".{fmt}"), lambda tmp, fmt=fmt: fig.savefig(
                tmp, format=fmt, dpi=FIGURE_DPI, bbox_inches="tight")))
    return written


def save_table(frame, path: str | Path) -> Path:
    """Write a pandas DataFrame as CSV, atomically."""
    return atomic_write(path, lambda tmp: frame.to_csv(tmp, index=False))


# ---------------------------------------------------------------- layer x head tables

def long_table(values: dict[str, np.ndarray], key: str = "metric", intervals: dict[str, np.ndarray] | None = None):
    """Layer x head arrays to the long CSV layout.

    values: {name: (L, H) array}; intervals: {name: (L, H, 2)} lower and upper bounds of every value (optional).
    Returns a DataFrame with columns layer, head, <key>, value, and ci_low, ci_high with intervals
    (0-indexed layers and heads; one row per head and name).
    """
    frames = []
    for name, array in values.items():
        array = np.asarray(array, dtype=float)
        if array.ndim != 2:
            raise AttnpatError(f"table '{name}' must be (layers, heads), got shape {array.shape}")
        layers, heads = np.meshgrid(np.arange(array.shape[0]), np.arange(array.shape[1]), indexing="ij")
        frame = pd.DataFrame({"layer": layers.ravel(), "head": heads.ravel(), key: name, "value": array.ravel()})
        if intervals is not None:
            bounds = np.asarray(intervals[name], dtype=float)
            if bounds.shape != (*array.shape, 2):
                raise AttnpatError(f"the intervals of '{name}' must be {(*array.shape, 2)}, got {bounds.shape}")
            frame["ci_low"], frame["ci_high"] = bounds[..., 0].ravel(), bounds[..., 1].ravel()
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def table_to_array(frame, name: str, key: str = "metric") -> np.ndarray:
    """Inverse of :func:`long_table` for one name: (L, H) array."""
    rows = frame[frame[key] == name]
    if rows.empty:
        raise AttnpatError(f"no rows for {key}={name!r}")
    array = np.full((int(rows["layer"].max()) + 1, int(rows["head"].max()) + 1), np.nan)
    array[rows.layer.to_numpy(int), rows["head"].to_numpy(int)] = rows.value.to_numpy(float)
    return array


# ---------------------------------------------------------------- run directories

def package_versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


class RunDir:
    """runs/<model-slug>/<task>/ with an accumulating manifest.json.

    ``manifest["analyses"][name]`` records each analysis's command, data, timing and outputs, so
    several commands can write into one run directory without overwriting each other's records.
    """

    def __init__(self, model_slug: str, task: str, root: str | Path | None = None):
        self.root = runs_root(root)
        self.path = self.root / model_slug / task
        self.model_slug = model_slug
        self.task = task
        self._written: list[str] | None = None  # inside record(): the files written so far, for its "outputs"
        self._retired: list[str] = []  # inside record(): files of an earlier run that this one does not write
        self._retired_entries: list[str] = []  # inside record(): manifest entries that go with those files
        self._staging: list[Path] = []  # inside record(): its staging folders, innermost last

    def file(self, name: str) -> Path:
        """Where ``name`` lives in the run folder (inside a record, once the analysis has finished)."""
        return self.path / name

    def check_writable(self) -> None:
        """A one-line AttnpatError unless this run folder can be written (writable_path on its manifest); verbs call
        it before their work, as record does, so a read-only runs folder fails before the work, not after it."""
        writable_path(self.file("manifest.json"))

    def current(self, name: str) -> Path:
        """The file ``name`` as this process sees it now: inside a record, the staged copy it wrote, if any."""
        for staging in reversed(self._staging):
            if (staging / name).is_file():
                return staging / name
        return self.file(name)

    def manifest(self) -> dict:
        path = self.file("manifest.json")
        if not path.is_file():
            return {}
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AttnpatError(f"{path} is not valid JSON: {exc}") from exc
        except OSError as exc:
            raise AttnpatError(os_error_message(exc, "cannot read")) from exc
        if not isinstance(manifest, dict):
            raise AttnpatError(f"{path} is not a run manifest (a JSON object)")
        return manifest

    def write_table(self, name: str, frame, merged: bool = False) -> Path:
        """Write ``<name>.csv``; inside a record it is staged and lands when the analysis finishes. merged: a
        table that several analyses merge their rows into (under :meth:`updating`), written in place at once so
        that the next merge sees it. Returns the path where it lands."""
        with self._named_as_landing():
            return self._note(save_table(frame, self._destination(f"{name}.csv", merged)))

    def write_figure(self, name: str, fig, merged: bool = False) -> list[Path]:
        """Write ``<name>.png`` and ``<name>.svg``, staged (or not: merged) as write_table's tables are."""
        with self._named_as_landing():
            return [self._note(path) for path in save_figure(fig, self._destination(name, merged))]

    def _destination(self, name: str, merged: bool) -> Path:
        return self._staging[-1] / name if self._staging and not merged else self.file(name)

    @contextmanager
    def _named_as_landing(self) -> Iterator[None]:
        """A failed staged write (disk full...) names the file where it would land, not its staging copy."""
        try:
            yield
        except AttnpatError as exc:
            message = str(exc)
            for staging in self._staging:
                message = message.replace(str(staging), str(self.path))
            if message == str(exc):
                raise
            raise AttnpatError(message) from exc

    def retire(self, *names: str) -> None:
        """Inside a record: files an earlier run of the analysis wrote that this run does not (an optional output
        not asked for this time), or folders (a resumable run's finished parts). They are removed when the run lands,
        with its own files, so the folder never holds a table of the earlier run beside this one's manifest entry;
        a failed run leaves them."""
        self._retired.extend(names)

    def retire_entries(self, *analyses: str) -> None:
        """Inside a record: manifest entries of other analyses whose files this run retires (:meth:`retire`); they
        are dropped from the manifest in the same step that removes the files."""
        self._retired_entries.extend(analyses)

    def _note(self, path: Path) -> Path:
        if self._written is not None:  # the innermost record's (an outer one's outputs are its own files)
            self._written.append(path.name)
        return self.file(path.name)

    def _output_name(self, output) -> str:
        """A path an analysis names (relative to the working folder, as a command-line path is): a file of this
        run folder by its name, anything else (e.g. an --out folder elsewhere) by its full path."""
        path = Path(output).absolute()
        return path.name if path.parent == self.path.absolute() else str(path)

    def read_table(self, name: str):
        path = self.current(f"{name}.csv")
        if not path.is_file():
            raise AttnpatError(f"no {name} table in {self.path}; run the analysis first")
        return pd.read_csv(path)

    @contextmanager
    def record(self, analysis: str, bundle=None, data=None, *, wait: bool = False, **extra) -> Iterator[dict]:
        """Context manager: yields a dict the analysis fills (n_truncated, figures...), and writes the manifest
        entry with timing when the block finishes without error. Its "outputs" are the files written through
        write_table / write_figure in the block, plus any the analysis lists itself (a checkpoint, a maps
        folder). A run folder that cannot be written is an AttnpatError before the block runs, not after its
        work.

        The block's tables and figures are staged in ``.staging-<analysis>/`` and moved into the run folder
        together with its manifest entry when the block finishes; a failed or stopped analysis leaves the
        folder as it was, never its new tables beside the figures or the manifest entry of an older run.

        wait: when another process records the same analysis here, wait for it (a short update that several
        commands make in turn) instead of stopping with an error."""
        self.check_writable()
        self.manifest()  # a damaged manifest is an error now, before the analysis writes its tables
        # one process per analysis and run folder: a second would overwrite the first one's tables mid-run
        with locked(self.file(f"{LOCK_FILE}-{analysis}"), f"{analysis} in {self.path}", wait=wait):
            for stale in self.path.glob(f"{STAGING}-{analysis}-{'?' * 8}"):  # killed runs' (mkdtemp's 8 letters)
                shutil.rmtree(stale, ignore_errors=True)  # another user's may stay: ours has its own name
            try:
                staging = Path(tempfile.mkdtemp(dir=self.path, prefix=f"{STAGING}-{analysis}-"))
            except OSError as exc:
                raise AttnpatError(os_error_message(exc, f"cannot write in {self.path}")) from exc
            started = time.time()
            entry: dict = {"command": command_line(), "started": _iso(started), **extra}
            if data is not None:
                entry["data"] = data.manifest()
            outer, self._written = self._written, []
            outer_retired, self._retired = self._retired, []
            outer_entries, self._retired_entries = self._retired_entries, []
            self._staging.append(staging)
            try:
                yield entry
                written = self._written
                listed = [self._output_name(output) for output in entry.get("outputs", [])]
                entry["outputs"] = list(dict.fromkeys(written + listed))
                finished = time.time()
                entry.update(finished=_iso(finished), elapsed_seconds=round(finished - started, 3))
                with self.updating():
                    # everything written first, so that only renames remain, with a stop held back for them
                    with self._named_as_landing():
                        atomic_write_json(staging / "manifest.json", self._merged_manifest(
                            analysis, entry, bundle, finished, retired=self._retired_entries))
                    with signals_held():
                        for name in dict.fromkeys(written):
                            if (staging / name).is_file():  # a merged table is in place already
                                os.replace(staging / name, self.file(name))
                        for name in sorted(set(self._retired) - set(written)):
                            try:
                                if self.file(name).is_dir():
                                    shutil.rmtree(self.file(name))
                                else:
                                    self.file(name).unlink(missing_ok=True)
                            except OSError as exc:  # the run's own files have landed: a warning, not a failure
                                log.warning("could not remove %s, left by an earlier run: %s", self.file(name), exc)
                        os.replace(staging / "manifest.json", self.file("manifest.json"))
            finally:
                self._written, self._retired, self._retired_entries = outer, outer_retired, outer_entries
                self._staging.pop()
                shutil.rmtree(staging, ignore_errors=True)

    @contextmanager
    def updating(self) -> Iterator[None]:
        """The run folder's short lock, for a read-merge-write of a file that other analyses may update at the
        same time (the manifest; a table that several modes share)."""
        with locked(self.file(LOCK_FILE), str(self.path), wait=True):
            yield

    def _merged_manifest(self, analysis: str, entry: dict, bundle, finished: float, retired=()) -> dict:
        """The manifest with ``entry`` recorded for ``analysis`` and the entries of the analyses ``retired`` dropped
        (read under :meth:`updating`)."""
        manifest = self.manifest()
        if bundle is not None:
            manifest["model"] = {"name": bundle.name, "source": bundle.source.kind, "path": bundle.source.path,
                                 "revision": bundle.revision, "layers": bundle.num_layers, "heads": bundle.num_heads,
                                 "map_kind": getattr(bundle, "map_kind", "weight")}
        manifest.setdefault("task", self.task)
        manifest["packages"] = package_versions()
        analyses = manifest.setdefault("analyses", {})
        for name in retired:
            analyses.pop(name, None)
        analyses[analysis] = entry
        manifest["updated"] = _iso(finished)
        return manifest


def command_line() -> str:
    """This process's command as a user would type it again: `attnpat verb ...` also for `python -m app.cli`
    (how the web app starts its jobs), whose argv[0] is the module's file."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if Path(sys.argv[0]).name == "attnpat" or getattr(spec, "name", None) == "app.cli":
        return shlex.join(["attnpat", *sys.argv[1:]])
    return shlex.join(sys.argv)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat(timespec="seconds")


def readable_manifest(manifest_path: Path) -> dict | None:
    """A run folder's manifest, or None when it is missing, unreadable, damaged or not a JSON object (for readers
    that show what there is, such as the run browser, instead of stopping at one damaged folder)."""
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: bad UTF-8 or JSON
        return None
    return manifest if isinstance(manifest, dict) else None


def list_runs(root: str | Path | None = None) -> list[dict]:
    """Every run directory under ``root``: model slug, task, path and manifest."""
    root = runs_root(root)
    runs = []
    for manifest_path in sorted(root.glob("*/*/manifest.json")):
        manifest = readable_manifest(manifest_path)
        if manifest is None or not isinstance(manifest.get("analyses", {}), dict):
            manifest = {"error": "unreadable manifest"}
        runs.append({"model": manifest_path.parent.parent.name, "task": manifest_path.parent.name,
                     "path": str(manifest_path.parent), "manifest": manifest})
    return runs
