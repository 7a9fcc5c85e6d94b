"""A conversation's message actions: edit and regenerate as new branches, switch branch,
delete an exchange, copy a message or a code block.

A mixin of :class:`~kvchat.tui.widgets.chat.Conversation`. Every change is one
engine call (:mod:`kvchat.engine.branch_ops`): an edit or a regenerate is a turn,
a switch or a deletion a job; the transcript is then drawn again from the session.
"""

from __future__ import annotations

from kvchat.clipboard import code_blocks, keep_copy
from kvchat.engine.session import SessionError

from ..screens.message_dialogs import DeletePairDialog, EditDialog
from .messages import (
    AssistantMessage,
    BranchBar,
    MessageAction,
    NoticeMessage,
    Selectable,
    UserMessage,
    Welcome,
    rebuild_note,
)


class BranchingMixin:
    """Message actions of a conversation tab."""

    _code_copies: dict[int, int]  # message index -> code blocks copied from it so far

    def _transcript_widgets(self) -> list:
        """The log's widgets for the transcript: a welcome until the first message, each
        message with its place (and ‹ k/n › when it has other versions), and each reply
        with the note of its turn's rebuild (turns pair with the last replies)."""
        session = self.session
        messages = session.messages
        replies = sum(1 for m in messages if m["role"] == "assistant")
        turns = session.turns[-replies:] if replies else []
        notes = [None] * (replies - len(turns)) + [rebuild_note(t.rebuilt) for t in turns]
        widgets: list = [] if any(m["role"] == "user" for m in messages) else [Welcome()]
        positions = session.branch_positions()
        for index, message in enumerate(messages):
            role = message["role"]
            if role == "user":
                widgets.append(UserMessage(message["content"], index))
            elif role == "assistant":
                widgets.append(AssistantMessage(message["content"],
                                                stopped=bool(message.get("stopped")),
                                                note=notes.pop(0), index=index))
            elif role == "system":
                widgets.append(NoticeMessage(f"System prompt: {message['content']}", "system"))
                continue
            if positions[index][1] > 1:
                widgets.append(BranchBar(index, positions[index], role))
        return widgets

    async def _show_branches_from(self, upto: int) -> None:
        """After an edit or a regenerate at ``upto``: the messages before it are as they
        were (their versions too: the new branch starts at ``upto``), so only those from
        ``upto`` on, drawn by the turn, get their ‹ k/n › where they have other versions."""
        positions = self.session.branch_positions()
        for widget in self.selectable():
            if widget.index >= upto and positions[widget.index][1] > 1:
                role = self.session.messages[widget.index]["role"]
                await self.log.mount(BranchBar(widget.index, positions[widget.index], role),
                                     after=widget)

    def selectable(self) -> list[Selectable]:
        """The messages shown that can be selected, in order."""
        return [w for w in self.log.children if isinstance(w, Selectable)]

    def action_select_last(self) -> None:
        """Ctrl+Up from the message box: select the newest message."""
        found = self.selectable()
        if found:
            found[-1].focus()
            found[-1].scroll_visible(animate=False)

    async def on_message_action(self, event: MessageAction) -> None:
        # a handler by name: Textual's @on is collected from widget classes only, not mixins
        event.stop()
        if event.action == "leave":
            if not self.stop():
                self.focus_input()
            return
        if event.action in ("copy", "copy_code"):
            self._copy(event.index, code=event.action == "copy_code")
            return
        if self.refuse_if_busy() or not 0 <= event.index < len(self.session.messages):
            return
        message = self.session.messages[event.index]
        if event.action == "edit":
            if message["role"] != "user":
                self.notify("Only your own messages can be edited; r makes a new version "
                            "of a reply.", severity="warning")
                return
            self.app.push_screen(EditDialog(message["content"]),
                                 lambda text: self._edited(event.index, text))
        elif event.action == "regenerate":
            index = event.index + (message["role"] == "user")
            await self._regenerate_at(index)
        elif event.action == "branch":
            self._switch(event.index, event.step)
        elif event.action == "delete":
            index = event.index - (message["role"] == "assistant")
            if index < 0 or self.session.messages[index]["role"] != "user":
                self.notify("That reply has no message of yours before it to delete with it.",
                            severity="warning")
                return
            preview = self.session.messages[index]["content"][:60]
            self.app.push_screen(DeletePairDialog(preview),
                                 lambda yes: self._delete(index) if yes else None)

    async def _edited(self, index: int, text: str | None) -> None:
        if text is None:
            return
        try:
            events = self.session.edit(index, text)
        except SessionError as error:
            self.notify(str(error), severity="warning", markup=False)
            return
        await self.start_turn(events, text=text, upto=index)

    async def _regenerate_at(self, index: int) -> None:
        if index >= len(self.session.messages):
            self.notify("That message has no reply yet.", severity="warning")
            return
        try:
            events = self.session.regenerate(index)
        except SessionError as error:
            self.notify(str(error), severity="warning", markup=False)
            return
        await self.start_turn(events, upto=index)

    def _switch(self, index: int, step: int) -> None:
        position = self.session.branch_position(index)
        if not 1 <= position[0] + step <= position[1]:
            self.notify("No other version that way." if position[1] > 1
                        else "This message has no other versions.", timeout=3)
            return

        def switched(result) -> None:
            k, n = self.session.branch_position(index)
            self.notify(f"Version {k} of {n}: kept {result.reused:,} cached tokens, "
                        f"evaluated {result.evaluated:,}.", timeout=6)
            return self._redraw_selecting(index)

        self.run_job("switching branch",
                     lambda progress: self.session.switch_branch(index, step, progress), switched)

    def _delete(self, index: int) -> None:
        def deleted(result) -> None:
            self.notify(f"Deleted the exchange: kept {result.reused:,} cached tokens, "
                        f"evaluated {result.evaluated:,}.", timeout=6)
            return self._redraw_selecting(min(index, len(self.session.messages) - 1))

        self.run_job("deleting", lambda progress: self.session.delete_pair(index, progress),
                     deleted)

    async def _redraw_selecting(self, index: int) -> None:
        """Draw the transcript again and select the message at ``index`` (if any)."""
        await self.reload()
        for widget in self.selectable():
            if widget.index == index:
                widget.focus()
                widget.scroll_visible(animate=False)
                return
        self.focus_input()

    def _copy(self, index: int, code: bool) -> None:
        """Copy the message (or its next code block) exactly as the transcript keeps it:
        to the terminal's clipboard (OSC 52) and to ``clipboard.txt`` in the data folder."""
        content = self.session.messages[index]["content"]
        what = "the message"
        if code:
            blocks = code_blocks(content)
            if not blocks:
                self.notify("No code block in this message.", severity="warning")
                return
            turn = self._code_copies.get(index, 0)
            self._code_copies[index] = turn + 1
            content = blocks[turn % len(blocks)]
            what = f"code block {turn % len(blocks) + 1} of {len(blocks)}"
        self.app.copy_to_clipboard(content)
        try:
            where = f"; also in {keep_copy(content)}"
        except OSError as error:
            where = f"; it could not also be written to a file ({error})"
        self.notify(f"Copied {what} ({len(content):,} characters){where}.", markup=False)
