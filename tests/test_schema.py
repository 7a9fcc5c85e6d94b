"""session.json with wrong types is a StoreError naming the file and the field; the other
sessions still list; nothing on disk changes."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from kvchat import store
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.store.schema import Settings


@pytest.fixture
def saved(demo_model, home):
    """Two saved sessions, "good" and "bad"; returns the parsed session.json of "bad"."""
    session = Session(demo_model, system="Be brief.", settings=GenerationSettings(max_tokens=6))
    [e for e in session.send("Hello.") if isinstance(e, TurnDone)]
    store.save(session, "good")
    folder = store.save(session, "bad")
    return json.loads((folder / "session.json").read_text())


def _set(data: dict, dotted: str, value) -> dict:
    data = json.loads(json.dumps(data))
    *parents, last = dotted.split(".")
    target = data
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return data


# (what to change, the value, the field the message names)
WRONG = [
    ("settings.temp", "hot", "settings.temp"),
    ("settings.temp", -0.5, "settings.temp"),
    ("settings.top_p", "0.9", "settings.top_p"),
    ("settings.top_p", 3, "settings.top_p"),
    ("settings.prefill_step", "512", "settings.prefill_step"),
    ("settings.prefill_step", 0, "settings.prefill_step"),
    ("settings.max_tokens", 1.5, "settings.max_tokens"),
    ("settings", [1], "settings"),
    ("turns", [1], "turns[0]"),
    ("turns.0.gen_tps", "fast", "turns[0].gen_tps"),
    ("archived", [1], "archived[0]"),
    ("archived", [{"role": "user"}], "archived[0].content"),
    ("messages.1", {"role": "user"}, "messages[1].content"),
    ("messages.1.role", "wizard", "messages[1].role"),
    ("messages.1.content", ["a"], "messages[1].content"),
    ("messages", "hello", "messages"),
    ("model_id", 7, "model_id"),
    ("model_id", ["a", "b"], "model_id"),
    ("cache_kind", {"x": 1}, "cache_kind"),
    ("cache.tokens", "many", "cache.tokens"),
    ("cache.tokens", -1, "cache.tokens"),
    ("cache.sha256", None, "cache.sha256"),
    ("ledger", [1, "2"], "ledger[1]"),
    ("ledger", [-4], "ledger[0]"),
    ("ledger", {"0": 1}, "ledger"),
    ("updated", 20240101, "updated"),
]


@pytest.mark.parametrize("field, value, named", WRONG, ids=[f"{w[0]}={w[1]!r}" for w in WRONG])
def test_wrong_types_are_an_error_naming_the_file_and_field(demo_model, saved, field, value, named):
    path = store.session_dir("bad") / "session.json"
    content = json.dumps(_set(saved, field, value)).encode()
    path.write_bytes(content)
    for call in (lambda: store.load("bad", demo_model), lambda: store.read("bad")):
        with pytest.raises(store.StoreError) as err:
            call()
        message = str(err.value)
        assert message.startswith(f"{path} is damaged ({named}: ")
        assert message.endswith("; it was left as it is.") and "\n" not in message
    assert path.read_bytes() == content
    listed = {s.name: s for s in store.list_sessions()}
    assert listed["good"].note is None and listed["good"].turns == 1
    assert f"({named}: " in listed["bad"].note


@pytest.mark.parametrize(
    "text, words",
    [
        (
            '{"cache": {"file": "c", "sha256": "0", "tokens": 1e400}, "messages": []}',
            "cache.tokens: Input should be a valid integer",
        ),
        (
            '{"settings": {"temp": 1e400}, "messages": []}',
            "settings.temp: Input should be a finite number",
        ),
        ('{"settings": {"temp": NaN}, "messages": []}', "settings.temp: Input should be a finite"),
        (
            '{"messages": [], "turns": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "recursion limit exceeded",
        ),
        ("[" * 100_000, "recursion limit exceeded"),
        ('{"messages": [{"role": "user", "content": "\\udc80"}]}', "lone leading surrogate"),
        ('{"messages": [], "ledger": [' + "9" * 5000 + "]}", "number out of range"),
        ("[1, 2]", "Input should be an object"),
    ],
)
def test_unparseable_content_is_one_sentence(demo_model, saved, text, words):
    path = store.session_dir("bad") / "session.json"
    path.write_text(text)
    with pytest.raises(store.StoreError) as err:
        store.load("bad", demo_model)
    assert words in str(err.value) and str(path) in str(err.value)
    assert {s.name for s in store.list_sessions() if s.note is None} == {"good"}


def test_several_problems_are_counted(saved):
    path = store.session_dir("bad") / "session.json"
    path.write_text(json.dumps({**saved, "model_id": 1, "cache_kind": 2, "ledger": "x"}))
    with pytest.raises(store.StoreError, match=r"\(model_id: .*, and 2 more problems\)"):
        store.read("bad")


def test_valid_files_keep_every_field_they_have(demo_model, saved):
    """The schema drops nothing a save writes: read() returns what is on disk."""
    assert store.read("bad") == saved
    path = store.session_dir("bad") / "session.json"
    old = {k: v for k, v in saved.items() if k not in ("settings", "turns", "archived", "cache")}
    old["ledger"] = []
    path.write_text(json.dumps(old))  # an older, smaller file still loads
    loaded = store.load("bad", demo_model)
    assert loaded.session.messages == saved["messages"]
    assert loaded.session.settings == GenerationSettings()


def test_settings_schema_has_the_engine_fields():
    assert set(Settings.model_fields) == {f.name for f in fields(GenerationSettings)}
    assert Settings().model_dump() == vars(GenerationSettings())


def test_every_sampling_setting_survives_save_and_load(demo_model, home):
    chosen = GenerationSettings(
        max_tokens=7,
        temp=0.9,
        top_p=0.8,
        top_k=12,
        min_p=0.05,
        repetition_penalty=1.3,
        repetition_context_size=64,
        presence_penalty=0.4,
        frequency_penalty=-0.5,
        seed=2**63 + 5,
    )
    assert all(
        getattr(chosen, f.name) != f.default
        for f in fields(GenerationSettings)
        if f.name not in ("prefill_step", "ignore_eos")
    )  # none left at its default
    session = Session(demo_model, settings=chosen)
    [e for e in session.send("Hello.") if isinstance(e, TurnDone)]
    folder = store.save(session, "sampled")
    assert json.loads((folder / "session.json").read_text())["settings"]["top_k"] == 12
    assert store.load("sampled", demo_model).session.settings == chosen
