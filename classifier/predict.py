"""Load a trained pattern classifier and predict the pattern class of attention maps of any length."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from analysis.errors import AttnpatError
from classifier import CLASSES
from classifier.checkpoint import load_checkpoint
from classifier.model import INPUT_CHANNELS, PatternCNN, inference_copy, prepare_maps

MapsLike = Sequence[np.ndarray | torch.Tensor] | torch.Tensor | np.ndarray


class PatternClassifier:
    """A trained PatternCNN with its metadata. Works on the CPU in inference mode."""

    def __init__(self, model: PatternCNN, metadata: dict, path: str | None = None):
        self.model = model.eval()
        self._fast = inference_copy(self.model)
        self.metadata = metadata
        self.path = path
        self.classes: tuple[str, ...] = CLASSES
        self.input_size: int = int(metadata["input_size"])

    def prepare(self, maps: MapsLike) -> torch.Tensor:
        """Maps of any lengths -> (N, 2, S, S) input images (see classifier.model for the transform)."""
        try:
            return prepare_maps(maps, self.input_size)
        except ValueError as exc:
            raise AttnpatError(str(exc)) from exc

    def proba_images(self, images: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        """images: (N, 2, S, S) -> (N, 5) class probabilities (float32 tensor)."""
        if images.ndim != 4 or tuple(images.shape[1:]) != (INPUT_CHANNELS, self.input_size, self.input_size):
            raise AttnpatError(f"classifier input must be (N, {INPUT_CHANNELS}, {self.input_size}, {self.input_size}), "
                               f"got {tuple(images.shape)}")
        out = []
        with torch.inference_mode():
            for start in range(0, images.shape[0], batch_size):
                chunk = images[start:start + batch_size].contiguous(memory_format=torch.channels_last)
                out.append(torch.softmax(self._fast(chunk), dim=1))
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
    def trained_on(self) -> str:
        return str(self.metadata.get("trained_on", "unknown"))


def load_classifier(path: str | Path | None = None) -> PatternClassifier:
    """The classifier at ``path`` (a .safetensors checkpoint); None = the shipped default checkpoint.

    Raises a one-line AttnpatError if the file is missing, corrupt or of the wrong shape or classes.
    """
    model, metadata = load_checkpoint(path)
    return PatternClassifier(model, metadata, str(path) if path is not None else None)
