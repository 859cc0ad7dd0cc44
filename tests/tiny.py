"""Tiny randomly initialised BERT models, saved to disk and loaded through the real loading path."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel

from analysis.models import EncoderBundle, ModelSource, embedded_model_path, load_model

MODEL_CLASSES = {"base": BertModel, "classifier": BertForSequenceClassification, "mlm": BertForMaskedLM}


@lru_cache(maxsize=1)
def minilm_tokenizer():
    return AutoTokenizer.from_pretrained(embedded_model_path())


def tiny_config(layers: int = 2, heads: int = 4, hidden: int = 32, num_labels: int = 2, **extra) -> BertConfig:
    """A tiny BERT config over the MiniLM vocabulary (eager attention); ``extra`` goes to BertConfig."""
    tokenizer = minilm_tokenizer()
    return BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=37, max_position_embeddings=512,
                      num_labels=num_labels, attn_implementation="eager", **extra)


def wrap_bundle(model, name: str = "tiny") -> EncoderBundle:
    """An EncoderBundle around an in-memory model (eval mode, CPU) with the MiniLM tokenizer."""
    return EncoderBundle(name, ModelSource(name, "local", "/nonexistent", True), model.eval(), minilm_tokenizer(),
                         torch.device("cpu"), "test")


def save_tiny_model(folder: Path, kind: str = "base", seed: int = 0, **config_kwargs) -> Path:
    """A tiny random model of ``kind`` plus the MiniLM tokenizer, saved as a local model folder."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[kind](tiny_config(**config_kwargs))
    model.save_pretrained(folder)
    minilm_tokenizer().save_pretrained(folder)
    return folder


def tiny_bundle(folder: Path, kind: str = "base", seed: int = 0, **config_kwargs):
    """An EncoderBundle around a tiny random model, on the CPU."""
    save_tiny_model(folder, kind, seed, **config_kwargs)
    return load_model(str(folder), kind=kind, device="cpu")
