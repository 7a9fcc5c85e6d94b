"""A turn's options (:class:`TurnOptions`: its sampling, logprobs, tools, template variables,
logits processors) are the turn's own: the session keeps its settings during the turn and
after, and the next request, or one sent at the same time, sees the session as it was."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from helpers import with_template
from mlx_lm.sample_utils import make_logits_processors
from serve_helpers import Server, chat
from test_serve_tools import WEATHER

from kvchat import store
from kvchat.engine.conversation.events import TokenLogprobs
from kvchat.engine.conversation.session import (
    GenerationSettings,
    Session,
    TurnDone,
    TurnOptions,
)
from kvchat.engine.conversation.template import render
from kvchat.engine.models.demo import CHAT_TEMPLATE

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are terse."
# the demo's template (it offers tools), reading a variable of its own
TEMPLATE = (
    "{%- if terse -%}{{- '<|im_start|>system\\nOne line.<|im_end|>\\n' -}}{%- endif -%}"
    + CHAT_TEMPLATE
)


@pytest.fixture(scope="module")
def options_model(demo_model, tmp_path_factory):
    return with_template(demo_model, tmp_path_factory.mktemp("models") / "demo-options", TEMPLATE)


def done_of(events: list) -> TurnDone:
    [done] = [e for e in events if isinstance(e, TurnDone)]
    return done


def logprobs_of(events: list) -> list[TokenLogprobs]:
    return [e for e in events if isinstance(e, TokenLogprobs)]


def test_a_turn_takes_its_options_and_leaves_the_session_as_it_was(options_model):
    lm = options_model
    own = GenerationSettings(max_tokens=8)
    session = Session(lm, system=SYSTEM, settings=own)
    done_of(list(session.send("Hello there.")))
    attributes = dict(vars(session))
    token = lm.tokenizer.encode(" cache", add_special_tokens=False)[0]
    options = TurnOptions(
        settings=GenerationSettings(max_tokens=3, temp=1.0, seed=5),
        tools=[WEATHER],
        variables={"terse": True},
        report_logprobs=2,
        logits_processors=tuple(make_logits_processors(logit_bias={token: 100})),
    )
    asked = [*session.messages, {"role": "user", "content": "What is a cache?"}]
    events = session.send("What is a cache?", options)
    first = next(e for e in events if isinstance(e, TokenLogprobs))
    assert vars(session) == attributes and session.settings is own  # during the turn
    rest = list(events)
    done = done_of(rest)

    # the turn sampled, reported and rendered as its options asked
    assert [e.token for e in [first, *logprobs_of(rest)]] == [token] * 3
    assert all(len(e.top) == 2 for e in [first, *logprobs_of(rest)])
    assert done.reply == lm.tokenizer.decode([token] * 3)
    offered = render(lm, asked, True, [WEATHER], {"terse": True})
    assert done.stats.prompt_tokens == len(offered) > len(render(lm, asked, True))

    # the session did not take them: the next turn is its own, as an uncached one
    assert vars(session) == attributes and own == GenerationSettings(max_tokens=8)
    later = list(session.send("And a ledger?"))
    fresh = Session(lm, settings=GenerationSettings(max_tokens=8), messages=session.messages[:-2])
    again = done_of(list(fresh.send("And a ledger?")))
    assert logprobs_of(later) == [] and done_of(later).reply == again.reply
    assert done_of(later).stats.prompt_tokens == again.stats.prompt_tokens


def test_requests_at_once_on_one_session_each_get_their_own_options(demo_model, home):
    """A request with sampling, logprobs and tools, and plain ones sent at the same time
    (one to the same session, which waits for it, one to another): each reply is the one
    it gets alone, and the session's settings, live and saved, are as they were."""
    lm = demo_model
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name rivers."}]
    special = {
        "temperature": 1.5,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "tools": [WEATHER],
        "max_tokens": 5,
    }
    with Server(lm) as server:
        first, _, _ = chat(server.client, ask, max_tokens=6, extra_headers={"X-Session-Id": "s"})
        own = replace(server.pool.get("s").settings)
        saved = store.read("s")["settings"]
        follow = [
            *ask,
            {"role": "assistant", "content": first},
            {"role": "user", "content": "Why?"},
        ]
        # the sampled request alone first: the session's settings, live and saved, stay
        named = {"X-Session-Id": "s"}
        alone, alone_body, _ = chat(server.client, follow, extra_headers=named, **special)
        server.wait_idle()
        assert server.pool.get("s").settings == own and store.read("s")["settings"] == saved
        with ThreadPoolExecutor(3) as threads:
            asked = [
                threads.submit(
                    chat, server.client, follow, extra_headers={"X-Session-Id": name}, **kw
                )
                for name, kw in (("s", special), ("s", {"max_tokens": 6}), ("t", {"max_tokens": 6}))
            ]
            (sampled, body, _), *plain = [a.result() for a in asked]
        server.wait_idle()
        assert server.pool.get("s").settings == own and store.read("s")["settings"] == saved

    reference = Session(lm, settings=GenerationSettings(max_tokens=6), messages=follow[:-1])
    greedy = done_of(list(reference.send("Why?")))
    for reply, other, _ in plain:
        assert reply == greedy.reply and other["choices"][0]["logprobs"] is None
        assert other["usage"]["prompt_tokens"] == len(render(lm, follow, True))
    # sampled alike, and its logprobs those of the reply alone (to float sums in a batch)
    entries, alone_entries = (b["choices"][0]["logprobs"]["content"] for b in (body, alone_body))
    assert sampled == alone and [e["token"] for e in entries] == [e["token"] for e in alone_entries]
    assert [e["logprob"] for e in entries] == pytest.approx(
        [e["logprob"] for e in alone_entries], abs=1e-3
    )
    assert len(entries) == body["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert body["usage"]["prompt_tokens"] == len(render(lm, follow, True, [WEATHER]))
