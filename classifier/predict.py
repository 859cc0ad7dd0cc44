"""Load a trained pattern classifier and predict the pattern class of attention maps of any length."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis.errors import AttnpatError
from analysis.patterns import CLASSES
from analysis.sampling import Predictor
from annotation.preannotate import rule_classes
from classifier.checkpoint import load_checkpoint
from classifier.model import IMAGE_CHANNELS, INPUT_CHANNELS, PROFILE_FEATURES, PatternCNN, inference_copy, prepare_maps

MapsLike = Sequence[np.ndarray | torch.Tensor] | torch.Tensor | np.ndarray


def bf16_supported() -> bool:
    """Whether this CPU runs bfloat16 convolutions natively (AVX512-BF16 / AMX), where they are faster."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PatternClassifier:
    """A trained PatternCNN with its metadata. Works on the CPU in inference mode.

    bf16: run the network in bfloat16 (None = where the CPU supports it natively; on such CPUs it is about
    1.5x faster and agrees with float32 on more than 99.9% of maps). Cross-validation scores are float32.
    """

    def __init__(self, model: PatternCNN, metadata: dict, path: str | None = None, bf16: bool | None = None):
        self.model = model.eval()
        self.bf16 = bf16_supported() if bf16 is None else bool(bf16)
        self._fast = inference_copy(self.model).to(torch.bfloat16 if self.bf16 else torch.float32)
        self._fast.profile_edges = self.model.profile_edges.float().clone()  # bin edges stay exact in bf16 too
        self.metadata = metadata
        self.path = path
        self.classes: tuple[str, ...] = CLASSES
        self.input_size: int = int(metadata["input_size"])

    def prepare(self, maps: MapsLike) -> torch.Tensor:
        """Maps of any lengths -> (N, INPUT_CHANNELS, S, S) input images (see classifier.model for the transform)."""
        try:
            return prepare_maps(maps, self.input_size)
        except ValueError as exc:
            raise AttnpatError(str(exc)) from exc

    def proba_images(self, images: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
        """images: (N, INPUT_CHANNELS, S, S) -> (N, 5) class probabilities (float32 tensor)."""
        if images.ndim != 4 or tuple(images.shape[1:]) != (INPUT_CHANNELS, self.input_size, self.input_size):
            raise AttnpatError(f"classifier input must be (N, {INPUT_CHANNELS}, {self.input_size}, {self.input_size}), "
                               f"got {tuple(images.shape)}")
        return self.proba_parts(images[:, :IMAGE_CHANNELS], images[:, IMAGE_CHANNELS, 0, :PROFILE_FEATURES], batch_size)

    def proba_parts(self, pictures: torch.Tensor, profile: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
        """pictures (N, IMAGE_CHANNELS, S, S) and profile (N, PROFILE_FEATURES), as written by
        classifier.model.write_inputs -> (N, 5) class probabilities (float32 tensor)."""
        if pictures.ndim != 4 or tuple(pictures.shape[1:]) != (IMAGE_CHANNELS, self.input_size, self.input_size):
            raise AttnpatError(f"classifier pictures must be (N, {IMAGE_CHANNELS}, {self.input_size}, "
                               f"{self.input_size}), got {tuple(pictures.shape)}")
        if tuple(profile.shape) != (pictures.shape[0], PROFILE_FEATURES):
            raise AttnpatError(f"classifier profile must be ({pictures.shape[0]}, {PROFILE_FEATURES}), "
                               f"got {tuple(profile.shape)}")
        out = []
        with torch.inference_mode():
            for start in range(0, pictures.shape[0], batch_size):
                chunk = pictures[start:start + batch_size].to(self.input_dtype).contiguous(
                    memory_format=torch.channels_last)  # both no-ops for the batch classifier's buffer
                logits = self._fast.forward_parts(chunk, profile[start:start + batch_size].float())
                out.append(torch.softmax(logits.float(), dim=1))
        return torch.cat(out) if out else torch.empty((0, len(self.classes)))

    def predict_proba(self, maps: MapsLike) -> np.ndarray:
        """maps: list of (n, n) arrays/tensors of any sizes, or (N, n, n) -> (N, 5) probabilities."""
        if len(maps) == 0:
            return np.empty((0, len(self.classes)), dtype=np.float32)
        return self.proba_images(self.prepare(maps)).numpy()

    def predict(self, maps: MapsLike) -> list[str]:
        """Predicted class name of every map."""
        return [self.classes[i] for i in self.predict_proba(maps).argmax(axis=1)]

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the network runs in (inputs of another dtype are converted)."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def trained_on(self) -> str:
        return str(self.metadata.get("trained_on", "unknown"))


def load_classifier(path: str | Path | None = None, bf16: bool | None = None) -> PatternClassifier:
    """The classifier at ``path`` (a .safetensors checkpoint); None = the shipped default checkpoint.
    bf16: see :class:`PatternClassifier` (None = automatic).

    Raises a one-line AttnpatError if the file is missing, corrupt or of the wrong shape or classes.
    The classifier keeps the absolute path, as a local model does (analysis.models): Ray workers load it by that
    path, from working directories that are not this process's.
    """
    model, metadata = load_checkpoint(path)
    return PatternClassifier(model, metadata, str(Path(path).resolve()) if path is not None else None, bf16)


def classify_heads(classifier, maps: torch.Tensor) -> tuple[list[list[str]], np.ndarray]:
    """Predicted class of every head of one example. classifier: anything with ``predict_proba(maps) -> (N, C)``;
    maps: (L, H, n, n) token-level. Returns (classes [L][H], probs (L, H, C))."""
    layers, heads, n, _ = maps.shape
    probs = np.asarray(classifier.predict_proba(maps.reshape(layers * heads, n, n)), dtype=float)
    probs = probs.reshape(layers, heads, -1)
    best = probs.argmax(-1)
    return [[CLASSES[int(best[layer, head])] for head in range(heads)] for layer in range(layers)], probs


def head_class_table(classes: list[list[str]], probs: np.ndarray) -> pd.DataFrame:
    """:func:`classify_heads`' answer as a long table: layer, head (0-indexed), class, p_<class> for each class.
    probs: (L, H, C)."""
    rows = []
    for layer, row in enumerate(classes):
        for head, name in enumerate(row):
            rows.append({"layer": layer, "head": head, "class": name,
                         **{f"p_{c}": float(probs[layer, head, k]) for k, c in enumerate(CLASSES)}})
    return pd.DataFrame(rows)


def pattern_predictor(name: str) -> Predictor:
    """A ``predict(maps, tokens) -> class names`` for analysis.sampling: 'rules' = the rule-based
    pre-annotator, 'classifier' = the shipped CNN, anything else = the path of a CNN checkpoint."""
    if name == "rules":
        return rule_classes
    classifier = load_classifier(None if name == "classifier" else Path(name))
    return lambda maps, tokens: classifier.predict(maps)
