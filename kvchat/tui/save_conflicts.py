"""What a tab does when another kvchat saved its session meanwhile (a save refused with
``store.SessionChanged``, or a look before a send): nothing is overwritten; the user
picks between reloading the session with this tab's turns kept as a branch of it, and
saving this tab as a new session."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widgets import TabPane

from kvchat import store

from .screens.changed_on_disk import ConflictDialog

if TYPE_CHECKING:
    from .app_view import AppView
    from .tabs import TabController
    from .widgets.chat import Conversation


class Conflicts:
    """Resolves a tab's session conflicts for ``app`` (its pool, tabs and dialogs), opening
    the reloaded session through ``tabs``."""

    def __init__(self, app: AppView, tabs: TabController) -> None:
        self.app = app
        self.tabs = tabs

    def ask(self, conversation: Conversation) -> None:
        """Show the dialog for ``conversation`` (once, however many saves were refused)."""
        app = self.app
        if isinstance(app.screen, ConflictDialog):
            return
        name = conversation.session_name
        new = self.tabs.unique_name(name)

        def chosen(choice: str | None) -> None:
            if choice == "reload":
                mine = conversation.unsaved  # turns of this tab that the disk lacks
                conversation.jobs.run(
                    "reloading",
                    lambda progress: app.pool.keep_as_branch(name, progress),
                    lambda loaded: app.call_later(self._reloaded, conversation, loaded, mine),
                    needs_cache=False,
                )
            elif choice == "fork":
                self._save_as(conversation, new)
            else:
                app.notify(
                    f"{name} is not saved: another kvchat saved it meanwhile. "
                    "Saving again asks what to do.",
                    severity="warning",
                    markup=False,
                )

        app.push_screen(ConflictDialog(name, new), chosen)

    async def _reloaded(self, conversation: Conversation, loaded: store.Loaded, mine: bool) -> None:
        """Show the reloaded session (both sides) in a tab in place of the old one (with
        the message being written, if any)."""
        app = self.app
        name = conversation.session_name
        draft = conversation.input.text
        if conversation.parent is not None and conversation.parent.id is not None:
            await app.tabs.remove_pane(conversation.parent.id)  # the pool holds the new one
        shown = await self.tabs.add_conversation(
            loaded.session,
            name,
            saved=True,
            notice_kind="info",
            notice=(
                f"Reloaded {name} as another kvchat saved it"
                + (
                    "; this tab's turns are kept as a branch (select a message, ← / → "
                    "switch branches)."
                    if mine
                    else "."
                )
                + (f" {loaded.notice}" if loaded.notice else "")
            ),
        )
        shown.input.put(draft)

    def _save_as(self, conversation: Conversation, new: str) -> None:
        """Save ``conversation`` as the new session ``new`` and file the tab under it."""
        from kvchat.runtime.sessions import save_session

        app = self.app
        old = conversation.session_name
        written = store.Generation()

        def save(progress) -> None:
            save_session(conversation.session, new, base=written)

        def saved(_) -> None:
            app.pool.rename(old, new, written)
            conversation.session_name = new
            conversation.saved = True
            if isinstance(conversation.parent, TabPane) and conversation.parent.id is not None:
                app.tabs.get_tab(conversation.parent.id).label = new
            app.refresh_sidebar()
            app.notify(
                f"Saved this tab as {new}; {old} stays as the other kvchat saved it.", markup=False
            )

        conversation.jobs.run("saving", save, saved, needs_cache=False)
