"""Opening and closing conversations: new tabs, saved sessions loaded (cache included) in
a worker, and closing a tab without losing unsaved messages.

A mixin of :class:`~kvchat.tui.app.KvChatApp`; it uses the app's ``tabs``,
``pool``, ``scheduler`` and ``config``.
"""

from __future__ import annotations

from textual import work
from textual.widgets import TabPane

from kvchat import drafts, store
from kvchat.engine.kinds import CacheKindError, make_cache, parse_kind
from kvchat.engine.model import LoadedModel, ModelLoadError
from kvchat.engine.session import Session
from kvchat.settings import apply_overrides, generation_of

from .conflict import Conflicts
from .screens.dialogs import CloseDialog, DraftDialog
from .screens.loading import LoadingScreen
from .widgets.chat import Conversation


class TabsMixin:
    """New tabs, saved sessions opened into tabs, and tabs closed."""

    def new_session(self, name: str | None = None, lm: LoadedModel | None = None) -> Session:
        """A new session on ``lm`` (default: the app's model), in the pool under ``name``
        when given.

        When the model is free, it starts from a copy of the cached system prompt
        of a live tab with the same model, kind and system prompt
        (:meth:`SessionPool.new_session`); while another tab uses the model it
        starts empty rather than wait or copy a cache being written.
        """
        c = self.config
        lm = lm or self.lm
        settings = generation_of(c)
        system = c.system or None
        kind = self._fitting_kind(lm)
        ticket = self.scheduler.request("new tab")
        try:
            self.scheduler.wait(ticket, timeout=0)
        except TimeoutError:
            session = Session(lm, kind=kind, system=system, settings=settings)
            if name is not None:
                self.pool.add(name, session)
            return session
        try:
            return self.pool.new_session(lm, kind, system, settings, name)
        finally:
            self.scheduler.done(ticket)

    def _fitting_kind(self, lm: LoadedModel) -> str:
        """The configured cache kind, or 'standard' (saying why) when ``lm`` cannot take it."""
        try:
            make_cache(lm.model, parse_kind(self.config.cache))
        except CacheKindError as error:
            self.notify(f"{error} This tab uses 'standard'.", severity="warning", markup=False)
            return "standard"
        return self.config.cache

    async def new_tab(self) -> Conversation | None:
        if self.lm is None:
            return None
        name = self._unique_name()
        return await self.add_conversation(self.new_session(name), name)

    async def add_conversation(
        self, session: Session, name: str, *, saved: bool = False, notice: str | None = None,
        notice_kind: str = "rebuild",
    ) -> Conversation:
        self._tab_numbers += 1
        n = self._tab_numbers
        conversation = Conversation(session, name, self.scheduler, id=f"conv-{n}")
        conversation.saved = saved
        conversation.autosave = self.config.autosave
        conversation.pool = self.pool
        if name not in self.pool:
            self.pool.add(name, session)
        pane = TabPane(name, conversation, id=f"pane-{n}")
        await self.tabs.add_pane(pane)
        self.tabs.active = pane.id
        if notice:
            await conversation.add_notice(notice, notice_kind)
        conversation.log.scroll_end(animate=False)
        conversation.focus_input()
        self.refresh_sidebar()
        self.offer_draft(conversation)
        return conversation

    def offer_draft(self, conversation: Conversation) -> None:
        """If a message was being sent in this session when kvchat last stopped, offer it
        back: Restore puts it in the message box (see :mod:`kvchat.drafts`)."""
        name = conversation.session_name
        text = drafts.pending(name, conversation.session.messages)
        if text is None:
            return

        def chosen(choice: str | None) -> None:
            if choice == "restore":
                conversation.input.text = text
                conversation.focus_input()
            elif choice == "discard":
                drafts.clear(name)

        self.push_screen(DraftDialog(name, text), chosen)

    def open_saved(self, name: str) -> None:
        for conversation in self.conversations():
            if conversation.session_name == name:
                pane = conversation.parent
                self.tabs.active = pane.id
                conversation.focus_input()
                return
        # Nothing keeps the focus: when the loading screen goes, Textual would focus the old
        # tab's input again, and a focused pane makes its tab the active one (TabPane.Focused).
        self.main_screen.set_focus(None)
        self.push_screen(LoadingScreen(f"Opening session {name}…"))
        self._load_session(name)

    @work(thread=True, group="load")
    def _load_session(self, name: str) -> None:
        """Worker: load the session's own model if no tab has it, then the session."""
        screen = self.screen
        shown = isinstance(screen, LoadingScreen)
        progress = (lambda done, total: self.call_from_thread(screen.set_progress, done, total)
                    ) if shown else None
        try:
            model_id = store.summary(name).model_id or self.lm.model_id
            if shown and self.models.get(model_id) is None:
                self.call_from_thread(screen.set_message,
                                      f"Loading model {model_id} for session {name}…")
            with self.scheduler.turn(f"load:{name}"):
                lm = self.models.acquire(model_id)
                try:
                    loaded = self.pool.open(name, lm, progress)
                finally:
                    self.models.release(lm)  # the pool holds it for the open session
                offloaded = self.pool.enforce_budget()
        except (store.StoreError, ModelLoadError) as error:
            self.call_from_thread(self._load_failed, str(error))
            return
        self.call_from_thread(self._loaded, name, loaded, offloaded)

    async def _loaded(self, name: str, loaded: store.Loaded, offloaded: list[str]) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.mark_offloaded(offloaded)
        Conflicts(self).warn_if_open_elsewhere(name)
        if name not in self.pool:  # loaded outside the pool (a sharded run's)
            self.pool.add(name, loaded.session, loaded.generation)
        # the generation flags given (--temp, --top-k, ...): for this run, over the saved ones
        loaded.session.settings = apply_overrides(loaded.session.settings, self.settings_flags)
        if loaded.resumed_from_disk:
            await self.add_conversation(  # with why its saved checkpoints were left out, if so
                loaded.session, name, saved=True, notice_kind="info",
                notice=f"Resumed with its cache from disk ({loaded.session.cache_tokens:,} "
                       "tokens): the next turn evaluates only the new message."
                       + (f" {loaded.notice}" if loaded.notice else ""),
            )
        else:
            await self.add_conversation(loaded.session, name, saved=True, notice=loaded.notice)

    async def _load_failed(self, message: str) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.notify(message, severity="error", markup=False, timeout=10)
        if not self.conversations():
            await self.new_tab()

    async def action_close_tab(self) -> None:
        """Close the active tab. Unsaved messages are saved first with ``autosave`` on
        (the default); with it off a dialog asks: Save, Discard or Cancel."""
        conversation = self.idle_conversation()
        if conversation is None:
            return
        name = conversation.session_name
        if not conversation.unsaved:
            saved = any(m["role"] == "user" for m in conversation.session.messages)
            await self.close_conversation(conversation)
            if saved:
                self.notify(f"Closed {name}; it is saved (Ctrl+O reopens it).", markup=False)
            return
        if self.config.autosave:
            self._save_and_close(conversation)
            return

        async def chosen(choice: str | None) -> None:
            if choice == "save":
                self._save_and_close(conversation)
            elif choice == "discard":
                await self.close_conversation(conversation, disk="discard")
                self.notify(f"Closed {name} without saving.", markup=False)

        self.push_screen(CloseDialog({name: store.exists(name)}), chosen)

    def _save_and_close(self, conversation: Conversation) -> None:
        name = conversation.session_name

        async def closed() -> None:
            await self.close_conversation(conversation)
            self.notify(f"Saved {name} and closed it; Ctrl+O reopens it.", markup=False)

        # then: not from inside the tab's own handler, as removing the tab waits for it
        conversation.save(lambda _: self.call_later(closed))

    async def close_conversation(self, conversation: Conversation, disk: str = "keep") -> None:
        """Remove a tab and its session from memory; its copy on disk stays (``keep``), goes
        if only an offload wrote it (``discard``) or goes whatever wrote it (``delete``).
        Its model is unloaded, in a worker, when no other tab uses it."""
        if conversation.parent is not None:
            await self.tabs.remove_pane(conversation.parent.id)
        name = conversation.session_name
        if disk == "discard":
            held = self.pool.discard(name, keep_hold=True)
        else:
            held = self.pool.drop(name, delete_from_disk=disk == "delete", keep_hold=True)
        self._let_go(conversation.session, held.model_id if held is not None else None)
        self.refresh_sidebar()

    @work(thread=True, group="close")
    def _let_go(self, session: Session, model_id: str | None) -> None:
        """Worker: give back a closed tab's hold on model ``model_id`` (unloading it when no
        other tab holds it) and free its cache, in turn with the other tabs. (Textual keeps
        the last worker each thread ran, and with it its arguments, for a while: they
        name the model rather than hold it.)"""
        with self.scheduler.turn("closing a tab"):
            lm = self.models.get(model_id) if model_id is not None else None
            if lm is not None:
                self.models.release(lm)
            del lm
            session.close()  # drops the session's own reference to the model last
