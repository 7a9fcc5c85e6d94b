"""checkpoints.safetensors is written when the checkpoints change, not on every save."""

from __future__ import annotations

import json
import os

import pytest

from kvchat import store
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.engine.conversation.session import Session
from tests.helpers import turn


def _file(folder):
    info = os.stat(folder / store.CHECKPOINTS_FILE)
    return info.st_ino, info.st_mtime_ns, info.st_size


def _entry(folder):
    return json.loads((folder / store.SESSION_FILE).read_text(encoding="utf-8"))["checkpoints"]


@pytest.mark.parametrize("name", ["gemma3_text", "mamba"])
def test_a_save_with_no_turn_since_the_last_leaves_the_checkpoints_file(arch, home, name):
    lm = arch(name)
    session = Session(lm, settings=GenerationSettings(max_tokens=6, temp=0.0))
    turn(session, "The quick brown fox jumps over the lazy dog.")
    folder = store.save(session, "chat")
    first, entry = _file(folder), _entry(folder)

    store.save(session, "chat")
    assert _file(folder) == first and _entry(folder) == entry

    turn(session, "Tell me another story about the fox.")
    store.save(session, "chat")
    assert _file(folder) != first and _entry(folder)["tokens"] != entry["tokens"]

    # a session just resumed saves without rewriting what it was read from
    resumed = store.load("chat", lm).session
    written, entry = _file(folder), _entry(folder)
    store.save(resumed, "chat")
    assert _file(folder) == written and _entry(folder) == entry
    assert store.load("chat", lm).notice is None

    # a file changed behind kvchat's back is written again
    (folder / store.CHECKPOINTS_FILE).unlink()
    store.save(resumed, "chat")
    assert _entry(folder) == entry and _file(folder)[2] == entry["bytes"]
    assert store.load("chat", lm).notice is None
