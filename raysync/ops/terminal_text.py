"""Strings from the hub as a terminal may print them: control characters escaped.

Model ids, subscriber and class names, node ids and errors are whatever users and their
code made them. Printed raw, an ANSI escape in one repaints or clears the screen, retitles
the window or hides what follows, and a newline forges a line of its own. ``raysync
status`` prints every such string through :func:`printable`, which writes each C0 control
character (newline and ESC included), DEL, each C1 control character (CSI, ``0x9b``,
included), the Unicode line and paragraph separators and the bidirectional overrides as
Python writes them in a string literal (``\\x1b``, ``\\n``, ``\\u202e``); and as rich text
(:func:`cell`), never markup.

Example:
    >>> printable("policy\\x1b[2J\\nv2")
    'policy\\\\x1b[2J\\\\nv2'
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported where a table is drawn: `raysync --help` stays fast
    from rich.text import Text

__all__ = ["cell", "printable"]


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""C0, DEL, C1; line and paragraph separators; bidirectional embeddings, overrides, isolates."""


def printable(text: Any) -> str:
    """``str(text)`` with every control character escaped as in a Python string literal.

    Example:
        >>> printable("a\\tb\\x9b")
        'a\\\\tb\\\\x9b'
    """
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], str(text))


def cell(value: Any, style: str = "") -> Text:
    """A table cell of a string from the hub: :func:`printable` text, never rich markup.

    Example:
        >>> cell("policy[/lora]\\n").plain
        'policy[/lora]\\\\n'
    """
    from rich.text import Text

    return Text(printable(value), style=style)
