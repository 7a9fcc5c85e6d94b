"""Hostile input outside the store: Unicode digits in kind names, config files that are not
UTF-8, huge or not files at all, replay scripts nested 100,000 deep; the sanitiser itself."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from kvchat.cli import app
from kvchat.cli.replay import ReplayError, load_script
from kvchat.config import ConfigError, load_config, parse_config, parse_size
from kvchat.engine.caches.kinds import CacheKindError, parse_kind
from kvchat.safety import ascii_int, printable, read_limited


@pytest.mark.parametrize(
    "name",
    [
        "rotating:²",
        "chunked:①",
        "rotating:٤٠٩٦",
        "quantized:８",
        "rotating:1_000",
        "rotating: 128",
        "rotating:+128",
        "rotating:" + "9" * 400,
    ],
)
def test_kind_numbers_are_ascii_digits_only(name):
    with pytest.raises(CacheKindError, match="needs a number written with 0-9"):
        parse_kind(name)


def test_kind_numbers_still_parse():
    assert parse_kind("rotating:4096").size == 4096 and parse_kind("quantized:4").size == 4


def test_cli_refuses_unicode_digits_in_one_sentence():
    result = CliRunner().invoke(app, ["ask", "--cache", "chunked:①", "hi"])
    assert result.exit_code == 2
    assert result.output.startswith("kvchat: Cache kind 'chunked' needs a number written with 0-9")
    assert result.output.count("\n") == 1


@pytest.mark.parametrize("text", ["٣", "²", "1_0", " 1", "1 ", "-1", "+1", "", "1" * 19, "1.0"])
def test_ascii_int_refuses(text):
    with pytest.raises(ValueError):
        ascii_int(text)


def test_ascii_int_accepts():
    assert ascii_int("0") == 0 and ascii_int("9" * 18) == 10**18 - 1


@pytest.mark.parametrize(
    "content, words",
    [
        (b'model = "caf\xe9"\n', "not valid UTF-8 (byte 0xe9 at offset 12)"),
        (b"memory_budget = " + b"9" * 400 + b"\n", "memory_budget = 999"),
        (b'memory_budget = "' + b"9" * 400 + b'"\n', "is larger than any memory"),
        (b"memory_budget = " + b"9" * 5000 + b"\n", "not valid TOML"),
        (b'memory_budget = "\xef\xbc\x91GB"\n', "expected a size such as 4GiB"),  # fullwidth 1
        (b"max_tokens = " + b"9" * 30 + b"\n", "max_tokens = 999"),
        (b"ttl = 1e400\n", "ttl = inf: expected a whole number"),
        (b"x = " + b"[" * 100_000 + b"\n", "not valid TOML"),
    ],
)
def test_config_file_problems_are_one_sentence(tmp_path, content, words):
    path = tmp_path / "config.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert words in message and "\n" not in message and len(message) < 300
    assert message.startswith(("config.toml: ", f"{path}: "))


def test_config_that_is_not_a_regular_file(tmp_path):
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.toml")  # opening a FIFO must not wait for a writer
    (tmp_path / "dir.toml").mkdir()
    for name in ("zero.toml", "fifo.toml", "dir.toml"):
        with pytest.raises(ConfigError, match="cannot be used as a settings file: it is not a"):
            load_config(tmp_path / name)
    (tmp_path / "big.toml").write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1,048,576 bytes"):
        load_config(tmp_path / "big.toml")
    (tmp_path / "link.toml").symlink_to(tmp_path / "real.toml")
    (tmp_path / "real.toml").write_text('cache = "rotating:128"\n')
    assert load_config(tmp_path / "link.toml").cache == "rotating:128"  # dotfile managers link


def test_sizes_still_parse():
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2 and parse_size("512MB") == 512_000_000
    assert parse_config("memory_budget = 123").memory_budget == 123


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"turns": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "recursion limit exceeded"),
        (b'{"turns": ["caf\xe9"]}', "is not valid JSON"),
        (
            b'{"turns": [{"op": "cache", "kind": "rotating:\xc2\xb2"}]}',
            "needs a number written with",
        ),
    ],
)
def test_replay_script_problems_are_one_sentence(tmp_path, content, words):
    path = tmp_path / "script.json"
    path.write_bytes(content)
    with pytest.raises(ReplayError) as err:
        load_script(path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_replay_script_that_is_not_a_regular_file(tmp_path):
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.json")
    for name in ("zero.json", "fifo.json"):
        with pytest.raises(ReplayError, match="Cannot read .*: it is not a regular file"):
            load_script(tmp_path / name)
    (tmp_path / "ok.json").write_text(json.dumps({"turns": ["hi"]}))
    assert load_script(tmp_path / "ok.json").steps[0].text == "hi"


def test_read_limited_reads_exactly_up_to_the_limit(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert read_limited(path, 100) == b"x" * 100
    with pytest.raises(ValueError, match="larger than 99 bytes"):
        read_limited(path, 99)
    with pytest.raises(FileNotFoundError):
        read_limited(tmp_path / "missing", 10)


def test_printable_escapes_every_terminal_control():
    text = "a\x1b[2Jb\x9b31mc\rd\u202ee\u2066f\x7fg\ud8ffh\ti\nj\r\nk"
    assert printable(text) == "a\\x1b[2Jb\\x9b31mc\\x0dd\\u202ee\\u2066f\\x7fg\\ud8ffh\ti\nj\nk"
    assert printable("a\tb\nc", one_line=True) == "a\\tb\\nc"
    assert printable("Grüße, 世界 🙂") == "Grüße, 世界 🙂"


def test_durations_take_ascii_digits_only():
    from kvchat import store

    assert store.parse_duration("3d") == 3 * 86400
    for text in ("٣d", "３h", "²m"):
        with pytest.raises(store.StoreError, match="Invalid duration"):
            store.parse_duration(text)


def test_a_model_name_that_is_not_utf8_is_one_sentence():
    from kvchat.engine.models.model import ModelLoadError, load_model

    name = b"/tmp/mod\xffel".decode("utf-8", "surrogateescape")
    with pytest.raises(ModelLoadError, match="not valid UTF-8") as caught:
        load_model(name)
    str(caught.value).encode("utf-8")  # the message itself prints anywhere
