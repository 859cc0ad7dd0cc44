"""The Explore tab's view-model: live maps for one small input, cached models, maps and predictions, the grid.

The app computes live only for small inputs: one sentence or sentence pair of at most
``MAX_LIVE_TOKENS`` tokens. Everything else comes from precomputed run directories. The maps as displayed
(word level, special tokens hidden) are analysis.stream.displayed_maps; the head classes are
classifier.predict.classify_heads.

Shapes: ``L`` layers, ``H`` heads, ``n`` real tokens (or words) of the input.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from analysis.data import Example, check_unicode
from analysis.errors import AttnpatError, quoted
from analysis.figures import GridLayout, grid_image
from analysis.mapkinds import KIND_NOTES
from analysis.models import load_model, model_files_stamp, with_map_kind
from analysis.stream import Encoded, NoTokenError, displayed_maps, encode_examples, stream_maps
from classifier.predict import classify_heads, load_classifier

MAX_LIVE_TOKENS = 128
# Characters beyond which a text cannot fit MAX_LIVE_TOKENS anyway; rejected before tokenising.
MAX_LIVE_CHARS = 2000


# ---------------------------------------------------------------- loaded models

class ModelCache:
    """Loaded EncoderBundles by name (least recently used dropped beyond ``capacity``); thread-safe.

    ``loader`` is analysis.models.load_model unless a test passes its own. ``allowed`` (when given) returns
    the names a client may ask for; any other name is refused before anything is loaded. ``stamp`` (name ->
    hashable) tells when a model's files were rewritten (a store model fine-tuned again): the cached bundle
    is then loaded afresh.
    """

    def __init__(self, capacity: int = 2, loader: Callable | None = None,
                 allowed: Callable[[], Iterable[str]] | None = None, stamp: Callable[[str], object] | None = None):
        self.capacity = capacity
        self.loader = loader or load_model
        self.allowed = allowed
        self.stamp = stamp or model_files_stamp
        self._bundles: OrderedDict[str, tuple[object, object]] = OrderedDict()  # name -> (bundle, its stamp)
        self._loading: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, name: str):
        if not isinstance(name, str | None):  # the API's model box takes any JSON value
            raise AttnpatError(f"not a model name: {quoted(name)}; pick one from the list")
        name = (name or "").strip()
        if not name:
            raise AttnpatError("no model chosen; pick minilm (the embedded all-MiniLM-L6-v2)")
        if self.allowed is not None:
            offered = list(self.allowed())
            if name not in offered:  # a client may send any string; only listed models are loaded
                raise AttnpatError(f"model {quoted(name)} is not one this app offers ({', '.join(offered)}); "
                                   "start it with `attnpat app --allow-any-model` to load any model")
        stamp = self.stamp(name)
        with self._lock:
            if name in self._bundles and self._bundles[name][1] == stamp:
                self._bundles.move_to_end(name)
                return self._bundles[name][0]
            loading = self._loading.setdefault(name, threading.Lock())
        with loading:  # one load per name: sessions asking for the same model wait for one load, others go on
            with self._lock:
                if name in self._bundles and self._bundles[name][1] == stamp:
                    return self._bundles[name][0]
            bundle = self.loader(name)
            with self._lock:
                self._bundles[name] = (bundle, stamp)
                self._bundles.move_to_end(name)
                while len(self._bundles) > self.capacity:
                    self._bundles.popitem(last=False)
                self._loading.pop(name, None)
            return bundle

    def loaded(self) -> list:
        with self._lock:
            return [bundle for bundle, _ in self._bundles.values()]


# ---------------------------------------------------------------- maps of one input

@dataclass
class LiveMaps:
    """Token-level maps of one input. maps: (L, H, n, n) float32, rows sum to 1; item: its tokenisation."""

    maps: torch.Tensor
    item: Encoded
    predictions: tuple | None = None  # (classes [L][H], probs (L, H, C)) once classified

    @property
    def tokens(self) -> list[str]:
        return self.item.tokens


def live_example(text: str, text_pair: str | None = None) -> Example:
    """Check a user's text (and optional pair) and wrap it as an Example."""
    text = (text or "").strip()
    pair = (text_pair or "").strip() or None
    if not text:
        raise AttnpatError("enter a sentence first (the text box is empty)")
    check_unicode(text, "the sentence")
    if pair is not None:
        check_unicode(pair, "the second sentence")
    if len(text) + len(pair or "") > MAX_LIVE_CHARS:
        raise AttnpatError(f"the input is too long for the live view ({len(text) + len(pair or '')} characters, "
                           f"at most {MAX_LIVE_CHARS}); use a batch job from the Runs tab")
    return Example("live", text, pair)


def sentence_maps(bundle, text: str, text_pair: str | None = None, *, max_tokens: int = MAX_LIVE_TOKENS) -> LiveMaps:
    """Maps of one sentence (pair) through the map stream. Inputs over ``max_tokens`` are rejected, not cut."""
    example = live_example(text, text_pair)
    max_tokens = min(max_tokens, getattr(bundle.tokenizer, "model_max_length", max_tokens) or max_tokens)
    try:
        encoded = encode_examples(bundle.tokenizer, [example], max_tokens)
    except NoTokenError as exc:  # its message names the example by id, which the user never gave
        which = ("sentence", "second sentence")[exc.part]
        raise AttnpatError(f"the {which} gives no token (only spaces or invisible characters)") from None
    if encoded[0].truncated:
        raise AttnpatError(f"the input is longer than {max_tokens} tokens, the live view's limit; shorten it or "
                           "use a batch job from the Runs tab")
    map_batch = next(iter(stream_maps(bundle, [example], max_length=max_tokens, batch_size=1, encoded=encoded)))
    return LiveMaps(map_batch.example_maps(0).contiguous(), map_batch.batch.items[0])


class MapMemo:
    """The last few inputs' LiveMaps, so toggles and head picks do not rerun the model; thread-safe."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._items: OrderedDict[tuple, LiveMaps] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, bundle, text: str, text_pair: str | None) -> LiveMaps:
        kind = getattr(bundle, "map_kind", "weight")
        key = (bundle.name, bundle.revision, kind, (text or "").strip(), (text_pair or "").strip())
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        live = sentence_maps(bundle, text, text_pair)
        with self._lock:
            self._items[key] = live
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return live


# ---------------------------------------------------------------- the Explore view

@dataclass
class ExploreView:
    """What the Explore tab shows for one input.

    maps: (L, H, m, m) as displayed; labels: (m,) tokens or words; classes: [L][H] predicted classes of the
    token-level maps (None without a classifier); probs: (L, H, C) or None; note: why labels are missing.
    """

    grid: object  # PIL image
    layout: GridLayout
    maps: torch.Tensor
    labels: list[str]
    classes: list[list[str]] | None
    probs: np.ndarray | None
    note: str = ""


class ViewClock:
    """Which of one browser session's Explore requests may still be shown: a result is shown only when nothing
    that supersedes it began since, so a slow request cannot replace a newer view (one thread per request).

    A grid request is superseded by a later grid request or a model pick; a head request (the large view) by a
    later head request, a grid request, a model pick, or a grid shown after it began (its grid may be gone).
    Tickets are ints; the grid ticket of a shown grid also lets exactly one head request follow that grid.
    """

    def __init__(self):
        self._grid = 0
        self._head = 0
        self._followed = 0
        self._lock = threading.Lock()

    def __deepcopy__(self, memo) -> ViewClock:
        return ViewClock()  # gr.State deep-copies its initial value for each session: each starts its own clock

    def start_grid(self) -> int:
        """A grid request (or a model pick, which clears the grid) begins: -> its ticket."""
        with self._lock:
            self._grid += 1
            self._head += 1
            return self._grid

    def show_grid(self, ticket: int) -> bool:
        """Whether the grid of ``ticket`` may be shown; if so, head requests begun before it are superseded."""
        with self._lock:
            if ticket != self._grid:
                return False
            self._head += 1
            return True

    def start_head(self) -> int:
        """A head request begins: -> its ticket."""
        with self._lock:
            self._head += 1
            return self._head

    def show_head(self, ticket: int) -> bool:
        with self._lock:
            return ticket == self._head

    def follow(self, grid_ticket: int) -> int | None:
        """A head request that follows the grid of ``grid_ticket`` begins: -> its head ticket, or None when that
        grid is superseded or already followed (a superseded grid's follow-up would otherwise draw a head too)."""
        with self._lock:
            if grid_ticket != self._grid or grid_ticket == self._followed:
                return None
            self._followed = grid_ticket
            self._head += 1
            return self._head


class LiveExplorer:
    """Maps, head classes and the grid for one input, with models, maps and predictions cached in-process.

    classifier_loader: returns an object with ``predict_proba(maps) -> (N, C)``; by default
    classifier.predict.load_classifier. When it is missing or fails, the grid is drawn without classes.
    """

    retry_seconds = 60.0

    def __init__(self, models: ModelCache | None = None, classifier_loader: Callable | None = None):
        self.models = models or ModelCache()
        self.memo = MapMemo()
        self._classifier_loader = classifier_loader or load_classifier
        self._classifier = None
        self._classifier_note = ""
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def classifier(self):
        """The pattern classifier, loaded once; None (with a note) while it is unavailable.

        A failed load is retried after ``retry_seconds``, so a checkpoint trained while the app runs is picked up.
        """
        with self._lock:
            if self._classifier is None and time.monotonic() >= self._retry_at:
                try:
                    self._classifier = self._classifier_loader()
                    self._classifier_note = ""
                except Exception as exc:  # a missing or broken checkpoint must not take the grid down with it
                    reason = str(exc) if isinstance(exc, AttnpatError) else f"{type(exc).__name__}: {exc}"
                    self._classifier_note = (f"pattern classifier unavailable ({reason}); "
                                             "heads are shown without classes")
                    self._retry_at = time.monotonic() + self.retry_seconds
            return self._classifier

    @property
    def classifier_note(self) -> str:
        return self._classifier_note

    def predictions(self, live: LiveMaps) -> tuple[list[list[str]] | None, np.ndarray | None]:
        """Classes of every head of ``live`` (token-level maps, as the classifier was trained), cached."""
        classifier = self.classifier()
        if classifier is None:
            return None, None
        if live.predictions is None:  # two sessions racing here compute the same answer twice; harmless
            live.predictions = classify_heads(classifier, live.maps)
        return live.predictions

    def live_maps(self, model: str, text: str, text_pair: str | None = None, map_kind: str = "weight") -> LiveMaps:
        """Maps of ``map_kind`` (weight, norm or rollout; analysis.mapkinds) of one input, memoised."""
        for value, box in ((text, "sentence"), (text_pair, "second sentence")):
            if not isinstance(value, str | None):  # the API may send any JSON value
                raise AttnpatError(f"the {box} must be text, got {type(value).__name__} {quoted(value)}")
        bundle = self.models.get(model)
        if map_kind and map_kind != "weight":
            bundle = with_map_kind(bundle, map_kind)
        return self.memo.get(bundle, text, text_pair)

    def explore(self, model: str, text: str, text_pair: str | None = None, *, word_level: bool = False,
                hide_special: bool = False, map_kind: str = "weight", scale_each: bool = False) -> ExploreView:
        """Text to grid: maps of every head, each head's predicted class, the grid image (absolute weights, or
        with ``scale_each`` each map scaled to its own maximum: analysis.figures.grid_image)."""
        live = self.live_maps(model, text, text_pair, map_kind)
        classes, probs = self.predictions(live)
        maps, labels = displayed_maps(live.maps, live.item, word_level=word_level, hide_special=hide_special)
        layout = GridLayout(maps.shape[0], maps.shape[1])
        note = self.classifier_note
        if map_kind and map_kind != "weight":
            note = f"{KIND_NOTES[map_kind]}. {note}".strip()
        grid = grid_image(maps, classes, layout, scale_each=scale_each)
        return ExploreView(grid, layout, maps, labels, classes, probs, note)

    def head_map(self, model: str, text: str, text_pair: str | None, layer: int, head: int, *,
                 word_level: bool = False, hide_special: bool = False,
                 map_kind: str = "weight") -> tuple[np.ndarray, list[str]]:
        """One head's displayed map (m, m) and its labels; layer and head are 0-indexed."""
        live = self.live_maps(model, text, text_pair, map_kind)
        layers, heads = live.maps.shape[:2]
        if not (0 <= layer < layers and 0 <= head < heads):
            raise AttnpatError(f"layer {layer + 1:g}, head {head + 1:g} does not exist: the model has {layers} layers "
                               f"x {heads} heads (1-indexed)")
        maps, labels = displayed_maps(live.maps, live.item, word_level=word_level, hide_special=hide_special)
        return maps[layer, head].numpy(), labels
