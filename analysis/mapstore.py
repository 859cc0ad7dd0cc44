"""A compact, resumable on-disk format for attention-map samples.

A map file is a compressed .npz shard holding several examples, each cropped to its real length:
  attn        float16, all examples' (L, H, n, n) maps flattened and concatenated
  lengths     (N,) int32 real lengths n
  shape       (2,) int32 = (L, H)
  tokens      (sum n,) str, all examples' tokens concatenated
  token_type_ids (sum n,) int8
  example_ids (N,) str
No pickled objects: shards load with ``allow_pickle=False``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from analysis.errors import AttnpatError
from analysis.rundir import atomic_write


@dataclass
class SavedMap:
    """One example's maps: attn (L, H, n, n) float32, its n tokens and segment ids."""

    example_id: str
    attn: np.ndarray
    tokens: list[str]
    token_type_ids: np.ndarray

    @property
    def map_ids(self) -> list[str]:
        """Ids of the single-head maps inside: '<example>/L<layer>H<head>' (0-indexed)."""
        layers, heads = self.attn.shape[:2]
        return [f"{self.example_id}/L{layer}H{head}" for layer in range(layers) for head in range(heads)]


def write_shard(path: str | Path, maps: list[SavedMap]) -> Path:
    if not maps:
        raise AttnpatError("no maps to write")
    shape = maps[0].attn.shape[:2]
    for item in maps:
        n = len(item.tokens)
        if item.attn.shape != (*shape, n, n):
            raise AttnpatError(f"map {item.example_id} has shape {item.attn.shape}, expected {(*shape, n, n)}")
    arrays = {
        "attn": np.concatenate([item.attn.astype(np.float16).ravel() for item in maps]),
        "lengths": np.asarray([len(item.tokens) for item in maps], dtype=np.int32),
        "shape": np.asarray(shape, dtype=np.int32),
        "tokens": np.asarray([token for item in maps for token in item.tokens], dtype=str),
        "token_type_ids": np.concatenate([np.asarray(item.token_type_ids, dtype=np.int8) for item in maps]),
        "example_ids": np.asarray([item.example_id for item in maps], dtype=str),
    }

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)

    return atomic_write(path, write)


def read_shard(path: str | Path) -> list[SavedMap]:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            attn, lengths, shape = data["attn"], data["lengths"], tuple(int(v) for v in data["shape"])
            tokens, types, ids = data["tokens"], data["token_type_ids"], data["example_ids"]
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise AttnpatError(f"{path} is not an attnpat map file ({type(exc).__name__})") from exc
    maps, offset, token_offset = [], 0, 0
    for example_id, n in zip(ids, lengths):
        size = shape[0] * shape[1] * n * n
        maps.append(SavedMap(str(example_id), attn[offset:offset + size].astype(np.float32).reshape(*shape, n, n),
                             [str(t) for t in tokens[token_offset:token_offset + n]],
                             types[token_offset:token_offset + n].astype(np.int64)))
        offset += size
        token_offset += n
    return maps


def shard_files(path: str | Path) -> list[Path]:
    """A single .npz file, or every shard-*.npz in a folder (sorted)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if files:
            return files
        raise AttnpatError(f"{path} holds no .npz map files")
    raise AttnpatError(f"map path {path} does not exist")


def iter_saved_maps(path: str | Path) -> Iterator[SavedMap]:
    for file in shard_files(path):
        yield from read_shard(file)
