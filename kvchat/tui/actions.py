"""The actions on the active tab that open a dialog or run one engine call in its worker:
save, trim or undo, the archive, cache kind, reset, regenerate, drop, rename, settings.

The app holds a :class:`TabActions` (``app.tab_actions``); its ``action_*`` methods call
it. Each acts on the app's idle active conversation, through its dialogs, its notices
and its tab controller.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import TYPE_CHECKING

from kvchat import store
from kvchat.engine.conversation.events import TurnDone
from kvchat.engine.conversation.history import archived_exchanges

from .screens.archive import ArchiveDialog
from .screens.confirm import ConfirmDialog
from .screens.drop import DropDialog
from .screens.rename import RenameDialog
from .screens.settings import SettingsDialog, TabSettings
from .screens.trim import TrimChoice, TrimDialog
from .widgets.sidebar import user_turns

if TYPE_CHECKING:
    from kvchat.engine.conversation.session import Session

    from .app_view import AppView
    from .tab_closer import TabCloser


class TabActions:
    """What the keys of ``KvChatApp.BINDINGS`` do to the active conversation of ``app``
    (closing its tab through ``closer``)."""

    def __init__(self, app: AppView, closer: TabCloser) -> None:
        self.app = app
        self.closer = closer
        self.notify = app.notify
        self.push_screen = app.push_screen

    def save(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        if not user_turns(conversation.session):
            self.notify("Nothing to save yet: send a message first.", severity="warning")
            return
        name = conversation.session_name

        def saved(path) -> None:
            conversation.saved = True
            self.notify(
                f"Saved {name} ({conversation.session.cache_tokens:,} cache tokens).", markup=False
            )

        # through the pool, so that it knows the tab is clean (Ctrl+W then closes at once)
        conversation.save(saved)

    def trim(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        session = conversation.session

        async def chosen(choice: TrimChoice | None) -> None:
            if choice is None:
                return
            turns = user_turns(session)
            if choice.undo >= turns or (
                choice.max_tokens is not None and drops_everything(session, choice.max_tokens)
            ):
                what = (
                    "undo the only turn" if choice.undo else f"trim to {choice.max_tokens:,} tokens"
                )
                self.push_screen(
                    ConfirmDialog(
                        "Drop every message?",
                        f"To {what}, every message of this conversation goes (the system "
                        "prompt stays); they are kept in the saved session under archived.",
                        "Drop them",
                    ),
                    lambda yes: act(choice) if yes else None,
                )
            else:
                act(choice)

        def act(choice: TrimChoice) -> None:
            if choice.undo:

                def undone(_):
                    self.notify(
                        f"Undid the last turn; the cache holds {session.cache_tokens:,} tokens."
                    )
                    return conversation.reload()

                conversation.jobs.run("undoing", lambda progress: session.undo(choice.undo), undone)
            elif choice.max_tokens is not None:
                limit = choice.max_tokens

                def trimmed(dropped: int):
                    self.notify(
                        f"Dropped {dropped} message(s); the cache holds "
                        f"{session.cache_tokens:,} tokens."
                    )
                    return conversation.reload()

                conversation.jobs.run(
                    "trimming",
                    lambda progress: session.trim_history(limit, progress),
                    trimmed,
                )

        self.push_screen(TrimDialog(session.cache_tokens, user_turns(session)), chosen)

    def archive(self) -> None:
        """The exchanges undo and trim archived: bring the one picked back to the end."""
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        session = conversation.session
        exchanges = archived_exchanges(session.archived)
        if not exchanges:
            self.notify("Nothing archived yet: undo and trim keep here what they drop.")
            return

        def chosen(index: int | None) -> None:
            if index is None:
                return

            def restored(_):
                self.notify("Restored the exchange at the end; the next turn evaluates it.")
                return conversation.reload()

            conversation.jobs.run(
                "restoring", lambda progress: session.restore_archived(index), restored
            )

        self.push_screen(ArchiveDialog(exchanges), chosen)

    def cache_kind(self) -> None:
        # here: the cache kinds come with mlx-lm, which the app's first frame does without
        from kvchat.engine.caches.kinds import (
            OFFERED_KINDS,
            applicable_kinds,
            known_applicable_kinds,
        )

        from .screens.kind import KindDialog

        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        session = conversation.session

        def chosen(kind: str | None) -> None:
            if kind is None or kind == session.kind.name:
                return

            def switched(reason: str | None) -> None:
                how = f"rebuilt ({reason})" if reason else "converted in place"
                self.notify(f"Cache is now {session.kind.name}: {how}.", markup=False)

            conversation.jobs.run(
                "switching cache", lambda progress: session.set_kind(kind, progress), switched
            )

        model = session.lm.model

        def show(applicable: list[str]) -> None:
            self.push_screen(KindDialog(session.kind.name, model, applicable), chosen)

        # Which kinds the model takes is found by running it on each, once per model (see
        # kvchat.engine.caches.fit): in the tab's worker the first time, then from the answers kept.
        known = known_applicable_kinds(model, list(OFFERED_KINDS))
        if known is not None:
            show(known)
            return
        names, stop = list(OFFERED_KINDS), threading.Event()

        def check(progress) -> list[str] | None:
            """Each kind in turn (its answer kept: a stopped check goes on from there)."""
            for done, name in enumerate(names):
                if stop.is_set():
                    return None
                progress(done, len(names))
                applicable_kinds(model, [name])
            return applicable_kinds(model, names)

        def checked(applicable: list[str] | None) -> None:
            if applicable is None:
                self.notify("Stopped checking cache kinds; F4 goes on from where it stopped.")
            else:
                show(applicable)

        conversation.jobs.run(
            "checking cache kinds", check, checked, needs_cache=False, stop=stop, unit="kinds"
        )

    def reset_cache(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return

        def done(emptied: bool) -> None:
            self.notify(
                "Cache emptied; the next turn prefills the whole transcript."
                if emptied
                else "The cache is empty already."
            )

        conversation.jobs.run("resetting", lambda progress: conversation.session.reset(), done)

    async def regenerate(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        session = conversation.session
        change = session.last_change  # what changed the cache since that reply, if anything

        def said(done: TurnDone) -> None:
            settings = session.settings
            if settings.temp > 0 and settings.seed is None:
                return
            greedy = settings.temp <= 0
            why = "Temperature is 0 (greedy)" if greedy else f"Seed {settings.seed} is set"
            if change is None:  # the same cache and logits: the same reply
                hint = (
                    "raise it in the tab's settings (F9), or with --temp or temp in the config file."
                    if greedy
                    else "clear it in the tab's settings (F9)."
                )
                self.notify(f"{why}: the same reply came again; {hint}", timeout=8)
                return
            self.notify(
                f"{why}, but the cache changed since that reply ({change.action}): "
                f"{done.stats.evaluated_tokens:,} token(s) were evaluated on it again, "
                "so the reply can differ.",
                timeout=8,
                markup=False,
            )

        await conversation.turns.regenerate(said)

    def drop(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        name = conversation.session_name

        async def chosen(where: str | None) -> None:
            if where is None:
                return
            if where == "disk":
                await self.closer.close_conversation(conversation, disk="delete")
                self.notify(f"Dropped {name} from memory and disk.", markup=False)
                return

            def save(progress) -> None:
                # An offloaded cache is on disk already, as the offload saved it.
                if name not in self.app.pool or self.app.pool.entry(name).in_memory:
                    store.save(conversation.session, name)

            async def closed() -> None:
                await self.closer.close_conversation(conversation)
                self.notify(f"Saved as {name} and closed; reopen it with Ctrl+O.", markup=False)

            def saved(_) -> None:
                conversation.saved = True
                # not from inside the tab's own handler: removing it waits for that handler
                self.app.call_later(closed)

            conversation.jobs.run("saving", save, saved, needs_cache=False)

        self.push_screen(DropDialog(name, store.exists(name)), chosen)

    def rename(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        old = conversation.session_name

        def chosen(new: str | None) -> None:
            if not new or new == old:
                return
            try:
                store.check_name(new)
            except store.StoreError as error:
                self.notify(str(error), severity="error", markup=False)
                return
            taken = {c.session_name for c in self.app.conversations()}
            if new in taken or store.exists(new):
                self.notify(
                    f"A session named {new!r} already exists.", severity="error", markup=False
                )
                return
            saved = conversation.saved and store.exists(old)

            def move(progress):
                if old in self.app.pool:
                    self.app.pool.get(old, progress)  # back from disk if it was offloaded
                if saved:
                    store.save(conversation.session, new)
                    store.delete(old)

            def moved(_) -> None:
                if old in self.app.pool:
                    self.app.pool.rename(old, new)
                else:
                    self.app.pool.add(new, conversation.session)
                conversation.session_name = new
                if conversation.parent is not None and conversation.parent.id is not None:
                    self.app.tabs.get_tab(conversation.parent.id).label = new
                self.app.refresh_sidebar()

            conversation.jobs.run("renaming", move, moved, needs_cache=False)

        self.push_screen(RenameDialog(old), chosen)

    def settings(self) -> None:
        conversation = self.app.idle_conversation()
        if conversation is None:
            return
        session = conversation.session

        def chosen(result: TabSettings | None) -> None:
            if result is None:
                return
            sampling = replace(session.settings, **result.values)
            changed = sampling != session.settings
            session.settings = sampling
            if result.system == (session.system or ""):
                self.notify("Settings apply from the next turn." if changed else "Nothing changed.")
                self.app.refresh_sidebar()
                return

            def done(kept: int):
                tokens = "token" if kept == 1 else "tokens"
                self.notify(
                    f"System prompt changed: the cache keeps its first {kept:,} "
                    f"{tokens}; the next turn evaluates the rest.",
                    markup=False,
                )
                return conversation.reload()

            conversation.jobs.run(
                "applying",
                lambda progress: session.set_system(result.system),
                done,
                needs_cache=False,
            )

        self.push_screen(
            SettingsDialog(session.lm.model_id, session.system or "", session.settings), chosen
        )


def drops_everything(session: Session, max_tokens: int) -> bool:
    """Whether a trim to ``max_tokens`` drops every exchange: the oldest go first, so it does
    when the system prompt and the last exchange alone are over ``max_tokens`` (one exchange
    rendered with the tokenizer: no model work)."""
    messages = session.messages
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        return False
    kept = [m for m in messages[:1] if m["role"] == "system"] + messages[last:]
    return len(session.render(kept, False)) > max_tokens
