"""Opening conversations: the first tab when the app starts, new tabs, saved sessions
loaded (cache included) in a worker (closing them is :mod:`~kvchat.tui.tab_closer`'s).

The app holds a :class:`TabController` (``app.tab_control``); it uses the app's
``tabs`` widget, ``pool``, ``models``, ``scheduler``, ``config`` and its dialogs (the app
as an :class:`~kvchat.tui.app_view.AppView`), and in a sharded run asks its ``shards``
first.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from textual.widgets import TabPane

from kvchat import drafts, store
from kvchat.settings import apply_overrides, generation_of

from .screens.draft import DraftDialog
from .screens.loading import LoadingScreen, loading_progress
from .screens.picker import UNSENT, SessionPicker, unsaved_drafts
from .widgets.chat import Conversation

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel

    from .app_view import AppView


class OneTabRun(Protocol):
    """What a sharded run decides for the tabs (see :class:`~kvchat.tui.sharded.ShardedRun`):
    its one tab's session, made and opened on every rank."""

    def new_session(self, name: str | None = None) -> Session: ...

    def open_saved(self, name: str) -> None: ...

    def refused(self) -> bool:
        """True (after saying why) when the run has its tab already."""
        ...


class TabController:
    """New tabs, saved sessions opened into tabs, and tabs closed, for ``app``."""

    def __init__(self, app: AppView) -> None:
        self.app = app
        self.shards: OneTabRun | None = None  # set in a sharded run
        self.numbers = 0  # tabs made so far: each pane's id is its number
        self.held = ""  # typed while a loading screen was up: for the next tab's box

    def hold(self, text: str) -> None:
        """Keep ``text`` (typed behind a loading screen) for the next tab's message box."""
        self.held += text

    def loading_screen(self, message: str, name: str | None = None) -> LoadingScreen:
        """A loading screen saying ``message`` that keeps what is typed behind it, showing
        at once the saved transcript of session ``name`` (default: the one ``--resume``
        names), read from its file: no model needed."""
        name = name or self.app.resume
        return LoadingScreen(message, keep=self.hold, transcript=saved_transcript(name))

    def new_session(self, name: str | None, lm: LoadedModel) -> Session:
        """A new session on ``lm`` (in a sharded run: on the run's model, over every rank),
        in the pool under ``name`` when given.

        When the model is free, it starts from a copy of the cached system prompt
        of a live tab with the same model, kind and system prompt
        (:meth:`SessionPool.new_session`); while another tab uses the model it
        starts empty rather than wait or copy a cache being written.
        """
        from kvchat.engine.conversation.session import Session

        app = self.app
        if self.shards is not None:
            return self.shards.new_session(name)
        c = app.config
        settings = generation_of(c)
        system = c.system or None
        kind = self.fitting_kind(lm)
        ticket = app.scheduler.request("new tab")
        try:
            app.scheduler.wait(ticket, timeout=0)
        except TimeoutError:
            session = Session(lm, kind=kind, system=system, settings=settings)
            if name is not None:
                app.pool.add(name, session)
            return session
        try:
            return app.pool.new_session(lm, kind, system, settings, name)
        finally:
            app.scheduler.done(ticket)

    def fitting_kind(self, lm: LoadedModel) -> str:
        """The configured cache kind, or 'standard' (saying why) when ``lm`` cannot take it."""
        from kvchat.engine.caches.kinds import CacheKindError, make_cache, parse_kind

        try:
            make_cache(lm.model, parse_kind(self.app.config.cache))
        except CacheKindError as error:
            self.app.notify(f"{error} This tab uses 'standard'.", severity="warning", markup=False)
            return "standard"
        return self.app.config.cache

    def unique_name(self, base: str = "chat") -> str:
        """``base-N``: the first N that no open tab and no saved session has."""
        taken = {c.session_name for c in self.app.conversations()}
        n = 1
        while f"{base}-{n}" in taken or store.exists(f"{base}-{n}"):
            n += 1
        return f"{base}-{n}"

    def open_first(self) -> None:
        """With the app's model loaded: resume the session asked for, or offer the saved
        ones, or open a new tab."""
        app = self.app
        if app.resume:
            self.open_saved(app.resume)
            return
        sessions = store.list_sessions() if app.picker_on_start else []
        unsent = unsaved_drafts() if app.picker_on_start else {}
        if sessions or unsent:
            app.push_screen(SessionPicker(sessions, cancellable=False, unsent=unsent), self.picked)
        else:
            app.call_later(self.new_tab)

    async def picked(self, name: str | None) -> None:
        """The session picker's answer: a saved session's name, "" for a new tab, an
        unsent draft's key (:data:`~.screens.picker.UNSENT` and a name never saved) for a
        new tab of that name, whose draft it offers back; None for nothing."""
        if name is None:
            return
        if name == "":
            await self.new_tab()
        elif name.startswith(UNSENT):
            name = name.removeprefix(UNSENT)
            if any(c.session_name == name for c in self.app.conversations()):
                self.open_saved(name)  # its tab is open: shown
            else:
                await self.new_tab(name)
        else:
            self.open_saved(name)

    async def new_tab(self, name: str | None = None) -> Conversation | None:
        """A new tab on the app's model (none before it is loaded, or in a sharded run
        that has its tab), named ``name`` or the next free ``chat-N``."""
        lm = self.app.lm
        if lm is None or (self.shards is not None and self.shards.refused()):
            return None
        name = name or self.unique_name()
        return await self.add_conversation(self.new_session(name, lm), name)

    async def add_conversation(
        self,
        session: Session,
        name: str,
        *,
        saved: bool = False,
        notice: str | None = None,
        notice_kind: str = "rebuild",
    ) -> Conversation:
        """Show ``session`` (as ``name``) in a new tab, made the active one, with ``notice``
        at the end of its transcript if given."""
        app = self.app
        self.numbers += 1
        n = self.numbers
        conversation = Conversation(
            session, name, app.scheduler, keymap=app.keymap, quitting=app.quitting, id=f"conv-{n}"
        )
        conversation.saved = saved
        conversation.autosave = app.config.autosave
        conversation.pool = app.pool
        if name not in app.pool:
            app.pool.add(name, session)
        pane_id = f"pane-{n}"
        await app.tabs.add_pane(TabPane(name, conversation, id=pane_id))
        app.tabs.active = pane_id
        if notice:
            await conversation.add_notice(notice, notice_kind)
        conversation.log.scroll_end(animate=False)
        # focused now, not at the app's next turn (Widget.focus): keys typed right after
        # Ctrl+T, already on their way, go to this tab's box rather than the old one's
        app.main_screen.set_focus(conversation.input)
        if self.held:  # typed while the loading screen was up
            conversation.input.insert(self.held)
            self.held = ""
        app.refresh_sidebar()
        self.offer_draft(conversation)
        return conversation

    def offer_draft(self, conversation: Conversation) -> None:
        """Give back what this session's message box held when kvchat last stopped (it goes
        straight back in the box), and offer the message that was being sent, if any:
        Restore puts it in the box, before what was typed (see :mod:`kvchat.drafts`)."""
        name = conversation.session_name
        typed = drafts.typed(name, conversation.session.messages)
        if typed is not None:
            conversation.input.put(typed)
            self.app.notify(
                f"{name}: the message you were writing is back in the box (not sent).",
                markup=False,
            )
        text = drafts.pending(name, conversation.session.messages)
        if text is None or text == typed:
            return

        def chosen(choice: str | None) -> None:
            if choice == "restore":
                conversation.input.put(text + (f"\n\n{typed}" if typed else ""))
                conversation.focus_input()
            elif choice == "discard":
                drafts.clear(name)

        self.app.push_screen(DraftDialog(name, text), chosen)

    def open_saved(self, name: str) -> None:
        """Show saved session ``name``: its tab if open, else a new tab once it is loaded
        (its model too, if no tab has it) behind the loading screen."""
        app = self.app
        if self.shards is not None:
            self.shards.open_saved(name)
            return
        for conversation in app.conversations():
            if conversation.session_name == name:
                pane = conversation.parent
                if pane is not None and pane.id is not None:
                    app.tabs.active = pane.id
                conversation.focus_input()
                return
        # Nothing keeps the focus: when the loading screen goes, Textual would focus the old
        # tab's input again, and a focused pane makes its tab the active one (TabPane.Focused).
        app.main_screen.set_focus(None)
        app.push_screen(self.loading_screen(f"Opening session {name}…", name))
        app.run_worker(
            partial(self.load_session, name), name="load_session", group="load", thread=True
        )

    def load_session(self, name: str) -> None:
        """Worker: load the session's own model if no tab has it, then the session."""
        from kvchat.engine.models.model import ModelLoadError

        app = self.app
        shown = app.screen
        screen = shown if isinstance(shown, LoadingScreen) else None  # the loading screen
        progress = (
            (lambda done, total: app.call_from_thread(screen.set_progress, done, total))
            if screen is not None
            else None
        )
        try:
            summary = store.summary(name)
            if summary.note:  # damaged: its model is unknown, and the file says why
                raise store.StoreError(summary.note)
            model_id = summary.model_id or (app.lm.model_id if app.lm else app.config.model)
            if screen is not None and app.models.get(model_id) is None:
                app.call_from_thread(
                    screen.set_message, f"Loading model {model_id} for session {name}…"
                )
            with app.scheduler.turn(f"load:{name}"):
                lm = app.models.acquire(model_id, loading_progress(screen, app.call_from_thread))
                try:
                    loaded = app.pool.open(name, lm, progress)
                finally:
                    app.models.release(lm)  # the pool holds it for the open session
                offloaded = app.pool.enforce_budget()
        except (store.StoreError, ModelLoadError) as error:
            app.call_from_thread(self.load_failed, str(error))
            return
        app.call_from_thread(self.loaded, name, loaded, offloaded)

    async def loaded(self, name: str, loaded: store.Loaded, offloaded: list[str]) -> None:
        """UI thread: a saved session loaded (``offloaded`` made room for it) into a tab."""
        app = self.app
        if isinstance(app.screen, LoadingScreen):
            app.pop_screen()
        self.mark_offloaded(offloaded)
        warn_if_open_elsewhere(name, app.notify)
        if name not in app.pool:  # loaded outside the pool (a sharded run's)
            app.pool.add(name, loaded.session, loaded.generation)
        # the generation flags given (--temp, --top-k, ...): for this run, over the saved ones
        loaded.session.settings = apply_overrides(loaded.session.settings, app.settings_flags)
        if loaded.resumed_from_disk:
            await self.add_conversation(  # with why its saved checkpoints were left out, if so
                loaded.session,
                name,
                saved=True,
                notice_kind="info",
                notice=f"Resumed with its cache from disk ({loaded.session.cache_tokens:,} "
                "tokens): the next turn evaluates only the new message."
                + (f" {loaded.notice}" if loaded.notice else ""),
            )
        else:
            await self.add_conversation(loaded.session, name, saved=True, notice=loaded.notice)

    async def load_failed(self, message: str) -> None:
        """UI thread: a session or a model could not load; say why (a tab stays open)."""
        app = self.app
        if isinstance(app.screen, LoadingScreen):
            app.pop_screen()
        app.notify(message, severity="error", markup=False, timeout=10)
        if not app.conversations():
            await self.new_tab()

    def mark_offloaded(self, offloaded: list[str]) -> None:
        """The tabs whose caches went to disk are saved; the sidebar says offloaded."""
        for conversation in self.app.conversations():
            if conversation.session_name in offloaded:
                conversation.saved = True
        self.app.refresh_sidebar()


def saved_transcript(name: str | None, last: int = 40) -> list[tuple[str, str]]:
    """The last ``last`` messages of saved session ``name`` as (role, text), as its file
    holds them; none for no name, a session not saved or a damaged one (its loading says
    why)."""
    if not name:
        return []
    try:
        messages = store.read(name).get("messages", [])
    except (store.StoreError, OSError):
        return []
    shown = [m for m in messages if m.get("role") in ("system", "user", "assistant")]
    return [(m["role"], str(m.get("content") or "")) for m in shown[-last:]]


def warn_if_open_elsewhere(name: str, notify: Callable[..., None]) -> None:
    """Notify when session ``name`` is open in another live kvchat process."""
    pids = store.open_elsewhere(name)
    if pids:
        which = ", ".join(str(p) for p in pids)
        notify(
            f"{name} is open in another kvchat process (pid {which}); saves from both are "
            "kept (a change made elsewhere comes back as a branch).",
            severity="warning",
            markup=False,
            timeout=10,
        )
