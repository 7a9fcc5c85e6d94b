"""Models for the app's tabs: the app's model loaded at start, and new tabs on another
model, loaded on demand behind the loading screen and held in the app's model registry.

The app holds a :class:`ModelLoader` (``app.model_loader``); it uses the app's ``models``
(a :class:`~kvchat.engine.models.registry.ModelRegistry`), ``pool``, ``scheduler``, its tab
controller and its loading screen.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from .screens.loading import LoadingScreen, loading_progress
from .screens.settings import ModelDialog

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

    from .app_view import AppView
    from .tabs import TabController


class ModelLoader:
    """Loads the app's model at start, and the models of new tabs (Ctrl+N), for ``app``;
    the tabs on them are opened through ``tabs``."""

    def __init__(self, app: AppView, tabs: TabController) -> None:
        self.app = app
        self.tabs = tabs

    def load_default(self, spec: str) -> None:
        """Load the app's model in a worker; the app starts when it is ready."""
        self.app.run_worker(
            partial(self.load_model, spec),
            name="load_model",
            group="model",
            exclusive=True,
            thread=True,
        )

    def load_model(self, spec: str) -> None:
        """Worker: load the app's model at start, in its turn as the other loads; one that
        cannot load ends the app. The engine's model code is imported here, behind the
        loading screen: it brings mlx-lm and transformers, seconds on a busy machine."""
        from kvchat.engine.models.model import ModelLoadError

        app = self.app
        try:
            with app.scheduler.turn(f"load:{spec}"):
                lm = app.models.acquire(spec, loading_progress(app.screen, app.call_from_thread))
                self.ready_ahead(lm)
        except ModelLoadError as error:
            app.call_from_thread(app.exit, return_code=2, message=f"kvchat: {error}")
            return
        app.call_from_thread(self.model_ready, lm)

    def ready_ahead(self, lm: LoadedModel) -> None:
        """In the loading worker, what ``lm``'s first tab and first turn would otherwise
        pay: whether it can take the configured cache kind (tried on it once, see
        :mod:`kvchat.engine.caches.fit`), so that new tabs find the answer ready instead of
        running the model on the UI thread, and the first turn's once-only costs
        (:func:`~kvchat.engine.generation.per_model.warm_up`). The other kinds are tried when the kind
        dialog is first opened: each try is two forward passes, seconds on a big model on
        the CPU."""
        from kvchat.engine.caches.kinds import applicable_kinds
        from kvchat.engine.generation.per_model import warm_up

        applicable_kinds(lm.model, [self.app.config.cache])
        warm_up(lm)

    def model_ready(self, lm: LoadedModel) -> None:
        app = self.app
        app.lm = lm
        if isinstance(app.screen, LoadingScreen):
            app.pop_screen()
        self.tabs.open_first()

    def new_tab_model(self) -> None:
        """Ask for a model, then open a new tab on it."""

        def chosen(spec: str | None) -> None:
            if spec:
                self.open_model_tab(spec)

        app = self.app
        current = app.lm.model_id if app.lm else app.config.model
        app.push_screen(ModelDialog(list(app.models.holders()), current), chosen)

    def open_model_tab(self, spec: str) -> None:
        """A new tab on model ``spec``; the loading screen shows while it loads."""
        app = self.app
        if app.models.get(spec) is None:
            app.main_screen.set_focus(None)  # see TabController.open_saved
            app.push_screen(LoadingScreen(f"Loading model {spec}…", keep=self.tabs.hold))
        app.run_worker(
            partial(self.load_tab_model, spec), name="load_tab_model", group="load", thread=True
        )

    def load_tab_model(self, spec: str) -> None:
        """Worker: load model ``spec`` for a new tab, making room for it in the pool."""
        from kvchat.engine.models.model import ModelLoadError

        app = self.app
        try:
            with app.scheduler.turn(f"load:{spec}"):
                lm = app.models.acquire(spec)
                self.ready_ahead(lm)
                offloaded = app.pool.enforce_budget()  # the new weights count too
        except ModelLoadError as error:
            app.call_from_thread(self.tabs.load_failed, str(error))
            return
        app.call_from_thread(self.model_tab_ready, lm, offloaded)

    async def model_tab_ready(self, lm: LoadedModel, offloaded: list[str]) -> None:
        app = self.app
        if isinstance(app.screen, LoadingScreen):
            app.pop_screen()
        tabs = self.tabs
        try:
            name = tabs.unique_name()
            await tabs.add_conversation(tabs.new_session(name, lm), name)
        finally:
            app.models.release(lm)  # the worker's hold; the tab's session holds it now
        self.tabs.mark_offloaded(offloaded)
