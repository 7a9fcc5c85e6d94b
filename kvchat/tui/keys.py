"""The keys' side of the app: the ``[keymap]`` applied at start, and the command
palette's entries, all read from the ``BINDINGS`` lists (see ``keymap.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from textual.app import SystemCommand
from textual.binding import Binding, BindingType

from .keymap import check_keymap, clashes, keys_of
from .keymap import notice as keymap_notice
from .screens.dialogs import Dialog
from .screens.help import HelpScreen
from .screens.message_dialogs import EditDialog
from .screens.picker import SessionPicker
from .widgets.chat import Conversation
from .widgets.chat_input import ChatInput
from .widgets.messages import SELECTED_BINDINGS

BindingGroups = list[tuple[str, list[Binding]]]


def declared(bindings: Iterable[BindingType]) -> list[Binding]:
    """A ``BINDINGS`` list's bindings (the TUI declares every one as a :class:`Binding`)."""
    return [binding for binding in bindings if isinstance(binding, Binding)]


def binding_groups(app_bindings: list[Binding], system_bindings: list[Binding]) -> BindingGroups:
    """Where each key works, and the BINDINGS list that defines it: every binding
    of the TUI (the help screen, the keymap and docs/configuration.md's table read this)."""
    return [
        ("anywhere", app_bindings),
        ("message box", declared(ChatInput.BINDINGS)),
        ("conversation", declared(Conversation.BINDINGS)),
        ("selected message", SELECTED_BINDINGS),
        ("session picker", declared(SessionPicker.BINDINGS)),
        ("dialogs", declared(Dialog.BINDINGS)),
        ("edit dialog", declared(EditDialog.BINDINGS)),
        ("help", declared(HelpScreen.BINDINGS)),
        ("anywhere", system_bindings),
    ]


def install_keymap(
    wanted: Iterable[tuple[str, str]],
    groups: BindingGroups,
    set_keymap: Callable[[dict[str, str]], Any],
    notify: Callable[..., Any],
) -> dict[str, str]:
    """Give Textual (``set_keymap``) the config's ``[keymap]`` (``wanted``), less the
    entries it cannot use (said in one notice; those bindings keep their default keys);
    return the entries in use."""
    ids = [binding.id for _, bindings in groups for binding in bindings if binding.id is not None]
    keymap, problems = check_keymap(wanted, ids)
    set_keymap(keymap)
    if problems:
        notify(keymap_notice(problems), severity="warning", markup=False, timeout=10)
    taken = clashes(groups, keymap)
    if taken:
        notify(f"Keymap: {'; '.join(taken)}.", severity="warning", markup=False, timeout=10)
    return keymap


def system_commands(
    app_bindings: list[Binding],
    keymap: dict[str, str],
    run_action: Callable[[str], Any],
    conversation: Conversation | None,
) -> Iterable[SystemCommand]:
    """The palette's entries for the app's bindings (run by ``run_action``) and for the
    message box's actions that are not typing (when a ``conversation`` is open)."""
    for binding in app_bindings:
        if binding.description:
            key = keys_of(binding, keymap)[0]
            help_text = f"{binding.tooltip or binding.description} ({key})"
            yield SystemCommand(binding.description, help_text, partial(run_action, binding.action))
    if conversation is not None:
        for binding in declared(ChatInput.BINDINGS):
            if binding.action in ("editor", "insert_file"):
                yield SystemCommand(
                    binding.description,
                    f"{binding.tooltip} ({keys_of(binding, keymap)[0]})",
                    partial(conversation.input.run_action, binding.action),
                )
