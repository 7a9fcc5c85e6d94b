"""The kvchat Textual app: tabs of conversations, the cache sidebar, dialogs and key bindings.

A thin layer: every action here is one engine or store call run through a
conversation's worker (see ``tab/turns.py`` and ``tab/jobs.py``); replies of several tabs run at
once, and work that needs the model alone goes in the order the shared
:class:`~kvchat.engine.generation.scheduler.Scheduler` decides. Every key is declared
once, in a ``BINDINGS`` list; the footer, the help screen and the command
palette are built from those lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from textual import on
from textual.app import SystemCommand
from textual.screen import Screen

from kvchat import store
from kvchat.config import Config
from kvchat.engine.generation.scheduler import Scheduler
from kvchat.engine.models.registry import ModelRegistry
from kvchat.runtime.pool import SessionPool

from .actions import TabActions
from .bindings import APP_BINDINGS, SYSTEM_BINDINGS, TAB_ACTIONS
from .expiry import ExpiryTicker
from .export_actions import ExportActions
from .keys import BindingGroups, binding_groups, install_keymap, system_commands
from .layout import TabbedLayout
from .models import ModelLoader
from .quitting import Quitter
from .save_conflicts import Conflicts
from .screens.help import HelpScreen
from .screens.picker import SessionPicker, unsaved_drafts
from .sharded import ONE_TAB, ShardedRun
from .tab_closer import TabCloser
from .tabs import TabController
from .theming import install_themes, remember_theme
from .widgets.chat import Conversation, SessionConflict


class KvChatApp(TabbedLayout):
    """kvchat's terminal UI.

    ``lm`` is a loaded model (tests pass the demo model); without it the app
    loads ``config.model`` behind a loading screen. ``volatile=False`` hides
    timings and memory figures, so snapshots are deterministic.

    Its screen (the tabs, the sidebar) is its base's, :class:`TabbedLayout`. The work is
    done by collaborators the app holds: ``tab_control`` (a :class:`TabController`: tabs
    opened, resumed), ``tab_closer`` (a :class:`TabCloser`), ``tab_actions`` (a
    :class:`TabActions`: what the keys do to the active tab), ``model_loader`` (a :class:`ModelLoader`), ``conflicts`` (a
    :class:`Conflicts`: a session another kvchat saved meanwhile), ``exports`` (an
    :class:`ExportActions`: export, import), ``expiry`` (an :class:`ExpiryTicker`: idle
    caches to disk), ``quitter`` (a :class:`Quitter`) and, in a sharded run, ``shards`` (a
    :class:`ShardedRun`). Its ``action_*`` methods call them. Each sees the app as an
    :class:`~kvchat.tui.app_view.AppView` and is given the others it calls.
    """

    CSS_PATH = "kvchat.tcss"
    TITLE = "kvchat"
    # Screen classes by terminal size: the sidebar narrows and hides, dialogs tighten.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (70, "-medium"), (100, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]

    # Every key of the app, declared in bindings.py (the footer's order, their ids).
    APP_BINDINGS = APP_BINDINGS
    SYSTEM_BINDINGS = SYSTEM_BINDINGS
    BINDINGS = [*APP_BINDINGS, *SYSTEM_BINDINGS]

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
        self.expiry = ExpiryTicker(
            self.pool,
            self.scheduler,
            tabs=self.conversations,
            call_from_thread=self.call_from_thread,
            run_worker=lambda work: self.run_worker(work, name="expire", group="pool", thread=True),
            done=self._expired,
        )
        self.exports = ExportActions(
            push_screen=self.push_screen, notify=self.notify, open_saved=self.open_saved
        )
        self.quitter = Quitter(self)
        self.shards: ShardedRun | None = None  # see shard()
        self.tab_control = TabController(self)
        self.tab_closer = TabCloser(self)
        self.tab_actions = TabActions(self, self.tab_closer)
        self.model_loader = ModelLoader(self, self.tab_control)
        self.conflicts = Conflicts(self, self.tab_control)
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

    def on_mount(self) -> None:
        if not self.is_headless:  # a terminal's app: SIGTERM and SIGHUP save, then quit
            self.quitter.listen()
        self.keymap = install_keymap(
            self.config.keymap, self.binding_groups(), self.set_keymap, self.notify
        )
        if "command_palette" in self.keymap:  # the footer shows the palette by this key
            # this app's own (Textual reads it from the instance), not every app's
            self.COMMAND_PALETTE_BINDING = self.keymap["command_palette"].split(",")[0]  # type: ignore[misc]
        install_themes(self, self.config.theme)
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self._theme_ready = True
        if self.expire_every and self.expire_every > 0:
            self.set_interval(self.expire_every, self.expire_idle, name="expire")
        if self.lm is None:
            self.push_screen(self.tab_control.loading_screen(f"Loading model {self.config.model}…"))
            self.model_loader.load_default(self.config.model)
        else:
            self.call_later(self.tab_control.open_first)

    def on_unmount(self) -> None:
        if not self.is_headless:
            self.quitter.stop_listening()

    def _theme_changed(self, theme) -> None:
        if self._theme_ready and theme.name != self.config.theme:
            self.config = self.config.override(theme=theme.name)
            remember_theme(self.config_path, theme.name, self.notify)

    # ------------------------------------------------------------- tabs

    async def new_tab(self) -> Conversation | None:
        return await self.tab_control.new_tab()

    def open_saved(self, name: str) -> None:
        self.tab_control.open_saved(name)

    @on(SessionConflict)
    def _session_conflict(self, event: SessionConflict) -> None:
        self.conflicts.ask(event.conversation)

    # ------------------------------------------------------------- actions

    def footer_inputs(self) -> tuple[object, ...]:
        return (self.lm is None, *super().footer_inputs())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in TAB_ACTIONS:
            if self.lm is None:
                return False
            if len(self.screen_stack) > 1 and action != "stop":
                return False
            conversation = self.active_conversation()
            if conversation is None:
                return None
            if action == "stop" and not conversation.busy:
                return False  # in the footer only while there is something to stop
        if action in ("new_tab", "new_tab_model", "import") and (
            self.lm is None or len(self.screen_stack) > 1
        ):
            return False
        return True

    async def action_new_tab(self) -> None:
        await self.new_tab()

    def action_stop(self) -> None:
        conversation = self.active_conversation()
        if conversation is not None and conversation.turns.stop():
            self.notify("Stopping…", timeout=2)

    def quitting(self) -> bool:
        """True once a quit has begun (see :mod:`~kvchat.tui.quitting`): no message starts."""
        return self.quitter.underway

    async def action_quit(self) -> None:
        """Quit, saving every tab with unsaved changes (autosave) or asking (see
        :mod:`~kvchat.tui.quitting`); a second Ctrl+Q quits without waiting."""
        if self.quitter.begin():
            self.run_worker(self.quitter.finish(), group="quit")

    def action_sessions(self) -> None:
        if self.shards is None or not self.shards.refused():
            self.push_screen(
                SessionPicker(store.list_sessions(), unsent=unsaved_drafts()),
                self.tab_control.picked,
            )

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.binding_groups()))

    @classmethod
    def binding_groups(cls) -> BindingGroups:
        """Every binding of the TUI, by where it works (see :func:`keys.binding_groups`)."""
        return binding_groups(cls.APP_BINDINGS, cls.SYSTEM_BINDINGS)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from system_commands(
            self.APP_BINDINGS, self.keymap, self.run_action, self.active_conversation()
        )
        yield from super().get_system_commands(screen)

    def action_export(self) -> None:
        conversation = self.idle_conversation()
        if conversation is not None:
            self.exports.export(conversation.session, conversation.session_name)

    def action_import(self) -> None:
        if not self.one_tab_only():
            self.exports.import_(
                self.lm.model_id, lambda: [c.session_name for c in self.conversations()]
            )

    # ------------------------------------------------------------- expiry

    def expire_idle(self) -> None:
        """The expiry timer's tick (see :class:`ExpiryTicker`)."""
        if self.lm is not None:
            self.expiry.tick()

    def _expired(self, offloaded: list[str], error: str | None) -> None:
        if error:
            self.notify(error, severity="warning", markup=False)
        self.tab_control.mark_offloaded(offloaded)

    async def action_close_tab(self) -> None:
        if not self.one_tab_only():
            await self.tab_closer.close_tab()

    def action_new_tab_model(self) -> None:
        if not self.one_tab_only():
            self.model_loader.new_tab_model()

    def action_save(self) -> None:
        self.tab_actions.save()

    def action_trim(self) -> None:
        self.tab_actions.trim()

    def action_archive(self) -> None:
        self.tab_actions.archive()

    def action_cache_kind(self) -> None:
        self.tab_actions.cache_kind()

    def action_reset_cache(self) -> None:
        self.tab_actions.reset_cache()

    async def action_regenerate(self) -> None:
        await self.tab_actions.regenerate()

    def action_drop(self) -> None:
        if self.shards is not None:
            self.shards.drop()
        else:
            self.tab_actions.drop()

    def action_rename(self) -> None:
        if not self.one_tab_only():
            self.tab_actions.rename()

    def action_settings(self) -> None:
        self.tab_actions.settings()

    # ------------------------------------------------------------- a sharded run

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    def shard(self, lm) -> None:
        """Before the app runs: use ``lm`` (a model loaded over every rank) for one tab.
        Idle caches stay in memory (an offload is one rank's, not every rank's). Which
        cache kinds the model takes is found out now, on every rank together: the kind
        dialog and new sessions then ask rank 0's kept answers, running nothing."""
        self.shards = ShardedRun(self, self.tab_control, lm)
        self.tab_control.shards = self.shards
        self.shards.probe_kinds()
        self.lm = lm
        self.models.retain(lm)
        self.expire_every = 0
        self.picker_on_start = False

    def rank_lost(self) -> None:
        """Another rank ended: quit (status 1) as soon as the turn it was in has failed
        too; ``kvchat launch`` then says which rank it was."""
        self.run_worker(self.quitter.exit_when_idle(return_code=1), group="quit")

    def one_tab_only(self) -> bool:
        """True (after saying why) in a sharded run: it keeps its one tab, on one model."""
        if self.shards is not None:
            self.notify(ONE_TAB, severity="warning", markup=False)
        return self.shards is not None
