"""Export the active tab's transcript and import a JSON export as a new tab, through the
store's own export and import (the ones ``kvchat sessions export|import`` use)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat import store
from kvchat.safety import printable

from .screens.export_dialogs import ExportDialog, ImportDialog

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session


class ExportActions:
    """Export (Markdown or JSON) and import, each behind its dialog.

    ``push_screen(screen, callback)`` shows a dialog, ``notify(text, **options)`` says
    what happened, ``open_saved(name)`` opens an imported session in a new tab.
    """

    def __init__(
        self,
        *,
        push_screen: Callable[..., Any],
        notify: Callable[..., Any],
        open_saved: Callable[[str], Any],
    ) -> None:
        self.push_screen = push_screen
        self.notify = notify
        self.open_saved = open_saved

    def export(self, session: Session, name: str) -> None:
        """Ask where, then write ``session`` (saved as ``name``) there."""

        def chosen(choice: tuple[str, str] | None) -> None:
            if choice is None:
                return
            fmt, path = choice
            try:
                text = store.export_session(session, name, fmt)
                written = store.write_export(Path(path), text)
            except store.StoreError as error:
                self.notify(str(error), severity="error", markup=False)
                return
            self.notify(
                f"Exported {name} to {printable(str(written), one_line=True)} "
                f"({len(text.encode()):,} bytes).",
                markup=False,
            )

        self.push_screen(ExportDialog(name), chosen)

    def import_(self, default_model: str, in_use: Callable[[], Iterable[str]]) -> None:
        """Ask for a JSON export, import it as a new session (a name not in ``in_use()``,
        on ``default_model`` when it names none) and open it."""

        def chosen(path: str | None) -> None:
            if path is None:
                return
            try:
                name = store.import_session(
                    Path(path), default_model=default_model, in_use=set(in_use())
                )
            except store.StoreError as error:
                self.notify(str(error), severity="error", markup=False)
                return
            self.notify(
                f"Imported {printable(path, one_line=True)} as {name}; its cache is "
                "built on its first turn.",
                markup=False,
            )
            self.open_saved(name)

        self.push_screen(ImportDialog(), chosen)
