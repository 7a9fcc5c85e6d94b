"""The keys' side of the app: the ``[keymap]`` applied at start, the help screen and the
command palette's entries, all read from the ``BINDINGS`` lists (see ``keymap.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from textual.app import SystemCommand
from textual.screen import Screen

from .keymap import check_keymap, clashes, keys_of
from .keymap import notice as keymap_notice
from .screens.dialogs import Dialog
from .screens.help import HelpScreen
from .screens.message_dialogs import EditDialog
from .screens.picker import SessionPicker
from .widgets.chat import Conversation
from .widgets.chat_input import ChatInput
from .widgets.messages import SELECTED_BINDINGS


class KeysMixin:
    """Needs ``APP_BINDINGS``, ``SYSTEM_BINDINGS``, ``config`` and ``keymap`` on the app."""

    def _apply_keymap(self) -> None:
        """Give Textual the config's ``[keymap]``, less the entries it cannot use (said in
        one notice; those bindings keep their default keys)."""
        ids = [binding.id for _, bindings in self.binding_groups() for binding in bindings]
        self.keymap, problems = check_keymap(self.config.keymap, ids)
        self.set_keymap(self.keymap)
        if "command_palette" in self.keymap:  # the footer shows the palette by this key
            self.COMMAND_PALETTE_BINDING = self.keymap["command_palette"].split(",")[0]
        if problems:
            self.notify(keymap_notice(problems), severity="warning", markup=False, timeout=10)
        taken = clashes(self.binding_groups(), self.keymap)
        if taken:
            self.notify(f"Keymap: {'; '.join(taken)}.", severity="warning", markup=False,
                        timeout=10)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.binding_groups()))

    @classmethod
    def binding_groups(cls) -> list[tuple[str, list]]:
        """Where each key works, and the BINDINGS list that defines it: every binding
        of the TUI (the help screen, the keymap and the README's table read this)."""
        return [
            ("anywhere", cls.APP_BINDINGS),
            ("message box", ChatInput.BINDINGS),
            ("conversation", Conversation.BINDINGS),
            ("selected message", SELECTED_BINDINGS),
            ("session picker", SessionPicker.BINDINGS),
            ("dialogs", Dialog.BINDINGS),
            ("edit dialog", EditDialog.BINDINGS),
            ("help", HelpScreen.BINDINGS),
            ("anywhere", cls.SYSTEM_BINDINGS),
        ]

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for binding in self.APP_BINDINGS:
            if binding.description:
                key = keys_of(binding, self.keymap)[0]
                help_text = f"{binding.tooltip or binding.description} ({key})"
                yield SystemCommand(binding.description, help_text,
                                    partial(self.run_action, binding.action))
        conversation = self.active_conversation()
        if conversation is not None:  # the message box's actions that are not typing
            for binding in ChatInput.BINDINGS:
                if binding.action in ("editor", "insert_file"):
                    yield SystemCommand(binding.description,
                                        f"{binding.tooltip} ({keys_of(binding, self.keymap)[0]})",
                                        partial(conversation.input.run_action, binding.action))
        yield from super().get_system_commands(screen)
