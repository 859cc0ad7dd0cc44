"""Extract attention maps to disk (resumable shards) and the per-layer overview of the demo."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.data import TaskData
from analysis.distributed import extract_shards
from analysis.errors import AttnpatError
from analysis.mapkinds import DEFAULT_MAP_KIND
from analysis.mapstore import (
    EXTRACT_INDEX,
    FORMAT,
    SavedMap,
    is_whole_map_file,
    other_weights,
    read_shard_identity,
    shard_identity,
    shard_name,
    write_shard,
)
from analysis.rundir import RunDir, atomic_write_json, locked, long_table, read_json
from analysis.stats import HeadMeans, attention_to, mean_entropy
from analysis.stream import (
    DEFAULT_MAX_LENGTH,
    Encoded,
    check_marks_cls_and_sep,
    encode_examples,
    length_sorted_batches,
    stream_maps,
    token_roles,
)
from analysis.uncertainty import EXAMPLE_INTERVAL


def extract_maps(bundle, data: TaskData, out_dir: str | Path, *, max_length: int = DEFAULT_MAX_LENGTH,
                 batch_size: int = 32, shard_size: int = 64, progress: bool = True, cluster=None) -> dict:
    """Save every example's maps as shards ``shard-00000.npz`` ... in ``out_dir``.

    Shards hold length-sorted groups of ``shard_size`` examples. A rerun skips shards already written
    (each is written atomically), so a killed extraction resumes where it stopped. Returns a summary
    dict (also written to ``out_dir/index.json``). ``cluster`` (analysis.cluster.Cluster): one job per
    shard on its workers.
    """
    out_dir = Path(out_dir)
    # one writer per maps folder, whichever run folder records it (--out may be shared)
    with locked(out_dir / ".maps.lock", f"the maps folder {out_dir}"):  # not .lock: --out may be a run folder
        return _extract_maps(bundle, data, out_dir, max_length=max_length, batch_size=batch_size,
                             shard_size=shard_size, progress=progress, cluster=cluster)


def _extract_maps(bundle, data: TaskData, out_dir: Path, *, max_length: int, batch_size: int, shard_size: int,
                  progress: bool, cluster) -> dict:
    check_no_orphan_shards(out_dir)
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)
    # the examples themselves, not where they were read: a data file's other --text-column gives other maps, and a
    # byte-identical copy of the file the same ones
    settings = {"format": FORMAT, "model": bundle.name, "revision": bundle.revision, "task": data.task,
                "split": data.split, "examples": data.examples_digest(),
                "n_examples": len(encoded), "max_length": max_length, "shard_size": shard_size,
                "map_kind": getattr(bundle, "map_kind", DEFAULT_MAP_KIND)}
    index_path = out_dir / EXTRACT_INDEX
    if index_path.is_file():
        previous = read_json(index_path, "the extraction index", "delete the maps folder or choose another --out")
        # folders extracted before the map kind or the examples were recorded: weights, and examples unknown
        legacy = {"map_kind": DEFAULT_MAP_KIND, "examples": settings["examples"]}
        if not isinstance(previous, dict) or {k: previous.get(k, legacy.get(k)) for k in settings} != settings:
            raise AttnpatError(f"{out_dir} holds maps made with other settings; choose another --out")
    settings["source"] = data.source  # recorded, not compared
    groups = length_sorted_batches(encoded, shard_size)
    identities = [shard_identity([bundle.slug] * len(group), [data.task] * len(group),
                                 [item.example_id for item in group]) for group in groups]
    present = [k for k in range(len(groups)) if (out_dir / shard_name(k)).is_file()]
    # a shard damaged since it was written (cut short by a full disk or a stopped copy) is computed again
    damaged = [k for k in present if not is_whole_map_file(out_dir / shard_name(k))
               or read_shard_identity(out_dir / shard_name(k)) is None]
    check_resumed_shards(out_dir, {k: identities[k] for k in sorted(set(present) - set(damaged))}, bundle.revision)
    atomic_write_json(index_path, {**settings, "complete": False})
    missing = sorted(set(range(len(groups))) - set(present) | set(damaged))
    if cluster is not None:
        extract_shards(cluster, bundle, data, {out_dir / shard_name(k): groups[k] for k in missing},
                       batch_size=batch_size, max_length=max_length, progress=progress)
    here = missing if cluster is None else []  # the shards this process computes
    todo = [item for k in here for item in groups[k]]
    shard_of = {item.index: k for k in here for item in groups[k]}
    pending: dict[int, list[SavedMap]] = {k: [] for k in here}
    for map_batch in stream_maps(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                 progress="extract" if progress and todo else False, encoded=todo):
        for i, item in enumerate(map_batch.batch.items):
            n = len(item)
            types = item.token_type_ids if item.token_type_ids is not None else [0] * n
            k = shard_of[item.index]
            pending[k].append(SavedMap(item.example_id, map_batch.example_maps(i).numpy(), item.tokens,
                                       np.asarray(types), bundle.slug, data.task))
            if len(pending[k]) == len(groups[k]):
                write_shard(out_dir / shard_name(k), pending.pop(k), bundle.revision)
    summary = {**settings, "complete": True, "n_shards": len(groups), "n_truncated": sum(e.truncated for e in encoded),
               "resumed_shards": len(groups) - len(missing), "damaged_shards": len(damaged),
               "shards": identities}  # what each shard holds, which readers check (analysis.mapstore)
    atomic_write_json(index_path, summary)
    return summary


def check_no_orphan_shards(out_dir: Path) -> None:
    """An AttnpatError when ``out_dir`` holds extraction shards but no index.json (deleted by hand): nothing tells
    what they were made from, so they are neither resumed (they could be another model's or task's maps) nor
    deleted (they could be the only copy); the user removes them. An extraction writes its index before its first
    shard, so a killed one always leaves the index."""
    orphans = sorted(out_dir.glob("shard-*.npz"))
    if orphans and not (out_dir / EXTRACT_INDEX).exists():
        raise AttnpatError(f"{out_dir} holds {len(orphans)} map shard(s) (shard-*.npz) but no {EXTRACT_INDEX} "
                           "telling what they were extracted from; remove them (or the folder) to extract afresh, "
                           "or choose another --out")


def check_resumed_shards(out_dir: Path, expected: dict[int, str], revision: str) -> None:
    """An AttnpatError when a shard an extraction would keep ({k: its :func:`shard_identity`}) holds other examples,
    model or task than this extraction puts there (another extraction's shard copied in), or maps of other weights
    than ``revision`` (EncoderBundle.revision; a shard that records none is not checked): resumed, it would pass
    for these maps; like shards without an index, it is neither kept nor overwritten (it could be the only copy)."""
    wrong = [k for k, identity in expected.items() if read_shard_identity(out_dir / shard_name(k)) != identity]
    if wrong:
        raise AttnpatError(f"{out_dir / shard_name(wrong[0])} holds other maps than this extraction puts there "
                           f"(other examples, model or task; {len(wrong)} such shard(s)); remove them, or choose "
                           "another --out")
    weights = {k: why for k in expected if (why := other_weights(out_dir / shard_name(k), revision))}
    if weights:
        first = min(weights)
        raise AttnpatError(f"{out_dir / shard_name(first)} holds maps of other weights of the model than this "
                           f"extraction's ({weights[first]}; {len(weights)} such shard(s)); remove them, or choose "
                           "another --out")


def write_maps(bundle, data: TaskData, run: RunDir, out: str | Path | None = None, *,
               max_length: int = DEFAULT_MAX_LENGTH, **kwargs) -> dict:
    """:func:`extract_maps` into ``out`` (default: the run's maps/ folder), recorded in the run's manifest.

    Returns extract_maps' summary plus ``out``, the folder written.
    """
    out = Path(out) if out is not None else run.file("maps")
    with run.record("extract", bundle, data, max_length=max_length) as entry:
        if kwargs.get("cluster") is not None:
            entry["cluster"] = kwargs["cluster"].manifest()
        summary = extract_maps(bundle, data, out, max_length=max_length, **kwargs)
        entry.update(n_truncated=summary["n_truncated"], outputs=[str(out)])
    return {**summary, "out": out}


def overview_inputs(tokenizer, data: TaskData, max_length: int = DEFAULT_MAX_LENGTH) -> list[Encoded]:
    """The task's encoded inputs, refusing a tokenizer that does not mark them with [CLS] and [SEP] (attention to
    them would read 0.000 for every head)."""
    encoded = encode_examples(tokenizer, data.examples, max_length)
    check_marks_cls_and_sep(tokenizer, encoded, "overview")
    return encoded


def layer_overview(bundle, data: TaskData, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                   progress: bool = True, encoded: list[Encoded] | None = None) -> tuple[HeadMeans, int]:
    """Per-head attention to [CLS], to [SEP] and row entropy over a task's maps, example by example.
    encoded: :func:`overview_inputs` when the caller has them already.

    Returns (HeadMeans holding {"to_cls"|"to_sep"|"entropy": (E, L, H)}, n_truncated).
    """
    encoded = overview_inputs(bundle.tokenizer, data, max_length) if encoded is None else encoded
    means = HeadMeans()
    for map_batch in stream_maps(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                 progress="overview" if progress else False, encoded=encoded):
        roles = token_roles(bundle.tokenizer, map_batch.batch.input_ids, map_batch.batch.attention_mask)
        means.add("to_cls", attention_to(map_batch.attentions, roles["cls"], roles["real"]))
        means.add("to_sep", attention_to(map_batch.attentions, roles["sep"], roles["real"]))
        means.add("entropy", mean_entropy(map_batch.attentions, roles["real"]))
    return means, sum(item.truncated for item in encoded)


def write_overview(bundle, data: TaskData, run: RunDir, **kwargs):
    """Compute :func:`layer_overview`, write overview.csv (each head's mean with its bootstrap 95% interval over the
    examples, ci_low and ci_high) to the run directory; return :meth:`HeadMeans.layer_table`."""
    encoded = overview_inputs(bundle.tokenizer, data, kwargs.get("max_length", DEFAULT_MAX_LENGTH))  # before the run
    with run.record("overview", bundle, data) as entry:
        means, n_truncated = layer_overview(bundle, data, encoded=encoded, **kwargs)
        values = means.result()
        run.write_table("overview", long_table(values, intervals=means.intervals()))
        entry.update(n_truncated=n_truncated, interval=EXAMPLE_INTERVAL)
    return means.layer_table()
