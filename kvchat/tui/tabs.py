"""Opening and closing conversations: the first tab when the app starts, new tabs, saved
sessions loaded (cache included) in a worker, and closing a tab without losing unsaved
messages.

The app holds a :class:`TabController` (``app.tab_control``); it uses the app's
``tabs`` widget, ``pool``, ``models``, ``scheduler``, ``config`` and its dialogs.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from textual.widgets import TabPane

from kvchat import drafts, store
from kvchat.settings import apply_overrides, generation_of

from .conflict import Conflicts
from .screens.close import CloseDialog
from .screens.draft import DraftDialog
from .screens.loading import LoadingScreen
from .screens.picker import UNSENT, SessionPicker, unsaved_drafts
from .widgets.chat import Conversation

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session
    from kvchat.engine.models.model import LoadedModel

    from .app import KvChatApp


class TabController:
    """New tabs, saved sessions opened into tabs, and tabs closed, for ``app``."""

    def __init__(self, app: KvChatApp) -> None:
        self.app = app
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

    def new_session(self, name: str | None = None, lm: LoadedModel | None = None) -> Session:
        """A new session on ``lm`` (default: the app's model), in the pool under ``name``
        when given.

        When the model is free, it starts from a copy of the cached system prompt
        of a live tab with the same model, kind and system prompt
        (:meth:`SessionPool.new_session`); while another tab uses the model it
        starts empty rather than wait or copy a cache being written.
        """
        from kvchat.engine.conversation.session import Session

        app = self.app
        if app.shards is not None:
            return app.shards.new_session(name)
        c = app.config
        lm = lm or app.lm
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
        if self.app.lm is None or (self.app.shards is not None and self.app.shards.refused()):
            return None
        name = name or self.unique_name()
        return await self.add_conversation(self.new_session(name), name)

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
        conversation = Conversation(session, name, app.scheduler, id=f"conv-{n}")
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
            conversation.input.text = typed
            self.app.notify(
                f"{name}: the message you were writing is back in the box (not sent).",
                markup=False,
            )
        text = drafts.pending(name, conversation.session.messages)
        if text is None or text == typed:
            return

        def chosen(choice: str | None) -> None:
            if choice == "restore":
                conversation.input.text = text + (f"\n\n{typed}" if typed else "")
                conversation.focus_input()
            elif choice == "discard":
                drafts.clear(name)

        self.app.push_screen(DraftDialog(name, text), chosen)

    def open_saved(self, name: str) -> None:
        """Show saved session ``name``: its tab if open, else a new tab once it is loaded
        (its model too, if no tab has it) behind the loading screen."""
        app = self.app
        if app.shards is not None:
            app.shards.open_saved(name)
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
            model_id = summary.model_id or app.lm.model_id
            if screen is not None and app.models.get(model_id) is None:
                app.call_from_thread(
                    screen.set_message, f"Loading model {model_id} for session {name}…"
                )
            with app.scheduler.turn(f"load:{name}"):
                lm = app.models.acquire(model_id, app.model_loader.progress_on(screen))
                try:
                    loaded = app.pool.open(name, lm, progress)
                finally:
                    app.models.release(lm)  # the pool holds it for the open session
                offloaded = app.pool.enforce_budget()
        except (store.StoreError, ModelLoadError) as error:
            app.call_from_thread(self.load_failed, str(error))  # type: ignore[arg-type]  # Textual infers Never for an async callback
            return
        app.call_from_thread(self.loaded, name, loaded, offloaded)  # type: ignore[arg-type]  # Textual infers Never for an async callback

    async def loaded(self, name: str, loaded: store.Loaded, offloaded: list[str]) -> None:
        """UI thread: a saved session loaded (``offloaded`` made room for it) into a tab."""
        app = self.app
        if isinstance(app.screen, LoadingScreen):
            app.pop_screen()
        self.mark_offloaded(offloaded)
        Conflicts(app).warn_if_open_elsewhere(name)
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

    async def close_tab(self) -> None:
        """Close the active tab. Unsaved messages are saved first with ``autosave`` on
        (the default); with it off a dialog asks: Save, Discard or Cancel."""
        app = self.app
        conversation = app.idle_conversation()
        if conversation is None:
            return
        name = conversation.session_name
        if not conversation.unsaved:
            saved = any(m["role"] == "user" for m in conversation.session.messages)
            await self.close_conversation(conversation)
            if saved:
                app.notify(f"Closed {name}; it is saved (Ctrl+O reopens it).", markup=False)
            return
        if app.config.autosave:
            self.save_and_close(conversation)
            return

        async def chosen(choice: str | None) -> None:
            if choice == "save":
                self.save_and_close(conversation)
            elif choice == "discard":
                await self.close_conversation(conversation, disk="discard")
                app.notify(f"Closed {name} without saving.", markup=False)

        app.push_screen(CloseDialog({name: store.exists(name)}), chosen)

    def save_and_close(self, conversation: Conversation) -> None:
        """Save ``conversation`` in its worker, then close its tab."""
        name = conversation.session_name

        async def closed() -> None:
            await self.close_conversation(conversation)
            self.app.notify(f"Saved {name} and closed it; Ctrl+O reopens it.", markup=False)

        # then: not from inside the tab's own handler, as removing the tab waits for it
        conversation.save(lambda _: self.app.call_later(closed))

    async def close_conversation(self, conversation: Conversation, disk: str = "keep") -> None:
        """Remove a tab and its session from memory; its copy on disk stays (``keep``), goes
        if only an offload wrote it (``discard``) or goes whatever wrote it (``delete``).
        Its model is unloaded, in a worker, when no other tab uses it."""
        app = self.app
        if conversation.parent is not None and conversation.parent.id is not None:
            await app.tabs.remove_pane(conversation.parent.id)
        name = conversation.session_name
        if disk == "discard":
            held = app.pool.discard(name, keep_hold=True)
        else:
            held = app.pool.drop(name, delete_from_disk=disk == "delete", keep_hold=True)
        model_id = held.model_id if held is not None else None
        app.run_worker(
            partial(self.let_go, conversation.session, model_id),
            name="let_go",
            group="close",
            thread=True,
        )
        app.refresh_sidebar()

    def let_go(self, session: Session, model_id: str | None) -> None:
        """Worker: give back a closed tab's hold on model ``model_id`` (unloading it when no
        other tab holds it) and free its cache, in turn with the other tabs. (Textual keeps
        the last worker each thread ran, and with it its arguments, for a while: they
        name the model rather than hold it.)"""
        with self.app.scheduler.turn("closing a tab"):
            lm = self.app.models.get(model_id) if model_id is not None else None
            if lm is not None:
                self.app.models.release(lm)
            del lm
            session.close()  # drops the session's own reference to the model last

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
