"""Model output is untrusted text: make it safe to put on a terminal."""

from __future__ import annotations

import re

# C0 and C1 control characters except tab and newline: ESC starts ANSI/OSC
# sequences, BEL ends OSC ones, CR can overwrite what is on the line.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character except tab and newline shown as ``\\xNN``.

    Escape sequences then print as their letters and do nothing. Rich markup
    is a separate matter: show the result with ``markup=False`` or as ``Text``.
    """
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\r\n", "\n"))
