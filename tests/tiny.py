"""Tiny randomly initialised BERT and MPNet models, saved to disk and loaded through the real loading path, and
tiny labeled sets of synthetic maps.

The MPNet ones stand in for all-mpnet-base-v2 (never downloaded by the tests): MPNet's own self-attention with
its relative position bias, and an MPNet tokenizer with all-mpnet-base-v2's special tokens over the MiniLM
vocabulary (<s> a </s></s> b </s>, no token type ids, padding id 1).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    MPNetConfig,
    MPNetForMaskedLM,
    MPNetForSequenceClassification,
    MPNetModel,
    MPNetTokenizer,
)

from analysis.models import EncoderBundle, ModelSource, embedded_model_path, load_model
from analysis.patterns import CLASSES
from annotation.dataset import write_labeled_folder
from classifier.synthetic import synthetic_dataset

MODEL_CLASSES = {"base": BertModel, "classifier": BertForSequenceClassification, "mlm": BertForMaskedLM}
MPNET_CLASSES = {"base": MPNetModel, "classifier": MPNetForSequenceClassification, "mlm": MPNetForMaskedLM}


@lru_cache(maxsize=1)
def minilm_tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_path())


def tiny_config(layers: int = 2, heads: int = 4, hidden: int = 32, num_labels: int = 2, **extra) -> BertConfig:
    """A tiny BERT config over the MiniLM vocabulary (eager attention); ``extra`` goes to BertConfig."""
    tokenizer = minilm_tokenizer()
    return BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=37, max_position_embeddings=512,
                      num_labels=num_labels, attn_implementation="eager", **extra)


@lru_cache(maxsize=1)
def mpnet_tokenizer():
    """An MPNet tokenizer laid out as all-mpnet-base-v2's: <s> <pad> </s> <unk>, then the (MiniLM) BERT vocabulary,
    <mask> last (30,527 ids); <s> is its [CLS], </s> its [SEP], <pad> id 1, unknown pieces [UNK]."""
    bert_vocab = (Path(embedded_model_path()) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    tokens = ["<s>", "<pad>", "</s>", "<unk>", *bert_vocab, "<mask>"]
    return MPNetTokenizer(vocab={token: index for index, token in enumerate(tokens)}, do_lower_case=True)


def tiny_mpnet_config(layers: int = 2, heads: int = 4, hidden: int = 32, num_labels: int = 2, **extra) -> MPNetConfig:
    """A tiny MPNet config over the MiniLM vocabulary (eager attention); ``extra`` goes to MPNetConfig."""
    return MPNetConfig(vocab_size=mpnet_tokenizer().vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, intermediate_size=37, max_position_embeddings=514,
                       num_labels=num_labels, attn_implementation="eager", **extra)


def _save_tiny(folder: Path, model_class, config, tokenizer, seed: int) -> Path:
    """A model of ``model_class`` randomly initialised from ``seed``, saved with ``tokenizer`` as a model folder."""
    torch.manual_seed(seed)
    model_class(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_mpnet(folder: Path, kind: str = "base", seed: int = 0, **config_kwargs) -> Path:
    """A tiny random MPNet of ``kind`` plus its tokenizer, saved as a local model folder."""
    return _save_tiny(folder, MPNET_CLASSES[kind], tiny_mpnet_config(**config_kwargs), mpnet_tokenizer(), seed)


def tiny_mpnet_bundle(folder: Path, kind: str = "base", seed: int = 0, **config_kwargs):
    """An EncoderBundle around a tiny random MPNet, on the CPU (through the real loading path)."""
    save_tiny_mpnet(folder, kind, seed, **config_kwargs)
    return load_model(str(folder), kind=kind, device="cpu")


def wrap_bundle(model, name: str = "tiny") -> EncoderBundle:
    """An EncoderBundle around an in-memory model (eval mode, CPU) with the MiniLM tokenizer."""
    return EncoderBundle(name, ModelSource(name, "local", "/nonexistent", True), model.eval(), minilm_tokenizer(),
                         torch.device("cpu"), "test")


def save_tiny_model(folder: Path, kind: str = "base", seed: int = 0, **config_kwargs) -> Path:
    """A tiny random model of ``kind`` plus the MiniLM tokenizer, saved as a local model folder."""
    return _save_tiny(folder, MODEL_CLASSES[kind], tiny_config(**config_kwargs), minilm_tokenizer(), seed)


def tiny_bundle(folder: Path, kind: str = "base", seed: int = 0, **config_kwargs):
    """An EncoderBundle around a tiny random model, on the CPU."""
    save_tiny_model(folder, kind, seed, **config_kwargs)
    return load_model(str(folder), kind=kind, device="cpu")


def save_tiny_labeled_set(folder: Path, n_per_class: int, seed: int = 0, task: str = "syn", heads: int = 1) -> Path:
    """A labeled set of short synthetic maps (n_per_class of every class; map ids tiny:<task>:ex-<i>:L0H<i % heads>),
    written as `attnpat annotate pull` writes one."""
    maps, labels = synthetic_dataset(n_per_class, np.random.default_rng(seed), lengths=(8, 20))
    ids = [f"tiny:{task}:ex-{i}:L0H{i % heads}" for i in range(len(maps))]
    rows = [{"map_id": map_id, "label": CLASSES[label]} for map_id, label in zip(ids, labels, strict=True)]
    return write_labeled_folder(folder, rows, dict(zip(ids, maps, strict=True)), [], {})
