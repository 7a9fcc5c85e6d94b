"""Models and a tab's settings: the app's model loaded at start, a tab's system prompt and
sampling, and new tabs on another model, loaded on demand behind the loading screen and
held in the app's model registry.

A mixin of :class:`~kvchat.tui.app.KvChatApp`; it uses the app's ``models``
(a :class:`~kvchat.engine.registry.ModelRegistry`), ``pool`` and ``scheduler``.
"""

from __future__ import annotations

from dataclasses import replace

from textual import work

from kvchat.engine.kinds import applicable_kinds
from kvchat.engine.model import LoadedModel, ModelLoadError

from .screens.loading import LoadingScreen
from .screens.settings import ModelDialog, SettingsDialog, TabSettings


class ModelsMixin:
    """The app's model loaded at start, ``action_settings``, and ``action_new_tab_model``
    with the worker that loads another model."""

    @work(thread=True, exclusive=True, group="model")
    def _load_model(self, spec: str) -> None:
        """Worker: load the app's model at start; one that cannot load ends the app."""
        try:
            lm = self.models.acquire(spec)
        except ModelLoadError as error:
            self.call_from_thread(self.exit, return_code=2, message=f"kvchat: {error}")
            return
        self._probe_kinds(lm)
        self.call_from_thread(self._model_ready, lm)

    def _probe_kinds(self, lm: LoadedModel) -> None:
        """Find out whether ``lm`` can take the configured cache kind (it is tried on it
        once, see :mod:`kvchat.engine.fit`) in the loading worker, so that new tabs find
        the answer ready instead of running the model on the UI thread. The other kinds
        are tried when the kind dialog is first opened: each try is two forward passes,
        seconds on a big model on the CPU."""
        applicable_kinds(lm.model, [self.config.cache])

    def _model_ready(self, lm: LoadedModel) -> None:
        self.lm = lm
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self._start()

    def action_settings(self) -> None:
        conversation = self.idle_conversation()
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
                self.notify("Settings apply from the next turn." if changed
                            else "Nothing changed.")
                self.refresh_sidebar()
                return

            def done(kept: int):
                tokens = "token" if kept == 1 else "tokens"
                self.notify(f"System prompt changed: the cache keeps its first {kept:,} "
                            f"{tokens}; the next turn evaluates the rest.", markup=False)
                return conversation.reload()

            conversation.run_job("applying", lambda progress: session.set_system(result.system),
                                 done, needs_cache=False)

        self.push_screen(
            SettingsDialog(session.lm.model_id, session.system or "", session.settings), chosen
        )

    def action_new_tab_model(self) -> None:
        def chosen(spec: str | None) -> None:
            if spec:
                self.open_model_tab(spec)

        self.push_screen(ModelDialog(list(self.models.holders()), self.lm.model_id), chosen)

    def open_model_tab(self, spec: str) -> None:
        """A new tab on model ``spec``; the loading screen shows while it loads."""
        if self.models.get(spec) is None:
            self.main_screen.set_focus(None)  # see open_saved
            self.push_screen(LoadingScreen(f"Loading model {spec}…"))
        self._load_tab_model(spec)

    @work(thread=True, group="load")
    def _load_tab_model(self, spec: str) -> None:
        try:
            with self.scheduler.turn(f"load:{spec}"):
                lm = self.models.acquire(spec)
                self._probe_kinds(lm)
                offloaded = self.pool.enforce_budget()  # the new weights count too
        except ModelLoadError as error:
            self.call_from_thread(self._load_failed, str(error))
            return
        self.call_from_thread(self._model_tab_ready, lm, offloaded)

    async def _model_tab_ready(self, lm: LoadedModel, offloaded: list[str]) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        try:
            name = self._unique_name()
            await self.add_conversation(self.new_session(name, lm), name)
        finally:
            self.models.release(lm)  # the worker's hold; the tab's session holds it now
        self.mark_offloaded(offloaded)
