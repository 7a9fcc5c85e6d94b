"""The app's collaborators on their own, without an App: each gets only the callbacks
it is built with, here plain functions that record what they are given."""

from __future__ import annotations

from dataclasses import dataclass

from helpers import turn

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session
from kvchat.engine.generation.scheduler import Scheduler
from kvchat.runtime.pool import SessionPool
from kvchat.tui.expiry import ExpiryTicker
from kvchat.tui.export_actions import ExportActions
from kvchat.tui.screens.export_dialogs import ExportDialog
from kvchat.tui.widgets.status import holder_name, progress_text, state_text, streaming_text


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Tab:
    owner: str
    session_name: str
    busy: bool


def chat(lm, text: str) -> Session:
    session = Session(lm, settings=GenerationSettings(max_tokens=6))
    turn(session, text)
    return session


def test_the_expiry_ticker_offloads_idle_caches_and_spares_a_busy_tab(demo_model, home):
    clock = Clock()
    pool = SessionPool(ttl_s=60, memory_budget_bytes=0, clock=clock)
    idle, busy = chat(demo_model, "Hello there."), chat(demo_model, "Something else.")
    pool.add("idle", idle)
    pool.add("busy", busy)
    tokens = idle.cache_tokens
    clock.now += 120  # both idle past the ttl by the pool's clock
    reports, queued = [], []
    ticker = ExpiryTicker(
        pool,
        Scheduler(),
        tabs=lambda: [Tab("conv-1", "idle", False), Tab("conv-2", "busy", True)],
        run_worker=queued.append,
        call_from_thread=lambda fn, *args: fn(*args),
        done=lambda offloaded, error: reports.append((offloaded, error)),
    )

    ticker.tick()
    ticker.tick()  # a tick while the first one's worker has not reported: nothing more
    assert len(queued) == 1 and ticker.running
    queued[0]()  # the worker runs
    assert reports == [(["idle"], None)] and not ticker.running
    assert not pool.entry("idle").in_memory and idle.cache_tokens == 0
    assert store.summary("idle").cache_tokens == tokens
    assert pool.entry("busy").in_memory and busy.cache_tokens > 0
    assert not store.exists("busy")


def test_the_export_actions_export_through_its_dialog_and_never_replaces(
    demo_model, home, tmp_path
):
    session = chat(demo_model, "What is a cache?")
    shown, said = [], []
    service = ExportActions(
        push_screen=lambda screen, then: shown.append((screen, then)),
        notify=lambda text, **options: said.append(text),
        open_saved=lambda name: None,
    )
    path = tmp_path / "talk.md"

    service.export(session, "talk")
    dialog, then = shown[-1]
    assert isinstance(dialog, ExportDialog)
    then(("md", str(path)))
    text = path.read_text()
    assert "## User\n\nWhat is a cache?\n\n## Assistant\n\n" in text
    assert said == [f"Exported talk to {path} ({len(text.encode()):,} bytes)."]

    service.export(session, "talk")
    shown[-1][1](("md", str(path)))  # the same file again: refused, the file kept
    assert said[-1] == f"{path} exists already; choose another file name."
    assert path.read_text() == text


def test_the_status_line_names_the_tab_holding_the_model():
    tabs = {"conv-1": "chat-1", "conv-2": "notes"}
    assert holder_name("conv-2", tabs) == "notes"
    assert holder_name("load:big", tabs) == "opening big"
    assert holder_name(None, tabs) == "another tab"
    assert str(state_text("waiting", "notes")) == (
        "Waiting for the model (notes is using it)… Esc cancels"
    )
    assert str(state_text("rebuilding", "")) == "Rebuilding…"
    assert state_text("idle", "") == ""


def test_the_status_line_says_how_fast_and_how_long_is_left():
    """A long prompt's evaluation shows its rate and the time left once it has a rate; a
    reply being written, its tokens so far and their rate."""
    assert str(progress_text("prefill", 0, 18_903, 0.0)) == (
        "Prefill: 0 of 18,903 tokens… Esc stops"
    )
    assert str(progress_text("prefill", 2_048, 18_903, 5.0)) == (
        "Prefill: 2,048 of 18,903 tokens · 410 tokens/s · 41 s left… Esc stops"
    )
    assert str(progress_text("prefill", 512, 90_000, 4.0)).endswith(
        " · 11 min 39 s left… Esc stops"
    )
    assert str(progress_text("checking cache kinds", 3, 12, 6.0, "kinds")) == (
        "Checking cache kinds: 3 of 12 kinds · 18 s left… Esc stops"
    )
    assert str(streaming_text(1, 0.0)) == "Answering: 1 token… Esc stops"
    assert str(streaming_text(43, 2.0)) == "Answering: 43 tokens · 21.0 tokens/s… Esc stops"
