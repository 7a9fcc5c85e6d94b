"""What the copy actions need besides the terminal: a reply's code blocks, and a file
that holds the last copied text for terminals that ignore OSC 52 (the escape
sequence Textual's ``App.copy_to_clipboard`` sends)."""

from __future__ import annotations

from pathlib import Path

from markdown_it import MarkdownIt

from kvchat import locations
from kvchat.atomic import write_atomic

CLIP_FILE = "clipboard.txt"


def code_blocks(text: str) -> list[str]:
    """The code blocks of Markdown ``text`` (fenced or indented), in order, as written,
    parsed as Textual's Markdown widget parses them."""
    tokens = MarkdownIt("gfm-like").parse(text)
    return [t.content for t in tokens if t.type in ("fence", "code_block")]


def keep_copy(text: str) -> Path:
    """Write ``text`` to ``clipboard.txt`` in the data directory (atomically, readable by
    the user only) and return its path."""
    path = locations.data_dir() / CLIP_FILE
    write_atomic(path, text.encode("utf-8", "replace"))
    return path
