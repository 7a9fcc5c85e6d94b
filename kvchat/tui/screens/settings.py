"""The tab's settings dialog (system prompt, temperature, top-p, max tokens) and the dialog
that picks the model of a new tab. Each dismisses with checked values or None."""

from __future__ import annotations

import math
from dataclasses import dataclass

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from kvchat.config import Config, ConfigError
from kvchat.engine.demo import demo_specs
from kvchat.engine.session import GenerationSettings

from .dialogs import Dialog


@dataclass(frozen=True)
class TabSettings:
    """What the settings dialog returns: the system prompt ("" for none) and sampling."""

    system: str
    max_tokens: int
    temp: float
    top_p: float


def parse_settings(system: str, temp: str, top_p: str, max_tokens: str) -> TabSettings:
    """Check the dialog's fields; raise ValueError with one sentence naming the bad one."""
    def number(label: str, text: str, kind=float):
        if not text.strip():
            raise ValueError(f"{label} is empty: give a number.")
        try:
            return kind(text.strip())
        except ValueError:
            whole = " whole" if kind is int else ""
            raise ValueError(f"{label} must be a{whole} number, not {text.strip()!r}.") from None

    t = number("Temperature", temp)
    p = number("Top-p", top_p)
    m = number("Max tokens", max_tokens, int)
    try:  # the same ranges as the config file and the command line
        Config().override(temp=t, max_tokens=m)
    except ConfigError as error:
        label = "Temperature" if str(error).startswith("--temp") else "Max tokens"
        raise ValueError(f"{label}: {str(error).split(': ', 1)[1]}") from None
    if not math.isfinite(p) or not 0 < p <= 1:
        raise ValueError("Top-p must be more than 0 and at most 1 (1: off).")
    return TabSettings(system if system.strip() else "", m, t, p)


class SettingsDialog(Dialog):
    """Edit the active tab's system prompt and sampling settings; Apply checks them first."""

    def __init__(self, model_id: str, system: str, settings: GenerationSettings) -> None:
        super().__init__()
        self.model_id = model_id
        self.system = system
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(classes="dialog", id="settings-dialog") as box:
            box.border_title = "Tab settings"
            with VerticalScroll(classes="body"):
                yield Static(f"Model: {self.model_id} (another model: Ctrl+N opens a new tab)",
                             classes="hint", markup=False)
                yield Label("System prompt (the cache is kept up to the first change):")
                yield TextArea(self.system, id="settings-system", soft_wrap=True,
                               show_line_numbers=False)
                for label, id_, value in (("Temperature", "settings-temp", f"{s.temp:g}"),
                                          ("Top-p", "settings-top-p", f"{s.top_p:g}"),
                                          ("Max tokens", "settings-max-tokens",
                                           str(s.max_tokens))):
                    with Horizontal(classes="row"):
                        yield Label(label, classes="field")
                        yield Input(value, id=id_, compact=True)
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
                *(self.query_one(f"#settings-{n}", Input).value
                  for n in ("temp", "top-p", "max-tokens")),
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
                id="model-options", classes="body",
            )
            with Vertical(classes="buttons"):
                yield Static("A model no tab uses any more is unloaded.", classes="hint",
                             markup=False)
                with Horizontal(classes="row"):
                    yield Input(placeholder="or type a model id or folder",
                                id="model-input")
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
            self.notify("Type a model id or folder, or pick one from the list.",
                        severity="warning")
            return
        self.dismiss(spec)

    @on(Button.Pressed, "#model-cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
