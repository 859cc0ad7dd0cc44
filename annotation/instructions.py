"""The labeling guideline and its gallery as one HTML page: the instructions of every Label Studio project.

Label Studio shows a project's ``expert_instruction`` (HTML) before and beside each task. It strips data:
URIs, so the gallery's images are served by Label Studio itself from the package's gallery folder
(`annotate serve` enables this; annotation.labelstudio attaches the folder to each project).
"""
from __future__ import annotations

import re
from pathlib import Path

from markdown_it import MarkdownIt

from analysis.errors import AttnpatError

HERE = Path(__file__).resolve().parent
GUIDELINE = HERE / "guideline.md"
GALLERY = HERE / "gallery" / "README.md"

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def _link_images(markdown: str, folder: Path, image_url) -> str:
    """Point ![alt](file.png) links, relative to ``folder``, at ``image_url(file name)``; drop them if it is None."""
    def link(match: re.Match) -> str:
        if not (folder / match.group(2)).is_file():
            raise AttnpatError(f"the gallery names {match.group(2)}, which is not in {folder}")
        return f"![{match.group(1)}]({image_url(match.group(2))})" if image_url else ""

    return _IMAGE.sub(link, markdown)


def instructions_html(guideline: Path = GUIDELINE, gallery: Path = GALLERY, image_url=None) -> str:
    """The guideline followed by the reference gallery, rendered to HTML.

    image_url: file name -> the URL under which the annotator's browser finds a gallery image (Label Studio
    strips data: URIs, so the images must be served); None leaves the images out and says where they are.
    """
    for path in (guideline, gallery):
        if not path.is_file():
            raise AttnpatError(f"labeling instructions need {path}, which is missing")
    renderer = MarkdownIt("commonmark").enable("table")
    # The guideline links the gallery's README and the gallery the guideline; inside Label Studio they share
    # one page, and its sanitiser strips the id attributes an in-page link would need: the links become words.
    guideline_text = re.sub(r"\[([^\]]+)\]\(gallery/README\.md\)", r"\1 (below)",
                            guideline.read_text(encoding="utf-8"))
    gallery_text = _link_images(gallery.read_text(encoding="utf-8"), gallery.parent, image_url)
    gallery_text = re.sub(r"\[([^\]]+)\]\(\.\./guideline\.md\)", r"\1 (above)", gallery_text)
    if image_url is None:
        gallery_text += ("\n\n*This server cannot show the gallery's images; they are in attnpat's "
                         "`annotation/gallery/` folder.*\n")
    return renderer.render(guideline_text) + "<hr/>" + renderer.render(gallery_text)
