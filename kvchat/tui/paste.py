"""Bracketed paste that arrives whole and in order, escape characters included.

Textual's ``XTermParser`` (8.2) reads an ESC inside a bracketed paste as the start
of a key sequence: from the first ESC on, the pasted text is typed as keys at
once (the ESC as ``^``), and only the text before it arrives, last, as the
``Paste`` event — ``A\\x1b[31mB\\x1b[0mC D`` pasted became ``^[31mB^[0mC DA``.
:class:`PasteParser` reads everything between ``ESC[200~`` and ``ESC[201~`` as
the pasted text; the message box then shows its control characters literally
(see ``ChatInput``).
"""

from __future__ import annotations

from collections.abc import Generator

from textual import events
from textual._parser import ParseEOF, ParseError, Peek1, Read1, TokenCallback
from textual._xterm_parser import BRACKETED_PASTE_END, BRACKETED_PASTE_START, XTermParser
from textual.driver import Driver
from textual.drivers import linux_driver
from textual.drivers.linux_driver import LinuxDriver


class PasteParser(XTermParser):
    """Textual's terminal parser, except that a bracketed paste is taken verbatim."""

    def parse(self, token_callback: TokenCallback) -> Generator[Read1 | Peek1, str, None]:
        def keep(token) -> None:
            # Textual's own (empty) Paste when it leaves paste mode: ours came first.
            if not (isinstance(token, events.Paste) and not token.text):
                token_callback(token)

        keys = super().parse(keep)
        awaiting = next(keys)
        recent = ""
        while True:
            try:
                character = yield awaiting
            except ParseError as error:  # a timeout or the end of input: Textual's to handle
                try:
                    awaiting = keys.throw(error)
                except StopIteration:
                    return
                continue
            recent = (recent + character)[-len(BRACKETED_PASTE_START):]
            try:
                awaiting = keys.send(character)
            except StopIteration:
                return
            if recent != BRACKETED_PASTE_START:
                continue
            text, ended = yield from self._pasted()
            token_callback(events.Paste(text))
            if not ended:
                return
            for character in BRACKETED_PASTE_END:  # Textual's parser leaves paste mode too
                awaiting = keys.send(character)
            recent = ""

    def _pasted(self) -> Generator[Read1, str, tuple[str, bool]]:
        """Read up to the end of the paste: (the text, whether the end marker came)."""
        text = ""
        while not text.endswith(BRACKETED_PASTE_END):
            try:
                text += yield self.read1()
            except ParseEOF:
                return text, False
        return text[: -len(BRACKETED_PASTE_END)], True


class PasteSafeDriver(LinuxDriver):
    """Textual's Linux/macOS driver reading input with :class:`PasteParser`."""

    def run_input_thread(self) -> None:
        # LinuxDriver.run_input_thread builds its parser from this module global.
        linux_driver.XTermParser = PasteParser
        super().run_input_thread()


def paste_safe(driver_class: type[Driver]) -> type[Driver]:
    """The driver to use instead of ``driver_class`` (Textual's Linux one is replaced)."""
    return PasteSafeDriver if driver_class is LinuxDriver else driver_class
