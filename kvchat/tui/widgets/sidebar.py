"""The cache panel for the active tab: what its KV cache holds and what the last turn cost.

The panel draws one :class:`CacheInfo`; updating it is one assignment
(``sidebar.info = CacheInfo.of(conversation)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Button, Sparkline, Static

from kvchat.engine.stats import TurnStats, memory


@dataclass(frozen=True)
class CacheInfo:
    """A snapshot of one session's cache, as the sidebar shows it."""

    name: str
    model_id: str
    kind: str
    state: str
    cache_tokens: int
    cache_bytes: int
    active_memory: int
    peak_memory: int
    turns: int
    last: TurnStats | None
    prompt_eval_history: tuple[float, ...]
    rebuilt: str | None
    saved: bool

    @classmethod
    def of(cls, conversation) -> CacheInfo:
        session = conversation.session
        last = session.last_stats
        active, peak = memory()
        return cls(
            name=conversation.session_name,
            model_id=session.lm.model_id,
            kind=session.kind.name,
            state=("offloaded to disk" if conversation.state == "idle"
                   and getattr(conversation, "offloaded", False) else conversation.state),
            cache_tokens=session.cache_tokens,
            cache_bytes=session.cache_bytes,
            active_memory=active,
            peak_memory=max(peak, last.peak_memory_bytes if last else 0),
            turns=len(session.turns),
            last=last,
            prompt_eval_history=tuple(t.prompt_eval_s for t in session.turns),
            rebuilt=session.pending_rebuild or (last.rebuilt if last else None),
            saved=conversation.saved,
        )


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError


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
        yield Static("", id="cache-rebuilt", markup=False)
        with Vertical(id="cache-buttons"):
            yield Button("Save", id="btn-save", compact=True, action="app.save")
            yield Button("Trim…", id="btn-trim", compact=True, action="app.trim")
            yield Button("Cache type…", id="btn-kind", compact=True, action="app.cache_kind")
            yield Button("Reset", id="btn-reset", compact=True, action="app.reset_cache", variant="warning")
            yield Button("Drop…", id="btn-drop", compact=True, action="app.drop", variant="error")

    def watch_info(self, info: CacheInfo | None) -> None:
        facts = self.query_one("#cache-facts", Static)
        rebuilt = self.query_one("#cache-rebuilt", Static)
        spark = self.query_one("#cache-sparkline", Sparkline)
        for button in self.query(Button):
            button.disabled = info is None or info.state not in ("idle", "offloaded to disk")
        if info is None:
            facts.update("No session open.")
            rebuilt.update("")
            spark.data = []
            return
        facts.update(self._table(info))
        history = list(info.prompt_eval_history) if self.volatile else [0.0] * info.turns
        spark.data = history[-40:]
        rebuilt.update(Text(f"Rebuilt: {info.rebuilt}") if info.rebuilt else "")
        rebuilt.display = bool(info.rebuilt)

    def _table(self, info: CacheInfo) -> Table:
        def vol(text: str) -> str:
            return text if self.volatile else "–"

        last = info.last
        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim", no_wrap=True)
        table.add_column(overflow="fold")
        rows = [
            ("session", info.name + ("" if info.saved else " (unsaved)")),
            ("model", info.model_id),
            ("kind", info.kind),
            ("state", info.state),
            ("tokens", f"{info.cache_tokens:,}"),
            ("bytes", human_bytes(info.cache_bytes)),
            ("memory", vol(human_bytes(info.active_memory))),
            ("peak mem", vol(human_bytes(info.peak_memory))),
            ("turns", str(info.turns)),
        ]
        if last is None:
            rows.append(("last turn", "–"))
        else:
            rows += [
                ("prompt eval", vol(seconds(last.prompt_eval_s))),
                ("TTFT", vol(seconds(last.ttft_s))),
                ("reused", f"{last.reused_tokens:,} of {last.prompt_tokens:,}"),
                ("evaluated", f"{last.evaluated_tokens:,}"),
                ("generated", f"{last.generated_tokens:,}"),
                ("gen speed", vol(f"{last.gen_tps:,.1f} tok/s")),
            ]
        for label, value in rows:
            table.add_row(label, Text(value))
        return table
