"""The labeling guideline and its gallery as one HTML page: the instructions of every Label Studio project.

Label Studio shows a project's ``expert_instruction`` (HTML) before and beside each task. It strips data:
URIs, so the gallery's images are served by Label Studio itself from the package's gallery folder
(`annotate serve` enables this; annotation.labelstudio attaches the folder to each project).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

from analysis.errors import AttnpatError

HERE = Path(__file__).resolve().parent
GUIDELINE = HERE / "guideline.md"
GALLERY = HERE / "gallery" / "README.md"

_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")
# one gallery table row: | ![alt](file.png) | **label** | `map id` | why. Cues: ... |
_GALLERY_ROW = re.compile(r"^\| !\[([^\]]*)\]\(([^)\s]+\.png)\) \| \*\*([^*]+)\*\* \| `([^`]+)` \| (.*) \|$")
_TABLE_HEAD = re.compile(r"^\| map \| label \| map id \| why \|$|^\|(-+\|)+$")
# Label Studio's instructions panel is about 540 pixels wide: a map in a table cell shrank to 60-90 pixels there
# (a 128-token column to a third of a pixel). Each map gets the panel's width instead, scaled without smoothing
# like the task images; Label Studio keeps <style> and class, and strips style attributes.
GALLERY_CLASS = "attnpat-gallery"
GALLERY_STYLE = (f"<style>.{GALLERY_CLASS} img {{ image-rendering: pixelated; max-width: 100%; height: auto; }}"
                 "</style>")


@dataclass(frozen=True)
class GalleryEntry:
    """One map of the gallery: its image file, label, map id and the caption (a reason, then 'Cues: ...')."""

    image: str
    label: str
    map_id: str
    caption: str

    @property
    def cues(self) -> str:
        """The caption's cue line as cue_text writes it (the table escapes its '|' as '\\|')."""
        return self.caption.split("Cues: ", 1)[1].replace("\\|", "|")


def gallery_entries(markdown: str) -> list[GalleryEntry]:
    """Every map row of the gallery's tables, in order."""
    return [GalleryEntry(match[2], match[3], match[4], match[5])
            for match in map(_GALLERY_ROW.match, markdown.splitlines()) if match]


def _gallery_blocks(markdown: str) -> str:
    """The gallery's tables as one block per map: the image on its own line, then label, map id and reason."""
    lines = []
    for line in markdown.splitlines():
        row = _GALLERY_ROW.match(line)
        if row:
            lines += [f"![{row[1]}]({row[2]})", "", f"**{row[3]}** · `{row[4]}` · {row[5]}", ""]
        elif not _TABLE_HEAD.match(line):
            lines.append(line)
    return "\n".join(lines) + "\n"


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
    # raw HTML off: a token such as <s> or & in a caption is shown as written, never read as a tag
    renderer = MarkdownIt("commonmark", {"html": False}).enable("table")
    # The guideline links the gallery's README and the gallery the guideline; inside Label Studio they share
    # one page, and its sanitiser strips the id attributes an in-page link would need: the links become words.
    guideline_text = re.sub(r"\[([^\]]+)\]\(gallery/README\.md\)", r"\1 (below)",
                            guideline.read_text(encoding="utf-8"))
    gallery_text = _link_images(_gallery_blocks(gallery.read_text(encoding="utf-8")), gallery.parent, image_url)
    gallery_text = re.sub(r"\[([^\]]+)\]\(\.\./guideline\.md\)", r"\1 (above)", gallery_text)
    if image_url is None:
        gallery_text += ("\n\n*This server cannot show the gallery's images; they are in attnpat's "
                         "`annotation/gallery/` folder.*\n")
    return (renderer.render(guideline_text) + "<hr/>" + GALLERY_STYLE
            + f'<div class="{GALLERY_CLASS}">' + renderer.render(gallery_text) + "</div>")
