"""Export the active tab's transcript and import a JSON export as a new tab, through the
store's own export and import (the ones ``kvchat sessions export|import`` use)."""

from __future__ import annotations

from kvchat import store
from kvchat.safety import printable

from .screens.transfer import ExportDialog, ImportDialog


class TransferMixin:
    """Export (Markdown or JSON) and import actions of the app."""

    def action_export(self) -> None:
        conversation = self.idle_conversation()
        if conversation is None:
            return
        name = conversation.session_name

        def chosen(choice: tuple[str, str] | None) -> None:
            if choice is None:
                return
            fmt, path = choice
            try:
                text = store.export_session(conversation.session, name, fmt)
                written = store.write_export(path, text)
            except store.StoreError as error:
                self.notify(str(error), severity="error", markup=False)
                return
            self.notify(f"Exported {name} to {printable(str(written), one_line=True)} "
                        f"({len(text.encode()):,} bytes).", markup=False)

        self.push_screen(ExportDialog(name), chosen)

    def action_import(self) -> None:
        def chosen(path: str | None) -> None:
            if path is None:
                return
            try:
                name = store.import_session(
                    path, default_model=self.lm.model_id,
                    in_use={c.session_name for c in self.conversations()})
            except store.StoreError as error:
                self.notify(str(error), severity="error", markup=False)
                return
            self.notify(f"Imported {printable(path, one_line=True)} as {name}; its cache is "
                        "built on its first turn.", markup=False)
            self.open_saved(name)

        self.push_screen(ImportDialog(), chosen)
