"""How a single attention map is drawn for people, and the measurable cues printed beside it.

This is the rendering the labeling guideline (annotation/guideline.md) fixes, used for every image an
annotator sees (Label Studio tasks, the gallery) and for the app's large map:

- **absolute weights**, as in Kovaleva et al.'s Figure 1: one fixed scale for every map, white = 0 and
  black = 1. Grey levels follow the square root of the weight, so that broad attention of 1-5% per
  cell is a visible light grey (uniform attention over 100 tokens is 10% grey) while a strong stripe
  stays dark. A map is never scaled to its own maximum in the main panel: scaled that way, the faint
  speckle of a near-uniform map turns into dark spots and the map looks heterogeneous.
- **crisp pixels**: every token is a square of at least ``min_cell`` pixels, nearest-neighbour, so a
  one-token column stays visible at 128 tokens;
- **a max-scaled inset** beside the map (linear, scaled to the map's maximum) to locate faint structure;
  the class is judged on the main panel;
- **token marks in strips outside the map**: [CLS] red, [SEP] blue, '.' and ',' green, so nothing
  covers the column it marks.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw

from analysis.errors import AttnpatError
from analysis.stats import named_profile

MARK_COLOURS = {"[CLS]": (214, 39, 40), "<s>": (214, 39, 40), "[SEP]": (31, 119, 180), "</s>": (31, 119, 180),
                ".": (44, 160, 44), ",": (44, 160, 44)}
STRIP = 6  # pixels of the token-mark strips above and left of the map
GAP = 8  # pixels between the map and its inset


# How far a row's sum may stray from 1: maps stored as float16 or computed in bfloat16 are off by well under 1%.
ROW_SUM_TOLERANCE = 0.02


def check_attention_map(attn, tokens: list[str] | None = None, *, rows_sum_to_one: bool = True) -> np.ndarray:
    """attn as a float32 (n, n) array, n >= 1, after checking it is a map the absolute 0..1 scale can draw: square,
    finite, weights in [0, 1] and, with ``rows_sum_to_one``, every row summing to 1 (a softmax row; norm and
    rollout rows are renormalised to 1 too). Anything else is an AttnpatError: drawn, weights above 1 would all be
    black and a map of zeros all white, an empty-looking picture an annotator would label. tokens: n or None."""
    attn = np.asarray(attn, dtype=np.float32)
    if attn.ndim != 2 or attn.shape[0] != attn.shape[1] or attn.shape[0] == 0:
        raise AttnpatError(f"an attention map must be square (n, n) with n >= 1, got shape {attn.shape}")
    if not np.isfinite(attn).all() or (attn < 0).any():
        raise AttnpatError("an attention map must be finite and non-negative")
    if attn.max() > 1 + ROW_SUM_TOLERANCE:
        raise AttnpatError(f"an attention map holds weights in [0, 1], got a maximum of {attn.max():.3g}")
    if rows_sum_to_one:
        sums = attn.sum(1, dtype=np.float64)
        off = int(np.abs(sums - 1).argmax())
        if abs(sums[off] - 1) > ROW_SUM_TOLERANCE:
            raise AttnpatError(f"each row of an attention map must sum to 1, but row {off} sums to {sums[off]:.3g}")
    if tokens is not None and len(tokens) != attn.shape[0]:
        raise AttnpatError(f"{len(tokens)} tokens for a map of size {attn.shape[0]}")
    return attn


def absolute_grey(attn: np.ndarray) -> np.ndarray:
    """attn: (n, n) weights in [0, 1] -> (n, n) uint8 grey, 255 = weight 0, 0 = weight 1 (square-root scale)."""
    return (255.0 * (1.0 - np.sqrt(np.clip(attn, 0.0, 1.0)))).round().astype(np.uint8)


def max_scaled_grey(attn: np.ndarray) -> np.ndarray:
    """attn: (n, n) -> (n, n) uint8 grey, linear, black = the map's own maximum."""
    peak = max(float(attn.max()), 1e-9)
    return (255.0 * (1.0 - np.clip(attn / peak, 0.0, 1.0))).round().astype(np.uint8)


def cell_size(n: int, panel: int = 512, min_cell: int = 3) -> int:
    """Pixels per token so that an n-token map fills about ``panel`` pixels, never under ``min_cell``."""
    return max(min_cell, math.ceil(panel / max(n, 1)))


def _upscale(grey: np.ndarray, cell: int) -> Image.Image:
    return Image.fromarray(grey, mode="L").resize((grey.shape[1] * cell, grey.shape[0] * cell), Image.NEAREST)


def render_map(attn: np.ndarray, tokens: list[str] | None = None, *, panel: int = 512, inset: bool = True,
               min_cell: int = 3) -> Image.Image:
    """The guideline's picture of one map. attn: (n, n), rows = queries, columns = keys; tokens: n or None.

    Returns an RGB image: the absolute-weight map (about ``panel`` pixels square) with token-mark strips on
    its top and left edges and, if ``inset``, a max-scaled copy a quarter of its size to the right.
    """
    attn = check_attention_map(attn, tokens)
    n = attn.shape[0]
    cell = cell_size(n, panel, min_cell)
    main = _upscale(absolute_grey(attn), cell)
    side = max(1, cell // 4) if inset else 0
    small = _upscale(max_scaled_grey(attn), side) if inset else None
    width = STRIP + main.width + (GAP + small.width if small else 0)
    image = Image.new("RGB", (width, STRIP + main.height), "white")
    image.paste(main.convert("RGB"), (STRIP, STRIP))
    if small is not None:
        image.paste(small.convert("RGB"), (STRIP + main.width + GAP, STRIP))
    draw = ImageDraw.Draw(image)
    for position, token in enumerate(tokens or []):
        colour = MARK_COLOURS.get(token)
        if colour is None:
            continue
        start = STRIP + position * cell
        draw.rectangle([start, 0, start + cell - 1, STRIP - 2], fill=colour)  # above the key column
        draw.rectangle([0, start, STRIP - 2, start + cell - 1], fill=colour)  # left of the query row
    return image


# The cues printed beside each map. Each is one profile scalar (analysis.stats.map_profile) or a sum of them.
CUE_NAMES = ("top_column", "rows_on_top_column", "band", "broadness", "excess_over_uniform")


def map_cues(attn: np.ndarray) -> dict[str, float]:
    """Measurable cues of one map (n, n), each in [0, 1]:

    top_column: mean share of a row's weight on the map's heaviest key column;
    rows_on_top_column: share of rows whose heaviest key is that column;
    band: mean share of a row's weight on itself and its two neighbours (offsets -1, 0, +1);
    broadness: mean row entropy / log n (1 = uniform attention);
    excess_over_uniform: mean over rows of sum_j (a_ij - 1/n)+ (0 = uniform, near 1 = one key per row).
    """
    attn = np.asarray(attn, dtype=np.float32)
    return cues_of_profile(named_profile(torch.from_numpy(attn)))


def cues_of_profile(profile: dict[str, float]) -> dict[str, float]:
    """:func:`map_cues` from a map's profile already computed ({PROFILE_NAMES name: value})."""
    return {
        "top_column": profile["top1_column_all"],
        "rows_on_top_column": profile["rows_on_top_column"],
        "band": profile["band-1"] + profile["band+0"] + profile["band+1"],
        "broadness": profile["broadness"],
        "excess_over_uniform": profile["excess_over_uniform"],
    }


def top_column_token(attn: np.ndarray, tokens: list[str] | None) -> str | None:
    """The token of the heaviest key column (None without tokens)."""
    if not tokens:
        return None
    return tokens[int(np.asarray(attn).mean(0).argmax())]


def cue_text(attn: np.ndarray, tokens: list[str] | None = None) -> str:
    """One line of cues for an annotator, e.g. 'n 57 | top column 0.62 ([CLS]) on 95% of rows | band 0.08 | ...'."""
    # each cue is a share in [0, 1]: float error (an entropy of exactly one key per row is -0.0) is not shown as
    # "-0.00" to an annotator
    cues = {name: min(max(value, 0.0), 1.0) + 0.0 for name, value in map_cues(attn).items()}
    where = top_column_token(attn, tokens)
    column = f"top column {cues['top_column']:.2f}" + (f" ({where})" if where else "")
    return (f"n {len(attn)} | {column} on {cues['rows_on_top_column']:.0%} of rows | band {cues['band']:.2f}"
            f" | broadness {cues['broadness']:.2f} | excess over uniform {cues['excess_over_uniform']:.2f}")
