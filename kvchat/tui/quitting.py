"""Quitting without losing work: Ctrl+Q, SIGTERM and SIGHUP (the terminal closing).

Ctrl+Q stops the replies being written (each is kept, marked stopped), waits for
the tabs to be idle, then saves every tab with unsaved changes (``autosave`` on)
or asks once, listing them (Save all, Discard, Cancel), as closing one tab does.
A second Ctrl+Q while that goes on quits at once.

A signal cannot ask and may come with no terminal left to draw on: it stops the
replies and ends the app at once; :func:`kvchat.tui.run.run_app` then saves the
unsaved sessions (``autosave`` on) once every worker has ended, on the app's
thread, and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

from kvchat import store

from .screens.close import CloseDialog

if TYPE_CHECKING:
    from .app_view import AppView

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Quitter:
    """The app's way out (a collaborator of :class:`~kvchat.tui.app.KvChatApp`)."""

    def __init__(self, app: AppView) -> None:
        self.app = app
        self.underway = False
        self.save_failed = False  # then the next Ctrl+Q quits at once
        self.signalled: signal.Signals | None = None  # the signal that ended the app, if any

    # ------------------------------------------------------------------ signals

    def listen(self) -> None:
        """Handle SIGTERM and SIGHUP on the app's event loop (on its thread)."""
        loop = asyncio.get_running_loop()
        for number in SIGNALS:
            loop.add_signal_handler(number, self.on_signal, number)

    def stop_listening(self) -> None:
        loop = asyncio.get_running_loop()
        for number in SIGNALS:
            loop.remove_signal_handler(number)

    def on_signal(self, number: signal.Signals) -> None:
        """Stop every reply (kept, marked stopped) and end the app now; the saving happens
        once its workers have ended (see the module's doc)."""
        self.signalled = signal.Signals(number)
        self.underway = True
        for conversation in self.app.conversations():
            conversation.session.stop()
        self.app.exit(return_code=0)

    # ------------------------------------------------------------------ Ctrl+Q

    def begin(self) -> bool:
        """Ctrl+Q, on the app's thread: stop the replies being written; True when the rest
        (:meth:`finish`, in a worker) is to follow, False when this Ctrl+Q quit at once.
        From here on no message starts (see ``Conversation.send``)."""
        app = self.app
        if self.underway or self.save_failed:
            app.exit()
            return False
        self.underway = True
        busy = [c for c in app.conversations() if c.busy]
        for conversation in busy:
            conversation.turns.stop()
        if busy:
            app.notify(
                "Stopping and saving before quitting… (Ctrl+Q again: quit now)",
                timeout=30,
                markup=False,
            )
        return True

    async def finish(self) -> None:
        """Once the tabs are idle: save the unsaved ones, or ask, then end the app."""
        app = self.app
        await self._idle()
        unsaved = [c for c in app.conversations() if c.unsaved]
        if unsaved and not app.config.autosave:
            choice = await self._ask(unsaved)
            if choice is None:
                self.underway = False
                return
            if choice == "discard":
                app.exit()
                return
        if unsaved:
            for conversation in unsaved:
                conversation.save()
            await self._idle()
            failed = [c.session_name for c in unsaved if c.unsaved]
            if failed:  # each one's error is on its tab; the app stays usable
                self.underway, self.save_failed = False, True
                app.notify(
                    f"Could not save {', '.join(failed)} (its tab says why); Ctrl+Q "
                    "again quits anyway.",
                    severity="error",
                    timeout=30,
                    markup=False,
                )
                return
        app.exit()

    async def _idle(self) -> None:
        while any(c.busy for c in self.app.conversations()):
            await asyncio.sleep(0.05)

    async def exit_when_idle(self, return_code: int) -> None:
        """End the app with ``return_code`` once no tab is busy (its turn failed or ended)."""
        await self._idle()
        self.app.exit(return_code=return_code)

    async def _ask(self, unsaved) -> str | None:
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        names = {c.session_name: store.exists(c.session_name) for c in unsaved}
        self.app.push_screen(CloseDialog(names, quitting=True), answer.set_result)
        return await answer
