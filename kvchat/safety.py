"""Untrusted input: model output, files on disk, arguments. Make it safe to show and to parse.

Anything a model wrote or a file held goes through :func:`printable` before
it reaches a terminal, and through :func:`dumps_json` before it is printed as
JSON. Numbers typed by a person go through :func:`ascii_int` (``int()`` and
``str.isdigit`` accept ``²`` and ``①``). Small files that may be anything (a
FIFO, ``/dev/zero``, a huge file) are read with :func:`read_limited`.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

# C0 and C1 control characters except tab and newline: ESC starts ANSI/OSC
# sequences, BEL ends OSC ones, CR can overwrite what is on the line, U+009B
# is a one-character CSI. Bidi overrides and isolates reorder what is shown.
# Lone surrogates (undecodable bytes kept by surrogateescape) cannot be printed.
_BEYOND_C0 = "\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f{_BEYOND_C0}]")
_JSON_UNSAFE = re.compile(f"[{_BEYOND_C0}]")  # json.dumps escapes C0 itself
_DIGITS = re.compile(r"[0-9]{1,18}")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, one_line: bool = False) -> str:
    """``text`` with every control character except tab and newline shown as ``\\xNN``
    (``\\uNNNN`` for bidi controls and lone surrogates); with ``one_line``, tab and
    newline too, for a table cell or a ``key value`` line.

    Escape sequences then print as their letters and do nothing. Rich markup
    is a separate matter: show the result with ``markup=False`` or as ``Text``.
    """
    text = _CONTROL.sub(_escape, text.replace("\r\n", "\n"))
    return text.replace("\t", "\\t").replace("\n", "\\n") if one_line else text


def dumps_json(data: object, indent: int | None = None) -> str:
    """JSON text of ``data`` that keeps non-ASCII letters readable but carries no
    terminal control: C1 characters, DEL, bidi controls and lone surrogates are
    written as ``\\uNNNN`` escapes (``json.dumps`` escapes C0 already)."""
    import json

    text = json.dumps(data, ensure_ascii=False, indent=indent)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def ascii_int(text: str) -> int:
    """The whole number in ``text``: ASCII digits only, at most 18 of them.

    Raises ValueError otherwise (``int()`` would take ``²``, ``①``, ``1_000``,
    spaces and 4,000-digit strings).
    """
    if not isinstance(text, str) or not _DIGITS.fullmatch(text):
        raise ValueError(f"expected a whole number written with 0-9 (got {text!r})")
    return int(text)


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of regular file ``path`` (symlinks followed), at most ``limit`` of them.

    Raises OSError for a missing or unreadable file, ValueError for something
    that is not a regular file (a FIFO is opened without blocking) or that is
    larger than ``limit``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("it is not a regular file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise ValueError(f"it is larger than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
