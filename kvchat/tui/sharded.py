"""The TUI on rank 0 of a sharded run (``kvchat launch -n 2 -- [TUI options]``).

A sharded run has one tab, on its one model: the other ranks follow one
session (kvchat/engine/distributed.py). Its session is a
:class:`~kvchat.engine.distributed.DistributedSession`, which sends every
operation that changes the cache to every rank; what it cannot send (switching
a branch, deleting a pair) it refuses in one sentence, shown as a notification.
The actions that would open, close or move a tab say so in one sentence too.

A mixin of :class:`~kvchat.tui.app.KvChatApp`, first among its bases.
"""

from __future__ import annotations

from textual import work

from kvchat import store

from .screens.loading import LoadingScreen

ONE_TAB = ("A sharded run has one tab, on its one model: other tabs, models and sessions, "
           "closing, renaming and dropping need a run on one machine.")


class ShardedMixin:
    """``shard(lm)`` makes the app run its one session over the ranks ``lm`` spans."""

    sharded = False

    def shard(self, lm) -> None:
        """Before the app runs: use ``lm`` (a model loaded over every rank) for one tab.
        Idle caches stay in memory (an offload is one rank's, not every rank's). Which
        cache kinds the model takes is found out now, on every rank together: the kind
        dialog and new sessions then ask rank 0's kept answers, running nothing."""
        from kvchat.engine.distributed import probe_kinds
        from kvchat.engine.kinds import EXAMPLE_KINDS

        probe_kinds(lm, list(dict.fromkeys([*EXAMPLE_KINDS, self.config.cache])))
        self.sharded = True
        self.lm = lm
        self.models.retain(lm)
        self.expire_every = 0
        self.picker_on_start = False

    def rank_lost(self) -> None:
        """Another rank ended: quit (status 1) as soon as the turn it was in has failed
        too; ``kvchat launch`` then says which rank it was."""
        self.run_worker(self._quit_when_idle(return_code=1), group="quit")

    def new_session(self, name=None, lm=None):
        if not self.sharded:
            return super().new_session(name, lm)
        from kvchat.engine.distributed import new_session
        from kvchat.engine.session import GenerationSettings

        c = self.config
        session = new_session(self.lm, kind=self._fitting_kind(self.lm), system=c.system or None,
                              settings=GenerationSettings(max_tokens=c.max_tokens, temp=c.temp))
        if name is not None:
            self.pool.add(name, session)
        return session

    def _refused(self) -> bool:
        """True (after saying why) when this is a sharded run and it has its tab."""
        if self.sharded and self.conversations():
            self.notify(ONE_TAB, severity="warning", markup=False)
            return True
        return False

    async def new_tab(self):
        return None if self._refused() else await super().new_tab()

    def open_saved(self, name: str) -> None:
        if not self.sharded:
            return super().open_saved(name)
        if self._refused():
            return
        self.push_screen(LoadingScreen(f"Opening session {name}…"))
        self._load_sharded(name)

    @work(thread=True, group="load")
    def _load_sharded(self, name: str) -> None:
        """Worker: open saved session ``name`` on every rank (each its own cache shard)."""
        from kvchat.engine.distributed import load_session

        try:
            loaded = load_session(name, self.lm)
        except store.StoreError as error:
            self.call_from_thread(self._load_failed, str(error))
            return
        self.call_from_thread(self._loaded, name, loaded, [])

    def _one_tab(self, action: str):
        """The app's ``action``, or, in a sharded run, the sentence saying why not."""
        if self.sharded:
            self.notify(ONE_TAB, severity="warning", markup=False)
            return None
        return getattr(super(), f"action_{action}")()

    def action_new_tab_model(self):
        return self._one_tab("new_tab_model")

    def action_import(self):
        return self._one_tab("import")

    def action_close_tab(self):
        return self._one_tab("close_tab")

    def action_drop(self):
        return self._one_tab("drop")

    def action_rename(self):
        return self._one_tab("rename")
