"""The TUI on rank 0 of a sharded run (``kvchat launch -n 2 -- [TUI options]``).

A sharded run has one tab, on its one model: the other ranks follow one
session (kvchat/engine/distributed.py). Its session is a
:class:`~kvchat.engine.distributed.DistributedSession`, which sends every
operation that changes the cache to every rank; what it cannot send (switching
a branch, deleting a pair) it refuses in one sentence, shown as a notification.
The actions that would open, close or move a tab say so in one sentence too. A
drop (from memory, or from disk on every rank) leaves the tab on a new session.

A mixin of :class:`~kvchat.tui.app.KvChatApp`, first among its bases.
"""

from __future__ import annotations

from textual import work

from kvchat import store

from .screens.dialogs import DropDialog
from .screens.loading import LoadingScreen

ONE_TAB = ("A sharded run has one tab, on its one model: other tabs, models and sessions, "
           "closing and renaming need a run on one machine.")


class ShardedMixin:
    """``shard(lm)`` makes the app run its one session over the ranks ``lm`` spans."""

    sharded = False

    def shard(self, lm) -> None:
        """Before the app runs: use ``lm`` (a model loaded over every rank) for one tab.
        Idle caches stay in memory (an offload is one rank's, not every rank's). Which
        cache kinds the model takes is found out now, on every rank together: the kind
        dialog and new sessions then ask rank 0's kept answers, running nothing."""
        from kvchat.engine.distributed import probe_kinds
        from kvchat.engine.kinds import OFFERED_KINDS

        probe_kinds(lm, list(dict.fromkeys([*OFFERED_KINDS, self.config.cache])))
        self.sharded = True
        self.lm = lm
        self.models.retain(lm)
        self.expire_every = 0
        self.picker_on_start = False

    def rank_lost(self) -> None:
        """Another rank ended: quit (status 1) as soon as the turn it was in has failed
        too; ``kvchat launch`` then says which rank it was."""
        self.run_worker(self.quitter.exit_when_idle(return_code=1), group="quit")

    def new_session(self, name=None, lm=None):
        if not self.sharded:
            return super().new_session(name, lm)
        from kvchat.engine.distributed import new_session
        from kvchat.settings import generation_of

        c = self.config
        session = new_session(self.lm, kind=self._fitting_kind(self.lm), system=c.system or None,
                              settings=generation_of(c))
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
        """Drop the tab's session, from memory (saved on every rank first) or from disk
        too (on every rank), after the one-machine confirmation; the tab then holds a
        new session, made on every rank together."""
        if not self.sharded:
            return super().action_drop()
        conversation = self.idle_conversation()
        if conversation is None:
            return
        name, fresh = conversation.session_name, self._unique_name()

        def drop(from_disk: bool):
            from kvchat.engine.distributed import delete_session

            problem = None
            if from_disk:
                problem = delete_session(name)
            else:
                conversation.save_now()  # every rank's shard, through the pool
            self.pool.drop(name)
            conversation.session.local.unload()  # rank 0's cache goes now, as the others' do
            return self.new_session(fresh), problem

        def chosen(where: str | None) -> None:
            if where is None:
                return
            said = (f"Dropped {name} from memory and disk on every rank." if where == "disk"
                    else f"Saved {name} on every rank and dropped it from memory "
                         f"(kvchat launch -- --resume {name} reopens it).")
            conversation.run_job(
                "dropping", lambda progress: drop(where == "disk"),
                lambda made: self.call_later(self._swap_tab, conversation, fresh, *made, said),
                needs_cache=False)

        self.push_screen(DropDialog(name, store.exists(name), "start a new session in its tab"),
                         chosen)

    async def _swap_tab(self, conversation, name: str, session, problem: str | None,
                        said: str) -> None:
        """Put ``session`` (new, as ``name``) in the place of ``conversation``'s tab."""
        await self.tabs.remove_pane(conversation.parent.id)
        await self.add_conversation(session, name)
        self.notify(problem or said, severity="warning" if problem else "information",
                    markup=False)

    def action_rename(self):
        return self._one_tab("rename")
