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


def progress_text(label: str, done: int, total: int, elapsed: float, unit: str = "tokens") -> Text:
    """A prompt's evaluation (or a cache's loading, or a job's steps in ``unit``) so far,
    with its rate and the time left once there is a rate to go by: ``Prefill: 2,048 of
    18,903 tokens · 410 tokens/s · 41 s left``."""
    text = f"{label.capitalize()}: {done:,} of {total:,} {unit}"
    if done > 0 and elapsed > 0 and done < total:
        rate = done / elapsed
        speed = f" · {rate:,.0f} {unit}/s" if unit == "tokens" else ""
        text += f"{speed} · {_duration((total - done) / rate)} left"
    return Text(text + "… Esc stops")


def streaming_text(tokens: int, elapsed: float) -> Text:
    """A reply being written: its tokens so far and their rate (from its first token)."""
    rate = f" · {(tokens - 1) / elapsed:,.1f} tokens/s" if tokens > 1 and elapsed > 0 else ""
    return Text(f"Answering: {tokens:,} token{'s' if tokens != 1 else ''}{rate}… Esc stops")


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{max(1, round(seconds))} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


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
