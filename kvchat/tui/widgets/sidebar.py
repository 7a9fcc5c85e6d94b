"""The cache panel for the active tab: what its KV cache holds and what the last turn cost
(while a turn runs: that turn, as far as it has got).

The panel draws one :class:`CacheInfo`; updating it is one assignment
(``sidebar.info = CacheInfo.of(conversation)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.widgets import Button, Sparkline, Static

from kvchat.engine.conversation.stats import CacheChange, TurnStats, memory
from kvchat.engine.conversation.thoughts import reevaluated_note
from kvchat.units import human_bytes

TURN_STATES = ("waiting", "answering")  # a conversation's states while a turn runs
TURN_ROWS = ("prompt eval", "TTFT", "reused", "evaluated", "generated", "gen speed")


def user_turns(session) -> int:
    """A session's turns as every view counts them (sidebar, trim dialog, session picker):
    the user messages in its transcript."""
    return sum(1 for m in session.messages if m["role"] == "user")


@dataclass(frozen=True)
class CacheInfo:
    """A snapshot of one session's cache, as the sidebar shows it."""

    name: str
    model_id: str
    weights: str  # how the model's weights are held, in brief (LoadedModel.weights_brief)
    kind: str
    state: str
    cache_tokens: int
    cache_bytes: int
    checkpoints: tuple[int, int]  # how many, their bytes
    active_memory: int
    peak_memory: int
    turns: int
    last: TurnStats | None  # None while a turn runs or after a change: not the cache's figures
    prefill: tuple[int, int] | None  # the running turn's prompt tokens evaluated, of how many
    streamed: tuple[int, float] | None  # its reply's tokens so far, seconds since the first
    prompt_eval_history: tuple[float, ...]
    rebuilt: str | None
    rebuild_pending: bool
    saved: bool
    layout: str | None = None  # a sharded run's world size and mode
    rank_bytes: tuple[int, ...] = ()  # a sharded run's cache bytes on each rank
    change: CacheChange | None = None  # maintenance since the last turn (undo, trim...)

    @classmethod
    def of(cls, conversation) -> CacheInfo:
        """The panel's figures of ``conversation``: while its turn runs, those its worker
        took as the turn began (the live session belongs to the turn's thread then)."""
        session = conversation.session
        running = conversation.state in TURN_STATES
        change = None if running else session.last_change
        figures = conversation.figures if running and conversation.figures else session.figures()
        last = None if running or change is not None else figures.last
        active, peak = memory()
        return cls(
            name=conversation.session_name,
            model_id=session.lm.model_id,
            weights=session.lm.weights_brief,
            kind=session.kind.name,
            state=(
                "offloaded to disk"
                if conversation.state == "idle" and getattr(conversation, "offloaded", False)
                else conversation.state
            ),
            cache_tokens=figures.cache_tokens,
            cache_bytes=figures.cache_bytes,
            checkpoints=figures.checkpoints,
            active_memory=active,
            peak_memory=max(peak, last.peak_memory_bytes if last else 0),
            turns=figures.user_turns,
            last=last,
            prefill=conversation.prefill if running else None,
            streamed=conversation.streamed if running else None,
            prompt_eval_history=figures.prompt_eval_history,
            rebuilt=figures.pending_rebuild or (last.rebuilt if last else None),
            rebuild_pending=figures.pending_rebuild is not None,
            # an undo, a trim, a kind... since the last save count too (read while idle only)
            saved=conversation.saved and (conversation.busy or not conversation.unsaved),
            layout=getattr(session.lm, "layout", None),
            rank_bytes=tuple(getattr(session, "rank_bytes", ())),
            change=change,
        )


def seconds(s: float) -> str:
    return f"{s * 1000:,.0f} ms" if s < 1 else f"{s:,.2f} s"


class CacheSidebar(Vertical):
    """The cache panel. ``volatile=False`` hides timings and memory (for snapshots)."""

    info: reactive[CacheInfo | None] = reactive(None, always_update=True)

    def __init__(self, volatile: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.volatile = volatile
        self.border_title = "KV cache"

    def compose(self) -> ComposeResult:
        yield Static("No session open.", id="cache-facts", markup=False)
        yield Static("prompt eval per turn", classes="caption", markup=False)
        yield Sparkline([], id="cache-sparkline")
        with Vertical(id="cache-buttons"):
            yield Button("Save", id="btn-save", compact=True, action="app.save")
            yield Button("Undo/trim…", id="btn-trim", compact=True, action="app.trim")
            yield Button("Cache type…", id="btn-kind", compact=True, action="app.cache_kind")
            yield Button(
                "Reset", id="btn-reset", compact=True, action="app.reset_cache", variant="warning"
            )
            yield Button("Drop…", id="btn-drop", compact=True, action="app.drop", variant="error")
        # below the buttons, so they stay put when it appears
        yield Static("", id="cache-rebuilt", markup=False)

    def on_mount(self) -> None:
        # The buttons are the mouse's way to the same actions as Ctrl+S, Ctrl+L...: a click
        # leaves the focus in the message box.
        for button in self.query(Button):
            button.can_focus = False

    def watch_info(self, info: CacheInfo | None) -> None:
        try:
            facts = self.query_one("#cache-facts", Static)
            rebuilt = self.query_one("#cache-rebuilt", Static)
            spark = self.query_one("#cache-sparkline", Sparkline)
        except NoMatches:  # the app is closing and took the panel's parts away
            return
        for button in self.query(Button):
            button.disabled = info is None or info.state not in ("idle", "offloaded to disk")
        if info is None:
            facts.update("No session open.")
            rebuilt.update("")
            spark.data = []
            return
        facts.update(self._table(info))
        history = list(info.prompt_eval_history)
        if not self.volatile:
            history = [0.0] * len(history)
        spark.data = history[-40:]
        when = "The next turn rebuilds the cache" if info.rebuild_pending else "Last turn rebuilt"
        rebuilt.update(Text(f"{when}: {info.rebuilt}.") if info.rebuilt else "")
        rebuilt.display = bool(info.rebuilt)

    def _table(self, info: CacheInfo) -> Group:
        def vol(text: str) -> str:
            return text if self.volatile else "–"

        last = info.last
        cache = [
            ("session", info.name + ("" if info.saved else " (unsaved)")),
            ("model", info.model_id),
            ("weights", info.weights),
            ("kind", info.kind),
            ("state", info.state),
            ("tokens", f"{info.cache_tokens:,}"),
            ("bytes", human_bytes(info.cache_bytes)),
            ("turns", str(info.turns)),
        ]
        if info.layout:  # a sharded run: each rank holds its part of the cache
            cache[-1:-1] = [
                ("ranks", info.layout),
                *((f"rank {rank}", human_bytes(n)) for rank, n in enumerate(info.rank_bytes)),
            ]
        count, size = info.checkpoints
        if count:  # sliding-window and recurrent models only: memory beside the cache
            cache.insert(-1, ("checkpoints", f"{count} · {human_bytes(size)}"))
        answered = last is not None and last.generated_tokens > 0  # no token after Esc: no TTFT
        turn = (
            []
            if last is None
            else [
                ("prompt eval", vol(seconds(last.prompt_eval_s))),
                ("TTFT", vol(seconds(last.ttft_s)) if answered else "—"),
                ("reused", f"{last.reused_tokens:,} of {last.prompt_tokens:,}"),
                ("evaluated", f"{last.evaluated_tokens:,}"),
                (
                    "generated",
                    f"{last.generated_tokens:,}" + (" (stopped)" if last.stopped else ""),
                ),
                ("gen speed", vol(f"{last.gen_tps:,.1f} tok/s") if answered else "—"),
            ]
        )
        if last is not None and last.not_batched:  # it decoded beside the batch, alone
            turn.append(("batched", f"no: {last.not_batched}"))
        elif last is not None and last.batch_size > 1:
            turn.append(
                (
                    "batched",
                    f"with {last.batch_size - 1} other" + ("s" if last.batch_size > 2 else ""),
                )
            )
        # mlx's figures are the whole process's (every tab, the model), not this cache's
        process = [
            ("memory", vol(human_bytes(info.active_memory))),
            ("peak", vol(human_bytes(info.peak_memory))),
        ]
        title = "last turn" + ("" if turn else "  –")
        if info.change is not None:  # the cache changed since: the turn's figures are stale
            title = f"last change  {info.change.action}"
            # the turn's rows, so the buttons stay put; only what the change evaluated applies
            turn = [
                (label, f"{info.change.evaluated_tokens:,}" if label == "evaluated" else "—")
                for label in TURN_ROWS
            ]
        if info.state in TURN_STATES:  # the running turn, never the previous one's figures
            title = f"this turn  {info.state}…"
            if info.prefill is not None:
                done, total = info.prefill
                turn = [("evaluated", f"{total:,}" if done >= total else f"{done:,} of {total:,}")]
            if info.streamed is not None:
                tokens, elapsed = info.streamed
                turn.append(("generated", f"{tokens:,}"))
                if tokens > 1 and elapsed > 0:
                    turn.append(("gen speed", f"{(tokens - 1) / elapsed:,.1f} tok/s"))
        note = reevaluated_note(last.reevaluated_reply_tokens) if last else None
        return Group(
            _grid(cache),
            Text(title, style="bold"),
            _grid(turn),
            *([Text(f"{note[0].upper()}{note[1:]}.", style="italic")] if note else []),
            Text("mlx, whole process", style="bold"),
            _grid(process),
        )


def _grid(rows: list[tuple[str, str]]) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True, min_width=11)  # the longest label
    table.add_column(overflow="fold")
    for label, value in rows:
        table.add_row(label, Text(value))
    return table
