"""Contact sheets: many rendered maps on one numbered page, for reviewing a sample quickly."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from PIL import Image, ImageDraw

from analysis.rundir import atomic_write


def contact_sheet(images: Sequence[Path], captions: Sequence[str], out: Path, columns: int = 4,
                  tile: int = 380) -> Path:
    """Tile PNGs (resized to ``tile`` px) in a grid with a caption above each; write ``out`` atomically."""
    rows = (len(images) + columns - 1) // columns
    caption_height = 22
    sheet = Image.new("RGB", (columns * tile, rows * (tile + caption_height)), "white")
    draw = ImageDraw.Draw(sheet)
    for k, (image_path, caption) in enumerate(zip(images, captions)):
        x, y = (k % columns) * tile, (k // columns) * (tile + caption_height)
        with Image.open(image_path) as image:
            image.thumbnail((tile, tile))
            sheet.paste(image, (x, y + caption_height))
        draw.text((x + 6, y + 4), caption, fill="black")
    atomic_write(out, lambda tmp: sheet.save(tmp, format="PNG"))
    return out
