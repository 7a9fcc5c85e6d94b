"""`kvchat replay`: scripted conversations through one Session, and the --no-cache baseline."""

from __future__ import annotations

import json

import pytest

from kvchat.cli.replay import ReplayError, load_script, parse_script, run_script
from kvchat.engine.conversation.session import GenerationSettings
from kvchat.engine.conversation.stats import STAT_FIELDS

SCRIPT = {
    "system": "You are terse.",
    "turns": [
        "What is a prompt cache?",
        "Why is the second turn cheap?",
        {"op": "regenerate"},
        {"op": "undo"},
        "Say it differently.",
        {"op": "cache", "kind": "quantized:8"},
        "And with a quantized cache?",
        {"op": "reset"},
        "After a reset?",
    ],
}


@pytest.mark.quantized_attention
def test_replay_matches_the_no_cache_baseline(demo_model):
    script = parse_script(SCRIPT)
    settings = GenerationSettings(max_tokens=10)
    cached = run_script(demo_model, script, settings=settings)
    baseline = run_script(demo_model, script, settings=settings, no_cache=True)
    assert cached["model"] == "demo" and cached["cache_kind"] == "quantized:8"
    ops = [t["op"] for t in cached["turns"]]
    assert ops == ["send", "send", "regenerate", "undo", "send", "cache", "send", "reset", "send"]
    replies = [t for t in cached["turns"] if "reply" in t]
    assert all(set(STAT_FIELDS) <= set(t) for t in replies)
    # up to the switch to a quantized cache, cached and uncached replies are equal
    for a, b in list(zip(cached["turns"], baseline["turns"]))[:5]:
        assert a.get("reply") == b.get("reply")
    # the cache did its work: turn 2 reuses, regenerate evaluates nothing
    assert cached["turns"][1]["reused_tokens"] > 0
    assert cached["turns"][2]["evaluated_tokens"] == 0
    assert baseline["turns"][1]["reused_tokens"] == 0
    assert baseline["turns"][2]["evaluated_tokens"] == baseline["turns"][2]["prompt_tokens"]
    # after the reset everything is evaluated again
    assert cached["turns"][8]["reused_tokens"] == 0


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "JSON object"),
        ({"turns": []}, "non-empty list"),
        ({"system": 3, "turns": ["hi"]}, "'system' must be a string"),
        ({"turns": ["hi", "  "]}, "turn 2: the message is empty"),
        ({"turns": [{"op": "dance"}]}, "turn 1: expected"),
        ({"turns": ["hi", {"op": "cache", "kind": "huge"}]}, "turn 2: Unknown cache kind"),
    ],
)
def test_malformed_scripts_are_clear_errors(data, message):
    with pytest.raises(ReplayError, match=message):
        parse_script(data)


def test_script_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SCRIPT))
    assert len(load_script(good).steps) == len(SCRIPT["turns"])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ReplayError, match="not valid JSON"):
        load_script(bad)
    with pytest.raises(ReplayError, match="Cannot read"):
        load_script(tmp_path / "missing.json")
