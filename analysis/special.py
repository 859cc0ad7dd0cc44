"""Attention to special tokens and to linguistic features (Kovaleva et al. Figures 6-7, section 4.4).

- to [CLS] / to [SEP]: per head, the attention mass on those tokens, averaged over the real query rows
  of an example and then over examples.
- last layer's [CLS] row: averaged over the last layer's heads, which tokens [CLS] attends to most
  (mean weight a token receives when it occurs, and how often it occurs), with a bootstrap 95% interval that
  resamples inputs (a token's occurrences in one input are no independent trials; TokenTally).
- linguistic features (section 4.4): for one occurrence of a feature (e.g. a negation word), the
  attention it receives from every token, summed and divided by the input length; the maximum over the
  occurrences in an input; averaged over the inputs that have the feature (inputs without it are
  skipped). Each feature's strongest head is reported twice: in-sample (the best of every head, so its own
  interval is optimistic) and held out (picked on the even-numbered inputs, its mean and interval over the
  odd-numbered ones, as probe-dep does; strongest_heads). Occurrences are token *positions* (via word ids or
  character offsets), never string matches over the whole input.

POS / dependency features (noun, verb, pronoun, subject, object) come from the offline English pipeline
(analysis.parsing: spaCy en_core_web_sm 3.8.0, installed by the set-up), aligned from its words to word
pieces by character offsets; without it they are reported as unavailable and only negation is computed.
"""
from __future__ import annotations

import unicodedata
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from scipy import sparse

from analysis.compare import check_same_shape, check_same_tokenizer
from analysis.data import Example
from analysis.errors import AttnpatError
from analysis.figures import close, panel_heatmaps
from analysis.parsing import NOT_INSTALLED, PIPELINE_NAME, spacy_tagger  # noqa: F401 (spacy_tagger: the CLI's tagger)
from analysis.probing import HELD_OUT, SELECTION, sentence_half
from analysis.rundir import long_table
from analysis.stats import HeadMeans, attention_to
from analysis.stream import (
    DEFAULT_MAX_LENGTH,
    Encoded,
    MapBatch,
    check_has_text,
    check_marks_cls_and_sep,
    encode_examples,
    piece_text,
    stream_maps,
    structural_token_ids,
    token_roles,
    word_groups,
)
from analysis.uncertainty import EXAMPLE_INTERVAL, bootstrap_sparse_ratio_interval, bootstrap_weighted_mean_interval

# Kovaleva et al. do not print their full list; this is the common negation-cue set we use (documented in
# the README): single words plus the n't contraction, matched per word position.
NEGATION_WORDS = frozenset({"no", "not", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor",
                            "cannot", "n't"})
TAGGER_FEATURES = ("noun", "verb", "pronoun", "subject", "object")
FEATURES = ("negation",) + TAGGER_FEATURES
UNAVAILABLE = NOT_INSTALLED
APOSTROPHES = ("'", "\u2019")
# how far past the part truncation keeps the tagger reads a cut text: context for the last kept sentence's parse
TAGGER_CONTEXT_CHARS = 1000
# the paired change fine-tuned minus base (write_feature_change): its table and its run-manifest entry
CHANGE_TABLE, CHANGE_ENTRY = "linguistic_change", "special_change"

# A tagger maps a text to (start_char, end_char, features) spans, one per word it tags.
Tagger = Callable[[str], list[tuple[int, int, frozenset]]]


# ---------------------------------------------------------------- pure functions over maps

def special_token_attention(attn: torch.Tensor, roles: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """attn: (B, L, H, T, T); roles from stream.token_roles. Returns {"to_cls", "to_sep"}: (B, L, H), the mean
    over real query rows of the mass on [CLS] / on every [SEP]."""
    return {"to_cls": attention_to(attn, roles["cls"], roles["real"]),
            "to_sep": attention_to(attn, roles["sep"], roles["real"])}


def cls_rows(last_layer: torch.Tensor, cls_mask: torch.Tensor) -> torch.Tensor:
    """The [CLS] query row averaged over heads. last_layer: (B, H, T, T); cls_mask: (B, T) bool with one
    [CLS] per example (the first is used). Returns (B, T)."""
    cls_position = cls_mask.to(torch.int64).argmax(-1)  # (B,)
    rows = last_layer[torch.arange(last_layer.shape[0]), :, cls_position, :]  # (B, H, T)
    return rows.mean(1)


def received_attention(attn: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Attention each key receives from every token, divided by the input length.
    attn: (B, L, H, T, T) with padding rows zero; lengths: (B,). Returns (B, L, H, T)."""
    return attn.sum(-2) / lengths.to(attn.dtype)[:, None, None, None]


def feature_attention(attn: torch.Tensor, lengths: torch.Tensor,
                      occurrences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 4.4's per-input value: max over a feature's occurrences of the length-normalised attention
    they receive.

    attn: (B, L, H, T, T); lengths: (B,); occurrences: (B, K, T) bool, occurrence k's token positions (a
    word split into pieces receives the sum over its pieces). Returns (values (B, L, H), present (B,) bool);
    values are 0 where an input has no occurrence.
    """
    received = received_attention(attn, lengths)  # (B, L, H, T)
    per_occurrence = torch.einsum("blht,bkt->blhk", received, occurrences.to(received.dtype))
    valid = occurrences.any(-1)  # (B, K)
    per_occurrence = per_occurrence.masked_fill(~valid[:, None, None, :], float("-inf"))
    present = valid.any(-1)
    if per_occurrence.shape[-1] == 0:
        return torch.zeros(received.shape[:3], dtype=received.dtype), present
    values = per_occurrence.max(-1).values
    return torch.where(present[:, None, None], values, torch.zeros_like(values)), present


# ---------------------------------------------------------------- finding occurrences (by position)

def negation_occurrences(item: Encoded) -> list[list[int]]:
    """Token positions of each negation word in one input: listed words, and n't however it was split
    ("does n't" -> n ' t, "didn't" -> didn ' t, or one word "didn't" where words split on whitespace only). A word
    truncation cut part-way is no occurrence: its kept pieces are another word ("nothingness" kept as "nothing")."""
    groups, labels = word_groups(item)
    labels = [label.lower() for label in labels]
    positions = [np.flatnonzero(groups == g).tolist() for g in range(len(labels))]
    cut = cut_positions(item)
    found, used = [], set()
    for g, label in enumerate(labels):
        if g in used:
            continue
        span, pieces = None, None
        if label == "t" and g >= 2 and labels[g - 1] in APOSTROPHES and labels[g - 2].endswith("n"):
            span = [g - 2, g - 1, g]
        elif label in {"'t", "\u2019t"} and g >= 1 and labels[g - 1].endswith("n"):
            span = [g - 1, g]
        else:
            pieces = word_core(item, positions[g])
            word = "".join(piece_text(item.tokens[p]) for p in pieces).lower().replace("\u2019", "'")
            if word in NEGATION_WORDS or (word.endswith("n't") and word[:-3].isalpha()):
                span = [g]
        if span and not used.intersection(span) and not cut.intersection(p for g in span for p in positions[g]):
            used.update(span)
            found.append(pieces if pieces is not None else sorted(p for s in span for p in positions[s]))
    return found


def cut_positions(item: Encoded) -> set[int]:
    """Token positions of the words truncation cut part-way (``Encoded.cut_words``)."""
    return {position for position, key in enumerate(zip(item.sequence_ids, item.word_ids)) if key in item.cut_words}


def word_core(item: Encoded, positions: list[int]) -> list[int]:
    """A word's token positions without the punctuation pieces at its edges. Tokenizers that split words on
    whitespace only (XLM-R, ALBERT, CamemBERT: SentencePiece) make "not," or "(never" one word."""
    start, end = 0, len(positions)
    while start < end and _is_punctuation(piece_text(item.tokens[positions[start]])):
        start += 1
    while end > start and _is_punctuation(piece_text(item.tokens[positions[end - 1]])):
        end -= 1
    return positions[start:end]


def _is_punctuation(text: str) -> bool:
    return bool(text) and all(unicodedata.category(ch).startswith("P") for ch in text)


def tagged_occurrences(tokenizer, example: Example, tagger: Tagger, max_length: int) -> dict[str, list[list[int]]]:
    """{feature: token positions of each tagged word} for one input, aligned by character offsets. A word that
    truncation cut part-way is left out, as one it cut off whole (its kept pieces are not the word), and so are
    special tokens written in the text ("[SEP]" is read as the tokenizer's own [SEP]). A segment truncation cut is
    tagged up to TAGGER_CONTEXT_CHARS characters past its kept part, which its last kept sentence rarely exceeds."""
    segments = [example.text] if example.text_pair is None else [example.text, example.text_pair]
    enc = tokenizer(*segments, truncation=True, max_length=max_length, return_offsets_mapping=True)
    full = tokenizer(*segments, truncation=False, return_offsets_mapping=True, verbose=False)
    structural = set(structural_token_ids(tokenizer))
    found: dict[str, list[list[int]]] = defaultdict(list)
    for segment, text in enumerate(segments):
        kept_end = max((b for seq, (_, b) in zip(enc.sequence_ids(), enc["offset_mapping"]) if seq == segment),
                       default=0)
        # not the cut-off rest of a long text: spaCy refuses one over 1,000,000 characters and parses it slowly
        # long before (1 GB per 100,000 characters, it says); a text kept whole is tagged whole
        for start, end, features in tagger(text[:kept_end + TAGGER_CONTEXT_CHARS]):
            positions = overlapping_tokens(enc, segment, start, end)
            if len(positions) < len(overlapping_tokens(full, segment, start, end)):
                continue  # cut part-way
            positions = [position for position in positions if enc["input_ids"][position] not in structural]
            if positions:
                for feature in features:
                    found[feature].append(positions)
    return dict(found)


def overlapping_tokens(enc, segment: int, start: int, end: int) -> list[int]:
    """Positions of the tokens of ``segment`` (a tokenizer's output with offsets) whose characters overlap
    [start, end)."""
    return [t for t, (seq, (a, b)) in enumerate(zip(enc.sequence_ids(), enc["offset_mapping"]))
            if seq == segment and b > a and a < end and b > start]


def occurrence_tensor(per_item: Sequence[list[list[int]]], width: int) -> torch.Tensor:
    """Stack per-input occurrence position lists into (B, K, T) bool (K = most occurrences in an input)."""
    most = max((len(occ) for occ in per_item), default=0)
    tensor = torch.zeros((len(per_item), most, width), dtype=torch.bool)
    for b, occurrences in enumerate(per_item):
        for k, positions in enumerate(occurrences):
            tensor[b, k, positions] = True
    return tensor


# ---------------------------------------------------------------- inputs

def encode_special_inputs(tokenizer, examples: Sequence[Example],
                          max_length: int = DEFAULT_MAX_LENGTH) -> list[Encoded]:
    """:func:`stream.encode_examples`, refusing before any map an input whose statistics would be empty or wrong:
    a tokenizer that names no [CLS] or [SEP] token, or inputs it does not mark with them (attention to it would read
    0 and the [CLS] row would be missing), and an input of special tokens only (``check_has_text``)."""
    encoded = encode_examples(tokenizer, examples, max_length)
    check_marks_cls_and_sep(tokenizer, encoded, "special")
    check_has_text(tokenizer, encoded)
    return encoded


# ---------------------------------------------------------------- accumulation over a stream

class TokenTally:
    """Mean attention a token string receives from the last layer's [CLS] row, and how often it occurs, with a 95%
    interval per token that resamples whole inputs (the occurrences of a token in one input share its maps, so
    they are no independent trials): each draw's mean is the resampled summed attention / the resampled count."""

    def __init__(self):
        self.ids: dict[str, int] = {}  # token -> column
        # per input: (columns of the tokens it holds, their summed attention, their counts)
        self.inputs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, tokens: Sequence[str], weights: Sequence[float]) -> None:
        """One input's tokens and the attention each receives (its [CLS] row)."""
        columns = np.array([self.ids.setdefault(token, len(self.ids)) for token in tokens], dtype=np.int64)
        held, position = np.unique(columns, return_inverse=True)
        self.inputs.append((held, np.bincount(position, weights=np.asarray(weights, dtype=np.float64)),
                            np.bincount(position).astype(np.float64)))

    def per_input(self) -> tuple[sparse.csr_matrix, sparse.csr_matrix]:
        """(summed attention, counts): (inputs, tokens) sparse matrices, tokens in first-seen order."""
        rows = np.repeat(np.arange(len(self.inputs)), [len(held) for held, _, _ in self.inputs])
        columns = np.concatenate([held for held, _, _ in self.inputs]) if self.inputs else np.zeros(0, np.int64)
        shape = (len(self.inputs), len(self.ids))

        def matrix(part: int) -> sparse.csr_matrix:
            data = np.concatenate([entry[part] for entry in self.inputs]) if self.inputs else np.zeros(0)
            return sparse.csr_matrix((data, (rows, columns)), shape=shape)

        return matrix(1), matrix(2)

    def table(self, min_count: int = 1) -> pd.DataFrame:
        """token, mean_attention, ci_low, ci_high, count (occurrences), inputs (inputs that hold it), for the tokens
        seen ``min_count`` times or more, highest mean first. The interval is the percentile bootstrap 95% interval
        over the inputs (1,000 draws, seed 0, shared by every token); a token of one input has none (NaN): one
        input resampled shows no spread."""
        columns = ["token", "mean_attention", "ci_low", "ci_high", "count", "inputs"]
        if not self.inputs:
            return pd.DataFrame(columns=columns)
        sums, counts = self.per_input()
        total = np.asarray(counts.sum(0)).ravel()
        bounds = bootstrap_sparse_ratio_interval(sums, counts)  # (tokens, 2), NaN for a token of one input
        inputs = np.diff(counts.tocsc().indptr)  # inputs holding each token
        frame = pd.DataFrame({"token": list(self.ids), "mean_attention": np.asarray(sums.sum(0)).ravel() / total,
                              "ci_low": bounds[:, 0], "ci_high": bounds[:, 1], "count": total.astype(np.int64),
                              "inputs": inputs})
        frame = frame[frame["count"] >= min_count]
        return frame.sort_values(["mean_attention", "count"], ascending=[False, False], ignore_index=True)


def special_statistics(bundle, examples: Sequence[Example], *, max_length: int = DEFAULT_MAX_LENGTH,
                       batch_size: int = 32, tagger: Tagger | None = None,
                       progress: bool | str = False) -> dict:
    """One pass over the maps: {"heads": {name: (L, H)} for to_cls, to_sep and each available feature,
    "intervals": {name: (L, H, 2)} their bootstrap 95% intervals over the examples (a feature's over the inputs that
    have it), "special_layers": one row per layer with the mean over its heads of to_cls and to_sep and their
    intervals (:meth:`HeadMeans.layer_table`), "model_intervals": {name: (2,)} the interval of the mean over every
    head, "counts": {feature: inputs with the feature}, "per_input": {feature: (values (E, L, H), present (E,) 0/1)}
    each input's attention to the feature in the order of ``examples`` (:func:`feature_change` pairs two models'),
    "cls_tally": TokenTally, "unavailable": {feature: why}, "n_truncated": inputs cut to max_length}."""
    encoded = encode_special_inputs(bundle.tokenizer, examples, max_length)
    means, tally = HeadMeans(), TokenTally()
    counts = defaultdict(int)
    order = []  # each streamed input's position in ``examples`` (the stream sorts by length)
    for maps in stream_maps(bundle, examples, max_length=max_length, batch_size=batch_size, progress=progress,
                            encoded=encoded):
        batch = maps.batch
        order.extend(item.index for item in batch.items)
        roles = token_roles(bundle.tokenizer, batch.input_ids, batch.attention_mask)
        for name, values in special_token_attention(maps.attentions, roles).items():
            means.add(name, values)
        _tally_cls_rows(maps, roles["cls"], tally)
        per_feature = {"negation": [negation_occurrences(item) for item in batch.items]}
        if tagger is not None:
            tagged = [tagged_occurrences(bundle.tokenizer, examples[item.index], tagger, max_length)
                      for item in batch.items]
            for feature in TAGGER_FEATURES:
                per_feature[feature] = [found.get(feature, []) for found in tagged]
        for feature, per_item in per_feature.items():
            occurrences = occurrence_tensor(per_item, maps.attentions.shape[-1])
            values, present = feature_attention(maps.attentions, batch.lengths, occurrences)
            means.add(feature, values, include=present)
            counts[feature] += int(present.sum())
    unavailable = {} if tagger is not None else {feature: UNAVAILABLE for feature in TAGGER_FEATURES}
    halves = np.array([sentence_half(index) for index in order])
    strongest = {feature: strongest_heads(*means.per_example(feature), halves)
                 for feature, count in counts.items() if count}
    in_data_order = np.argsort(order)
    per_input = {feature: tuple(part[in_data_order] for part in means.per_example(feature)) for feature in counts}
    return {"heads": means.result(), "intervals": means.intervals(), "strongest": strongest, "per_input": per_input,
            "special_layers": means.layer_table(["to_cls", "to_sep"]), "model_intervals": means.model_intervals(),
            "counts": dict(counts), "cls_tally": tally, "unavailable": unavailable,
            "n_truncated": sum(item.truncated for item in encoded)}


def strongest_heads(values: np.ndarray, weights: np.ndarray, halves: np.ndarray) -> dict:
    """A feature's strongest head, in-sample and held out.

    values: (E, L, H) per-input attention to the feature; weights: (E,) 1 for inputs that have it, 0 otherwise;
    halves: (E,) each input's half (probing.sentence_half of its position in the data). The in-sample head is the
    best of all L x H means, so its own interval is optimistic (it was picked for being high); the held-out head is
    picked on the SELECTION half and its mean and bootstrap 95% interval are taken over the HELD_OUT half's inputs
    that have the feature, as probe-dep does. Returns {"layer", "head", "held_out": {"layer", "head", "mean",
    "ci_low", "ci_high", "inputs"} or None when either half has no input with the feature} (0-indexed).
    """
    layer, head = np.unravel_index(int(np.argmax(weighted_means(values, weights))), values.shape[1:])
    selection, held_out = weights * (halves == SELECTION), weights * (halves == HELD_OUT)
    result = {"layer": int(layer), "head": int(head), "held_out": None}
    if selection.sum() > 0 and held_out.sum() > 0:
        picked = np.unravel_index(int(np.argmax(weighted_means(values, selection))), values.shape[1:])
        rows = halves == HELD_OUT
        scored = values[rows][:, picked[0], picked[1]]  # (E_held,)
        low, high = bootstrap_weighted_mean_interval(scored, weights[rows])
        result["held_out"] = {"layer": int(picked[0]), "head": int(picked[1]),
                              "mean": float(weighted_means(scored, weights[rows])), "ci_low": float(low),
                              "ci_high": float(high), "inputs": int(held_out.sum())}
    return result


def unpaired_reason(tuned_bundle, base_bundle) -> str | None:
    """Why two models' attention to the features cannot be paired input by input (another tokenizer puts the
    features at other positions; other layers x heads have no head (l, h) in common), or None when it can."""
    try:
        check_same_tokenizer(base_bundle.tokenizer, tuned_bundle.tokenizer)
        check_same_shape(base_bundle, tuned_bundle)
    except AttnpatError as exc:
        return str(exc)
    return None


def feature_change(tuned: dict[str, tuple[np.ndarray, np.ndarray]],
                   base: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, dict]:
    """Paired change of each feature's attention, fine-tuned minus base, over the same inputs.

    tuned, base: {feature: (values (E, L, H), present (E,) 0/1)} in data order (special_statistics' "per_input"),
    the same E inputs and L x H heads. Only inputs that have the feature for both models count. The two models'
    values of an input are differenced before resampling, so each bootstrap draw takes the same inputs for both
    (paired: what the inputs share cancels). Returns {feature: {"change": (L, H) mean difference, "intervals":
    (L, H, 2) its percentile bootstrap 95% interval over the inputs, "model": (3,) the mean over every head's
    difference with its interval, "differences": (E, L, H), "weights": (E,)}} for the features both have on an input.
    """
    found = {}
    for feature in [feature for feature in tuned if feature in base]:
        (tuned_values, tuned_present), (base_values, base_present) = tuned[feature], base[feature]
        if tuned_values.shape != base_values.shape:
            raise AttnpatError(f"a paired change needs the same inputs and heads, got {tuned_values.shape} "
                               f"fine-tuned and {base_values.shape} base values of {feature}")
        weights = tuned_present * base_present
        if not weights.any():
            continue
        differences = tuned_values.astype(np.float64) - base_values.astype(np.float64)  # (E, L, H)
        per_input_mean = differences.mean((1, 2))  # (E,)
        found[feature] = {"change": weighted_means(differences, weights),
                          "intervals": bootstrap_weighted_mean_interval(differences, weights),
                          "model": np.array([weighted_means(per_input_mean, weights),
                                             *bootstrap_weighted_mean_interval(per_input_mean, weights)]),
                          "differences": differences, "weights": weights}
    return found


def held_out_change(change: dict, layer: int, head: int) -> dict | None:
    """One head's paired change (:func:`feature_change`'s entry of a feature) over the HELD_OUT half of the inputs
    (odd data positions), for a head picked on the other half (strongest_heads' "held_out"): {"layer", "head",
    "mean", "ci_low", "ci_high" (percentile bootstrap 95%), "inputs"}; None when that half has no input with it."""
    held = np.array([sentence_half(position) for position in range(len(change["weights"]))]) == HELD_OUT
    weights = change["weights"][held]
    if not weights.any():
        return None
    scored = change["differences"][held][:, layer, head]  # (E_held,)
    low, high = bootstrap_weighted_mean_interval(scored, weights)
    return {"layer": layer, "head": head, "mean": float(weighted_means(scored, weights)), "ci_low": float(low),
            "ci_high": float(high), "inputs": int(weights.sum())}


def change_table(changes: dict[str, dict]) -> pd.DataFrame:
    """Long table layer, head, feature, value (fine-tuned minus base), ci_low, ci_high, inputs (those with the
    feature for both models) of :func:`feature_change`'s result, features in FEATURES order."""
    features = [feature for feature in FEATURES if feature in changes]
    if not features:
        return pd.DataFrame(columns=["layer", "head", "feature", "value", "ci_low", "ci_high", "inputs"])
    frame = long_table({feature: changes[feature]["change"] for feature in features}, key="feature",
                       intervals={feature: changes[feature]["intervals"] for feature in features})
    frame["inputs"] = frame["feature"].map({feature: int(changes[feature]["weights"].sum()) for feature in features})
    return frame


def write_feature_change(tuned_bundle, base_bundle, data, run, tuned_stats: dict, base_stats: dict) -> dict:
    """Write linguistic_change.csv (:func:`change_table`) into the fine-tuned model's ``run``; returns
    :func:`feature_change` of the two models' special_statistics over the same ``data``."""
    changes = feature_change(tuned_stats["per_input"], base_stats["per_input"])
    with run.record(CHANGE_ENTRY, tuned_bundle, data, base_model=base_bundle.reference,
                    base_revision=base_bundle.revision,
                    interval="paired percentile bootstrap 95% interval of fine-tuned minus base over the inputs that "
                             f"have the feature for both models ({EXAMPLE_INTERVAL.split('(')[-1]}") as entry:
        run.write_table(CHANGE_TABLE, change_table(changes))
        entry.update(feature_counts={feature: int(found["weights"].sum()) for feature, found in changes.items()})
    return changes


def weighted_means(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """values: (E, ...), weights: (E,) with a positive sum -> (...) the weighted mean over E (uncounted inputs'
    values never read)."""
    counted = np.where(weights.reshape(-1, *(1,) * (values.ndim - 1)) > 0, values, 0.0)
    return np.tensordot(weights, counted, 1) / weights.sum()


def _tally_cls_rows(maps: MapBatch, cls_mask: torch.Tensor, tally: TokenTally) -> None:
    has_cls = cls_mask.any(-1)
    rows = cls_rows(maps.attentions[:, -1], cls_mask)  # (B, T)
    for i in range(len(maps)):
        if has_cls[i]:
            n = int(maps.batch.lengths[i])
            tally.add(maps.tokens(i)[:n], rows[i, :n].tolist())


# ---------------------------------------------------------------- run directory

def linguistic_table(heads: dict[str, np.ndarray], intervals: dict[str, np.ndarray] | None = None):
    """Long table layer, head, feature, value (and ci_low, ci_high from ``intervals``: {feature: (L, H, 2)}) for the
    features present in ``heads``."""
    return long_table({feature: heads[feature] for feature in FEATURES if feature in heads}, key="feature",
                      intervals=intervals)


def write_special(bundle, data, run, *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                  tagger: Tagger | None = None, progress: bool | str = False, top: int = 30,
                  min_count: int = 5, retire_change: bool = False) -> dict:
    """Compute :func:`special_statistics` for ``data`` and write special_tokens.csv/png/svg,
    cls_last_layer.csv and linguistic.csv into ``run`` (per-head tables: each mean with its bootstrap 95% interval
    over the examples, ci_low and ci_high). retire_change: an earlier run's linguistic_change.csv
    (:func:`write_feature_change`) and its manifest entry go when these tables land; a paired change of these inputs,
    if one follows, is written anew after the base's statistics. Returns the statistics, with "top_cls_tokens": the
    ``top`` first rows of cls_last_layer.csv among the tokens seen "top_cls_min_count" times or more."""
    with run.record("special", bundle, data, max_length=max_length) as entry:
        if retire_change:  # another run's change beside these tables would read as theirs, even until the new one lands
            run.retire(f"{CHANGE_TABLE}.csv")
            run.retire_entries(CHANGE_ENTRY)
        stats = special_statistics(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                   tagger=tagger, progress=progress)
        heads, intervals = stats["heads"], stats["intervals"]
        run.write_table("special_tokens", long_table({"to_cls": heads["to_cls"], "to_sep": heads["to_sep"]},
                                                     intervals=intervals))
        fig = panel_heatmaps({"attention to [CLS]": heads["to_cls"], "attention to [SEP]": heads["to_sep"]},
                             title=f"{bundle.name} on {data.task}: mean attention to special tokens",
                             label="mean attention", cmap="Blues", vmin=0.0, vmax=1.0)
        run.write_figure("special_tokens", fig)
        close(fig)
        cls_table = stats["cls_tally"].table()
        run.write_table("cls_last_layer", cls_table)
        run.write_table("linguistic", linguistic_table(heads, intervals))
        entry.update(n_truncated=stats["n_truncated"], interval=EXAMPLE_INTERVAL, feature_counts=stats["counts"],
                     unavailable=stats["unavailable"], tagger=PIPELINE_NAME if tagger is not None else None,
                     negation_words=sorted(NEGATION_WORDS),
                     strongest_heads={feature: found["held_out"] for feature, found in stats["strongest"].items()},
                     strongest_head_held_out="each feature's head picked on the even-numbered inputs (0, 2, ...), its "
                                             "mean and bootstrap 95% interval over the odd-numbered inputs that have "
                                             "the feature (0-indexed layer and head; null: a half lacks the feature)")
    # tokens seen once dominate a raw ranking; the printed summary keeps the ones that recur (at most in every
    # input: with fewer inputs than min_count no token could qualify and the summary would be empty)
    stats["top_cls_min_count"] = min(min_count, len(data.examples))
    stats["top_cls_tokens"] = cls_table[cls_table["count"] >= stats["top_cls_min_count"]].head(top)
    return stats
