"""The one map-streaming path: examples -> length-sorted, dynamically padded batches -> attention maps.

Every analysis reads maps through :func:`stream_maps` (or the model inputs through :func:`iter_batches`
when it runs its own forward pass, e.g. with gradients). Nothing here holds the maps of a whole data set.

Shapes: ``B`` batch, ``L`` layers, ``H`` heads, ``T`` padded length, ``n`` an example's real length.
"""
from __future__ import annotations

import ctypes
import functools
import string
import threading
import weakref
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from analysis.data import Example
from analysis.errors import AttnpatError
from analysis.mapkinds import (
    DEFAULT_MAP_KIND,
    captured_values,
    check_map_kind,
    norm_maps_from_values,
    renormalise_rows,
    rollout_maps,
)
from analysis.progress import progress_bar

DEFAULT_MAX_LENGTH = 128
PUNCTUATION = frozenset(string.punctuation)
# glibc hands blocks above its mmap threshold (at most 32 MiB by default) back to the system when freed, so every
# batch's maps (up to ~150 MiB per copy for MiniLM at 32 x 128 tokens) would arrive in fresh pages that the kernel
# faults in and zeroes. Kept in the heap below this size, a batch reuses the previous batch's memory.
KEPT_FREED_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


_GLIBC_DEFAULT_THRESHOLD = 128 * 1024  # glibc's own M_MMAP_THRESHOLD and M_TRIM_THRESHOLD


@functools.cache
def _libc():
    """glibc's mallopt and malloc_trim, or None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_kept_lock = threading.Lock()
_kept_depth = 0  # map streams running in this process (threads of the web app, nested streams)


@contextmanager
def freed_memory_kept() -> Iterator[bool]:
    """For the block, let this process's allocator keep freed blocks up to :data:`KEPT_FREED_BYTES` for reuse
    instead of returning them to the system (glibc only; elsewhere nothing changes); yields whether it took effect.
    Classifying MiniLM's maps of three tasks takes about 5% less time. When the last such block ends, glibc's
    default thresholds come back and the kept memory goes back to the system: work that follows in the same process
    (the demo's next step, the web app) allocates as a fresh process would (compare after classify peaked at 6.3 GB
    with the thresholds left raised, 2.3 GB alone)."""
    global _kept_depth
    libc = _libc()
    with _kept_lock:
        _kept_depth += 1
        took = libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, KEPT_FREED_BYTES)
                                         and libc.mallopt(_M_TRIM_THRESHOLD, KEPT_FREED_BYTES))
    try:
        yield took
    finally:
        with _kept_lock:
            _kept_depth -= 1
            if libc is not None and _kept_depth == 0:
                libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
                libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
                libc.malloc_trim(0)


@dataclass
class Encoded:
    """One tokenised example (unpadded). ``word_ids[t]`` = word index of token t (None for special tokens);
    ``cut_words``: the (sequence id, word index) of words truncation cut part-way (some of their pieces kept)."""

    index: int
    example_id: str
    input_ids: list[int]
    token_type_ids: list[int] | None
    tokens: list[str]
    word_ids: list[int | None]
    sequence_ids: list[int | None]
    truncated: bool
    cut_words: frozenset[tuple[int, int]] = frozenset()

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class TokenBatch:
    """Padded model inputs for a length-sorted batch.

    input_ids, attention_mask, token_type_ids: (B, T) long; lengths: (B,) long real lengths;
    items: the Encoded examples in batch order; labels: (B,) tensor or None when any label is missing.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None
    lengths: torch.Tensor
    items: list[Encoded]
    labels: torch.Tensor | None

    def model_inputs(self, device: torch.device | None = None) -> dict:
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.token_type_ids is not None:
            inputs["token_type_ids"] = self.token_type_ids
        return {key: value.to(device) for key, value in inputs.items()} if device is not None else inputs

    @property
    def indices(self) -> list[int]:
        return [item.index for item in self.items]


@dataclass
class MapBatch:
    """Attention maps of one batch. attentions: (B, L, H, T, T) float32 on the CPU, rows of padding zeroed
    (maps of the stream's kind: weights, renormalised norms or rollout, see analysis.mapkinds)."""

    attentions: torch.Tensor
    batch: TokenBatch

    def __len__(self) -> int:
        return self.attentions.shape[0]

    def example_maps(self, i: int) -> torch.Tensor:
        """(L, H, n, n): example i's maps cropped to its real tokens."""
        n = int(self.batch.lengths[i])
        return self.attentions[i, :, :, :n, :n]

    def tokens(self, i: int) -> list[str]:
        return self.batch.items[i].tokens


# ---------------------------------------------------------------- tokenising

class NoTokenError(AttnpatError):
    """An example's text (``part`` 0) or text pair (``part`` 1) gives no token; the message names the example, for
    data files. A caller with one input of its own (the web app's Explore) words it for its user instead."""

    def __init__(self, example: Example, part: int):
        name = ("text", "text pair")[part]
        super().__init__(f"example {example.id} has a {name} that gives no token (only spaces or invisible characters)")
        self.part = part


def encode_examples(tokenizer, examples: Sequence[Example], max_length: int = DEFAULT_MAX_LENGTH) -> list[Encoded]:
    """Tokenise examples with truncation (longest segment first); ``truncated`` marks the ones cut.

    Empty text raises AttnpatError: an empty input has no map worth analysing.
    """
    if max_length < 4:
        raise AttnpatError(f"maximum length must be at least 4 tokens, got {max_length}")
    limit = getattr(tokenizer, "model_max_length", 512) or 512
    if max_length > min(limit, 4096):
        raise AttnpatError(f"maximum length {max_length} exceeds the model's limit of {limit} tokens")
    encoded = []
    for index, example in enumerate(examples):
        if not isinstance(example.text, str) or not example.text.strip():
            raise AttnpatError(f"example {example.id} has empty text")
        if example.text_pair is not None and not str(example.text_pair).strip():
            raise AttnpatError(f"example {example.id} has an empty text pair")
        if example.words is not None:
            args, kwargs = (list(example.words),), {"is_split_into_words": True}
        else:
            args = (example.text,) if example.text_pair is None else (example.text, example.text_pair)
            kwargs = {}
        full = tokenizer(*args, truncation=False, verbose=False, **kwargs)
        enc = tokenizer(*args, truncation=True, max_length=max_length, **kwargs)
        ids = enc["input_ids"]
        untruncated = full.sequence_ids()
        for part in (0, 1):  # zero-width or direction marks only: no token
            if (part == 0 or example.text_pair is not None) and part not in untruncated:
                raise NoTokenError(example, part)
        encoded.append(Encoded(
            index=index,
            example_id=example.id,
            input_ids=ids,
            token_type_ids=enc.get("token_type_ids"),
            tokens=tokenizer.convert_ids_to_tokens(ids),
            word_ids=enc.word_ids(),
            sequence_ids=enc.sequence_ids(),
            truncated=len(full["input_ids"]) > len(ids),
            cut_words=cut_words(full, enc),
        ))
    return encoded


def structural_token_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's special tokens ([CLS], [SEP], [PAD], [MASK], ...) except [UNK], which stands for
    real text the vocabulary lacks."""
    return sorted(set(tokenizer.all_special_ids) - {tokenizer.unk_token_id})


def text_tokens(tokenizer, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the positions whose token is text, not a special token (:func:`structural_token_ids`).
    input_ids: (B, T) long. Padding positions are special ([PAD]), so they are never text."""
    return ~torch.isin(input_ids, torch.tensor(structural_token_ids(tokenizer), dtype=input_ids.dtype))


def check_has_text(tokenizer, encoded: Sequence[Encoded]) -> None:
    """Refuse an example whose tokens are all special tokens: a text such as "[SEP]" or "[CLS] [SEP]" is
    tokenised as the special tokens themselves, so the statistics over it would describe only the tokenizer's
    frame and the masked-language-model loss would have no token to mask (a silent zero gradient)."""
    special = set(structural_token_ids(tokenizer))
    for item in encoded:
        if all(token in special for token in item.input_ids):
            raise AttnpatError(f"example {item.example_id} has only special tokens ({' '.join(item.tokens)}), no "
                               "text to analyse")


def check_marks_cls_and_sep(tokenizer, encoded: Sequence[Encoded], verb: str) -> None:
    """Refuse a tokenizer that names no [CLS] or [SEP] token (<s>, </s> for RoBERTa-style ones), or inputs it does
    not mark with them: attention to the token would read 0 for every head, a figure of nothing, not a finding.
    verb names the command in the message."""
    for role, name in (("[CLS]", "cls_token"), ("[SEP]", "sep_token")):
        token_id = getattr(tokenizer, f"{name}_id", None)
        if token_id is None:
            raise AttnpatError(f"the tokenizer names no {role} token ({name} is unset), so attention to {role} cannot "
                               f"be measured; {verb} needs a tokenizer that marks its inputs with [CLS] and [SEP]")
        unmarked = next((item for item in encoded if token_id not in item.input_ids), None)
        if unmarked is not None:
            raise AttnpatError(f"example {unmarked.example_id} has no {role} token ({getattr(tokenizer, name)}) "
                               f"after tokenising ({' '.join(unmarked.tokens)}), so attention to {role} cannot be "
                               "measured")


def cut_words(full, enc) -> frozenset[tuple[int, int]]:
    """(sequence id, word index) of the words of which ``enc`` (truncated) keeps fewer pieces than ``full``."""
    pieces = Counter(zip(full.sequence_ids(), full.word_ids(), strict=True))
    kept = Counter(zip(enc.sequence_ids(), enc.word_ids(), strict=True))
    return frozenset(key for key, count in kept.items() if key[1] is not None and count < pieces[key])


def check_batch_size(batch_size: int) -> int:
    """The one rule for a batch size (every verb's --batch-size): a positive integer."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise AttnpatError(f"batch size must be positive, got {batch_size}")
    return batch_size


def length_sorted_batches(encoded: Sequence[Encoded], batch_size: int) -> list[list[Encoded]]:
    """Group examples of similar length so padding stays small; original order is kept within ties."""
    check_batch_size(batch_size)
    ordered = sorted(encoded, key=lambda item: (len(item), item.index))
    return [ordered[start:start + batch_size] for start in range(0, len(ordered), batch_size)]


def collate(items: Sequence[Encoded], pad_id: int, labels: Sequence | None = None) -> TokenBatch:
    """Pad to the longest item in the batch (dynamic padding)."""
    width = max(len(item) for item in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    has_types = items[0].token_type_ids is not None
    token_type_ids = torch.zeros((len(items), width), dtype=torch.long) if has_types else None
    for row, item in enumerate(items):
        n = len(item)
        input_ids[row, :n] = torch.tensor(item.input_ids)
        attention_mask[row, :n] = 1
        if has_types:
            token_type_ids[row, :n] = torch.tensor(item.token_type_ids)
    lengths = attention_mask.sum(1)
    label_tensor = None
    if labels is not None and all(labels[item.index] is not None for item in items):
        values = [labels[item.index] for item in items]
        dtype = torch.float if any(isinstance(v, float) and not float(v).is_integer() for v in values) else torch.long
        label_tensor = torch.tensor(values, dtype=dtype)
    return TokenBatch(input_ids, attention_mask, token_type_ids, lengths, list(items), label_tensor)


def iter_batches(bundle, examples: Sequence[Example], *, max_length: int = DEFAULT_MAX_LENGTH,
                 batch_size: int = 32, encoded: Sequence[Encoded] | None = None) -> Iterator[TokenBatch]:
    """Length-sorted, dynamically padded model inputs (on the CPU)."""
    encoded = encoded if encoded is not None else encode_examples(bundle.tokenizer, examples, max_length)
    pad_id = bundle.tokenizer.pad_token_id if bundle.tokenizer.pad_token_id is not None else 0
    labels = [example.label for example in examples]
    for items in length_sorted_batches(encoded, batch_size):
        yield collate(items, pad_id, labels)


# ---------------------------------------------------------------- maps

def forward_attentions(model: torch.nn.Module, batch: TokenBatch, device: torch.device) -> tuple[torch.Tensor, object]:
    """Run the model and return (attentions (B, L, H, T, T) on ``device``, model outputs)."""
    outputs = model(**batch.model_inputs(device), output_attentions=True)
    attentions = getattr(outputs, "attentions", None)
    if not attentions:
        raise AttnpatError(
            "the model returned no attention maps; it must be loaded with attn_implementation='eager' "
            "(transformers' SDPA attention silently returns none)"
        )
    return torch.stack(attentions, dim=1), outputs


def forward_maps(model: torch.nn.Module, batch: TokenBatch, device: torch.device, kind: str = "weight") -> torch.Tensor:
    """Run the model and return maps of ``kind`` (analysis.mapkinds) as (B, L, H, T, T) on ``device``.

    weight: the attention weights; norm: Kobayashi's ||alpha f(x)|| per head from the same pass (the value
    projections' outputs are recorded by hooks), rows renormalised; rollout: Abnar & Zuidema's rollout per layer,
    repeated over the layer's heads.
    """
    if kind == "norm":
        with captured_values(model) as values:
            attentions, _ = forward_attentions(model, batch, device)
        return norm_maps_from_values(model, attentions, values)
    attentions, _ = forward_attentions(model, batch, device)
    if kind == "rollout":
        return rollout_maps(attentions, batch.attention_mask.to(attentions.device).bool())
    return attentions


def stream_maps(bundle, examples: Sequence[Example], *, max_length: int = DEFAULT_MAX_LENGTH,
                batch_size: int = 32, progress: bool | str = False,
                encoded: Sequence[Encoded] | None = None, map_kind: str | None = None) -> Iterator[MapBatch]:
    """Yield MapBatch objects for ``examples`` in length-sorted order (see ``MapBatch.batch.items``).

    map_kind: weight, norm or rollout (analysis.mapkinds); default: the bundle's own ``map_kind`` (weight for a
    plain bundle). Padding rows (query positions past an example's length) are zeroed so that any sum over a
    batch equals the sum over the real tokens; padding columns already get zero weight from the mask.
    """
    kind = check_map_kind(map_kind or getattr(bundle, "map_kind", DEFAULT_MAP_KIND))
    encoded = encoded if encoded is not None else encode_examples(bundle.tokenizer, examples, max_length)
    bar = progress_bar(len(encoded), progress, "maps")
    with freed_memory_kept(), torch.inference_mode():
        for batch in iter_batches(bundle, examples, max_length=max_length, batch_size=batch_size, encoded=encoded):
            attentions = forward_maps(bundle.model, batch, bundle.device, kind)
            query_mask = batch.attention_mask.to(attentions.device)[:, None, None, :, None]
            attentions = attentions.mul_(query_mask).float().cpu()  # in place: the maps are this pass's own copy
            yield MapBatch(attentions, batch)
            if bar is not None:
                bar.update(len(batch.items))
    if bar is not None:
        bar.close()


def token_roles(tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean selector masks over token positions, matched by id and position, not by string.

    input_ids, attention_mask: (B, T). Returns {"cls", "sep", "punct", "period", "comma", "real"}: (B, T) bool.
    """
    real = attention_mask.bool()
    cls = (input_ids == tokenizer.cls_token_id) & real if tokenizer.cls_token_id is not None else torch.zeros_like(real)
    sep = (input_ids == tokenizer.sep_token_id) & real if tokenizer.sep_token_id is not None else torch.zeros_like(real)
    vocab_text = _token_texts(tokenizer)
    period_ids = [i for i, text in vocab_text.items() if text == "."]
    comma_ids = [i for i, text in vocab_text.items() if text == ","]
    punct_ids = [i for i, text in vocab_text.items() if text and all(ch in PUNCTUATION for ch in text)]
    return {
        "cls": cls,
        "sep": sep,
        "period": torch.isin(input_ids, torch.tensor(period_ids, dtype=input_ids.dtype)) & real,
        "comma": torch.isin(input_ids, torch.tensor(comma_ids, dtype=input_ids.dtype)) & real,
        "punct": torch.isin(input_ids, torch.tensor(punct_ids, dtype=input_ids.dtype)) & real & ~cls & ~sep,
        "real": real,
    }


# keyed by the tokenizer object itself, held weakly: an id() key would be reused by the next tokenizer made
# after one is freed, which then read the old vocabulary's punctuation ids
_TOKEN_TEXT_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_texts(tokenizer) -> dict[int, str]:
    """Vocabulary id -> surface text without word-boundary markers (##, Ġ, ▁); cached per tokenizer."""
    texts = _TOKEN_TEXT_CACHE.get(tokenizer)
    if texts is None:
        texts = {index: token.lstrip("Ġ▁").removeprefix("##") for token, index in tokenizer.get_vocab().items()}
        _TOKEN_TEXT_CACHE[tokenizer] = texts
    return texts


# ---------------------------------------------------------------- word-level maps

def word_groups(item: Encoded) -> tuple[np.ndarray, list[str]]:
    """Token -> word-group index (T,), and the group labels. Special tokens form their own groups;
    words of the second segment are numbered after the first segment's."""
    groups, labels, last_key = [], [], None
    for position, (word, sequence) in enumerate(zip(item.word_ids, item.sequence_ids)):
        key = ("special", position) if word is None else (sequence, word)
        if key != last_key:
            labels.append(item.tokens[position] if word is None else "")
            last_key = key
        groups.append(len(labels) - 1)
        if word is not None:
            labels[-1] += piece_text(item.tokens[position])
    return np.asarray(groups), labels


def piece_text(token: str) -> str:
    """A word piece's text without its word-boundary marker (##, Ġ, ▁), as word labels join them."""
    return token[2:] if token.startswith("##") else token.lstrip("Ġ▁")


def to_word_level(attn: torch.Tensor, groups: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Token-level maps to word-level maps (Clark et al.).

    attn: (..., n, n) rows summing to 1; groups: (n,) word index of each token (0..W-1, every word present).
    Attention TO a word = sum over its pieces; FROM a word = mean over its pieces. Returns (..., W, W);
    every row still sums to 1.
    """
    groups = torch.as_tensor(groups, dtype=torch.long, device=attn.device)
    n = attn.shape[-1]
    if groups.shape != (n,):
        raise AttnpatError(f"word groups of shape {tuple(groups.shape)} do not match maps of length {n}")
    num_words = int(groups.max()) + 1
    membership = torch.zeros((num_words, n), dtype=attn.dtype, device=attn.device)
    membership[groups, torch.arange(n, device=attn.device)] = 1.0
    to_words = attn @ membership.T  # (..., n, W): sum over the pieces of each key word
    mean_rows = membership / membership.sum(1, keepdim=True)
    return mean_rows @ to_words  # (..., W, W): mean over the pieces of each query word


# ---------------------------------------------------------------- one example's maps as shown

def drop_positions(maps: torch.Tensor, keep: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Remove rows and columns not in ``keep`` and renormalise each row to sum to 1.

    maps: (..., n, n); keep: (n,) bool. Returns (..., k, k). Renormalising shows how the remaining
    weight is spread among the kept tokens (a row that was all on [SEP] becomes its leftover spread).
    """
    keep = torch.as_tensor(np.asarray(keep, dtype=bool))
    if not bool(keep.any()):
        raise AttnpatError("nothing left to show after hiding the special tokens")
    index = torch.nonzero(keep).squeeze(1)
    return renormalise_rows(maps.index_select(-1, index).index_select(-2, index))


def displayed_maps(maps: torch.Tensor, item: Encoded, *, word_level: bool = False,
                   hide_special: bool = False) -> tuple[torch.Tensor, list[str]]:
    """One example's maps as displayed: optionally word-level (Clark et al. pooling), optionally without the
    special tokens (rows renormalised: :func:`drop_positions`).

    maps: (L, H, n, n) token-level, n = the example's tokens; item: its tokenisation. Returns (maps (L, H, m, m),
    labels (m,)), m = tokens or words shown.
    """
    labels = list(item.tokens)
    special = np.array([word is None for word in item.word_ids], dtype=bool)
    if word_level:
        groups, labels = word_groups(item)
        maps = to_word_level(maps, groups)
        # a group is special when its tokens are (special tokens form their own groups)
        special = np.array([special[groups == g].all() for g in range(len(labels))], dtype=bool)
    if hide_special:
        maps = drop_positions(maps, ~special)
        labels = [label for label, is_special in zip(labels, special) if not is_special]
    return maps, labels
