"""HTML reduced to readable text with the standard library's parser.

Scripts, styles and other non-content elements are dropped; block elements end lines;
runs of whitespace collapse. Not a renderer: enough for a model to read a page.
"""

from __future__ import annotations

import html.parser
import re

__all__ = ["html_to_text"]

_SKIPPED = frozenset(
    {"script", "style", "noscript", "template", "svg", "canvas", "iframe", "object", "head"}
)
_BLOCKS = frozenset(
    {
        "p", "div", "br", "li", "ul", "ol", "tr", "table", "section", "article", "header",
        "footer", "nav", "aside", "main", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
        "blockquote", "dd", "dt", "dl", "hr", "figure", "figcaption", "form", "title",
    }
)  # fmt: skip
_SPACES = re.compile(r"[ \t\r\f\v\u00a0]+")
_BLANK_LINES = re.compile(r"\n\s*\n+")


class _Extractor(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title: list[str] = []
        self._skipping = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        elif tag in _SKIPPED:
            self._skipping += 1
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCKS:  # <br/>, <hr/>
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in _SKIPPED and self._skipping:
            self._skipping -= 1
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title.append(data)
        elif not self._skipping:
            self.parts.append(data)


def html_to_text(markup: str) -> tuple[str, str]:
    """(title, text) of an HTML document."""
    parser = _Extractor()
    parser.feed(markup)
    parser.close()
    title = " ".join("".join(parser.title).split())
    return title, tidy("".join(parser.parts))


def tidy(text: str) -> str:
    """Collapses runs of spaces and blank lines; trims each line."""
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
