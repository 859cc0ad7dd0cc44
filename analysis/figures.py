"""Shared plotting: one attention map with marked special tokens, and layer x head heatmaps.

Every figure is a matplotlib Figure (Agg backend); save it with analysis.rundir.save_figure (PNG + SVG).
Figures label layers and heads 1-indexed, as the papers do, and say so on the axes.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from analysis.errors import AttnpatError  # noqa: E402

# Tokens marked on the axes of rendered maps (the guideline: [CLS], [SEP], '.' and ',').
MARKED_TOKENS = {"[CLS]": "[CLS]", "<s>": "[CLS]", "[SEP]": "[SEP]", "</s>": "[SEP]", ".": ".", ",": ","}


def check_map(attn: np.ndarray, tokens: list[str] | None = None) -> np.ndarray:
    """Validate one map: (n, n), finite, non-negative; tokens (if given) of length n."""
    attn = np.asarray(attn, dtype=np.float32)
    if attn.ndim != 2 or attn.shape[0] != attn.shape[1]:
        raise AttnpatError(f"an attention map must be square (n, n), got shape {attn.shape}")
    if not np.isfinite(attn).all() or (attn < 0).any():
        raise AttnpatError("an attention map must be finite and non-negative")
    if tokens is not None and len(tokens) != attn.shape[0]:
        raise AttnpatError(f"{len(tokens)} tokens for a map of size {attn.shape[0]}")
    return attn


def marked_positions(tokens: list[str]) -> list[tuple[int, str]]:
    """(position, label) of the tokens marked on the axes."""
    return [(i, MARKED_TOKENS[t]) for i, t in enumerate(tokens) if t in MARKED_TOKENS]


def draw_map(ax, attn: np.ndarray, tokens: list[str] | None = None, *, all_ticks: bool = False,
             title: str | None = None) -> None:
    """Draw one map on ``ax``: row = query, column = key, darker = more weight (scaled to the map's max).

    attn: (n, n). With ``all_ticks`` every token is labelled; otherwise only [CLS], [SEP], '.' and ','.
    """
    attn = check_map(attn, tokens)
    ax.imshow(attn, cmap="Greys", vmin=0.0, vmax=max(float(attn.max()), 1e-6), interpolation="nearest")
    if tokens is not None:
        ticks = list(enumerate(tokens)) if all_ticks else marked_positions(tokens)
        positions = [p for p, _ in ticks]
        labels = [label for _, label in ticks]
        fontsize = 7 if all_ticks or len(ticks) < 30 else 5
        ax.set_xticks(positions, labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(positions, labels, fontsize=fontsize)
        # Colour the special-token tick labels instead of drawing guide lines: a line over the map would
        # hide the very column it marks (labelers could not see [CLS] columns on 128-token maps).
        for tick in (*ax.get_xticklabels(), *ax.get_yticklabels()):
            if tick.get_text() in {"[CLS]", "[SEP]"}:
                tick.set_color("tab:red")
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title:
        ax.set_title(title, fontsize=9)


def map_figure(attn: np.ndarray, tokens: list[str] | None = None, *, size: float = 4.0, all_ticks: bool = False,
               title: str | None = None):
    """A single-map figure (used for annotation images and the app's large map)."""
    fig, ax = plt.subplots(figsize=(size, size))
    draw_map(ax, attn, tokens, all_ticks=all_ticks, title=title)
    fig.tight_layout()
    return fig


def label_head_axes(ax, layers: int, heads: int, fontsize: int = 7) -> None:
    """Ticks and labels of a layer x head grid, 1-indexed as in the papers (and said so)."""
    ax.set_xticks(range(heads), [str(h + 1) for h in range(heads)], fontsize=fontsize)
    ax.set_yticks(range(layers), [str(layer + 1) for layer in range(layers)], fontsize=fontsize)
    ax.set_xlabel("head (1-indexed)", fontsize=fontsize + 2)
    ax.set_ylabel("layer (1-indexed)", fontsize=fontsize + 2)


def draw_head_heatmap(ax, values: np.ndarray, *, title: str = "", cmap: str = "viridis", vmin: float | None = None,
                      vmax: float | None = None, annotate: bool = False, fontsize: int = 7):
    """Draw one layer x head heatmap on ``ax``; values: (L, H). Returns the image (for a colorbar)."""
    values = np.asarray(values, dtype=float)
    if values.ndim != 2:
        raise AttnpatError(f"a layer x head heatmap needs a (layers, heads) array, got shape {values.shape}")
    image = ax.imshow(values, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    layers, heads = values.shape
    label_head_axes(ax, layers, heads, fontsize)
    if title:
        ax.set_title(title, fontsize=fontsize + 3)
    if annotate:
        colours = image.cmap(image.norm(values))
        for layer in range(layers):
            for head in range(heads):
                red, green, blue = colours[layer, head, :3]
                dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5  # readable on light and dark cells
                ax.text(head, layer, f"{values[layer, head]:.2f}", ha="center", va="center", fontsize=5,
                        color="white" if dark else "black")
    return image


def head_heatmap(values: np.ndarray, *, title: str, cmap: str = "viridis", label: str = "",
                 vmin: float | None = None, vmax: float | None = None, center: float | None = None,
                 annotate: bool = False):
    """A layer x head heatmap figure. values: (L, H). ``center`` makes a diverging scale symmetric around it."""
    values = np.asarray(values, dtype=float)
    if center is not None:
        spread = np.nanmax(np.abs(values - center)) or 1.0
        vmin, vmax = center - spread, center + spread
    layers, heads = values.shape if values.ndim == 2 else (1, 1)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.42 * heads + 1.5), max(2.5, 0.4 * layers + 1.2)))
    image = draw_head_heatmap(ax, values, title=title, cmap=cmap, vmin=vmin, vmax=vmax, annotate=annotate)
    fig.colorbar(image, ax=ax, label=label)
    fig.tight_layout()
    return fig


def panel_heatmaps(panels: dict[str, np.ndarray], *, title: str, label: str, cmap: str = "viridis",
                   vmin: float | None = None, vmax: float | None = None):
    """One layer x head heatmap per entry of ``panels`` ({panel title: (L, H)}), in a row."""
    layers, heads = np.asarray(next(iter(panels.values()))).shape
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * max(4.0, 0.42 * heads + 1.8),
                                                       max(2.6, 0.4 * layers + 1.4)), squeeze=False)
    for ax, (name, values) in zip(axes[0], panels.items()):
        image = draw_head_heatmap(ax, values, title=name, cmap=cmap, vmin=vmin, vmax=vmax)
        fig.colorbar(image, ax=ax, label=label, shrink=0.85)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def close(fig) -> None:
    plt.close(fig)
