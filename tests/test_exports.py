"""Export (Markdown, JSON) of saved and live sessions, and import of a JSON export as a new
session that is prefilled on first use; ``kvchat sessions import``."""

from __future__ import annotations

import json

import pytest
from helpers import turn
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.engine.conversation.session import GenerationSettings, Session

TEXTS = ["Hello there.", "What is a cache?"]
NEXT = "And why is it fast?"


def chat(lm, texts=TEXTS) -> Session:
    session = Session(lm, system="You are terse.", settings=GenerationSettings(max_tokens=10))
    for text in texts:
        turn(session, text)
    return session


def _without_times(text: str) -> dict:
    data = json.loads(text)
    return {k: v for k, v in data.items() if k not in ("created", "updated")}


def test_a_live_session_exports_as_its_saved_copy_does(demo_model, home):
    session = chat(demo_model)
    store.save(session, "talk")
    created = store.read("talk")["created"]
    assert f"- created: {created}, last used: " in store.export_session(session, "talk", "md")
    assert (
        store.export_session(session, "talk", "md").split("\n")[5:]
        == store.export("talk", "md").split("\n")[5:]
    )  # past the times
    assert _without_times(store.export_session(session, "talk", "json")) == _without_times(
        store.export("talk", "json")
    )
    md = store.export_session(session, "talk", "md")
    assert md.startswith("# talk\n\n- model: demo\n- cache kind: standard\n")
    assert "## User\n\nWhat is a cache?\n\n## Assistant\n\n" in md


def test_import_makes_a_session_without_cache_that_prefills_on_first_use(
    demo_model, home, tmp_path
):
    original = chat(demo_model)
    store.save(original, "talk")
    path = tmp_path / "talk.json"
    path.write_text(store.export("talk", "json"))

    name = store.import_session(path)
    assert name == "talk-2"  # "talk" is taken: the next free name
    data = store.read(name)
    assert data["messages"] == original.messages and data["ledger"] == []
    assert data["settings"]["max_tokens"] == 10 and len(data["turns"]) == 2
    assert not (store.session_dir(name) / store.CACHE_FILE).exists()

    loaded = store.load(name, demo_model)
    assert loaded.notice is None and not loaded.resumed_from_disk
    assert loaded.session.cache_tokens == 0
    done = turn(loaded.session, NEXT)  # the whole transcript is prefilled now
    assert done.stats.reused_tokens == 0
    assert done.stats.evaluated_tokens == done.stats.prompt_tokens > 30
    assert done.reply == turn(original, NEXT).reply  # as if it had never left

    assert store.import_session(path, name="mine", model_id="demo:other") == "mine"
    assert store.read("mine")["model_id"] == "demo:other"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("# talk\n\n## User\n\nhi\n", "is not a JSON export; import reads what"),
        ('{"messages": [{"role": "root", "content": "x"}]}', "is damaged (messages[0].role"),
        ('{"messages": "hi"}', "is damaged (messages"),
        ('{"name": "x"}', "is damaged (messages"),
        ('{"messages": [], "settings": {"temp": -1}}', "is damaged (settings.temp"),
        ('{"messages": []', "is damaged"),
    ],
)
def test_a_bad_file_is_refused_in_one_sentence_and_nothing_is_saved(
    home, tmp_path, content, message
):
    path = tmp_path / "in.json"
    path.write_text(content)
    with pytest.raises(store.StoreError) as error:
        store.import_session(path, default_model="demo")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert store.list_sessions() == []


def test_import_refuses_a_taken_name_a_missing_file_and_no_model(demo_model, home, tmp_path):
    store.save(chat(demo_model, texts=[]), "taken")
    path = tmp_path / "in.json"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}')
    with pytest.raises(store.StoreError, match="'taken' already exists"):
        store.import_session(path, name="taken", default_model="demo")
    with pytest.raises(store.StoreError, match="does not exist"):
        store.import_session(tmp_path / "nope.json", default_model="demo")
    with pytest.raises(store.StoreError, match="names no model"):
        store.import_session(path)
    assert store.import_session(path, default_model="demo") == "imported"
    assert store.read("taken")["messages"] == [{"role": "system", "content": "You are terse."}]


def test_cli_import_then_export_gives_back_the_transcript(demo_model, home, tmp_path):
    store.save(chat(demo_model), "talk")
    runner = CliRunner()
    exported = runner.invoke(app, ["sessions", "export", "talk", "--format", "json"])
    assert exported.exit_code == 0
    path = tmp_path / "talk.json"
    path.write_text(exported.output)

    result = runner.invoke(app, ["sessions", "import", str(path), "--name", "again"])
    assert result.exit_code == 0, result.output
    assert result.output == (
        f"Imported {path} as session again; `kvchat --resume again` opens it.\n"
    )
    back = runner.invoke(app, ["sessions", "export", "again", "--format", "json"])
    assert {**_without_times(back.output), "name": "talk"} == _without_times(exported.output)

    path.write_text("not json")
    result = runner.invoke(app, ["sessions", "import", str(path)])
    assert result.exit_code != 0 and "is not a JSON export" in result.output


def test_a_long_name_that_is_taken_gets_a_shortened_suffix(demo_model, home, tmp_path):
    long = "n" * 100  # the longest name there is: a suffix must make room for itself
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"name": long, "messages": [{"role": "user", "content": "hi"}]}))
    assert store.import_session(path, default_model="demo") == long
    assert store.import_session(path, default_model="demo") == "n" * 98 + "-2"
    assert store.read("n" * 98 + "-2")["messages"] == [{"role": "user", "content": "hi"}]


EXPORT_SCRIPT = (
    "import sys; from kvchat import store; store.write_export(sys.argv[1], 'x' * 100_000)"
)


def test_an_export_killed_before_it_is_in_place_leaves_no_file(tmp_path):
    """An export appears whole or not at all: killed once its bytes are written but before
    they take the name, it leaves nothing under that name."""
    import os
    import subprocess
    import sys

    from helpers import kill_when_stopped, stopped_before_rename

    target = tmp_path / "talk.md"
    proc = subprocess.Popen(
        [sys.executable, "-c", stopped_before_rename(EXPORT_SCRIPT, "talk.md"), str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert kill_when_stopped(proc, "talk.md") and not os.path.lexists(target)
    # and a later export of the same name is whole, with nothing else beside it that counts
    assert store.write_export(target, "whole\n") == target
    assert target.read_text() == "whole\n"


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_an_export_never_replaces_a_file_and_a_failed_one_leaves_nothing(
    tmp_path, monkeypatch, links
):
    import errno
    import os

    if not links:  # a file system without hard links (FAT): the name is claimed, then filled

        def no_link(*_):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    taken = tmp_path / "taken.md"
    taken.write_text("mine\n")
    with pytest.raises(store.StoreError, match="exists already"):
        store.write_export(taken, "export\n")
    assert taken.read_text() == "mine\n"
    assert store.write_export(tmp_path / "new.md", "export\n").read_text() == "export\n"
    with pytest.raises(store.StoreError, match="nothing was left there"):
        store.write_export(tmp_path / "missing" / "new.md", "export\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.md", "taken.md"]
