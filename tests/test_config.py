"""Settings file: defaults, validation messages naming the key, the writer, flags."""

from __future__ import annotations

import pytest

from kvchat.config import (
    KEYS,
    Config,
    ConfigError,
    dumps,
    load_config,
    parse_config,
    parse_size,
    remember,
    save_config,
)


def test_missing_file_gives_defaults(tmp_path):
    assert load_config(tmp_path / "nope.toml") == Config()


def test_round_trip_through_the_writer(tmp_path):
    config = Config(
        model="some/model", cache="quantized:4", system='say "hi"\n\tthen \\ stop \x07',
        max_tokens=99, temp=0.7, theme="kvchat-light", autosave=False, ttl=0,
        memory_budget=123, keymap=(("send", "ctrl+s"), ("odd \"id\"", "f5,ctrl+r")),
    )
    path = save_config(config, tmp_path / "config.toml")
    assert load_config(path) == config
    text = path.read_text()
    assert all(f"{key} = " in text for key in KEYS if key != "keymap")
    assert text.endswith('\n[keymap]\n"send" = "ctrl+s"\n"odd \\"id\\"" = "f5,ctrl+r"\n')


def test_sizes_and_kinds_are_normalised():
    config = parse_config('cache = "Quantized:8"\nmemory_budget = "4GiB"')
    assert config.cache == "quantized:8"
    assert config.memory_budget == 4 * 1024**3
    assert parse_size("512MB") == 512_000_000
    assert parse_size(10) == 10


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('cache = "foo"', 'config.toml: cache = "foo": Unknown cache kind'),
        ("max_tokens = 0", "config.toml: max_tokens = 0: must be at least 1."),
        ('max_tokens = "5"', 'config.toml: max_tokens = "5": expected a whole number.'),
        ("temp = -1", "config.toml: temp = -1: expected a temperature"),
        ('autosave = "yes"', 'config.toml: autosave = "yes": expected true or false.'),
        ('memory_budget = "lots"', 'config.toml: memory_budget = "lots": expected a size'),
        ("colour = 1", "config.toml: colour: unknown setting"),
        ("model = [", "config.toml: not valid TOML"),
        ("keymap = 3", "config.toml: keymap: expected a table of binding ids and keys"),
        ('keymap = "ctrl+s"', "config.toml: keymap: expected a table"),
        ("[keymap]\nsend = 3", 'config.toml: keymap."send" = 3: expected keys as a string'),
        ('[keymap]\nsend = ""', 'config.toml: keymap."send" = "": expected keys as a string'),
        ('[keymap]\nsend = " "', 'config.toml: keymap."send" = " ": expected keys'),
        ('[keymap]\nsend = ["a"]', 'config.toml: keymap."send" = "[\'a\']": expected keys'),
        ("[keymap.send]\nkey = 'a'", 'config.toml: keymap."send" = "{\'key\': \'a\'}": '),
        ('[keymap]\n"\\u001b[31m" = 1', 'config.toml: keymap."\\u001b[31m" = 1: expected'),
    ],
)
def test_bad_values_name_the_key(text, message):
    with pytest.raises(ConfigError) as error:
        parse_config(text)
    assert str(error.value).startswith(message)


def test_flags_override_and_none_means_not_given():
    config = Config(model="a", max_tokens=10).override(model="b", max_tokens=None, temp=0.5)
    assert (config.model, config.max_tokens, config.temp) == ("b", 10, 0.5)
    with pytest.raises(ConfigError, match=r"^--cache = \"bad\": Unknown cache kind"):
        Config().override(cache="bad")


def test_remember_keeps_other_settings(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('model = "mine"\n')
    remember(path, theme="kvchat-light")
    config = load_config(path)
    assert (config.model, config.theme) == ("mine", "kvchat-light")


def test_dumps_is_valid_toml_for_defaults():
    assert parse_config(dumps(Config())) == Config()


def test_keymap_table_is_read_in_order_and_kept_by_remember(tmp_path):
    text = 'theme = "kvchat-light"\n[keymap]\nsend = "ctrl+s"\nsave = "f10, ctrl+s"\n'
    assert parse_config(text).keymap == (("send", "ctrl+s"), ("save", "f10, ctrl+s"))
    assert parse_config("").keymap == ()
    path = tmp_path / "config.toml"
    path.write_text(text)
    remember(path, temp=0.5)  # the TUI rewrites the file when the theme changes
    config = load_config(path)
    assert config.keymap == (("send", "ctrl+s"), ("save", "f10, ctrl+s"))
    assert (config.theme, config.temp) == ("kvchat-light", 0.5)
