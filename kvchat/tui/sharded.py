"""The TUI on rank 0 of a sharded run (``kvchat launch -n 2 -- [TUI options]``).

A sharded run has one tab, on its one model: the other ranks follow one
session (kvchat/engine/sharding/driver.py). Its session is a
:class:`~kvchat.engine.sharding.driver.ShardedSession`, which sends every
operation that changes the cache to every rank; what it cannot send (switching
a branch, deleting a pair) it refuses in one sentence, shown as a notification.
The actions that would open, close or move a tab say so in one sentence too. A
drop (from memory, or from disk on every rank) leaves the tab on a new session.

The app holds a :class:`ShardedRun` (``app.shards``) once :meth:`KvChatApp.shard` has
given it a model loaded over every rank; its tab controller (whose
:class:`~kvchat.tui.tabs.OneTabRun` it is) and actions ask it first.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from kvchat import store

from .screens.drop import DropDialog
from .screens.loading import LoadingScreen

if TYPE_CHECKING:
    from .app_view import AppView
    from .tabs import TabController

ONE_TAB = (
    "A sharded run has one tab, on its one model: other tabs, models and sessions, "
    "closing and renaming need a run on one machine."
)


class ShardedRun:
    """The sharded side of ``app``: its one session over the ranks ``lm`` spans, in the
    tab that ``tabs`` shows."""

    def __init__(self, app: AppView, tabs: TabController, lm) -> None:
        self.app = app
        self.tabs = tabs
        self.lm = lm

    def probe_kinds(self) -> None:
        """Find out which cache kinds the model takes, on every rank together (before the
        app runs): the kind dialog and new sessions then ask rank 0's kept answers."""
        from kvchat.engine.caches.kinds import OFFERED_KINDS
        from kvchat.engine.sharding.driver import probe_kinds

        probe_kinds(self.lm, list(dict.fromkeys([*OFFERED_KINDS, self.app.config.cache])))

    def new_session(self, name=None):
        """A new session on every rank (in the app's pool as ``name`` when given)."""
        from kvchat.engine.sharding.driver import new_session
        from kvchat.settings import generation_of

        app = self.app
        c = app.config
        session = new_session(
            self.lm,
            kind=self.tabs.fitting_kind(self.lm),
            system=c.system or None,
            settings=generation_of(c),
        )
        if name is not None:
            app.pool.add(name, session)
        return session

    def refused(self) -> bool:
        """True (after saying why) when the run has its tab already."""
        if self.app.conversations():
            self.app.notify(ONE_TAB, severity="warning", markup=False)
            return True
        return False

    def open_saved(self, name: str) -> None:
        if self.refused():
            return
        self.app.push_screen(LoadingScreen(f"Opening session {name}…"))
        self.app.run_worker(
            partial(self.load, name), name="load_sharded", group="load", thread=True
        )

    def load(self, name: str) -> None:
        """Worker: open saved session ``name`` on every rank (each its own cache shard)."""
        from kvchat.runtime.sharded.disk import load_session

        tabs = self.tabs
        try:
            loaded = load_session(name, self.lm)
        except store.StoreError as error:
            self.app.call_from_thread(tabs.load_failed, str(error))
            return
        self.app.call_from_thread(tabs.loaded, name, loaded, [])

    def drop(self) -> None:
        """Drop the tab's session, from memory (saved on every rank first) or from disk
        too (on every rank), after the one-machine confirmation; the tab then holds a
        new session, made on every rank together."""
        app = self.app
        conversation = app.idle_conversation()
        if conversation is None:
            return
        name, fresh = conversation.session_name, self.tabs.unique_name()

        def drop(from_disk: bool):
            from kvchat.engine.sharding.driver import ShardedSession
            from kvchat.runtime.sharded.disk import delete_session

            problem = None
            if from_disk:
                problem = delete_session(name)
            else:
                conversation.save_now()  # every rank's shard, through the pool
            app.pool.drop(name)
            session = conversation.session  # made by new_session (or load): a sharded one
            if isinstance(session, ShardedSession):
                session.local.unload()  # rank 0's cache goes now, as the others' do
            return self.new_session(fresh), problem

        def chosen(where: str | None) -> None:
            if where is None:
                return
            said = (
                f"Dropped {name} from memory and disk on every rank."
                if where == "disk"
                else f"Saved {name} on every rank and dropped it from memory "
                f"(kvchat launch -- --resume {name} reopens it)."
            )
            conversation.jobs.run(
                "dropping",
                lambda progress: drop(where == "disk"),
                lambda made: app.call_later(self.swap_tab, conversation, fresh, *made, said),
                needs_cache=False,
            )

        app.push_screen(
            DropDialog(name, store.exists(name), "start a new session in its tab"), chosen
        )

    async def swap_tab(
        self, conversation, name: str, session, problem: str | None, said: str
    ) -> None:
        """Put ``session`` (new, as ``name``) in the place of ``conversation``'s tab."""
        app = self.app
        await app.tabs.remove_pane(conversation.parent.id)
        await self.tabs.add_conversation(session, name)
        app.notify(problem or said, severity="warning" if problem else "information", markup=False)
