"""The labeling guideline and its gallery as one HTML page: the instructions of every Label Studio project.

Label Studio shows a project's ``expert_instruction`` (HTML) before and beside each task. The gallery's
images are inlined as data URIs, so the instructions need no file server and stay offline.
"""
from __future__ import annotations

import base64
import re
from pathlib import Path

from markdown_it import MarkdownIt

from analysis.errors import AttnpatError

HERE = Path(__file__).resolve().parent
GUIDELINE = HERE / "guideline.md"
GALLERY = HERE / "gallery" / "README.md"

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def _inline_images(markdown: str, folder: Path) -> str:
    """Replace ![alt](file.png) links, relative to ``folder``, with data URIs."""
    def inline(match: re.Match) -> str:
        path = folder / match.group(2)
        if not path.is_file():
            raise AttnpatError(f"the gallery names {match.group(2)}, which is not in {folder}")
        data = base64.b64encode(path.read_bytes()).decode()
        return f"![{match.group(1)}](data:image/png;base64,{data})"

    return _IMAGE.sub(inline, markdown)


def instructions_html(guideline: Path = GUIDELINE, gallery: Path = GALLERY) -> str:
    """The guideline followed by the reference gallery, rendered to HTML with the gallery images inlined."""
    for path in (guideline, gallery):
        if not path.is_file():
            raise AttnpatError(f"labeling instructions need {path}, which is missing")
    renderer = MarkdownIt("commonmark").enable("table")
    # The guideline links the gallery's README; inside Label Studio the gallery follows on the same page.
    guideline_text = guideline.read_text(encoding="utf-8").replace("(gallery/README.md)", "(#reference-gallery)")
    gallery_text = _inline_images(gallery.read_text(encoding="utf-8"), gallery.parent)
    gallery_text = gallery_text.replace("](../guideline.md)", "](#labeling-guideline)")
    return ('<a id="labeling-guideline"></a>' + renderer.render(guideline_text) + '<hr id="reference-gallery"/>'
            + renderer.render(gallery_text))
