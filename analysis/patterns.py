"""The attention-pattern vocabulary of Kovaleva et al. 2019: the five classes, their colours and short tags.

One fixed order everywhere (labels, logits, tables, figures, the app's grid).
"""
from __future__ import annotations

CLASSES = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
# One colour per class, in CLASSES order, shared by every figure and the app.
CLASS_COLOURS = ("#1f77b4", "#2ca02c", "#17becf", "#ff7f0e", "#9467bd")
# The short tag drawn on a layer x head grid, in CLASSES order.
CLASS_TAGS = ("V", "D", "V+D", "B", "H")


def _rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


# Class -> (short tag, RGB colour).
CLASS_STYLE: dict[str, tuple[str, tuple[int, int, int]]] = {
    name: (tag, _rgb(colour)) for name, tag, colour in zip(CLASSES, CLASS_TAGS, CLASS_COLOURS, strict=True)
}
