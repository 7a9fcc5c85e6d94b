"""Fuzz: a few hundred seeded mutations of session.json and cache.safetensors through
``store.load``, ``store.list_sessions`` and ``kvchat sessions show``. Every failure must be
a StoreError or a notice (0 tracebacks), a good session beside it must still list, and a
session that loads must answer its next turn."""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
import struct
import traceback
from collections import Counter

import pytest
from typer.testing import CliRunner

from kvchat import store
from kvchat.cli import app
from kvchat.engine.caches.kinds import applicable_kinds
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone

CASES_PER_BLOCK = 50
JSON_BLOCKS = 4  # 200 session.json mutations
CACHE_BLOCKS = 4  # 200 cache mutations
KINDS = ["standard", "quantized:8", "rotating:64", "chunked:64"]
EVIL = "\x1b]52;c;eA==\x07\x9b2J\r\u202e"
RAW_CONTROL = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")
DEEP = "@@deep@@"
VALUES = [
    "hot",
    "",
    EVIL,
    -1,
    0,
    1,
    -0.5,
    0.5,
    1e308,
    10**30,
    10**400,
    True,
    None,
    [],
    {},
    [1],
    [None],
    {"role": "user"},
    "many",
    [[[[]]]],
    DEEP,
]


@pytest.fixture(scope="module")
def templates(demo_model, tmp_path_factory):
    """session.json and cache.safetensors bytes of a saved conversation, per kind (those
    of KINDS that this backend runs: a quantized one is refused on CUDA)."""
    home = tmp_path_factory.mktemp("fuzz-templates")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCHAT_HOME", str(home))
        out = {}
        for kind in applicable_kinds(demo_model.model, KINDS):
            session = Session(
                demo_model,
                kind=kind,
                system="Be brief.",
                settings=GenerationSettings(max_tokens=24),
            )
            for text in ("Hello there, how are you today?", "What is a cache?", "Why?"):
                [e for e in session.send(text) if isinstance(e, TurnDone)]
            session.settings.max_tokens = 2  # each case's turn: short
            folder = store.save(session, "t")
            out[kind] = (
                (folder / "session.json").read_bytes(),
                (folder / "cache.safetensors").read_bytes(),
            )
        return out


# ------------------------------------------------------------------ session.json mutations


def _nodes(tree, path=()):
    yield path
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:8]):
            yield from _nodes(v, (*path, i))


def _parent(tree, path):
    for part in path[:-1]:
        tree = tree[part]
    return tree


def mutate_json(raw: bytes, rng: random.Random) -> bytes:
    data = json.loads(raw)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _nodes(data) if p]
        path = rng.choice(paths)
        parent = _parent(data, path)
        op = rng.random()
        if op < 0.55:
            parent[path[-1]] = copy.deepcopy(rng.choice(VALUES))
        elif op < 0.8:
            del parent[path[-1]]
        else:
            parent[path[-1]] = {"nested": copy.deepcopy(parent[path[-1]])}
    text = json.dumps(data).replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000, 1)
    out = bytearray(text.encode())
    op = rng.random()
    if op < 0.15:
        del out[rng.randrange(len(out)) :]
    elif op < 0.3:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


# ------------------------------------------------------------------ cache mutations


def _header(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def mutate_cache(raw: bytes, rng: random.Random) -> bytes:
    header, body = _header(raw)
    tensors = [k for k in header if k != "__metadata__"]
    meta = header["__metadata__"]
    op = rng.randrange(7)
    if op == 0:  # flip bytes anywhere
        out = bytearray(raw)
        for _ in range(rng.randint(1, 16)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        return bytes(out)
    if op == 1:  # truncate
        return raw[: rng.randrange(len(raw))]
    name = rng.choice(tensors)
    entry = header[name]
    if op == 2:
        entry["dtype"] = rng.choice(["I8", "F16", "BF16", "U32", "BOOL", "F64", "I64", "X9"])
    elif op == 3:
        shape = entry["shape"]
        change = rng.randrange(4)
        if change == 0 and shape:
            shape[rng.randrange(len(shape))] *= 2
        elif change == 1 and shape:
            shape.pop()
        elif change == 2:
            shape.append(1)
        else:
            entry["shape"] = [10**12]
    elif op == 4:
        start, end = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(
            [[start, end + 8], [end, start], [start, 10**15], [start + 4, end + 4], [-8, end]]
        )
    elif op == 5:  # rename, drop or duplicate a tensor
        choice = rng.randrange(3)
        if choice == 0:
            header[name + ".x" if rng.random() < 0.5 else name[::-1]] = header.pop(name)
        elif choice == 1:
            del header[name]
        else:
            header[f"{len(tensors) + 5}.0"] = dict(entry)
    else:  # metadata: class names, scalar types, kvchat's own fields
        key = rng.choice(sorted(meta))
        meta[key] = rng.choice(
            [
                "KVCache",
                "CacheList",
                "BatchKVCache",
                "LRUPromptCache",
                "copy",
                "scalar",
                "string",
                "none",
                "bogus",
                "",
                "-1",
                "1,2,x",
                EVIL,
            ]
        )
    return _with_header(header, body)


# ------------------------------------------------------------------ the run


def _forge_checksum(json_raw: bytes, cache_raw: bytes) -> bytes:
    data = json.loads(json_raw)
    data["cache"]["sha256"] = hashlib.sha256(cache_raw).hexdigest()
    data["cache"]["bytes"] = len(cache_raw)
    return json.dumps(data).encode()


def run_case(lm, json_raw: bytes, cache_raw: bytes) -> tuple[str, list[str]]:
    """Write the pair as session "fuzz" (beside an intact "good"), exercise it; return
    how the load ended ("error", "notice", "resumed" or "fresh") and what went wrong
    (tracebacks, raw control bytes, a lost good session)."""
    folder = store.session_dir("fuzz")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "session.json").write_bytes(json_raw)
    (folder / "cache.safetensors").write_bytes(cache_raw)
    problems, outcome = [], "error"
    try:
        loaded = store.load("fuzz", lm)
        outcome = "notice" if loaded.notice else "resumed" if loaded.resumed_from_disk else "fresh"
        assert loaded.notice is None or "\n" not in loaded.notice
        reply = [e for e in loaded.session.send("Go on.") if isinstance(e, TurnDone)][0].reply
        assert isinstance(reply, str)
    except store.StoreError as exc:
        if "\n" in str(exc) or str(folder) not in str(exc):
            problems.append(f"load: the error is not one sentence naming the file: {exc}")
    except Exception:
        problems.append("load: " + traceback.format_exc())
    try:
        listed = {s.name: s for s in store.list_sessions()}
        assert listed["good"].note is None and "fuzz" in listed
    except Exception:
        problems.append("list: " + traceback.format_exc())
    result = CliRunner().invoke(app, ["sessions", "show", "fuzz"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        problems.append("show: " + "".join(traceback.format_exception(result.exception)))
    elif RAW_CONTROL.search(result.stdout_bytes + result.stderr_bytes):
        problems.append(f"show printed raw control bytes: {result.stdout_bytes[:200]!r}")
    return outcome, problems


@pytest.fixture
def home(demo_model, templates, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    good = store.session_dir("good")
    good.mkdir(parents=True)
    json_raw, cache_raw = templates["standard"]
    (good / "session.json").write_bytes(json_raw)
    (good / "cache.safetensors").write_bytes(cache_raw)
    return tmp_path / "home"


@pytest.mark.parametrize("block", range(JSON_BLOCKS))
def test_fuzz_session_json(demo_model, templates, home, block):
    failures, outcomes = [], Counter()
    for case in range(CASES_PER_BLOCK):
        rng = random.Random(f"json-{block}-{case}")
        json_raw, cache_raw = templates[rng.choice(list(templates))]
        outcome, problems = run_case(demo_model, mutate_json(json_raw, rng), cache_raw)
        outcomes[outcome] += 1
        failures += [f"case json-{block}-{case}: {problem}" for problem in problems]
    assert not failures, f"{len(failures)} failures; first:\n{failures[0]}"
    assert outcomes["error"] >= CASES_PER_BLOCK // 2, outcomes  # most mutations break the schema


@pytest.mark.parametrize("block", range(CACHE_BLOCKS))
def test_fuzz_cache_file(demo_model, templates, home, block):
    failures, outcomes = [], Counter()
    for case in range(CASES_PER_BLOCK):
        rng = random.Random(f"cache-{block}-{case}")
        json_raw, cache_raw = templates[rng.choice(list(templates))]
        mutated = mutate_cache(cache_raw, rng)
        forged = rng.random() < 0.5  # as an attacker would: the checksum rewritten to match
        if forged:
            json_raw = _forge_checksum(json_raw, mutated)
        outcome, problems = run_case(demo_model, json_raw, mutated)
        outcomes[outcome, forged] += 1
        failures += [f"case cache-{block}-{case}: {problem}" for problem in problems]
    assert not failures, f"{len(failures)} failures; first:\n{failures[0]}"
    assert outcomes["resumed", False] == 0, outcomes  # a changed file never passes its checksum
    assert outcomes["notice", True] + outcomes["notice", False] >= CASES_PER_BLOCK * 3 // 4, (
        outcomes
    )


def test_cache_file_that_is_a_folder(demo_model, templates, home):
    json_raw, _ = templates["standard"]
    folder = store.session_dir("fuzz")
    (folder / "cache.safetensors").mkdir(parents=True)
    (folder / "session.json").write_bytes(json_raw)
    loaded = store.load("fuzz", demo_model)
    assert not loaded.resumed_from_disk and "is a folder" in loaded.notice
    assert [e for e in loaded.session.send("Go on.") if isinstance(e, TurnDone)]
    assert {s.name for s in store.list_sessions() if s.note is None} == {"good", "fuzz"}
