"""Every use of Textual's private modules and attributes, in one place.

Textual has no public API for two things kvchat needs; both live here, and
``tests/tui/test_textual_compat.py`` fails loudly when a Textual release changes
what they rely on:

- **Bracketed paste taken whole.** Textual's ``XTermParser`` (8.2) reads an ESC
  inside a bracketed paste as the start of a key sequence: from the first ESC on,
  the pasted text is typed as keys at once (the ESC as ``^``), and only the text
  before it arrives, last, as the ``Paste`` event — ``A\\x1b[31mB\\x1b[0mC D``
  pasted became ``^[31mB^[0mC DA``. :class:`PasteParser` reads everything between
  ``ESC[200~`` and ``ESC[201~`` as the pasted text; the message box then shows its
  control characters literally (see ``ChatInput``). :class:`PasteSafeDriver` is
  Textual's Linux driver reading input through it (a driver class is public API:
  ``App.get_driver_class``); Textual's modules are not modified.
- **What tests read of a running app** (:func:`screen_text`, :func:`notifications`,
  :func:`driver`): the screen as plain text (what ``App.export_screenshot`` renders,
  as text rather than SVG), the notifications on show, and the driver the app
  writes to the terminal through.
"""

from __future__ import annotations

import io
import os
import selectors
from codecs import getincrementaldecoder
from collections.abc import Generator

from rich.console import Console
from textual import events
from textual._parser import ParseEOF, ParseError, Peek1, Read1, TokenCallback
from textual._xterm_parser import BRACKETED_PASTE_END, BRACKETED_PASTE_START, XTermParser
from textual.driver import Driver
from textual.drivers.linux_driver import LinuxDriver
from textual.notifications import Notification


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
            recent = (recent + character)[-len(BRACKETED_PASTE_START) :]
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
        """``LinuxDriver.run_input_thread`` (Textual 8.2), with :class:`PasteParser`."""
        selector = selectors.SelectSelector()
        selector.register(self.fileno, selectors.EVENT_READ)
        parser = PasteParser(self._debug)
        decode = getincrementaldecoder("utf-8")().decode

        def process(ready: list[tuple[selectors.SelectorKey, int]], final: bool = False) -> None:
            for index, (_key, mask) in enumerate(ready):
                if mask & selectors.EVENT_READ:
                    last = index == len(ready) - 1
                    data = decode(os.read(self.fileno, 4096), final=final and last)
                    if not data:  # stdin is a pipe that ended
                        break
                    for event in parser.feed(data):
                        self.process_message(event)
            for event in parser.tick():
                self.process_message(event)

        try:
            while not self.exit_event.is_set():
                process(selector.select(0.1))
            selector.unregister(self.fileno)
            process(selector.select(0.1), final=True)
        finally:
            selector.close()
            try:
                for _event in parser.feed(""):
                    pass
            except (EOFError, ParseError):
                pass


def paste_safe(driver_class: type[Driver]) -> type[Driver]:
    """The driver to use instead of ``driver_class`` (Textual's Linux one is replaced)."""
    return PasteSafeDriver if driver_class is LinuxDriver else driver_class


def screen_text(app) -> str:
    """What the terminal shows now, as plain text (one line per row), rendered as
    ``App.export_screenshot`` renders the screen (through the screen's compositor)."""
    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        record=True,
        force_terminal=True,
        color_system="truecolor",
        legacy_windows=False,
    )
    console.print(
        app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    )
    return console.export_text()


def notifications(app) -> list[Notification]:
    """The notifications the app shows now, oldest first."""
    return list(app._notifications)


def driver(app) -> Driver:
    """The driver a running app writes to the terminal through."""
    return app._driver
