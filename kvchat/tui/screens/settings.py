"""The tab's settings dialog (the system prompt and every generation setting that
kvchat/settings.py gives a dialog label) and the dialog that picks the model of a new tab.
Each dismisses with checked values or None."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from kvchat.declaration import ConfigError, Setting
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.engine.models.demo import demo_specs
from kvchat.settings import DIALOG

from .dialogs import Dialog


@dataclass(frozen=True)
class TabSettings:
    """What the settings dialog returns: the system prompt ("" for none) and the
    generation settings by name."""

    system: str
    values: dict[str, Any]


def field_id(setting: Setting) -> str:
    return "settings-" + setting.name.replace("_", "-")


def shown(value: Any) -> str:
    """A setting's value as its field shows it ("" for none)."""
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)


def parse_settings(system: str, texts: Mapping[str, str]) -> TabSettings:
    """Check the dialog's fields (``texts`` by setting name); raise ValueError with one
    sentence naming the bad one."""
    values = {}
    for setting in DIALOG:
        try:
            values[setting.name] = setting.parse_text(texts[setting.name], setting.label)
        except ConfigError as error:
            raise ValueError(
                f"{setting.label}: {error.reason}" if error.reason else str(error)
            ) from None
    return TabSettings(system if system.strip() else "", values)


class SettingsDialog(Dialog):
    """Edit the active tab's system prompt and sampling settings; Apply checks them first."""

    def __init__(self, model_id: str, system: str, settings: GenerationSettings) -> None:
        super().__init__()
        self.model_id = model_id
        self.system = system
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="settings-dialog") as box:
            box.border_title = "Tab settings"
            with VerticalScroll(classes="body"):
                yield Static(
                    f"Model: {self.model_id} (another model: Ctrl+N opens a new tab)",
                    classes="hint",
                    markup=False,
                )
                yield Label("System prompt (the cache is kept up to the first change):")
                yield TextArea(
                    self.system, id="settings-system", soft_wrap=True, show_line_numbers=False
                )
                for setting in DIALOG:
                    with Horizontal(classes="row"):
                        yield Label(setting.label, classes="field")
                        yield Input(
                            shown(getattr(self.settings, setting.name)),
                            id=field_id(setting),
                            compact=True,
                            tooltip=setting.help,
                        )
            with Horizontal(classes="row buttons"):
                yield Button("Apply", id="settings-apply", variant="primary")
                yield Button("Cancel", id="settings-cancel")

    def on_mount(self) -> None:
        self.query_one("#settings-temp", Input).focus()

    @on(Button.Pressed, "#settings-apply")
    @on(Input.Submitted)
    def _apply(self) -> None:
        try:
            chosen = parse_settings(
                self.query_one("#settings-system", TextArea).text,
                {s.name: self.query_one(f"#{field_id(s)}", Input).value for s in DIALOG},
            )
        except ValueError as error:
            self.notify(str(error), severity="warning", markup=False)
            return
        self.dismiss(chosen)

    @on(Button.Pressed, "#settings-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class ModelDialog(Dialog):
    """The model of a new tab: one loaded already, a demo, or a typed id or folder."""

    def __init__(self, loaded: list[str], current: str) -> None:
        super().__init__()
        self.names = list(dict.fromkeys([current, *loaded, *demo_specs()]))
        self.loaded = set(loaded)
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="model-dialog") as box:
            box.border_title = "New tab with model"
            yield OptionList(
                *(Option(f"{n}  (loaded)" if n in self.loaded else n, id=n) for n in self.names),
                id="model-options",
                classes="body",
            )
            with Vertical(classes="buttons"):
                yield Static(
                    "A model no tab uses any more is unloaded.", classes="hint", markup=False
                )
                with Horizontal(classes="row"):
                    yield Input(placeholder="or type a model id or folder", id="model-input")
                    yield Button("Open", id="model-use", variant="primary")
                    yield Button("Cancel", id="model-cancel")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    @on(Button.Pressed, "#model-use")
    @on(Input.Submitted, "#model-input")
    def _typed(self) -> None:
        spec = self.query_one("#model-input", Input).value.strip()
        if not spec:
            self.notify("Type a model id or folder, or pick one from the list.", severity="warning")
            return
        self.dismiss(spec)

    @on(Button.Pressed, "#model-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
