"""The kvchat Textual app: tabs of conversations, the cache sidebar, dialogs and key bindings.

A thin layer: every action here is one engine or store call run through a
conversation's worker (see ``widgets/chat.py``); replies of several tabs run at
once, and work that needs the model alone goes in the order the shared
:class:`~kvchat.engine.scheduler.Scheduler` decides. Every key is declared
once, in a ``BINDINGS`` list; the footer, the help screen and the command
palette are built from those lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, TabbedContent, Tabs

from kvchat import store
from kvchat.config import Config, ConfigError, load_config, remember
from kvchat.engine.registry import ModelRegistry
from kvchat.engine.scheduler import Scheduler
from kvchat.engine.threads import mlx_event_loop
from kvchat.pool import SessionPool
from kvchat.settings import apply_overrides
from kvchat.themes import kvchat_themes

from .actions import ActionsMixin
from .conflict import Conflicts
from .expiry import ExpiryMixin
from .keys import KeysMixin
from .models import ModelsMixin
from .quitting import Quitter
from .screens.loading import LoadingScreen
from .screens.picker import SessionPicker
from .sharded import ShardedMixin
from .tabs import TabsMixin
from .transfer import TransferMixin
from .widgets.chat import Conversation
from .widgets.sidebar import CacheInfo, CacheSidebar
from .widgets.turn_events import Changed, SessionConflict

# Actions that need an open conversation (and no dialog on top).
_TAB_ACTIONS = {
    "close_tab", "next_tab", "previous_tab", "rename", "save", "trim", "cache_kind",
    "reset_cache", "drop", "regenerate", "stop", "settings", "export",
}


class KvChatApp(ShardedMixin, TabsMixin, ActionsMixin, ModelsMixin, ExpiryMixin, KeysMixin,
                TransferMixin, App):
    """kvchat's terminal UI.

    ``lm`` is a loaded model (tests pass the demo model); without it the app
    loads ``config.model`` behind a loading screen. ``volatile=False`` hides
    timings and memory figures, so snapshots are deterministic.
    """

    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    # Screen classes by terminal size: the sidebar narrows and hides, dialogs tighten.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (70, "-medium"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]

    # The footer shows them in this order, as far as the width goes: help first. Each has
    # an id, which ``[keymap]`` in config.toml may give other keys (see ``keymap.py``).
    APP_BINDINGS = [
        # F1 only: "?" is a character the message box needs.
        Binding("f1", "help", "Help", id="help", tooltip="List every key."),
        Binding("ctrl+t", "new_tab", "New tab", id="new_tab",
                tooltip="Start a new conversation in a new tab."),
        Binding("ctrl+w", "close_tab", "Close tab", id="close_tab", priority=True, show=False,
                tooltip="Close the active tab; unsaved messages are saved first (autosave) "
                        "or a dialog asks."),
        Binding("ctrl+pagedown,alt+right", "next_tab", "Next tab", id="next_tab", show=False),
        Binding("ctrl+pageup,alt+left", "previous_tab", "Previous tab", id="previous_tab",
                show=False),
        Binding("f2", "rename", "Rename", id="rename", show=False,
                tooltip="Rename the active session."),
        Binding("escape", "stop", "Stop", id="stop", tooltip="Stop the reply being written."),
        Binding("ctrl+s", "save", "Save", id="save", tooltip="Save the session, cache included."),
        Binding("ctrl+l", "trim", "Undo/trim", id="trim",
                tooltip="Undo the last turn or trim the history."),
        Binding("f4", "cache_kind", "Cache type", id="cache_kind",
                tooltip="Switch the cache kind of this tab."),
        Binding("f9", "settings", "Settings", id="settings", show=False,
                tooltip="This tab's system prompt, temperature, top-p and max tokens."),
        Binding("ctrl+n", "new_tab_model", "New tab, model…", id="new_tab_model", show=False,
                tooltip="Open a new tab on another model (loaded on demand)."),
        Binding("ctrl+r", "reset_cache", "Reset cache", id="reset_cache", show=False,
                tooltip="Empty the cache; the next turn prefills the whole transcript."),
        Binding("f5", "regenerate", "Regenerate", id="regenerate", show=False,
                tooltip="Replace the last reply with a new one."),
        Binding("f8", "drop", "Drop", id="drop", show=False,
                tooltip="Drop the session from memory, or from disk too."),
        Binding("ctrl+o,f3", "sessions", "Sessions", id="sessions",
                tooltip="Open a saved session."),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar", id="toggle_sidebar", show=False,
                tooltip="Show or hide the cache panel."),
        Binding("f12", "export", "Export…", id="export", show=False,
                tooltip="Write this tab's transcript to a file, as Markdown or JSON."),
        Binding("shift+f12", "import", "Import…", id="import", show=False,
                tooltip="Open a JSON export as a new session (its cache built on first use)."),
    ]
    # Textual's own two, given ids (Textual adds the palette's key when no binding has it).
    SYSTEM_BINDINGS = [
        Binding("ctrl+p", "command_palette", "palette", id="command_palette", priority=True,
                show=False, tooltip="Every action, and the themes."),
        Binding("ctrl+q", "quit", "Quit", id="quit", priority=True, show=False),
    ]
    BINDINGS = APP_BINDINGS + SYSTEM_BINDINGS

    def __init__(
        self,
        config: Config | None = None,
        *,
        lm=None,
        resume: str | None = None,
        volatile: bool = True,
        picker: bool = True,
        config_path: Path | None = None,
        expire_every: float = 15.0,
        settings_flags: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = config or Config()
        # generation settings given on the command line: they win over a saved session's
        self.settings_flags = dict(settings_flags or {})
        self.lm = lm
        self.resume = resume
        self.volatile = volatile
        self.picker_on_start = picker
        self.config_path = config_path
        self.scheduler = Scheduler()
        # The loaded models: each open session holds its own; the app holds its default
        # model (for new tabs). A model no one holds is unloaded.
        self.models = ModelRegistry()
        if lm is not None:
            self.models.retain(lm)
        # Every open tab's session, by name: idle caches go to disk after ``ttl`` seconds
        # or when the caches and models in memory pass ``memory_budget`` bytes.
        self.pool = SessionPool.for_config(self.config, self.models)
        self.expire_every = expire_every
        self._maintaining = False
        self.quitter = Quitter(self)
        self._tab_numbers = 0
        self._theme_ready = False
        self.keymap: dict[str, str] = {}  # the [keymap] entries in use: binding id -> keys

    def get_driver_class(self):
        """Textual's driver, reading bracketed pastes whole (see ``textual_compat.py``).

        ``textual_compat.py`` builds on Textual's private parser modules; if a Textual
        release moves them, Textual's own driver is used (pastes then lose their
        escape characters' order again, but the app runs).
        """
        driver = super().get_driver_class()
        try:
            from .textual_compat import paste_safe
        except ImportError:
            return driver
        return paste_safe(driver)

    # ------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield TabbedContent(id="tabs")
            yield CacheSidebar(volatile=self.volatile, id="sidebar")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        if not self.is_headless:  # a terminal's app: SIGTERM and SIGHUP save, then quit
            self.quitter.listen()
        self._apply_keymap()
        self._register_themes()
        if self.expire_every and self.expire_every > 0:
            self.set_interval(self.expire_every, self.expire_idle, name="expire")
        if self.lm is None:
            self.push_screen(LoadingScreen(f"Loading model {self.config.model}…"))
            self._load_model(self.config.model)
        else:
            self.call_later(self._start)

    def on_unmount(self) -> None:
        if not self.is_headless:
            self.quitter.stop_listening()

    def _register_themes(self) -> None:
        themes, problems = kvchat_themes()
        for theme in themes:
            self.register_theme(theme)
        for problem in problems:
            self.notify(f"Theme skipped: {problem}", severity="warning", markup=False)
        if self.config.theme in self.available_themes:
            self.theme = self.config.theme
        else:
            self.notify(f"Unknown theme {self.config.theme!r}; using kvchat-dark.",
                        severity="warning", markup=False)
            self.theme = "kvchat-dark"
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self._theme_ready = True

    def _theme_changed(self, theme) -> None:
        if self._theme_ready and theme.name != self.config.theme:
            self.config = self.config.override(theme=theme.name)
            try:
                remember(self.config_path, theme=theme.name)
            except ConfigError as error:  # the file does not parse: it was left alone
                self.notify(str(error), severity="warning", markup=False)
            except OSError as error:
                self.notify(f"Could not remember the theme: {error}", severity="warning")

    def _start(self) -> None:
        if self.resume:
            self.open_saved(self.resume)
            return
        sessions = store.list_sessions() if self.picker_on_start else []
        if sessions:
            self.push_screen(SessionPicker(sessions, cancellable=False), self._picked)
        else:
            self.call_later(self.new_tab)

    async def _picked(self, name: str | None) -> None:
        if name is None:
            return
        if name == "":
            await self.new_tab()
        else:
            self.open_saved(name)

    # ------------------------------------------------------------- tabs

    @property
    def main_screen(self) -> Screen:
        """The screen holding the tabs and the sidebar, whatever dialog is on top of it."""
        return self.screen_stack[0]

    @property
    def tabs(self) -> TabbedContent:
        return self.main_screen.query_one("#tabs", TabbedContent)

    @property
    def sidebar(self) -> CacheSidebar:
        return self.main_screen.query_one("#sidebar", CacheSidebar)

    def conversations(self) -> list[Conversation]:
        if not self.screen_stack:  # the app is closing
            return []
        return list(self.main_screen.query(Conversation))

    def active_conversation(self) -> Conversation | None:
        try:
            pane = self.tabs.active_pane
        except Exception:
            return None
        if pane is None:
            return None
        found = pane.query(Conversation)
        return found.first() if found else None

    def _unique_name(self, base: str = "chat") -> str:
        taken = {c.session_name for c in self.conversations()}
        n = 1
        while f"{base}-{n}" in taken or store.exists(f"{base}-{n}"):
            n += 1
        return f"{base}-{n}"

    @on(SessionConflict)
    def _session_conflict(self, event: SessionConflict) -> None:
        Conflicts(self).ask(event.conversation)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.refresh_sidebar()
        conversation = self.active_conversation()
        if conversation is not None and conversation.is_mounted:
            self.call_later(conversation.focus_input)

    @on(Changed)
    def _changed(self, event: Changed) -> None:
        if event.conversation is self.active_conversation():
            self.refresh_sidebar()

    def refresh_sidebar(self) -> None:
        try:
            sidebar = self.sidebar
        except (IndexError, NoMatches):  # the app is closing: nothing left to draw
            return
        conversation = self.active_conversation()
        sidebar.info = CacheInfo.of(conversation) if conversation else None
        self.refresh_bindings()

    # ------------------------------------------------------------- actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in _TAB_ACTIONS:
            if self.lm is None or not self.is_mounted:
                return False
            if len(self.screen_stack) > 1 and action != "stop":
                return False
            conversation = self.active_conversation()
            if conversation is None:
                return None
            if action == "stop" and not conversation.busy:
                return False  # in the footer only while there is something to stop
        if action in ("new_tab", "new_tab_model", "import") and (
                self.lm is None or len(self.screen_stack) > 1):
            return False
        return True

    async def action_new_tab(self) -> None:
        await self.new_tab()

    def idle_conversation(self):
        """The active conversation, or None (saying why) when it is busy or there is none;
        for the actions that must not run during a reply or a job."""
        conversation = self.active_conversation()
        if conversation is None or conversation.refuse_if_busy():
            return None
        return conversation

    def action_next_tab(self) -> None:
        self.tabs.query_one(Tabs).action_next_tab()

    def action_previous_tab(self) -> None:
        self.tabs.query_one(Tabs).action_previous_tab()

    def action_stop(self) -> None:
        conversation = self.active_conversation()
        if conversation is not None and conversation.stop():
            self.notify("Stopping…", timeout=2)

    async def action_quit(self) -> None:
        """Quit, saving every tab with unsaved changes (autosave) or asking (see
        :mod:`~kvchat.tui.quitting`); a second Ctrl+Q quits without waiting."""
        if self.quitter.begin():
            self.run_worker(self.quitter.finish(), group="quit")

    def action_sessions(self) -> None:
        if self._refused():
            return
        self.push_screen(SessionPicker(store.list_sessions()), self._picked)

    def action_toggle_sidebar(self) -> None:
        shown = self.sidebar.display
        self.main_screen.set_class(shown, "-hide-sidebar")
        self.main_screen.set_class(not shown, "-show-sidebar")



def tui_app(*, model: str | None = None, cache: str | None = None, system: str | None = None,
            resume: str | None = None, flags: dict[str, Any] | None = None) -> KvChatApp:
    """The TUI with the config file's settings, overridden by the given options and
    ``flags`` (generation settings by name, None where not given, as
    :func:`kvchat.cli.common.setting_options` passes them); the flags given also win
    over the settings saved with the sessions it opens. :class:`ConfigError` or
    :class:`store.StoreError` says why not."""
    if resume and model is None:
        model = store.summary(resume).model_id
    flags = flags or {}
    config = apply_overrides(load_config(), {"model": model, "cache": cache, "system": system},
                             flags)
    given = {name: getattr(config, name) for name, value in flags.items() if value is not None}
    return KvChatApp(config, resume=resume, settings_flags=given)


def run_tui(**flags) -> int:
    """Start the TUI (:func:`tui_app` says what ``flags`` can be). Returns the exit status."""
    import sys

    try:
        app = tui_app(**flags)
    except (store.StoreError, ConfigError) as error:
        print(f"kvchat: {error}", file=sys.stderr)
        return 2
    return run_app(app)


def run_app(app: KvChatApp) -> int:
    """Run ``app`` until it exits; returns its exit status. Its thread workers run in an
    :class:`~kvchat.engine.threads.MlxThreadPool`, whose threads have ended cleanly when
    this returns, so the process then exits normally."""
    with mlx_event_loop() as loop:
        app.run(loop=loop)
    return after_exit(app)


def after_exit(app: KvChatApp) -> int:
    """Once ``app`` has ended and every worker with it: save what is still unsaved (after a
    signal, or a crash of the UI) where autosave is on, on the app's thread; return the
    exit status. (A sharded run saves through its ring, which is gone by now.)"""
    import sys

    if app.config.autosave and not app.sharded:
        try:
            app.pool.save_unsaved()
        except (store.StoreError, OSError) as error:
            print(f"kvchat: could not save before quitting: {error}", file=sys.stderr)
            return 1
    if app.quitter.signalled is not None:
        return 0
    return app.return_code or 0
