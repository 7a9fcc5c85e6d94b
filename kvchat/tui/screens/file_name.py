"""A file's name, for the message box's Insert file (Ctrl+F)."""

from __future__ import annotations

from .dialogs import PathDialog


class FileDialog(PathDialog):
    """The path of a text file whose text goes into the message at the cursor."""

    AUTO_FOCUS = "#file-input"
    PREFIX, INPUT, TITLE, OK = "file", "file-input", "Insert a file", "Insert"
    TEXT = "Its text goes into the message at the cursor (not sent); UTF-8 text, at most 1 MiB."
    PLACEHOLDER = "path, e.g. ~/notes.txt"
