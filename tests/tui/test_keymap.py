"""The keymap: ``[keymap]`` in config.toml gives bindings other keys, through Textual's
keymap; the footer, the help screen and the palette show them; bad entries are a notice."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Footer

from kvchat.config import Config, parse_config
from kvchat.tui.app import KvChatApp
from kvchat.tui.keymap import keymap_table, valid_key
from kvchat.tui.screens.help import HelpScreen
from kvchat.tui.textual_compat import notifications

from .conftest import SIZE, settle, widget_text

pytestmark = pytest.mark.anyio
KEYMAP_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _app(demo_model, *keymap: tuple[str, str]) -> KvChatApp:
    config = Config(model="demo", max_tokens=8, autosave=False, keymap=keymap)
    return KvChatApp(config, lm=demo_model, volatile=False)


def _notices(app) -> list[str]:
    return [n.message for n in notifications(app)]


def _all_bindings():
    return [b for _, bindings in KvChatApp.binding_groups() for b in bindings]


def test_every_binding_has_a_unique_id():
    ids = [b.id for b in _all_bindings()]
    assert None not in ids and len(ids) == len(set(ids)) > 25
    assert "send" in ids and "quit" in ids and "dialog_cancel" in ids


def test_the_docs_list_every_id_with_its_default_keys():
    table = keymap_table(KvChatApp.binding_groups())
    assert table in KEYMAP_DOC.read_text(encoding="utf-8"), (
        "docs/configuration.md's [keymap] table is out of date; paste this:\n" + table
    )
    assert "| `new_tab` | anywhere | `ctrl+t` | New tab |" in table


@pytest.mark.parametrize(
    "key",
    [
        "ctrl+s",
        "f5",
        "slash",
        "?",
        "a",
        "shift+enter",
        "alt+left",
        "ctrl+pagedown",
        "question_mark",
        "space",
    ],
)
def test_keys_textual_knows(key):
    assert valid_key(key)


@pytest.mark.parametrize(
    "key",
    ["ctrl+zz", "", "ctrl+", "hyperdrive+a", "ctrl+ctrl+a", "f99", "enterr", "\x1b", " ", "<any>"],
)
def test_keys_textual_does_not_know(key):
    assert not valid_key(key)


async def test_a_remapped_key_works_the_old_one_does_not_and_both_screens_say_so(demo_model, home):
    # (not f6 or f7: TextArea, the message box, has them)
    app = _app(
        demo_model,
        ("new_tab", "f11"),
        ("send", "shift+f11"),
        ("save", "f10"),
        ("command_palette", "shift+f10"),
    )
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert not _notices(app)
        footer = widget_text(app.screen.query_one(Footer))
        assert "f10 Save" in footer and "^s" not in footer
        assert footer.rstrip().endswith("shift+f10 palette")

        await pilot.press("ctrl+t")  # the old key: nothing
        await settle(pilot)
        assert len(app.conversations()) == 1
        await pilot.press("f11")
        await settle(pilot)
        assert len(app.conversations()) == 2

        conversation = app.active_conversation()
        await pilot.press(*"hi", "enter")  # Enter no longer sends: a new line
        await settle(pilot, conversation)
        assert conversation.input.text == "hi\n" and conversation.session.messages == []
        await pilot.press("shift+f11")
        await settle(pilot, conversation)
        assert conversation.session.messages[0] == {"role": "user", "content": "hi\n"}

        await pilot.press("f1")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        table = app.screen.query_one("#help-table")
        rows = {
            str(table.get_row_at(i)[2]): str(table.get_row_at(i)[1]) for i in range(table.row_count)
        }
        assert rows["New tab"] == "f11" and rows["Send"] == "shift+f11"
        assert rows["Save"] == "f10" and rows["Undo/trim"] == "^l"  # not remapped: as before

        commands = {c.title: c.help for c in app.get_system_commands(app.screen)}
        assert commands["New tab"].endswith("(f11)")


async def test_bad_entries_are_one_notice_and_the_rest_apply(demo_model, home):
    app = _app(
        demo_model,
        ("nope", "f11"),
        ("save", "ctrl+zz"),
        ("trim", "f11,\x1b[A"),
        ("toggle_sidebar", "f11"),
    )
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        notices = _notices(app)
        assert notices == [
            "Keymap entries left out (default keys kept): unknown id 'nope'; "
            "save = 'ctrl+zz' is not a key Textual knows; "
            "trim = 'f11,\\x1b[A' is not a key Textual knows."
        ]
        keys = {b.binding.id: key for key, b in app.screen.active_bindings.items()}
        assert keys["save"] == "ctrl+s" and keys["trim"] == "ctrl+l"
        shown = app.sidebar.display
        await pilot.press("f11")  # the good entry applies
        await pilot.pause()
        assert app.sidebar.display is not shown


async def test_a_key_taken_from_another_binding_says_so_once(demo_model, home):
    app = _app(demo_model, ("new_tab", "ctrl+s"))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+s")  # now a new tab, not a save
        await settle(pilot)
        await pilot.press("ctrl+s")
        await settle(pilot)
        assert len(app.conversations()) == 3
        assert [n for n in _notices(app) if n.startswith("Keymap")] == [
            "Keymap: ctrl+s was save's key; it now does new_tab."
        ]


async def test_the_docs_example_applies_cleanly_and_swaps_enter(demo_model, home):
    text = KEYMAP_DOC.read_text(encoding="utf-8")
    example = text[text.index("```toml\n[keymap]") + 8 :]
    config = parse_config(example[: example.index("```")])
    app = KvChatApp(config.override(max_tokens=8), lm=demo_model, volatile=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert not _notices(app) and app.keymap["save"] == "f10"
        conversation = app.active_conversation()
        await pilot.press(*"one", "enter", *"two", "ctrl+j")
        await settle(pilot, conversation)
        assert conversation.session.messages[-2] == {"role": "user", "content": "one\ntwo"}
