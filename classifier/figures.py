"""Figures of the classifier's scores against labels (cross-validated in `attnpat train`, on a labeled set in
`attnpat evaluate`)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import close  # importing analysis.figures selects the Agg backend
from analysis.patterns import CLASSES
from analysis.rundir import RunDir


def write_confusion_figure(run: RunDir, stem: str, confusion: np.ndarray, title: str) -> list[Path]:
    """Draw a confusion matrix with its counts into run/<stem>.png and .svg.

    confusion: (5, 5) counts, rows = the labels' class, columns = the predicted class (CLASSES order).
    """
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    image = ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(len(CLASSES)), CLASSES, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(CLASSES)), CLASSES, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true (label)")
    ax.set_title(title, fontsize=10)
    for t in range(len(CLASSES)):
        for p in range(len(CLASSES)):
            ax.text(p, t, str(int(confusion[t, p])), ha="center", va="center", fontsize=8,
                    color="white" if confusion[t, p] > confusion.max() / 2 else "black")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    written = run.write_figure(stem, fig)
    close(fig)
    return written
