"""Small pieces of text that the package's messages share: rank lists, shortened lines, red headlines.

Imports nothing but the standard library, so the version check (before torch is imported) and the
grader (which never imports torch) can use it too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

RED, RESET = "\x1b[31m", "\x1b[0m"


def ranks_phrase(ranks: Sequence[int]) -> str:
    """`rank 2` or `ranks 0, 1, 3`."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def shorten(text: str, width: int) -> str:
    """`text`, cut to `width` characters with `...` at the end if it is longer."""
    return text if len(text) <= width else text[: width - 3] + "..."


# Terminal escape sequences: CSI (colours, cursor moves), OSC (titles, OSC-8 links) and the rest of ESC's forms.
_ESCAPES = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[PX^_][^\x1b]*(\x1b\\)?|[@-Z\\-_])")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """`text` with terminal escape sequences and other control characters (bidirectional overrides included)
    removed: what a student's code says reaches a report, a terminal or a feedback page as plain text only."""
    text = _ESCAPES.sub("", text)
    if not keep_newlines:
        text = text.replace("\n", " ").replace("\t", " ")
    return _CONTROLS.sub("", text.replace("\r", "") if keep_newlines else text)


def red_headline(name: str, text: str) -> str:
    """`Name: text` with the name in red, as IPython shows an exception's first line."""
    return f"{RED}{name}{RESET}: {text}"


class RedTraceback:
    """For exceptions whose traceback would only show the package's own frames: IPython shows
    `_render_traceback_()` in their place, the exception's name in red, its headline, then its details."""

    shown_name: str | None = None  # the name shown; the class's own if None
    headline: str
    details: list[str]

    def _render_traceback_(self) -> list[str]:
        return [red_headline(self.shown_name or type(self).__name__, self.headline), *self.details]
