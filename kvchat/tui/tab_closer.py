"""Closing a tab without losing unsaved messages: saved first (``autosave``) or asked
(Save, Discard, Cancel); the tab's session leaves the pool, its model is unloaded when no
other tab holds it.

The app holds a :class:`TabCloser` (``app.tab_closer``); it uses the app's ``tabs``
widget, ``pool``, ``models``, ``scheduler`` and its close dialog (the app as an
:class:`~kvchat.tui.app_view.AppView`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from kvchat import store

from .screens.close import CloseDialog

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session

    from .app_view import AppView
    from .widgets.chat import Conversation


class TabCloser:
    """Closes the tabs of ``app``."""

    def __init__(self, app: AppView) -> None:
        self.app = app

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
