"""The settings table: one declaration per setting, from which every place that takes a
setting is made; the precedence flag > environment > file > default."""

from __future__ import annotations

from dataclasses import fields

import pytest
from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.config import Config, load_config
from kvchat.declaration import ConfigError
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.settings import (
    API,
    DIALOG,
    FLAGS,
    GENERATION,
    apply_overrides,
    from_env,
    generation_of,
)


def test_the_engine_settings_are_the_tables_generation_settings():
    engine = [f.name for f in fields(GenerationSettings)]
    assert engine == [s.name for s in GENERATION] + ["prefill_step", "ignore_eos"]
    assert [f.default for f in fields(GenerationSettings)][: len(GENERATION)] == [
        s.default for s in GENERATION
    ]
    assert {s.name for s in DIALOG} == {s.name for s in FLAGS} == {s.name for s in API}


def test_every_flag_is_an_option_of_kvchat_and_ask():
    for command in ([], ["ask"]):
        shown = " ".join(CliRunner().invoke(app, [*command, "--help"]).stdout.split())
        missing = [s.option for s in FLAGS if s.option not in shown]
        assert missing == [], command


def test_later_layers_win_and_none_is_not_given():
    base = GenerationSettings(temp=0.5, top_k=10, seed=3)
    merged = apply_overrides(base, {"temp": 1.0, "top_k": None}, {"temp": 0.2, "theme": "x"})
    assert (merged.temp, merged.top_k, merged.seed) == (0.2, 10, 3)  # theme: not a field here
    assert base.temp == 0.5  # a copy
    with pytest.raises(ConfigError, match=r"^--min-p = 2\.0: must be at least 0 and at most 1\.$"):
        apply_overrides(base, {"min_p": 2.0})


def test_the_environment_sits_between_the_file_and_the_flags(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('model = "demo:random"\ntemp = 0.3\nseed = 5\n')
    config = load_config(path, environ={"KVCHAT_TEMP": "0.9", "KVCHAT_SEED": " "})
    assert (config.model, config.temp, config.seed) == ("demo:random", 0.9, 5)  # empty: unset
    assert apply_overrides(config, {"temp": 0.1, "seed": 2**64 - 1}).seed == 2**64 - 1
    with pytest.raises(ConfigError, match=r"^--seed = 18446744073709551616: must be at least"):
        apply_overrides(config, {"seed": 2**64})
    assert generation_of(config) == GenerationSettings(temp=0.9, seed=5)
    assert from_env(
        {"KVCHAT_MEMORY_BUDGET": "2GiB", "KVCHAT_CACHE": "Rotated:8", "OTHER": "1"}
    ) == {"memory_budget": 2 << 30, "cache": "rotated:8"}
    assert load_config(tmp_path / "none.toml", environ={}) == Config()
