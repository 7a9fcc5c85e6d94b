"""Every key of the app, declared once: the footer, the help screen, the command palette
and the ``[keymap]`` of config.toml read these lists."""

from __future__ import annotations

from textual.binding import Binding

# The footer shows them in this order, as far as the width goes: help first. Each has
# an id, which ``[keymap]`` in config.toml may give other keys (see ``keymap.py``).
APP_BINDINGS = [
    # F1 only: "?" is a character the message box needs.
    Binding("f1", "help", "Help", id="help", tooltip="List every key."),
    # priority: the app opens the tab before it takes the next key, so what is typed right
    # after Ctrl+T goes into the new tab's box (a key the focused box saw first would run
    # the action in the box's turn, while the app went on handing keys to the old box)
    Binding(
        "ctrl+t",
        "new_tab",
        "New tab",
        id="new_tab",
        priority=True,
        tooltip="Start a new conversation in a new tab.",
    ),
    Binding(
        "ctrl+w",
        "close_tab",
        "Close tab",
        id="close_tab",
        priority=True,
        show=False,
        tooltip="Close the active tab; unsaved messages are saved first (autosave) "
        "or a dialog asks.",
    ),
    Binding("ctrl+pagedown,alt+right", "next_tab", "Next tab", id="next_tab", show=False),
    Binding("ctrl+pageup,alt+left", "previous_tab", "Previous tab", id="previous_tab", show=False),
    Binding(
        "f2", "rename", "Rename", id="rename", show=False, tooltip="Rename the active session."
    ),
    Binding("escape", "stop", "Stop", id="stop", tooltip="Stop the reply being written."),
    Binding("ctrl+s", "save", "Save", id="save", tooltip="Save the session, cache included."),
    Binding(
        "ctrl+l", "trim", "Undo/trim", id="trim", tooltip="Undo the last turn or trim the history."
    ),
    # shift+F5: F5 brings a new reply, shift+F5 an archived exchange (F6, F7: the message box's)
    Binding(
        "shift+f5",
        "archive",
        "Archive…",
        id="archive",
        show=False,
        tooltip="See the exchanges undo and trim archived, and bring one back.",
    ),
    Binding(
        "f4",
        "cache_kind",
        "Cache type",
        id="cache_kind",
        tooltip="Switch the cache kind of this tab.",
    ),
    Binding(
        "f9",
        "settings",
        "Settings",
        id="settings",
        show=False,
        tooltip="This tab's system prompt, temperature, top-p and max tokens.",
    ),
    Binding(
        "ctrl+n",
        "new_tab_model",
        "New tab, model…",
        id="new_tab_model",
        show=False,
        tooltip="Open a new tab on another model (loaded on demand).",
    ),
    Binding(
        "ctrl+r",
        "reset_cache",
        "Reset cache",
        id="reset_cache",
        show=False,
        tooltip="Empty the cache; the next turn prefills the whole transcript.",
    ),
    Binding(
        "f5",
        "regenerate",
        "Regenerate",
        id="regenerate",
        show=False,
        tooltip="Replace the last reply with a new one.",
    ),
    Binding(
        "f8",
        "drop",
        "Drop",
        id="drop",
        show=False,
        tooltip="Drop the session from memory, or from disk too.",
    ),
    Binding("ctrl+o,f3", "sessions", "Sessions", id="sessions", tooltip="Open a saved session."),
    Binding(
        "ctrl+b",
        "toggle_sidebar",
        "Sidebar",
        id="toggle_sidebar",
        show=False,
        tooltip="Show or hide the cache panel.",
    ),
    Binding(
        "f12",
        "export",
        "Export…",
        id="export",
        show=False,
        tooltip="Write this tab's transcript to a file, as Markdown or JSON.",
    ),
    Binding(
        "shift+f12",
        "import",
        "Import…",
        id="import",
        show=False,
        tooltip="Open a JSON export as a new session (its cache built on first use).",
    ),
]
# Textual's own two, given ids (Textual adds the palette's key when no binding has it).
SYSTEM_BINDINGS = [
    Binding(
        "ctrl+p",
        "command_palette",
        "palette",
        id="command_palette",
        priority=True,
        show=False,
        tooltip="Every action, and the themes.",
    ),
    Binding("ctrl+q", "quit", "Quit", id="quit", priority=True, show=False),
]

# Actions that need an open conversation (and no dialog on top).
TAB_ACTIONS = {
    "close_tab",
    "next_tab",
    "previous_tab",
    "rename",
    "save",
    "trim",
    "archive",
    "cache_kind",
    "reset_cache",
    "drop",
    "regenerate",
    "stop",
    "settings",
    "export",
}
