"""Shared plotting: one attention map with marked special tokens, layer x head heatmaps, and the fast
layer x head grid of one input's maps (the app's Explore view).

Every figure is a matplotlib Figure (Agg backend); save it with analysis.rundir.save_figure (PNG + SVG).
Figures label layers and heads 1-indexed, as the papers do, and say so on the axes.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from analysis.errors import AttnpatError  # noqa: E402
from analysis.patterns import CLASS_STYLE  # noqa: E402
from analysis.rendering import absolute_grey, cell_size, check_attention_map  # noqa: E402
from analysis.rundir import FIGURE_DPI  # noqa: E402

# Tokens marked on the axes of rendered maps (the guideline: [CLS], [SEP], '.' and ',').
MARKED_TOKENS = {"[CLS]": "[CLS]", "<s>": "[CLS]", "[SEP]": "[SEP]", "</s>": "[SEP]", ".": ".", ",": ","}


def check_map(attn: np.ndarray, tokens: list[str] | None = None) -> np.ndarray:
    """Validate one map as render_map does (analysis.rendering.check_attention_map): (n, n) with n >= 1, finite,
    weights in [0, 1]; tokens (if given) of length n. Rows need not sum to 1: the app's maps without [CLS]/[SEP]
    lose those columns' weight."""
    return check_attention_map(attn, tokens, rows_sum_to_one=False)


def marked_positions(tokens: list[str]) -> list[tuple[int, str]]:
    """(position, label) of the tokens marked on the axes."""
    return [(i, MARKED_TOKENS[t]) for i, t in enumerate(tokens) if t in MARKED_TOKENS]


def draw_map(ax, attn: np.ndarray, tokens: list[str] | None = None, *, all_ticks: bool = False,
             title: str | None = None) -> None:
    """Draw one map on ``ax``: row = query, column = key, darker = more weight.

    attn: (n, n) weights in [0, 1] (every map kind's rows sum to 1). Drawn as the labeling guideline draws maps
    (analysis.rendering.absolute_grey): absolute weights on one fixed square-root scale, white = 0 and black = 1,
    nearest-neighbour; a map scaled to its own maximum turns a near-uniform map's speckle into dark spots, and
    would not look like the class predicted beside it. With ``all_ticks`` every token is labelled; otherwise only
    [CLS], [SEP], '.' and ','.
    """
    attn = check_map(attn, tokens)
    ax.imshow(absolute_grey(attn), cmap="gray", vmin=0, vmax=255, interpolation="nearest")
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


# Inches around the large map for its tick labels and title (save_figure's tight bounding box trims the rest).
MAP_MARGINS = {"left": 0.9, "bottom": 0.9, "right": 0.2, "top": 0.4}


def map_figure(attn: np.ndarray, tokens: list[str] | None = None, *, panel: int = 512, all_ticks: bool = False,
               title: str | None = None):
    """A single-map figure: the app's large map, drawn as render_map draws the annotators' maps: the guideline's
    absolute scale (:func:`draw_map`) and, once saved (analysis.rundir.save_figure, FIGURE_DPI), a whole number of
    pixels per token, at least 3, filling about ``panel`` pixels (analysis.rendering.cell_size). attn: (n, n).

    The axes are sized in those pixels: an axes of another size resamples the map to it, and its one-token columns
    come out some a pixel wider than others (before: 4 to 6 pixels each at 128 tokens, 39 or 40 at 17)."""
    n = check_map(attn, tokens).shape[0]
    side = n * cell_size(n, panel) / FIGURE_DPI
    width = side + MAP_MARGINS["left"] + MAP_MARGINS["right"]
    height = side + MAP_MARGINS["bottom"] + MAP_MARGINS["top"]
    fig = plt.figure(figsize=(width, height), dpi=FIGURE_DPI)
    ax = fig.add_axes((MAP_MARGINS["left"] / width, MAP_MARGINS["bottom"] / height, side / width, side / height))
    for spine in ax.spines.values():  # drawn on the map's edge, a frame would cover part of [CLS]'s column
        spine.set_position(("outward", 1))
    draw_map(ax, attn, tokens, all_ticks=all_ticks, title=title)
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


# ---------------------------------------------------------------- the layer x head grid of one input

@dataclass(frozen=True)
class GridLayout:
    """Pixel geometry of the layer x head grid (so a click can be mapped back to a head)."""

    layers: int
    heads: int
    cell: int = 56
    gap: int = 6
    margin_left: int = 28
    margin_top: int = 20
    band: int = 13  # class tag strip under each map

    @property
    def pitch_x(self) -> int:
        return self.cell + self.gap

    @property
    def pitch_y(self) -> int:
        return self.cell + self.band + self.gap

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.margin_left + self.heads * self.pitch_x, self.margin_top + self.layers * self.pitch_y

    def head_at(self, x: float, y: float) -> tuple[int, int] | None:
        """0-indexed (layer, head) under pixel (x, y), or None outside every map."""
        column, dx = divmod(int(x) - self.margin_left, self.pitch_x)
        row, dy = divmod(int(y) - self.margin_top, self.pitch_y)
        if 0 <= column < self.heads and 0 <= row < self.layers and dx < self.cell and dy < self.cell + self.band:
            return row, column
        return None


_GREYS = (255 - np.arange(256)).astype(np.uint8)  # darker = more weight, as in the annotation renders


def grid_image(maps: torch.Tensor | np.ndarray, classes: list[list[str]] | None = None,
               layout: GridLayout | None = None, *, scale_each: bool = False) -> Image.Image:
    """All heads as one image: a mosaic of small maps (layers = rows, heads = columns, 1-indexed labels).

    maps: (L, H, n, n) weights in [0, 1]. Each map is resized to ``layout.cell`` pixels (nearest neighbour when
    enlarging, max-pooling when shrinking) in one tensor operation for all heads, then pasted into a numpy
    canvas: no per-axis matplotlib drawing. Greys are absolute weights on the labeling guideline's scale
    (analysis.rendering.absolute_grey, as draw_map), so heads compare as annotators saw them and a near-uniform
    map stays light; with ``scale_each`` each map is scaled linearly to its own maximum instead, which shows
    faint structure but makes every map look as strong as the strongest.
    classes: optional [L][H] class names, drawn as a coloured tag under each map. Returns a PIL image.
    """
    maps = torch.as_tensor(maps).float()
    if maps.ndim != 4 or maps.shape[-1] != maps.shape[-2]:
        raise AttnpatError(f"grid maps must be (layers, heads, n, n), got shape {tuple(maps.shape)}")
    layers, heads, n, _ = maps.shape
    layout = layout or GridLayout(layers, heads)
    cell = layout.cell
    if n > cell:  # max-pooling keeps one-token stripes and bands visible when shrinking
        small = torch.nn.functional.adaptive_max_pool2d(maps, cell)
    else:
        index = torch.arange(cell) * n // cell
        small = maps.index_select(-1, index).index_select(-2, index)  # (L, H, cell, cell)
    if scale_each:
        peak = small.amax(dim=(-1, -2), keepdim=True).clamp(min=1e-12)
        shades = _GREYS[(small / peak * 255).round().to(torch.uint8).numpy()]  # (L, H, cell, cell)
    else:
        shades = absolute_grey(small.numpy())  # (L, H, cell, cell)

    width, height = layout.size
    canvas = np.full((height, width, 3), 255, dtype=np.uint8)
    for layer in range(layers):
        top = layout.margin_top + layer * layout.pitch_y
        for head in range(heads):
            left = layout.margin_left + head * layout.pitch_x
            canvas[top:top + cell, left:left + cell] = shades[layer, head, :, :, None]
            if classes is not None:
                canvas[top + cell:top + cell + layout.band, left:left + cell] = CLASS_STYLE[classes[layer][head]][1]

    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    for head in range(heads):
        draw.text((layout.margin_left + head * layout.pitch_x + cell // 2 - 3, 4), str(head + 1), fill=(60, 60, 60))
    for layer in range(layers):
        draw.text((6, layout.margin_top + layer * layout.pitch_y + cell // 2 - 5), str(layer + 1), fill=(60, 60, 60))
        if classes is not None:
            for head in range(heads):
                tag = CLASS_STYLE[classes[layer][head]][0]
                draw.text((layout.margin_left + head * layout.pitch_x + 3, layout.margin_top + layer * layout.pitch_y
                           + cell), tag, fill=(255, 255, 255))
    return image


def png_as_svg(png_path: Path, svg_path: Path, width: int, height: int) -> Path:
    """Wrap a raster image in an SVG file (the grid is a pixel mosaic; a vector redraw would be slow)."""
    data = base64.b64encode(Path(png_path).read_bytes()).decode()
    Path(svg_path).write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                              f'viewBox="0 0 {width} {height}"><image width="{width}" height="{height}" '
                              f'href="data:image/png;base64,{data}"/></svg>\n')
    return Path(svg_path)


# ---------------------------------------------------------------- figures for tables that came without one

MAX_GRID_SIDE = 256  # more layers or heads than any BERT-family model has (the largest have 48 and 64)


def layer_head_figure(frame, title: str = ""):
    """Heatmaps of a long layer x head table (columns layer, head, <key>, value, optionally ci_low, ci_high, which
    are not drawn): one panel per key value.

    Returns a matplotlib figure, or None when ``frame`` is not such a table. Panels label layers and heads
    1-indexed, like :func:`head_heatmap`.
    """
    columns = [c for c in frame.columns if c not in {"ci_low", "ci_high"}]
    if columns[:2] != ["layer", "head"] or "value" not in columns or len(columns) != 4 or frame.empty:
        return None
    key = [c for c in columns if c not in {"layer", "head", "value"}][0]
    try:
        layer_index, head_index = frame.layer.to_numpy(float), frame["head"].to_numpy(float)
        frame.value.to_numpy(float)
    except (TypeError, ValueError):  # a damaged or foreign table: text where numbers belong
        return None
    for index in (layer_index, head_index):
        if not np.isfinite(index).all() or (index % 1).any() or index.min() < 0 or index.max() >= MAX_GRID_SIDE:
            return None  # not layer/head indices: a figure of that size would exhaust memory
    names = list(dict.fromkeys(frame[key]))[:12]
    layers, heads = int(layer_index.max()) + 1, int(head_index.max()) + 1
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * (0.3 * heads + 1.6), nrows * (0.3 * layers + 1.2)),
                             squeeze=False)
    for ax, name in zip(axes.flat, names):
        rows = frame[frame[key] == name]
        values = np.full((layers, heads), np.nan)
        values[rows.layer.to_numpy(int), rows["head"].to_numpy(int)] = rows.value.to_numpy(float)
        image = draw_head_heatmap(ax, values, title=f"{key} = {name}", fontsize=5)
        fig.colorbar(image, ax=ax, fraction=0.046, format="%.3g")  # no offset text over the title
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
