"""The app's screen: tabs of conversations beside the cache sidebar, the footer below, and
what the app looks up on it (the tabs, the active conversation) and does to it (the
sidebar redrawn, shown or hidden; the next tab).

:class:`TabbedLayout` is the base of :class:`~kvchat.tui.app.KvChatApp`, which fills the
tabs; with it the app is the :class:`~kvchat.tui.app_view.AppView` its collaborators see.
"""

from __future__ import annotations

from textual import on
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, TabbedContent, Tabs

from .widgets.chat import Changed, Conversation
from .widgets.sidebar import CacheInfo, CacheSidebar


class TabbedLayout(App):
    """The tabs (one :class:`Conversation` each) and the cache sidebar of the active one.
    ``volatile=False`` hides the sidebar's timings and memory figures."""

    volatile: bool
    _footer_shown: tuple[object, ...] = ()  # footer_inputs() when the footer was last refreshed

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield TabbedContent(id="tabs")
            yield CacheSidebar(volatile=self.volatile, id="sidebar")
        yield Footer(compact=True)

    @property
    def main_screen(self) -> Screen:
        """The screen holding the tabs and the sidebar, whatever dialog is on top of it."""
        return self.screen_stack[0]

    @property
    def tabs(self) -> TabbedContent:
        return self.main_screen.query_one("#tabs", TabbedContent)

    @property
    def sidebar(self) -> CacheSidebar:
        return self.main_screen.query_one("#sidebar", CacheSidebar)

    def conversations(self) -> list[Conversation]:
        if not self.screen_stack:  # the app is closing
            return []
        return list(self.main_screen.query(Conversation))

    def active_conversation(self) -> Conversation | None:
        try:
            pane = self.tabs.active_pane
        except Exception:
            return None
        if pane is None:
            return None
        found = pane.query(Conversation)
        return found.first() if found else None

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.refresh_sidebar()
        conversation = self.active_conversation()
        if conversation is not None and conversation.is_mounted:
            self.call_later(conversation.focus_input)

    @on(Changed)
    def _changed(self, event: Changed) -> None:
        if event.conversation is self.active_conversation():
            self.refresh_sidebar()

    def refresh_sidebar(self) -> None:
        try:
            sidebar = self.sidebar
        except (IndexError, NoMatches):  # the app is closing: nothing left to draw
            return
        conversation = self.active_conversation()
        sidebar.info = CacheInfo.of(conversation) if conversation else None
        # Rebuilding the footer's keys a few times a second while a reply streams was about a
        # third of the UI thread's work (29% of a core, 16-20% without it, streaming
        # demo:qwen2.5-3b@q4 on a 2-core VM): only when they change.
        shown = self.footer_inputs()
        if shown != self._footer_shown:
            self._footer_shown = shown
            self.refresh_bindings()

    def footer_inputs(self) -> tuple[object, ...]:
        """What the footer's keys depend on besides the screens (``check_action``'s inputs):
        the active conversation and whether it is busy."""
        conversation = self.active_conversation()
        return (conversation, conversation is not None and conversation.busy)

    def idle_conversation(self) -> Conversation | None:
        """The active conversation, or None (saying why) when it is busy or there is none;
        for the actions that must not run during a reply or a job."""
        conversation = self.active_conversation()
        if conversation is None or conversation.refuse_if_busy():
            return None
        return conversation

    def action_next_tab(self) -> None:
        self.tabs.query_one(Tabs).action_next_tab()

    def action_previous_tab(self) -> None:
        self.tabs.query_one(Tabs).action_previous_tab()

    def action_toggle_sidebar(self) -> None:
        shown = self.sidebar.display
        self.main_screen.set_class(shown, "-hide-sidebar")
        self.main_screen.set_class(not shown, "-show-sidebar")
