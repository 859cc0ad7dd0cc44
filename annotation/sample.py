"""Sample single-head maps for annotation, stratified over tasks, layers, heads and examples.

A sample folder holds the raw float maps (the source of truth that labels join back to) and the
rendered PNGs annotators look at:

  <folder>/index.jsonl   one row per map: map_id, task, example_id, layer, head, n, tokens, image
  <folder>/maps.npz      attn (sum n*n,) float32 concatenated maps, lengths (N,), map_ids (N,)
  <folder>/png/<file>.png

map_id = "<model-slug>:<task>:<example_id>:L<layer>H<head>" (0-indexed), unique and stable, so pushing
the same sample again never creates a second task for a map.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from analysis.data import load_task
from analysis.errors import AttnpatError
from analysis.figures import close, map_figure
from analysis.rundir import atomic_write, atomic_write_text
from analysis.stream import stream_maps

DEFAULT_TASKS = ("sst2", "mrpc", "rte", "wiki")


@dataclass
class SampledMap:
    map_id: str
    task: str
    example_id: str
    layer: int
    head: int
    tokens: list[str]
    attn: np.ndarray  # (n, n) float32

    @property
    def image_name(self) -> str:
        return self.map_id.replace(":", "__") + ".png"

    def index_row(self) -> dict:
        row = asdict(self)
        row.pop("attn")
        row.update(n=len(self.tokens), image=f"png/{self.image_name}")
        return row


def make_map_id(model_slug: str, task: str, example_id: str, layer: int, head: int) -> str:
    return f"{model_slug}:{task}:{example_id}:L{layer}H{head}"


def plan_cells(num_layers: int, num_heads: int, per_task: int, n_examples: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """(example_position, layer, head) triples: heads are covered round-robin in a shuffled order, so every
    head appears before any appears twice; examples are spread evenly over the draws."""
    heads = [(layer, head) for layer in range(num_layers) for head in range(num_heads)]
    cells = []
    while len(cells) < per_task:
        order = heads[:]
        rng.shuffle(order)
        cells.extend(order[: per_task - len(cells)])
    examples = [i % n_examples for i in range(per_task)]
    rng.shuffle(examples)
    triples, seen = [], set()
    for example, (layer, head) in zip(examples, cells):
        while (example, layer, head) in seen:  # the same head of the same example twice: move to the next example
            example = (example + 1) % n_examples
        seen.add((example, layer, head))
        triples.append((example, layer, head))
    return triples


def draw_examples(task: str, count: int, rng: random.Random, seed: int) -> list:
    """``count`` random examples of ``task`` (wiki: drawn from its first max(2 * count, 200) seeded segments)."""
    data = load_task(task, n=None if task != "wiki" else max(count * 2, 200), seed=seed)
    chosen = rng.sample(range(len(data.examples)), min(count, len(data.examples)))
    return [data.examples[i] for i in chosen]


def sample_maps(bundle, *, n_maps: int = 480, tasks: Sequence[str] = DEFAULT_TASKS, seed: int = 0,
                examples_per_task: int = 60, max_length: int = 128) -> Iterator[SampledMap]:
    """Yield ``n_maps`` maps split evenly over ``tasks`` (stratified over layers, heads and examples)."""
    if n_maps < len(tasks):
        raise AttnpatError(f"--count {n_maps} is smaller than the number of tasks ({len(tasks)})")
    rng = random.Random(seed)
    for position, task in enumerate(tasks):
        per_task = n_maps // len(tasks) + (1 if position < n_maps % len(tasks) else 0)
        examples = draw_examples(task, examples_per_task, rng, seed)
        cells = plan_cells(bundle.num_layers, bundle.num_heads, per_task, len(examples), rng)
        wanted: dict[int, list[tuple[int, int]]] = {}
        for example, layer, head in cells:
            wanted.setdefault(example, []).append((layer, head))
        for batch in stream_maps(bundle, examples, max_length=max_length, batch_size=16):
            for i, item in enumerate(batch.batch.items):
                maps = batch.example_maps(i)
                for layer, head in wanted.get(item.index, []):
                    yield SampledMap(make_map_id(bundle.slug, task, item.example_id, layer, head), task,
                                     item.example_id, layer, head, list(item.tokens),
                                     maps[layer, head].numpy().astype(np.float32).copy())


def render_png(sampled: SampledMap, path: Path) -> Path:
    """The annotator's image: the map with [CLS]/[SEP]/'.'/',' marked on the axes."""
    # Long inputs get a bigger canvas so that single-token columns stay visible.
    size = 4.2 if len(sampled.tokens) <= 48 else 6.0
    fig = map_figure(sampled.attn, sampled.tokens, size=size,
                     title=f"{sampled.task} L{sampled.layer + 1} H{sampled.head + 1} (1-indexed)")
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    finally:
        close(fig)
    return path


def write_sample(folder: str | Path, maps: Sequence[SampledMap], *, render: bool = True) -> Path:
    """Write index.jsonl, maps.npz and (optionally) the PNGs; existing PNGs are kept (resumable)."""
    folder = Path(folder)
    if not maps:
        raise AttnpatError("no maps to write")
    ids = [m.map_id for m in maps]
    if len(set(ids)) != len(ids):
        raise AttnpatError("duplicate map ids in a sample")
    if render:
        for sampled in maps:
            target = folder / "png" / sampled.image_name
            if not target.is_file():
                render_png(sampled, target)
    save_maps(folder / "maps.npz", ids, [m.attn for m in maps])
    atomic_write_text(folder / "index.jsonl", "".join(json.dumps(m.index_row()) + "\n" for m in maps))
    return folder


def save_maps(path: Path, map_ids: Sequence[str], maps: Sequence[np.ndarray]) -> Path:
    """Single-head maps of any sizes in one compressed file (no pickles)."""
    arrays = {"attn": np.concatenate([np.asarray(m, np.float32).ravel() for m in maps]),
              "lengths": np.asarray([np.asarray(m).shape[0] for m in maps], np.int32),
              "map_ids": np.asarray(list(map_ids), dtype=str)}

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            np.savez_compressed(handle, **arrays)

    return atomic_write(path, write)


def load_maps(path: Path) -> dict[str, np.ndarray]:
    """map_id -> (n, n) float32 map, from a file written by :func:`save_maps`."""
    try:
        with np.load(path, allow_pickle=False) as data:
            flat, lengths, ids = data["attn"], data["lengths"], data["map_ids"]
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise AttnpatError(f"{path} is not an attnpat map file ({type(exc).__name__})") from exc
    out, offset = {}, 0
    for map_id, n in zip(ids, lengths):
        out[str(map_id)] = flat[offset:offset + n * n].reshape(n, n)
        offset += n * n
    return out


def read_index(folder: str | Path) -> list[dict]:
    path = Path(folder) / "index.jsonl"
    if not path.is_file():
        raise AttnpatError(f"{folder} is not a map sample (no index.jsonl)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ensure_sample(samples_dir: Path, model: str, count: int, tasks: Sequence[str], seed: int = 0,
                  name: str | None = None, max_length: int = 128, log=print, *, stratify_by: str | None = None,
                  class_shares: str | None = None, exclude: Sequence[str | Path] = ()) -> Path:
    """The sample folder for these settings, made (or finished) if needed. A folder made with other
    settings is never overwritten: that raises AttnpatError.

    stratify_by: None = stratified over tasks/layers/heads/examples (:func:`sample_maps`); "rules", "classifier"
    (the shipped checkpoint) or a checkpoint path = stratified by that predictor's class with ``class_shares``
    (:func:`sample_maps_by_prediction`). exclude: labeled-set or sample folders whose maps are never drawn again.
    """
    from analysis.models import load_model, model_slug

    name = name or f"{model_slug(model)}-n{count}-s{seed}"
    folder = Path(samples_dir) / name
    settings = {"model": model, "count": count, "tasks": list(tasks), "seed": seed, "max_length": max_length,
                "stratified_by": str(stratify_by) if stratify_by else None}
    if stratify_by:
        settings.update(class_shares=parse_class_shares(class_shares),
                        exclude=[str(path) for path in exclude])
    settings_file = folder / "sample.json"
    if settings_file.is_file():
        previous = json.loads(settings_file.read_text())
        if {k: previous.get(k) for k in settings} != settings:
            raise AttnpatError(f"sample '{name}' was made with other settings ({previous}); choose --sample")
        if (folder / "index.jsonl").is_file() and (folder / "maps.npz").is_file():
            index = read_index(folder)
            if all((folder / row["image"]).is_file() for row in index):
                return folder
    predict = _predictor(stratify_by) if stratify_by else None
    excluded = set().union(*(_map_ids_in(path) for path in exclude)) if exclude else set()
    bundle = load_model(model)
    atomic_write_text(settings_file, json.dumps({**settings, "revision": bundle.revision}, indent=2))
    if predict is None:
        log(f"sampling {count} maps of {model} over {', '.join(tasks)} into {folder}")
        maps = list(sample_maps(bundle, n_maps=count, tasks=tasks, seed=seed, max_length=max_length))
    else:
        log(f"sampling {count} maps of {model} stratified by {stratify_by} predictions "
            f"({', '.join(f'{k} {v:.2f}' for k, v in settings['class_shares'].items())}) into {folder}")
        maps = sample_maps_by_prediction(bundle, n_maps=count, tasks=tasks, seed=seed, max_length=max_length,
                                         exclude=excluded, predict=predict, shares=settings["class_shares"])
    write_sample(folder, maps)
    return folder


def _predictor(stratify_by: str):
    """'rules' -> the pre-annotator; 'classifier' -> the shipped CNN; anything else -> a checkpoint path."""
    if stratify_by == "rules":
        return rule_predictions
    from classifier.predict import load_classifier

    classifier = load_classifier(None if stratify_by == "classifier" else Path(stratify_by))
    return lambda maps, tokens: classifier.predict(maps)


def _map_ids_in(folder: str | Path) -> set[str]:
    """The map ids of a labeled set (labels.csv) or a sample (index.jsonl)."""
    folder = Path(folder)
    if (folder / "labels.csv").is_file():
        import pandas as pd

        return set(pd.read_csv(folder / "labels.csv", usecols=["map_id"], dtype=str).map_id)
    return {row["map_id"] for row in read_index(folder)}


def rule_predictions(maps: Sequence[np.ndarray], tokens: Sequence[str]) -> list[str]:
    """The rule-based pre-annotator's class for each (n, n) map of one example."""
    from annotation.preannotate import preannotate

    return [preannotate(attn, tokens)[0] for attn in maps]


def parse_class_shares(text: str | None) -> dict[str, float]:
    """'block=3,heterogeneous=3,diagonal=2' -> {class: share}, shares summing to 1 (unnamed classes get 0);
    None or '' -> equal shares."""
    from classifier import CLASSES

    if not text:
        return {name: 1.0 / len(CLASSES) for name in CLASSES}
    weights = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in CLASSES:
            raise AttnpatError(f"unknown class '{name}' in class shares; the classes are {', '.join(CLASSES)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise AttnpatError(f"class share '{part.strip()}' must look like CLASS=NUMBER") from None
        if weights[name] < 0:
            raise AttnpatError(f"class share '{part.strip()}' is negative")
    total = sum(weights.values())
    if total <= 0:
        raise AttnpatError("class shares must not all be zero")
    return {name: weights.get(name, 0.0) / total for name in CLASSES}


def class_quotas(shares: dict[str, float], n_maps: int) -> dict[str, int]:
    """Whole numbers of maps per class that add up to ``n_maps`` (largest remainders get the rest)."""
    exact = {name: share * n_maps for name, share in shares.items()}
    quotas = {name: int(value) for name, value in exact.items()}
    by_remainder = sorted(exact, key=lambda name: exact[name] - quotas[name], reverse=True)
    for name in by_remainder[: n_maps - sum(quotas.values())]:
        quotas[name] += 1
    return quotas


def sample_maps_by_prediction(bundle, *, n_maps: int, tasks: Sequence[str] = DEFAULT_TASKS, seed: int = 0,
                              examples_per_task: int = 40, exclude: set[str] = frozenset(),
                              max_length: int = 128, predict=rule_predictions,
                              shares: dict[str, float] | None = None) -> list[SampledMap]:
    """A supplemental sample stratified by a predicted class, so rare patterns get enough labels.

    predict(maps, tokens) -> class names, for one example's (n, n) maps (default: the rule-based
    pre-annotator; a trained classifier works the same way). shares: class -> fraction of ``n_maps``
    (default equal); within a class, maps are spread over tasks round-robin. The labels still come from
    annotators: the prediction only decides which maps are shown. Maps in ``exclude`` are never drawn.
    A class predicted for fewer maps than its quota gives what it has (the sample is then smaller).
    """
    from classifier import CLASSES

    shares = shares or parse_class_shares(None)
    rng = random.Random(seed)
    pools: dict[str, list[tuple[str, str, object, int, int, np.ndarray]]] = {name: [] for name in CLASSES}
    for task in tasks:
        examples = draw_examples(task, examples_per_task, rng, seed + 1)
        for batch in stream_maps(bundle, examples, max_length=max_length, batch_size=16):
            for i, item in enumerate(batch.batch.items):
                maps = batch.example_maps(i).numpy()
                cells = [(make_map_id(bundle.slug, task, item.example_id, layer, head), layer, head)
                         for layer in range(maps.shape[0]) for head in range(maps.shape[1])]
                cells = [cell for cell in cells if cell[0] not in exclude]
                labels = predict([maps[layer, head] for _, layer, head in cells], item.tokens)
                for (map_id, layer, head), label in zip(cells, labels):
                    pools[label].append((map_id, task, item, layer, head, maps[layer, head].copy()))
    quotas = class_quotas(shares, n_maps)
    picked = []
    for name in CLASSES:
        pool = pools[name]
        rng.shuffle(pool)
        by_task: dict[str, list] = {}
        for entry in pool:
            by_task.setdefault(entry[1], []).append(entry)
        round_robin = [e for group in zip(*by_task.values()) for e in group] if by_task else []
        in_round_robin = {e[0] for e in round_robin}
        leftovers = [e for e in pool if e[0] not in in_round_robin]
        picked.extend((round_robin + leftovers)[:quotas[name]])
    rng.shuffle(picked)
    return [SampledMap(map_id, task, item.example_id, layer, head, list(item.tokens), attn.astype(np.float32))
            for map_id, task, item, layer, head, attn in picked]
