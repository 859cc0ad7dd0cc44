"""Annotation samples: single-head maps drawn from a model (or from saved map files), rendered for annotators.

A sample folder holds the raw float maps (the source of truth that labels join back to) and the
rendered PNGs annotators look at:

  <folder>/index.jsonl   one row per map: map_id, task, example_id, layer, head, n, tokens, image, and truncated
                         (true: the input was cut at max_length tokens; null: not known, maps read from files)
  <folder>/maps.npz      the maps with their tokens, in the one map format (analysis.mapstore)
  <folder>/png/<file>.png
  <folder>/sample.json   the settings it was drawn with

Map ids follow analysis.mapstore.make_map_id, unique and stable, so pushing the same sample again never
creates a second task for a map. The drawing itself is analysis.sampling.
"""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict
from pathlib import Path

from analysis.data import check_task, json_lines
from analysis.errors import AttnpatError
from analysis.mapstore import iter_map_groups, make_map_id, read_single_maps, write_single_maps
from analysis.models import load_model, model_slug
from analysis.rendering import check_attention_map, render_map
from analysis.rundir import atomic_write, atomic_write_text, read_json
from analysis.sampling import (
    Predictor,
    SampledMap,
    parse_class_shares,
    plan_cells,
    sample_maps,
    sample_maps_by_prediction,
)
from annotation.dataset import read_text_table


def image_name(sampled: SampledMap) -> str:
    return sampled.map_id.replace(":", "__") + ".png"


def index_row(sampled: SampledMap) -> dict:
    """The map's row of index.jsonl (everything but the map itself)."""
    row = asdict(sampled)
    row.pop("attn")
    row.update(n=len(sampled.tokens), image=f"png/{image_name(sampled)}")
    return row


def render_png(sampled: SampledMap, path: Path) -> Path:
    """The annotator's image, drawn as the labeling guideline says (analysis.rendering.render_map)."""
    image = render_map(sampled.attn, sampled.tokens)
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
    return path


def check_drawable(maps: Sequence[SampledMap]) -> None:
    """An AttnpatError naming the first map render_map cannot draw as attention weights (see
    analysis.rendering.check_attention_map): checked before the first image is written, not halfway through."""
    for sampled in maps:
        try:
            check_attention_map(sampled.attn, sampled.tokens)
        except AttnpatError as exc:
            raise AttnpatError(f"map {sampled.map_id}: {exc}") from None


def write_sample(folder: str | Path, maps: Sequence[SampledMap], *, render: bool = True) -> Path:
    """Write index.jsonl, maps.npz and (optionally) the PNGs; existing PNGs are kept (resumable)."""
    folder = Path(folder)
    if not maps:
        raise AttnpatError("no maps to write")
    ids = [m.map_id for m in maps]
    if len(set(ids)) != len(ids):
        raise AttnpatError("duplicate map ids in a sample")
    check_drawable(maps)
    if render:
        for sampled in maps:
            target = folder / "png" / image_name(sampled)
            if not target.is_file():
                render_png(sampled, target)
    write_single_maps(folder / "maps.npz", {m.map_id: m.attn for m in maps}, {m.map_id: m.tokens for m in maps})
    atomic_write_text(folder / "index.jsonl", "".join(json.dumps(index_row(m)) + "\n" for m in maps))
    return folder


# what push and pull read from each index.jsonl row (index_row writes them, and the tokens)
INDEX_FIELDS = frozenset({"map_id", "image", "task", "example_id", "layer", "head", "n", "tokens"})


def read_index(folder: str | Path) -> list[dict]:
    path = Path(folder) / "index.jsonl"
    if not path.is_file():
        raise AttnpatError(f"{folder} is not a map sample (no index.jsonl)")
    rows = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for number, row in json_lines(text, lambda number, reason: f"{path} line {number} is damaged ({reason}); "
                                                               "delete the sample folder to draw it again"):
        if not isinstance(row, dict) or not INDEX_FIELDS <= set(row):
            raise AttnpatError(f"{path} line {number} is not a sample row ({', '.join(sorted(INDEX_FIELDS))}); "
                               "delete the sample folder to draw it again")
        rows.append(row)
    return rows


def read_sample(folder: str | Path, images: bool = False) -> tuple[list[dict], dict]:
    """A sample folder's index rows and its maps (map_id -> (n, n)), checked to agree: every row's map is in
    maps.npz and, with ``images``, its PNG is there (a folder written half, or edited, is one error, before a
    server is contacted)."""
    folder = Path(folder)
    rows = read_index(folder)
    if not (folder / "maps.npz").is_file():
        raise AttnpatError(f"{folder} has no maps.npz; delete the sample folder to draw it again")
    maps = read_single_maps(folder / "maps.npz")
    unmapped = [row["map_id"] for row in rows if row["map_id"] not in maps]
    if unmapped:
        raise AttnpatError(f"{folder / 'index.jsonl'} lists {len(unmapped)} maps that {folder / 'maps.npz'} lacks "
                           f"(first: {unmapped[0]}); delete the sample folder to draw it again")
    unseen = [row["image"] for row in rows if images and not (folder / str(row["image"])).is_file()]
    if unseen:
        raise AttnpatError(f"{folder} lacks {len(unseen)} of its images (first: {unseen[0]}); delete the sample "
                           "folder to draw it again")
    return rows, maps


def sample_saved_maps(path: str | Path, n_maps: int, seed: int = 0,
                      exclude: AbstractSet[str] = frozenset()) -> list[SampledMap]:
    """``n_maps`` single-head maps drawn from map files written by `attnpat extract` (a file or a folder):
    heads covered round-robin in a shuffled order and examples spread evenly, as analysis.sampling.sample_maps
    does on a model, none of whose map ids is in ``exclude``. Each file is read twice (to plan, then to pick),
    so memory holds one file at a time."""
    shapes, sources = [], []
    for group in iter_map_groups(path):
        layers, heads = group.grid().shape[:2]  # raises for single-head maps (a sample or a labeled set)
        shapes.append((layers, heads))
        sources.append((group.model, group.task, group.example_id))
    if len(set(shapes)) != 1:
        raise AttnpatError(f"{path} holds maps of models with different numbers of layers or heads")
    (layers, heads), rng = shapes[0], random.Random(seed)

    def excluded(example: int, layer: int, head: int) -> bool:
        return make_map_id(*sources[example], layer, head) in exclude

    wanted: dict[int, list[tuple[int, int]]] = {}
    for example, layer, head in plan_cells(layers, heads, n_maps, len(shapes), rng, excluded if exclude else None):
        wanted.setdefault(example, []).append((layer, head))
    picked = []
    for position, group in enumerate(iter_map_groups(path)):
        grid = group.grid()
        for layer, head in wanted.get(position, []):
            picked.append(SampledMap(make_map_id(group.model, group.task, group.example_id, layer, head), group.task,
                                     group.example_id, layer, head, list(group.tokens or []),
                                     grid[layer, head].copy()))
    rng.shuffle(picked)
    return picked


def ensure_sample(samples_dir: Path, model: str, count: int, tasks: Sequence[str], seed: int = 0,
                  name: str | None = None, max_length: int = 128, log=print, *, stratify_by: str | None = None,
                  predict: Predictor | None = None, class_shares: str | None = None,
                  exclude: Sequence[str | Path] = (), maps: str | Path | None = None,
                  before_drawing: Callable[[], object] | None = None) -> Path:
    """The sample folder for these settings, made (or finished) if needed. A folder made with other
    settings is never overwritten: that raises AttnpatError.

    Maps are drawn from ``model`` stratified over tasks/layers/heads/examples (analysis.sampling.sample_maps),
    or, with ``stratify_by`` (the predictor's name, recorded in sample.json) and ``predict``, by predicted
    class with ``class_shares`` (analysis.sampling.sample_maps_by_prediction). exclude: labeled-set or
    sample folders whose maps are never drawn again, however the sample is drawn. maps: map files written by
    `attnpat extract` to draw from instead of a model (:func:`sample_saved_maps`). before_drawing: called once the
    settings are checked, before any map is drawn (push checks its server there).
    """
    if count < 1:
        raise AttnpatError(f"--count {count}: a sample needs 1 map or more")
    if name is not None and (Path(name).name != name or name in ("", ".", "..")):
        raise AttnpatError(f"--sample '{name}' must be a plain folder name (no '/', not '..')")
    if class_shares and not stratify_by:
        raise AttnpatError("--class-shares needs --stratify-by (the shares are of predicted classes)")
    if maps is None:
        if not tasks:
            raise AttnpatError("--tasks names no task")
        # one spelling per task: map ids hold the task, and --exclude compares ids
        tasks = [check_task(task) for task in tasks]
        repeated = [task for k, task in enumerate(tasks) if task in tasks[:k]]
        if repeated:  # drawn twice, a task would take two shares of the sample (and could draw a map twice)
            raise AttnpatError(f"--tasks names {repeated[0]} twice")
        if not stratify_by and count < len(tasks):  # a natural sample splits its maps evenly over the tasks
            raise AttnpatError(f"--count {count} is smaller than the number of tasks ({len(tasks)})")
    # Recorded for every stratified sample (as before), and for the others when given, so older samples drawn
    # without it keep their settings.
    excluded_folders = {"exclude": [str(path) for path in exclude]} if exclude else {}
    if maps is not None:
        if stratify_by:
            raise AttnpatError("a sample drawn from saved maps cannot be stratified by a predicted class")
        name = name or f"{Path(maps).resolve().name}-n{count}-s{seed}"
        settings = {"maps": str(Path(maps).resolve()), "count": count, "seed": seed, **excluded_folders}
    else:
        name = name or f"{model_slug(model)}-n{count}-s{seed}"
        settings = {"model": model, "count": count, "tasks": list(tasks), "seed": seed, "max_length": max_length,
                    "stratified_by": str(stratify_by) if stratify_by else None, **excluded_folders}
        if stratify_by:
            if predict is None:
                raise AttnpatError(f"stratifying by {stratify_by} needs its predictor")
            settings.update(class_shares=parse_class_shares(class_shares), exclude=[str(path) for path in exclude])
    folder = Path(samples_dir) / name
    settings_file = folder / "sample.json"
    previous = {}
    if settings_file.is_file():
        previous = read_json(settings_file, "the sample's settings", "delete the sample folder to draw it again")
    if maps is None and not stratify_by:
        settings.update(heads_plan(previous, settings))
    if settings_file.is_file():
        # a sample whose drawing never finished holds no maps yet: new settings may replace it
        if {k: previous.get(k) for k in settings} != settings:
            if (folder / "index.jsonl").is_file():
                raise AttnpatError(f"sample '{name}' was made with other settings ({previous}); choose --sample")
            # its images were rendered from maps of the old settings: kept, they would be pushed for new maps
            shutil.rmtree(folder / "png", ignore_errors=True)
        if (folder / "index.jsonl").is_file() and (folder / "maps.npz").is_file():
            index = read_index(folder)
            if all((folder / row["image"]).is_file() for row in index):
                return folder
    # read before the server is contacted: a bad --exclude is an option to correct, like the others
    excluded = set().union(*(map_ids_in(path) for path in exclude)) if exclude else set()
    check_source(maps, max_length)
    if before_drawing is not None:
        before_drawing()
    if maps is not None:
        log(f"sampling {count} maps from {maps} into {folder}")
        drawn = sample_saved_maps(maps, count, seed, excluded)
        check_drawable(drawn)  # a map file's maps may be anything finite: refused before the sample folder is made
        atomic_write_text(settings_file, json.dumps(settings, indent=2))
        write_sample(folder, drawn)
        return folder
    bundle = load_model(model)
    say_foreign_exclusions(excluded, bundle.slug, exclude, log)
    if previous.get("revision") not in (None, bundle.revision):
        # the model folder changed since this sample was drawn (fine-tuned again): its maps are not this model's
        if (folder / "index.jsonl").is_file():
            raise AttnpatError(f"sample '{name}' was drawn from another revision of {model} "
                               f"({previous['revision']}, now {bundle.revision}); choose --sample")
        shutil.rmtree(folder / "png", ignore_errors=True)  # images of the old maps, as for other settings
    atomic_write_text(settings_file, json.dumps({**settings, "revision": bundle.revision}, indent=2))
    if not stratify_by:
        log(f"sampling {count} maps of {model} over {', '.join(tasks)} into {folder}")
        drawn = list(sample_maps(bundle, n_maps=count, tasks=tasks, seed=seed, max_length=max_length,
                                 exclude=excluded, heads_across_tasks="heads" in settings))
    else:
        log(f"sampling {count} maps of {model} stratified by {stratify_by} predictions "
            f"({', '.join(f'{k} {v:.2f}' for k, v in settings['class_shares'].items())}) into {folder}")
        drawn = sample_maps_by_prediction(bundle, n_maps=count, tasks=tasks, seed=seed, max_length=max_length,
                                          exclude=excluded, predict=predict, shares=settings["class_shares"])
        if not drawn:  # no candidate map of any class given a share: nothing to write, so say which
            asked = [name for name, share in settings["class_shares"].items() if share > 0]
            raise AttnpatError(f"{stratify_by} predicted none of the {count} maps asked for as {' or '.join(asked)}; "
                               "try other --class-shares or another --seed")
        if len(drawn) < count:  # a rare class can have fewer candidate maps than its share
            log(f"the sample holds {len(drawn)} maps, not {count}: {stratify_by} predicted some classes for fewer "
                f"maps than their share; push another --sample with another --seed for more")
    say_truncated(drawn, max_length, log)
    write_sample(folder, drawn)
    return folder


# sample.json's record that one round-robin over the heads spans every task (analysis.sampling.sample_maps)
HEADS_ACROSS_TASKS = {"heads": "one round-robin across the tasks"}


def heads_plan(previous: dict, settings: dict) -> dict:
    """The heads entry of a natural sample's settings: HEADS_ACROSS_TASKS, except for a sample drawn before it
    existed with these settings (its sample.json has no 'heads'), which is finished with the plan it began with."""
    if previous and "heads" not in previous and {k: previous.get(k) for k in settings} == settings:
        return {}
    return HEADS_ACROSS_TASKS


def say_foreign_exclusions(excluded: AbstractSet[str], slug: str, folders: Sequence[str | Path], log) -> None:
    """Log when --exclude holds no map of the model drawn from (map ids begin '<model>:'): it then excludes
    nothing, which a user who named another model's labeled sets should hear."""
    if excluded and not any(map_id.startswith(f"{slug}:") for map_id in excluded):
        models = sorted({map_id.split(":", 1)[0] for map_id in excluded})
        log(f"note: --exclude {', '.join(map(str, folders))} holds maps of {', '.join(models)} only, none of {slug}: "
            "it excludes nothing from this sample")


def say_truncated(drawn: Sequence[SampledMap], max_length: int, log) -> None:
    """Log how many drawn maps are of inputs cut at ``max_length`` tokens (annotators see it in each caption)."""
    cut = sum(bool(sampled.truncated) for sampled in drawn)
    if cut:
        log(f"{cut} of the {len(drawn)} maps are of inputs longer than --max-length {max_length} tokens, cut to fit; "
            "their captions and index.jsonl rows say truncated")


def check_source(maps: str | Path | None, max_length: int) -> None:
    """AttnpatError for a source that cannot be drawn from, found before the server is contacted or a model loaded:
    ``maps`` missing or not whole examples (a sample's or labeled set's single-head maps.npz), or a --max-length
    below the 4 tokens analysis.stream takes."""
    if maps is not None:
        first = next(iter_map_groups(maps), None)  # one file read: the others are checked as they are drawn
        if first is None:
            raise AttnpatError(f"--maps {maps} holds no maps")
        if len(first.heads) == 1:
            raise AttnpatError(f"--maps {maps} holds maps of single heads (a sample or a labeled set); draw from the "
                               "map files `attnpat extract` writes, which hold every head of each example")
    elif max_length < 4:
        raise AttnpatError(f"--max-length {max_length}: an input needs at least 4 tokens")


def map_ids_in(folder: str | Path) -> set[str]:
    """The map ids of a labeled set (labels.csv), a sample (index.jsonl), or every labeled set and sample
    anywhere under a folder of them (e.g. annotation/labeled)."""
    folder = Path(folder)
    if not folder.exists():
        raise AttnpatError(f"--exclude {folder} does not exist (a labeled set, a sample, or a folder of them)")
    if (folder / "labels.csv").is_file():
        return set(read_text_table(folder / "labels.csv", ("map_id",)).map_id)
    if (folder / "index.jsonl").is_file() or not folder.is_dir():
        return {row["map_id"] for row in read_index(folder)}
    inside = sorted({path.parent for name in ("labels.csv", "index.jsonl") for path in folder.rglob(name)})
    if not inside:
        raise AttnpatError(f"{folder} holds no labeled set (labels.csv) or map sample (index.jsonl) to exclude")
    return set().union(*(map_ids_in(path) for path in inside))
