"""One on-disk format for attention maps, one map-id grammar and one digest over maps.

A map file is a compressed .npz of map groups. A group holds some heads of one input, all sharing its
n real tokens: every head of an example (`attnpat extract` shards, float16) or a single head (annotation
samples and labeled sets, float32). Arrays (no pickled objects: files load with ``allow_pickle=False``):
  format          () str, FORMAT
  models, tasks, example_ids   (G,) str: whose maps, on which input
  lengths         (G,) int32 real lengths n
  head_counts     (G,) int32 k, the heads each group holds
  heads           (sum k, 2) int32 (layer, head), 0-indexed, group by group
  attn            (sum k*n*n,) float16 or float32: each group's (k, n, n) maps flattened, group by group
  has_tokens      (G,) bool: whether the group's tokens are stored (labeled sets may have none)
  tokens          (sum n over groups with tokens,) str
  token_type_ids  (same,) int8
  revision        () str, optional: the weights the maps were computed with (EncoderBundle.revision; extraction
                  shards record it, so a shard of other weights of the same model is told apart)

Map id: '<model-slug>:<task>:<example>:L<layer>H<head>' (0-indexed), made by :func:`make_map_id` and read
by :func:`parse_map_id`; unique and stable, so labels, predictions and tasks join on it.
"""
from __future__ import annotations

import hashlib
import json
import re
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from analysis.errors import AttnpatError
from analysis.rundir import atomic_write, read_json

FORMAT = "attnpat-maps/1"
EXTRACT_INDEX = "index.json"  # what `attnpat extract` writes beside its shards (analysis.extract)
_CELL = re.compile(r"L(\d+)H(\d+)")


class MapId(NamedTuple):
    model: str
    task: str
    example_id: str
    layer: int
    head: int


def make_map_id(model: str, task: str, example_id: str, layer: int, head: int) -> str:
    """'<model>:<task>:<example>:L<layer>H<head>'; a ':' inside model or task becomes '_' (the example id may
    hold any character: it is read as everything between the second and the last ':')."""
    return f"{_field(model)}:{_field(task)}:{example_id}:L{int(layer)}H{int(head)}"


def _field(text: str) -> str:
    return str(text).replace(":", "_")


def parse_map_id(map_id: str) -> MapId:
    """The parts of a map id made by :func:`make_map_id`; anything else raises AttnpatError."""
    prefix, _, cell = str(map_id).rpartition(":")
    parts = prefix.split(":", 2)
    match = _CELL.fullmatch(cell)
    if len(parts) != 3 or not all(parts) or match is None:
        raise AttnpatError(f"map id {map_id!r} is not <model>:<task>:<example>:L<layer>H<head>")
    return MapId(parts[0], parts[1], parts[2], int(match[1]), int(match[2]))


def maps_digest(maps: Sequence[np.ndarray], map_ids: Sequence[str] | None = None,
                labels: Sequence[int] | None = None) -> str:
    """sha256 over maps (each as float32 bytes), preceded per map by its id and its label (one byte) when given.

    One map alone gives the sha256 of its bytes (what an annotation task records); ids and labels identify
    exactly what a model was trained on."""
    digest = hashlib.sha256()
    for k, attn in enumerate(maps):
        if map_ids is not None:
            digest.update(str(map_ids[k]).encode())
        if labels is not None:
            digest.update(int(labels[k]).to_bytes(1, "little"))
        digest.update(np.ascontiguousarray(attn, np.float32).tobytes())
    return digest.hexdigest()


@dataclass
class MapGroup:
    """Some heads of one input: attn (k, n, n) float32; heads (k, 2) (layer, head); tokens: n strings or None;
    token_type_ids: (n,) ints or None."""

    model: str
    task: str
    example_id: str
    heads: np.ndarray
    attn: np.ndarray
    tokens: list[str] | None = None
    token_type_ids: np.ndarray | None = None

    @property
    def map_ids(self) -> list[str]:
        return [make_map_id(self.model, self.task, self.example_id, layer, head) for layer, head in self.heads]

    def grid(self) -> np.ndarray:
        """(L, H, n, n): the maps of a group that holds every head of its example, layer by layer."""
        k, n = self.attn.shape[:2]
        layers, heads = (int(v) + 1 for v in self.heads.max(0))
        full = np.stack(np.meshgrid(np.arange(layers), np.arange(heads), indexing="ij"), -1).reshape(-1, 2)
        if k != layers * heads or not np.array_equal(self.heads, full):
            raise AttnpatError(f"maps of {self.example_id} are single heads, not every head of the example")
        return self.attn.reshape(layers, heads, n, n)


def single_map(map_id: str, attn: np.ndarray, tokens: Sequence[str] | None = None) -> MapGroup:
    """A group of one head: attn (n, n); its id (see :func:`make_map_id`) says whose map it is."""
    part = parse_map_id(map_id)
    return MapGroup(part.model, part.task, part.example_id, np.asarray([[part.layer, part.head]]),
                    np.asarray(attn, np.float32)[None], list(tokens) if tokens is not None else None)


@dataclass
class SavedMap:
    """Every head of one example (an `attnpat extract` shard entry): attn (L, H, n, n) float32, its n tokens,
    segment ids, and the model and task it comes from."""

    example_id: str
    attn: np.ndarray
    tokens: list[str]
    token_type_ids: np.ndarray
    model: str
    task: str

    def group(self) -> MapGroup:
        layers, heads, n = self.attn.shape[:3]
        cells = np.stack(np.meshgrid(np.arange(layers), np.arange(heads), indexing="ij"), -1).reshape(-1, 2)
        return MapGroup(self.model, self.task, self.example_id, cells, self.attn.reshape(-1, n, n), list(self.tokens),
                        np.asarray(self.token_type_ids))

    @property
    def map_ids(self) -> list[str]:
        return self.group().map_ids


def write_maps(path: str | Path, groups: Sequence[MapGroup], dtype=np.float32, revision: str | None = None) -> Path:
    """Write ``groups`` to one map file (atomically); maps are stored as ``dtype`` (float16 halves the size);
    ``revision``: the model weights' identity, recorded when given."""
    if not groups:
        raise AttnpatError("no maps to write")
    for group in groups:
        k, n = len(group.heads), group.attn.shape[-1]
        if group.attn.shape != (k, n, n):
            raise AttnpatError(f"maps of {group.example_id} have shape {group.attn.shape}, expected {(k, n, n)}")
        if group.tokens is not None and len(group.tokens) != n:
            raise AttnpatError(f"maps of {group.example_id} are {n} tokens long but come with {len(group.tokens)} "
                               "tokens")
    with_tokens = [group for group in groups if group.tokens is not None]
    arrays = {
        "format": np.asarray(FORMAT),
        "models": np.asarray([_field(group.model) for group in groups], dtype=str),
        "tasks": np.asarray([_field(group.task) for group in groups], dtype=str),
        "example_ids": np.asarray([group.example_id for group in groups], dtype=str),
        "lengths": np.asarray([group.attn.shape[-1] for group in groups], dtype=np.int32),
        "head_counts": np.asarray([len(group.heads) for group in groups], dtype=np.int32),
        "heads": np.concatenate([np.asarray(group.heads, np.int32).reshape(-1, 2) for group in groups]),
        "attn": np.concatenate([np.asarray(group.attn).astype(dtype).ravel() for group in groups]),
        "has_tokens": np.asarray([group.tokens is not None for group in groups]),
        "tokens": np.asarray([token for group in with_tokens for token in group.tokens], dtype=str),
        "token_type_ids": np.concatenate([np.zeros(0, np.int8)] + [
            np.asarray(group.token_type_ids if group.token_type_ids is not None else np.zeros(len(group.tokens)),
                       np.int8) for group in with_tokens]),
    }
    if revision is not None:
        arrays["revision"] = np.asarray(str(revision))

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)

    return atomic_write(path, write)


def read_maps(path: str | Path) -> list[MapGroup]:
    """Every group of one map file, maps as float32. Files of the earlier single-head layout (map_ids,
    lengths, attn) are read too; anything else raises AttnpatError."""
    path = Path(path)
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a bare .npy array (or one pickled object): not ours
            raise ValueError("not an .npz archive")
        with loaded as data:
            arrays = {name: data[name] for name in data.files}
        if not all(isinstance(array, np.ndarray) for array in arrays.values()):  # numpy hands back raw bytes
            raise ValueError("a member is not a .npy array")
    # NotImplementedError, RuntimeError: zipfile refusing a damaged entry (unknown method or version, "encrypted")
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, NotImplementedError,
            RuntimeError) as exc:
        raise AttnpatError(f"{path} is not an attnpat map file ({type(exc).__name__})") from exc
    if "format" not in arrays:
        return _read_single_head_layout(path, arrays)
    if arrays["format"].dtype.kind != "U" or str(arrays["format"]) != FORMAT:
        raise AttnpatError(f"{path} has map format {ascii(str(arrays['format'])[:60])}, expected {FORMAT!r}")
    check_map_arrays(path, arrays)
    try:
        groups, offset, head_offset, token_offset = [], 0, 0, 0
        tokens, types = arrays["tokens"], arrays["token_type_ids"]
        for g, (n, k) in enumerate(zip(arrays["lengths"].tolist(), arrays["head_counts"].tolist(), strict=True)):
            size = k * n * n
            group = MapGroup(str(arrays["models"][g]), str(arrays["tasks"][g]), str(arrays["example_ids"][g]),
                             arrays["heads"][head_offset:head_offset + k].astype(np.int64),
                             arrays["attn"][offset:offset + size].astype(np.float32).reshape(k, n, n))
            if arrays["has_tokens"][g]:
                group.tokens = [str(t) for t in tokens[token_offset:token_offset + n]]
                group.token_type_ids = types[token_offset:token_offset + n].astype(np.int64)
                token_offset += n
            groups.append(group)
            offset, head_offset = offset + size, head_offset + k
    except (KeyError, ValueError, IndexError) as exc:
        raise AttnpatError(f"{path} is not a complete attnpat map file ({type(exc).__name__})") from exc
    return groups


def check_map_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """The arrays of a map file have the dtypes and shapes the format states, and agree with each other:
    ``attn`` holds exactly sum(k * n * n) values, heads and tokens exactly as many rows as the groups say,
    and every value is a finite, non-negative attention weight. Anything else is one AttnpatError."""
    lengths = _array(path, arrays, "lengths", 1, "iu")
    groups = len(lengths)
    for name in ("models", "tasks", "example_ids"):
        _array(path, arrays, name, 1, "U", groups)
    head_counts = _array(path, arrays, "head_counts", 1, "iu", groups)
    has_tokens = _array(path, arrays, "has_tokens", 1, "b", groups)
    if (lengths < 1).any() or (head_counts < 1).any():
        raise AttnpatError(f"{path}: every map length and head count must be positive")
    lengths, head_counts = lengths.astype(np.int64), head_counts.astype(np.int64)
    heads = _array(path, arrays, "heads", 2, "iu", int(head_counts.sum()))
    if heads.shape[1] != 2 or (heads < 0).any():
        raise AttnpatError(f"{path}: 'heads' must hold (layer, head) pairs >= 0, got shape {heads.shape}")
    n_tokens = int(lengths[has_tokens].sum())
    _array(path, arrays, "tokens", 1, "U", n_tokens)
    _array(path, arrays, "token_type_ids", 1, "iu", n_tokens)
    _check_attn(path, _array(path, arrays, "attn", 1, "f"), int((head_counts * lengths ** 2).sum()))


def _array(path: Path, arrays: dict, name: str, ndim: int, kinds: str, rows: int | None = None) -> np.ndarray:
    """arrays[name], checked to have ``ndim`` dimensions, a dtype of one of ``kinds`` and ``rows`` rows."""
    if name not in arrays:
        raise AttnpatError(f"{path} is not a complete attnpat map file (no '{name}' array)")
    array = arrays[name]
    if array.ndim != ndim or array.dtype.kind not in kinds or (rows is not None and array.shape[0] != rows):
        wanted = f"{ndim}-d {'/'.join(_KIND_NAMES[kind] for kind in kinds)}"
        wanted += f" of {rows} rows" if rows is not None else ""
        raise AttnpatError(f"{path}: '{name}' is {array.dtype} of shape {array.shape}, expected {wanted}")
    return array


_KIND_NAMES = {"i": "int", "u": "uint", "U": "str", "b": "bool", "f": "float"}


def _check_attn(path: Path, attn: np.ndarray, expected: int) -> None:
    if attn.size != expected:
        raise AttnpatError(f"{path}: 'attn' holds {attn.size} values, but the map lengths say {expected}")
    if not np.isfinite(attn).all() or (attn < 0).any():
        raise AttnpatError(f"{path}: 'attn' holds values that are not attention weights (negative, NaN or infinite)")


def _read_single_head_layout(path: Path, arrays: dict) -> list[MapGroup]:
    if not {"map_ids", "lengths", "attn"} <= set(arrays):
        raise AttnpatError(f"{path} is not an attnpat map file (maps extracted by an earlier version: extract again)")
    lengths = _array(path, arrays, "lengths", 1, "iu")
    _array(path, arrays, "map_ids", 1, "U", len(lengths))
    if (lengths < 1).any():
        raise AttnpatError(f"{path}: every map length must be positive")
    _check_attn(path, _array(path, arrays, "attn", 1, "f"), int((lengths.astype(np.int64) ** 2).sum()))
    groups, offset = [], 0
    for map_id, n in zip(arrays["map_ids"], arrays["lengths"].tolist(), strict=True):
        groups.append(single_map(str(map_id), arrays["attn"][offset:offset + n * n].reshape(n, n)))
        offset += n * n
    return groups


def write_single_maps(path: str | Path, maps: dict[str, np.ndarray],
                      tokens: dict[str, Sequence[str]] | None = None) -> Path:
    """Single-head maps (map_id -> (n, n)) as float32 groups of one head, with their tokens where known."""
    tokens = tokens or {}
    return write_maps(path, [single_map(map_id, attn, tokens.get(map_id)) for map_id, attn in maps.items()])


def read_single_maps(path: str | Path) -> dict[str, np.ndarray]:
    """map_id -> (n, n) float32 map, for every head of every group in a map file (or in every map file of a folder).
    A map id found twice with other values (two files of a folder that disagree) is an error, not the last one."""
    found: dict[str, np.ndarray] = {}
    for group in iter_map_groups(path):
        for map_id, attn in zip(group.map_ids, group.attn, strict=True):
            if map_id in found and not np.array_equal(found[map_id], attn):
                raise AttnpatError(f"map {map_id} is in {path} twice with different values; remove the file "
                                   "that holds the wrong one")
            found[map_id] = attn
    return found


def write_shard(path: str | Path, maps: list[SavedMap], revision: str | None = None) -> Path:
    """Whole examples (every head) as float16 groups; ``revision``: the model weights' identity
    (EncoderBundle.revision), which readers check against the extraction's index.json."""
    for item in maps:
        n = len(item.tokens)
        if item.attn.ndim != 4 or item.attn.shape[2:] != (n, n) or item.attn.shape[:2] != maps[0].attn.shape[:2]:
            raise AttnpatError(f"map {item.example_id} has shape {item.attn.shape}, expected "
                               f"{(*maps[0].attn.shape[:2], n, n)}")
    return write_maps(path, [item.group() for item in maps], np.float16, revision)


def is_whole_map_file(path: str | Path) -> bool:
    """Whether ``path`` is a map file whose zip directory is intact and names every array of the format: cheap
    (the directory sits at the file's end; no map is read), and enough to catch a file cut short by a full disk,
    a copy stopped midway or a hand edit. Map files are written atomically, so attnpat itself never leaves one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return {"format.npy", "example_ids.npy", "lengths.npy", "attn.npy"} <= names


def read_shard(path: str | Path) -> list[SavedMap]:
    """The whole examples of one map file (every group must hold every head of its example)."""
    return [SavedMap(group.example_id, group.grid(), group.tokens or [], group.token_type_ids, group.model,
                     group.task) for group in read_maps(path)]


def shard_name(k: int) -> str:
    """The file name of an extraction's k-th shard (0-indexed)."""
    return f"shard-{k:05d}.npz"


def shard_identity(models: Sequence[str], tasks: Sequence[str], example_ids: Sequence[str]) -> str:
    """sha256 naming what a shard holds: each group's model slug, task (as stored, ':' made '_') and example id, in
    order. An extraction records one per shard in its index.json; its maps are not hashed (reading them is the cost
    a reader saves)."""
    content = [[_field(model), _field(task), str(example)] for model, task, example in
               zip(models, tasks, example_ids, strict=True)]
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()


def read_shard_identity(path: str | Path) -> str | None:
    """:func:`shard_identity` of a map file, read from its three small name arrays only (no map is decompressed);
    None when they cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return shard_identity(*(data[name].tolist() for name in ("models", "tasks", "example_ids")))
    except (OSError, ValueError, EOFError, KeyError, TypeError, AttributeError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, RuntimeError):
        return None


def read_shard_revision(path: str | Path) -> str | None:
    """The model weights' identity a map file records (its small ``revision`` array; no map is decompressed); None
    when it records none (a file written before shards recorded it, an annotation sample) or cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return str(data["revision"]) if "revision" in data.files else None
    except (OSError, ValueError, EOFError, KeyError, TypeError, AttributeError, zipfile.BadZipFile, zlib.error,
            NotImplementedError, RuntimeError):
        return None


def other_weights(path: str | Path, revision: str | None) -> str | None:
    """Why map file ``path`` is not made from the model weights ``revision`` ('revision X, not Y'); None when it
    is, or when either is unknown (a shard written before shards recorded their weights)."""
    recorded = read_shard_revision(path)
    if recorded is None or not revision or recorded == revision:
        return None
    return f"revision {recorded}, not {revision}"


def shard_files(path: str | Path) -> list[Path]:
    """A single .npz file, or every .npz in a folder (sorted); an extraction's folder only when it checks out
    (:func:`check_extraction_finished`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        check_extraction_finished(path)
        files = sorted(path.glob("*.npz"))
        if files:
            return files
        raise AttnpatError(f"{path} holds no .npz map files")
    raise AttnpatError(f"map path {path} does not exist")


def check_extraction_finished(folder: Path) -> None:
    """A folder of `attnpat extract` shards (an index beside them) is read only when the extraction finished, every
    shard it wrote is there, the folder holds no other map file, and each shard holds the examples the index records
    for it: a killed extraction holds the shards of its shortest examples (shards are length-sorted), which would
    pass for the whole data set, and a map file copied in (another extraction's shard, a sample) would be read as
    part of it. A folder without the index is read as it is."""
    index_path = folder / EXTRACT_INDEX
    if not index_path.is_file():
        return
    index = read_json(index_path, "the extraction index", "run the same `attnpat extract` again")
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return  # not an extraction's index
    if not index.get("complete"):
        raise AttnpatError(f"{folder} holds an unfinished extraction (stopped or still running): run the same "
                           "`attnpat extract` again to finish it")
    n_shards = index.get("n_shards")
    names = [shard_name(k) for k in range(n_shards if isinstance(n_shards, int) else 0)]
    absent = [name for name in names if not (folder / name).is_file()]
    if absent:
        raise AttnpatError(f"{folder} lacks {absent[0]} of its extraction ({len(absent)} of {n_shards} shards "
                           "missing): run the same `attnpat extract` again to make them")
    foreign = sorted({path.name for path in folder.glob("*.npz")} - set(names))
    if foreign:
        raise AttnpatError(f"{folder} holds {foreign[0]}, which its extraction ({EXTRACT_INDEX}: {n_shards} shards) "
                           f"did not write ({len(foreign)} such file(s)); move them out of the folder")
    recorded = index.get("shards")  # absent in indexes written before shards were recorded: not checked
    if isinstance(recorded, list) and len(recorded) == len(names):
        for name, identity in zip(names, recorded, strict=True):
            if read_shard_identity(folder / name) != identity:
                raise AttnpatError(f"{folder / name} holds other maps than its extraction wrote (other examples, "
                                   f"model or task than {EXTRACT_INDEX} records); remove it and run the same "
                                   "`attnpat extract` again")
    for name in names:  # a shard of other weights of the model holds the same examples under the same names
        why = other_weights(folder / name, index.get("revision"))
        if why:
            raise AttnpatError(f"{folder / name} holds maps of other weights of the model than its extraction's "
                               f"({why} as {EXTRACT_INDEX} records); remove it and run the same `attnpat extract` "
                               "again")


def iter_map_groups(path: str | Path) -> Iterator[MapGroup]:
    """Every group of a map file or of every map file in a folder."""
    for file in shard_files(path):
        yield from read_maps(file)


def iter_saved_maps(path: str | Path) -> Iterator[SavedMap]:
    for file in shard_files(path):
        yield from read_shard(file)
