"""Strings from session files and models reach no terminal raw: `kvchat sessions list/show/
export` and `ask`, run as real subprocesses, print escapes as letters; JSON output decodes
back to the very same strings. `ask` takes invalid UTF-8 from argv or stdin and says so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.safety import dumps_json, printable

CLI = [sys.executable, "-c", "from kvchat.cli import main; main()"]
EVIL = (
    "\x1b]52;c;cHduZWQ=\x07 \x1b]0;title\x07 \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\ "
    "\x1b[2J cr\r \x9b31m \u202eevil\u202c \x7f\x00"
)
# Raw C0 (but tab and newline), DEL, C1 (UTF-8 encoded), bidi overrides and isolates.
RAW_CONTROL = re.compile(
    rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xaa-\xae]|\xe2\x81[\xa6-\xa9]"
)


def kvchat(*args, input: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, input=input, timeout=120, env=os.environ.copy()
    )


def assert_clean(out: bytes) -> None:
    found = RAW_CONTROL.findall(out)
    assert not found, f"raw control bytes on the terminal: {found[:5]}"


@pytest.fixture
def evil(demo_model, home):
    """A session whose every stored string carries terminal escapes, plus a damaged one."""
    session = Session(demo_model, system="Be brief.", settings=GenerationSettings(max_tokens=4))
    [e for e in session.send("Hello.") if isinstance(e, TurnDone)]
    folder = store.save(session, "evil")
    path = folder / "session.json"
    data = json.loads(path.read_text())
    data["messages"] = [
        {"role": "system", "content": "sys " + EVIL},
        {"role": "user", "content": "user " + EVIL},
        {"role": "assistant", "content": "reply " + EVIL},
    ]
    data["archived"] = [{"role": "user", "content": "old " + EVIL}]
    data.update(
        model_id="model " + EVIL,
        cache_kind="kind " + EVIL,
        created="2026 " + EVIL,
        updated="2026-11-23T10:00:00 " + EVIL,
    )
    path.write_text(json.dumps(data))
    store.save(session, "broken")
    (store.session_dir("broken") / "session.json").write_text(json.dumps({"messages": EVIL}))
    return data


def test_sessions_list_show_export_print_no_raw_control(evil):
    listing = kvchat("sessions", "list")
    assert listing.returncode == 0, listing.stderr
    assert_clean(listing.stdout)
    text = listing.stdout.decode()
    assert "model \\x1b]52;c;cHduZWQ=\\x07" in text and "\\x9b31m \\u202eevil\\u202c" in text
    assert "note: broken: " in text and "(messages: Input should be a valid array)" in text

    show = kvchat("sessions", "show", "evil")
    assert show.returncode == 0, show.stderr
    assert_clean(show.stdout)
    shown = show.stdout.decode()
    for key, value in (
        ("system", "sys " + EVIL),
        ("model", "model " + EVIL),
        ("cache kind", "kind " + EVIL),
        ("created", "2026 " + EVIL),
    ):
        assert f"{key:<13} {printable(value, one_line=True)}\n" in shown

    md = kvchat("sessions", "export", "evil", "--format", "md")
    assert md.returncode == 0, md.stderr
    assert_clean(md.stdout)
    exported = md.stdout.decode()
    for part in ("sys", "user", "reply", "old", "model", "kind"):
        assert f"{part} \\x1b]52;c;cHduZWQ=\\x07 \\x1b]0;title\\x07" in exported
    assert "\\x1b[2J cr\\x0d \\x9b31m" in exported


@pytest.mark.parametrize(
    "args",
    [
        ["sessions", "list", "--json"],
        ["sessions", "show", "evil", "--json"],
        ["sessions", "export", "evil", "--format", "json"],
    ],
)
def test_json_output_escapes_controls_and_round_trips(evil, args):
    out = kvchat(*args)
    assert out.returncode == 0, out.stderr
    assert_clean(out.stdout)
    assert b"\\u009b31m \\u202eevil\\u202c \\u007f\\u0000" in out.stdout
    data = json.loads(out.stdout)
    if args[1] == "list":
        data = next(s for s in data if s["name"] == "evil")
    if args[1] == "export":
        assert data["messages"] == evil["messages"] and data["archived"] == evil["archived"]
    assert data["model_id"] == "model " + EVIL and data["cache_kind"] == "kind " + EVIL
    if args[1] == "show":
        assert data["system"] == "sys " + EVIL


def test_ask_model_load_error_from_a_session_file(evil):
    path = store.session_dir("evil") / "session.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "model_id": "/no/such/" + EVIL}))
    out = kvchat("ask", "--session", "evil", "Hi.")
    assert out.returncode == 2
    assert_clean(out.stderr)
    assert out.stderr.decode().startswith("kvchat: Could not load model '/no/such/\\x1b]52;c;")


def test_dumps_json_is_lossless():
    data = {"k\x9b": ["\x1b[2J", "\u202e", "é中", "\ud800", "\x7f"]}
    text = dumps_json(data)
    assert json.loads(text) == data and text.isascii() is False
    assert not RAW_CONTROL.search(text.encode("utf-8", "surrogatepass"))


@pytest.mark.parametrize("via", ["argv", "stdin"])
def test_ask_decodes_invalid_utf8_with_replacement(demo_model, home, via):
    message = b"caf\xe9 and \xff\xfe bytes"
    args = [message] if via == "argv" else ["-"]
    out = kvchat(
        "ask",
        "--max-tokens",
        "4",
        "--session",
        "u",
        "--json",
        *args,
        input=message if via == "stdin" else None,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.decode() == (
        "kvchat: the message is not valid UTF-8; the bytes that are "
        "not were replaced with U+FFFD.\n"
    )
    sent = store.read("u")["messages"][0]
    assert sent == {"role": "user", "content": "caf\ufffd and \ufffd\ufffd bytes"}
    reference = Session(demo_model, settings=GenerationSettings(max_tokens=4))
    done = [e for e in reference.send(sent["content"]) if isinstance(e, TurnDone)][0]
    assert json.loads(out.stdout)["reply"] == done.reply


def test_ask_valid_utf8_says_nothing(home):
    out = kvchat("ask", "--max-tokens", "2", "-", input="Grüße, 世界.".encode())
    assert out.returncode == 0 and out.stderr == b""
