"""A conversation's message actions: edit and regenerate as new branches, switch branch,
delete an exchange, copy a message or a code block.

A :class:`BranchNavigator` is held by each conversation tab. Every change is one
engine call (:mod:`kvchat.engine.conversation.session`): an edit or a regenerate is a turn,
a switch or a deletion a job; the transcript is then drawn again from the session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchat.engine.conversation.events import SessionError
from kvchat.tui.clipboard import code_blocks, keep_copy

from ..screens.message_dialogs import DeletePairDialog, EditDialog
from ..widgets.messages import MessageAction

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from kvchat.engine.conversation.stats import Refilled

    from .jobs import JobRunner
    from .turns import TurnRunner
    from .view import TabView


class BranchNavigator:
    """The message actions of ``conversation`` (the tab, as a
    :class:`~kvchat.tui.tab.view.TabView`): it uses the tab's session, its
    transcript and its notices; it starts its edits and regenerations as turns through
    ``turns``, its branch switches and deletions as jobs through ``jobs``."""

    def __init__(self, conversation: TabView, turns: TurnRunner, jobs: JobRunner) -> None:
        self.conversation = conversation
        self.turns = turns
        self.jobs = jobs
        self.code_copies: dict[int, int] = {}  # message index -> code blocks copied so far

    def select_last(self) -> None:
        """Ctrl+Up from the message box: select the newest message."""
        found = self.conversation.selectable()
        if found:
            found[-1].focus()
            found[-1].scroll_visible(animate=False)

    async def handle(self, event: MessageAction) -> None:
        """Do what a selected message's key asks: edit, regenerate, switch branch, delete,
        copy, or leave the selection."""
        tab = self.conversation
        if event.action == "leave":
            if not self.turns.stop():
                tab.focus_input()
            return
        if event.action in ("copy", "copy_code"):
            self.copy(event.index, code=event.action == "copy_code")
            return
        if tab.refuse_if_busy() or not 0 <= event.index < len(tab.session.messages):
            return
        message = tab.session.messages[event.index]
        if event.action == "edit":
            if message["role"] != "user":
                tab.app.notify(
                    "Only your own messages can be edited; r makes a new version of a reply.",
                    severity="warning",
                )
                return
            tab.app.push_screen(
                EditDialog(message["content"]), lambda text: self.edited(event.index, text)
            )
        elif event.action == "regenerate":
            index = event.index + (message["role"] == "user")
            await self.regenerate_at(index)
        elif event.action == "branch":
            self.switch(event.index, event.step)
        elif event.action == "delete":
            index = event.index - (message["role"] == "assistant")
            if index < 0 or tab.session.messages[index]["role"] != "user":
                tab.app.notify(
                    "That reply has no message of yours before it to delete with it.",
                    severity="warning",
                )
                return
            preview = tab.session.messages[index]["content"][:60]
            tab.app.push_screen(
                DeletePairDialog(preview), lambda yes: self.delete(index) if yes else None
            )

    async def edited(self, index: int, text: str | None) -> None:
        """The edit dialog's answer: message ``index`` sent again as ``text`` (a new branch)."""
        if text is None:
            return
        tab = self.conversation
        try:
            events = tab.session.edit(index, text)
        except SessionError as error:
            tab.app.notify(str(error), severity="warning", markup=False)
            return
        await self.turns.start(events, text=text, upto=index)

    async def regenerate_at(self, index: int) -> None:
        """A new version of the reply at ``index`` (a new branch)."""
        tab = self.conversation
        if index >= len(tab.session.messages):
            tab.app.notify("That message has no reply yet.", severity="warning")
            return
        try:
            events = tab.session.regenerate(index)
        except SessionError as error:
            tab.app.notify(str(error), severity="warning", markup=False)
            return
        await self.turns.start(events, upto=index)

    def switch(self, index: int, step: int) -> None:
        """Show the version ``step`` away of the message at ``index`` (a job)."""
        tab = self.conversation
        session = tab.session
        position = session.branch_position(index)
        if not 1 <= position[0] + step <= position[1]:
            tab.app.notify(
                "No other version that way."
                if position[1] > 1
                else "This message has no other versions.",
                timeout=3,
            )
            return

        def switched(result: Refilled) -> Awaitable[None]:
            k, n = session.branch_position(index)
            tab.app.notify(
                f"Version {k} of {n}: kept {result.reused:,} cached tokens, "
                f"evaluated {result.evaluated:,}.",
                timeout=6,
            )
            return self.redraw_selecting(index)

        self.jobs.run(
            "switching branch",
            lambda progress: session.switch_branch(index, step, progress),
            switched,
        )

    def delete(self, index: int) -> None:
        """Delete the exchange whose message of the user is at ``index`` (a job)."""
        tab = self.conversation
        session = tab.session

        def deleted(result: Refilled) -> Awaitable[None]:
            tab.app.notify(
                f"Deleted the exchange: kept {result.reused:,} cached tokens, "
                f"evaluated {result.evaluated:,}.",
                timeout=6,
            )
            return self.redraw_selecting(min(index, len(session.messages) - 1))

        self.jobs.run("deleting", lambda progress: session.delete_pair(index, progress), deleted)

    async def redraw_selecting(self, index: int) -> None:
        """Draw the transcript again and select the message at ``index`` (if any)."""
        tab = self.conversation
        await tab.reload()
        for widget in tab.selectable():
            if widget.index == index:
                widget.focus()
                widget.scroll_visible(animate=False)
                return
        tab.focus_input()

    def copy(self, index: int, code: bool) -> None:
        """Copy the message (or its next code block) exactly as the transcript keeps it:
        to the terminal's clipboard (OSC 52) and to ``clipboard.txt`` in the data folder."""
        tab = self.conversation
        content = tab.session.messages[index]["content"]
        what = "the message"
        if code:
            blocks = code_blocks(content)
            if not blocks:
                tab.app.notify("No code block in this message.", severity="warning")
                return
            turn = self.code_copies.get(index, 0)
            self.code_copies[index] = turn + 1
            content = blocks[turn % len(blocks)]
            what = f"code block {turn % len(blocks) + 1} of {len(blocks)}"
        tab.app.copy_to_clipboard(content)
        try:
            where = f"; also in {keep_copy(content)}"
        except OSError as error:
            where = f"; it could not also be written to a file ({error})"
        tab.app.notify(f"Copied {what} ({len(content):,} characters){where}.", markup=False)
