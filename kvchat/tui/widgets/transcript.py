"""A session's transcript as the log's widgets: a welcome until the first message, each
message with its place, ‹ k/n › where a message has other versions, and each reply with
the note of its turn's rebuild."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.containers import VerticalScroll

from .messages import (
    AssistantMessage,
    BranchBar,
    NoticeMessage,
    Selectable,
    UserMessage,
    Welcome,
    rebuild_note,
)

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session


def transcript_widgets(session: Session) -> list:
    """The log's widgets for ``session``'s transcript (turns pair with the last replies)."""
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
            widgets.append(
                AssistantMessage(
                    message["content"],
                    stopped=bool(message.get("stopped")),
                    note=notes.pop(0),
                    index=index,
                )
            )
        elif role == "system":
            widgets.append(NoticeMessage(f"System prompt: {message['content']}", "system"))
            continue
        if positions[index][1] > 1:
            widgets.append(BranchBar(index, positions[index], role))
    return widgets


def selectable(log: VerticalScroll) -> list[Selectable]:
    """The messages shown in ``log`` that can be selected, in order."""
    return [w for w in log.children if isinstance(w, Selectable)]


async def show_branches_from(log: VerticalScroll, session: Session, upto: int) -> None:
    """After an edit or a regenerate at ``upto``: the messages before it are as they
    were (their versions too: the new branch starts at ``upto``), so only those from
    ``upto`` on, drawn by the turn, get their ‹ k/n › where they have other versions."""
    positions = session.branch_positions()
    for widget in selectable(log):
        if widget.index >= upto and positions[widget.index][1] > 1:
            role = session.messages[widget.index]["role"]
            await log.mount(BranchBar(widget.index, positions[widget.index], role), after=widget)
