"""What ``kvchat/tui/textual_compat.py`` takes from Textual's private parts still holds.

These fail, loudly and by name, when a Textual release moves or changes a private
piece the module builds on; fix ``textual_compat.py`` (and only it) then.
"""

from __future__ import annotations

import inspect
import os
import threading

import pytest
from textual import events
from textual.app import App
from textual.drivers.linux_driver import LinuxDriver
from textual.widgets import Static

from kvchat.tui import textual_compat
from kvchat.tui.textual_compat import PasteSafeDriver, driver, notifications, screen_text

pytestmark = pytest.mark.anyio


def test_the_private_parser_pieces_are_where_the_module_takes_them():
    from textual import _parser, _xterm_parser

    assert _xterm_parser.BRACKETED_PASTE_START == "\x1b[200~"
    assert _xterm_parser.BRACKETED_PASTE_END == "\x1b[201~"
    parameters = list(inspect.signature(_xterm_parser.XTermParser.parse).parameters)
    assert parameters == ["self", "token_callback"]
    for name in ("ParseEOF", "ParseError", "Peek1", "Read1", "TokenCallback"):
        assert hasattr(_parser, name), f"textual._parser.{name} is gone"
    assert callable(_parser.Parser.read1)


def test_the_driver_loop_still_matches_the_one_it_replaces():
    """PasteSafeDriver.run_input_thread is Textual's loop with another parser: the
    loop it copies still builds its parser the same way and feeds the same calls."""
    source = inspect.getsource(LinuxDriver.run_input_thread)
    for piece in (
        "XTermParser(self._debug)",
        "parser.feed",
        "parser.tick",
        "self.exit_event.is_set()",
        "self.process_message(event)",
        "selector.select(0.1)",
    ):
        assert piece in source, f"LinuxDriver.run_input_thread no longer has {piece}"


async def test_the_driver_reads_a_paste_from_the_terminal_whole():
    """A real pipe in place of the terminal: the driver's input thread turns the bytes
    into a typed key and one whole Paste holding its escape characters."""
    received: list = []
    read_end, write_end = os.pipe()

    class Recording(PasteSafeDriver):
        def process_message(self, message) -> None:
            received.append(message)

    driver = Recording(App(), debug=False, mouse=False)
    driver.fileno = read_end
    thread = threading.Thread(target=driver.run_input_thread)
    thread.start()
    try:
        os.write(write_end, "x\x1b[200~A\x1b[31mB\x1b[201~".encode())
        os.close(write_end)
        deadline = threading.Event()
        for _ in range(100):  # a bounded wait on the thread's output
            if any(isinstance(m, events.Paste) for m in received):
                break
            deadline.wait(0.05)
    finally:
        driver.exit_event.set()
        thread.join(timeout=5)
        os.close(read_end)
    keys = [m.key for m in received if isinstance(m, events.Key)]
    pastes = [m.text for m in received if isinstance(m, events.Paste)]
    assert keys == ["x"]
    assert pastes == ["A\x1b[31mB"]


async def test_screen_text_is_what_the_screen_shows():
    class Two(App):
        def compose(self):
            yield Static("first line")
            yield Static("second: [not markup]", markup=False)

    app = Two()
    async with app.run_test(size=(40, 4)) as pilot:
        await pilot.pause()
        rows = screen_text(app).splitlines()
    assert rows[:2] == ["first line".ljust(40), "second: [not markup]".ljust(40)]
    assert len(rows) == 4


async def test_notifications_and_driver_are_the_running_apps():
    app = App()
    async with app.run_test(size=(40, 4)) as pilot:
        app.notify("first")
        app.notify("second [b]not markup[/b]", markup=False)
        await pilot.pause()
        assert [n.message for n in notifications(app)] == ["first", "second [b]not markup[/b]"]
        written: list[str] = []
        terminal = driver(app)
        original = terminal.write
        terminal.write = written.append
        try:
            app.copy_to_clipboard("x")
        finally:
            terminal.write = original
        assert written == ["\x1b]52;c;eA==\a"]


def test_nothing_else_in_kvchat_reaches_into_textual_private_parts():
    import pathlib
    import re

    package = pathlib.Path(textual_compat.__file__).parents[1]
    private = re.compile(
        r"textual\._|\._compositor|_background_screens|_notifications|"
        r"\._driver\b|from textual\.\w+ import _"
    )
    found = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "textual_compat.py" and private.search(path.read_text())
    ]
    assert found == []
