"""A tab's status line: what it is doing (waiting for the model, answering, a job)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.text import Text


def state_text(state: str, holder: str) -> Text | str:
    """The status line for a tab in ``state`` (``holder`` holds the model when it waits)."""
    if state == "idle":
        return ""
    if state == "waiting":
        return Text(f"Waiting for the model ({holder} is using it)… Esc cancels")
    if state == "answering":
        return Text("Answering… Esc stops")
    return Text(f"{state.capitalize()}…")


def holder_name(running: str | None, tabs: Mapping[str, str]) -> str:
    """Who holds the model, as the user knows it: ``running`` is the scheduler's owner,
    ``tabs`` each tab's owner and name (a tab's name rather than its widget id)."""
    if running is None:
        return "another tab"
    if running in tabs:
        return tabs[running]
    if running.startswith("load:"):
        return f"opening {running.removeprefix('load:')}"
    return running
