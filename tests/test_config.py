"""Settings file: defaults, validation messages naming the key, the writer, flags."""

from __future__ import annotations

import pytest

from kvchat.config import (
    Config,
    ConfigError,
    load_config,
    parse_config,
    parse_size,
    remember,
)
from tests.helpers import mypy_errors


def test_missing_file_gives_defaults(tmp_path):
    assert load_config(tmp_path / "nope.toml") == Config()


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
        ("keymap = 3", "config.toml: keymap = 3: expected a table of binding ids and keys"),
        ('keymap = "ctrl+s"', 'config.toml: keymap = "ctrl+s": expected a table'),
        ("[keymap]\nsend = 3", 'config.toml: keymap."send" = 3: expected keys as a string'),
        ('[keymap]\nsend = ""', 'config.toml: keymap."send" = "": expected keys as a string'),
        ('[keymap]\nsend = " "', 'config.toml: keymap."send" = " ": expected keys'),
        ('[keymap]\nsend = ["a"]', 'config.toml: keymap."send" = "[\'a\']": expected keys'),
        ("[keymap.send]\nkey = 'a'", "config.toml: keymap.\"send\" = \"{'key': 'a'}\": "),
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


HAND_WRITTEN = """\
# my kvchat settings
model = "demo"          # the small one
cache = 'quantized:8'   # half the memory
max_tokens = 200
temp = 0.7
system = "You are terse."
'theme' = 'kvchat-light'  # light, for the day
future_option = [1, 2]  # a key this version does not know

[keymap]
save = "f10"
"send" = 'ctrl+s'  # a comment in the table
"""


def test_a_theme_change_touches_only_its_line(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(HAND_WRITTEN)
    remember(path, theme="gruvbox")
    after = path.read_text()
    assert after == HAND_WRITTEN.replace("'theme' = 'kvchat-light'", "'theme' = 'gruvbox'")
    # the unknown key stays for the user to see: loading names it as unknown
    with pytest.raises(ConfigError, match="future_option: unknown setting"):
        load_config(path, environ={})


def test_a_new_key_goes_before_the_tables_and_no_default_is_written(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(HAND_WRITTEN)
    remember(path, top_k=40)
    lines = path.read_text().splitlines(keepends=True)
    assert "".join(line for line in lines if line != "top_k = 40\n") == HAND_WRITTEN
    assert lines.index("top_k = 40\n") < lines.index("[keymap]\n")
    fresh = tmp_path / "new" / "config.toml"
    remember(fresh, theme="gruvbox")
    assert fresh.read_text() == 'theme = "gruvbox"\n'


def test_a_file_that_does_not_parse_is_left_byte_for_byte(tmp_path):
    path = tmp_path / "config.toml"
    broken = HAND_WRITTEN.replace("temp = 0.7", "temp = 0.7x").encode()
    path.write_bytes(broken)
    with pytest.raises(ConfigError) as error:
        remember(path, theme="gruvbox")
    assert str(error.value) == (
        "config.toml has an error at line 5 (Invalid number); your change applies to this "
        "run only and the file was left alone."
    )
    assert path.read_bytes() == broken
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]  # no temporary left


def test_a_bad_value_is_refused_before_the_file_is_touched(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(HAND_WRITTEN)
    with pytest.raises(ConfigError, match=r"^config.toml: top_k = -1: must be at least 0\.$"):
        remember(path, top_k=-1)
    assert path.read_text() == HAND_WRITTEN


def test_environment_beats_the_file_and_flags_beat_both(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("temp = 0.7\ntop_k = 5\nmax_tokens = 100\n")
    env = {"KVCHAT_TEMP": "1.2", "KVCHAT_SEED": "7", "KVCHAT_AUTOSAVE": "no"}
    config = load_config(path, environ=env)
    assert (config.temp, config.top_k, config.max_tokens) == (1.2, 5, 100)
    assert (config.seed, config.autosave) == (7, False)
    flagged = config.override(temp=0.1, top_k=None)
    assert (flagged.temp, flagged.top_k) == (0.1, 5)
    with pytest.raises(ConfigError, match=r"^KVCHAT_TOP_P must be a number, not 'high'\.$"):
        load_config(path, environ={"KVCHAT_TOP_P": "high"})
    with pytest.raises(ConfigError, match=r"^KVCHAT_TOP_P = 0\.0: must be more than 0"):
        load_config(path, environ={"KVCHAT_TOP_P": "0"})


def test_a_linked_config_is_edited_where_it_lives(tmp_path):
    from kvchat.config import remember

    kept = tmp_path / "dotfiles" / "kvchat.toml"
    kept.parent.mkdir()
    kept.write_text("# mine\ntemp = 0.5\n")
    link = tmp_path / "config.toml"
    link.symlink_to(kept)
    remember(link, theme="gruvbox")
    assert link.is_symlink()
    assert kept.read_text() == '# mine\ntemp = 0.5\ntheme = "gruvbox"\n'


def test_a_file_cut_short_says_end_of_file(tmp_path):
    """tomlkit names the end of the text as the character '\\x00'; people read "end of
    file"."""
    path = tmp_path / "config.toml"
    path.write_text("temp = 0.7\ntheme = ")
    with pytest.raises(ConfigError) as error:
        remember(path, theme="gruvbox")
    assert str(error.value) == (
        "config.toml has an error at line 2 (Unexpected end of file); your change applies "
        "to this run only and the file was left alone."
    )


def test_config_fields_are_the_settings_with_their_types():
    """Config's typed fields (what mypy sees) are exactly the declared settings."""
    import typing

    from kvchat.config import Fields
    from kvchat.settings import SETTINGS

    hints = typing.get_type_hints(Fields)
    assert list(hints) == [s.name for s in SETTINGS]
    for s in SETTINGS:
        if s.type is dict:  # a table, held as (key, value) pairs
            assert typing.get_origin(hints[s.name]) is tuple, s.name
        else:
            assert hints[s.name] == (s.type | None if s.optional else s.type), s.name
    assert typing.get_type_hints(Config) == hints


def test_mypy_sees_a_misspelled_setting(tmp_path):
    """A setting read under a wrong name is a type error, not a run-time surprise."""
    errors = mypy_errors(
        tmp_path,
        "from kvchat.config import load_config\n"
        "config = load_config()\n"
        "ok: float = config.temp\n"
        "bad = config.xtc_probabilty\n"
        "wrong: str = config.max_tokens\n",
    )
    assert len(errors) == 2, errors
    assert 'use.py:4: error: "Config" has no attribute "xtc_probabilty"' in errors[0]
    assert "use.py:5: error: Incompatible types in assignment" in errors[1]
