"""Python warnings as one line each: `file:line: Category: message`, without the source line that Python prints
under it by default (a line of our code means nothing to someone running a script, and breaks the log's one
line per event). Entry points call `one_line_warnings()` first; nothing changes at import."""

from __future__ import annotations

import warnings


def one_line(message, category, filename, lineno, line=None) -> str:
    """warnings.formatwarning's signature; the message's own line breaks become spaces."""
    text = " ".join(str(message).split())
    return f"{filename}:{lineno}: {category.__name__}: {text}\n"


def one_line_warnings() -> None:
    """From now on, this process prints each warning as one line (`one_line`)."""
    warnings.formatwarning = one_line
