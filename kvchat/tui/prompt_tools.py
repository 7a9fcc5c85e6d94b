"""Text from outside the message box: a file's text (``/file PATH``) and ``$EDITOR``.
Imports no Textual; every failure is a :class:`PromptToolError` of one sentence, and
the message being written is never touched by a failure.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kvchat.store.base import StoreError
from kvchat.store.files import read_regular

FILE_LIMIT = 1 << 20  # 1 MiB: about 250k tokens, more than the context of the models kvchat runs
FILE_COMMAND = "/file "


class PromptToolError(Exception):
    """Why a file or the editor gave no text (one sentence for a notice)."""


def file_request(message: str) -> tuple[str, str] | None:
    """(text before, path) when the message's last line is ``/file PATH``, else None."""
    before, _, last = message.rpartition("\n")
    if not last.startswith(FILE_COMMAND) or not last[len(FILE_COMMAND) :].strip():
        return None
    return (before + "\n" if before else ""), last[len(FILE_COMMAND) :].strip()


def read_text_file(path: str, limit: int = FILE_LIMIT) -> str:
    """The UTF-8 text of the regular file at ``path`` (``~`` expanded, symlinks followed:
    the user names the file), at most ``limit`` bytes."""
    target = Path(path).expanduser()
    try:
        resolved = target.resolve(strict=True)
    except FileNotFoundError:
        raise PromptToolError(f"No file at {path}.") from None
    except (OSError, RuntimeError) as error:
        raise PromptToolError(f"{path} cannot be read ({error.__class__.__name__}).") from None
    if resolved.is_dir():
        raise PromptToolError(f"{path} is a folder; give a file's path.")
    try:
        data = read_regular(resolved, limit)
    except FileNotFoundError:
        raise PromptToolError(f"No file at {path}.") from None
    except StoreError as error:
        raise PromptToolError(str(error)) from None
    except OSError as error:
        raise PromptToolError(f"{path} cannot be read ({error.strerror}).") from None
    try:
        if b"\0" in data:
            raise UnicodeDecodeError("utf-8", data, 0, 1, "NUL")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise PromptToolError(
            f"{path} is not a text file (it holds NUL bytes or is not UTF-8)."
        ) from None


def editor_command(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The editor to run: ``$VISUAL``, else ``$EDITOR``, split as a shell would."""
    value = (environ.get("VISUAL") or environ.get("EDITOR") or "").strip()
    if not value:
        raise PromptToolError("Set $EDITOR to edit messages in an editor.")
    try:
        return shlex.split(value)
    except ValueError:
        raise PromptToolError(f"$EDITOR ({value}) cannot be split into a command.") from None


def edit_in_editor(text: str, command: list[str]) -> str:
    """Run ``command`` on a private temporary file holding ``text``; the file's text when
    the editor exits with status 0 (without the one final newline editors add)."""
    fd, name = tempfile.mkstemp(prefix="kvchat-message-", suffix=".md")  # mode 0600
    path = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            status = subprocess.run([*command, name]).returncode
        except OSError as error:
            raise PromptToolError(
                f"The editor {command[0]} could not be started ({error.strerror}); "
                "the message is unchanged."
            ) from None
        if status != 0:
            raise PromptToolError(
                f"The editor exited with status {status}; the message is unchanged."
            )
        edited = read_text_file(name)
    finally:
        path.unlink(missing_ok=True)
    return edited[:-1] if edited.endswith("\n") else edited
