"""F9, the tab's settings: sampling and max tokens change the next turn, a new system prompt
keeps the cache up to the change, bad values change nothing, and all of it is saved."""

from __future__ import annotations

import pytest
from textual.widgets import Input, TextArea

from kvchat import store
from kvchat.config import Config
from kvchat.engine.conversation.maintenance import common_prefix
from kvchat.engine.conversation.session import GenerationSettings, Session, TurnDone
from kvchat.tui.app import KvChatApp
from kvchat.tui.screens.settings import ModelDialog, SettingsDialog
from kvchat.tui.textual_compat import notifications

from .conftest import SIZE, palette_pick, send, settle, until, widget_text

pytestmark = pytest.mark.anyio


def notices(app) -> list[str]:
    return [n.message for n in notifications(app)]


async def edit_settings(pilot, **values: str) -> SettingsDialog:
    """F9, then set the named fields (system, temp, top_p, max_tokens); not applied yet."""
    await pilot.press("f9")
    await until(pilot, lambda: isinstance(pilot.app.screen, SettingsDialog))
    dialog = pilot.app.screen
    for key, value in values.items():
        if key == "system":
            dialog.query_one("#settings-system", TextArea).text = value
        else:
            dialog.query_one(f"#settings-{key.replace('_', '-')}", Input).value = value
    return dialog


async def apply(pilot) -> None:
    await pilot.click("#settings-apply")
    await settle(pilot)


async def test_max_tokens_and_greedy_temperature_change_the_next_turn(demo_model, endless, home):
    app = KvChatApp(
        Config(model="demo", max_tokens=8, temp=1.5, autosave=False), lm=demo_model, volatile=False
    )
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        await send(pilot, "hello there")  # sampled at 1.5
        assert session.last_stats.generated_tokens == 8

        await edit_settings(pilot, max_tokens="3")
        await apply(pilot)
        assert session.settings.max_tokens == 3 and session.settings.temp == 1.5
        await send(pilot, "again")
        assert session.last_stats.generated_tokens == 3
        assert "Settings apply from the next turn." in notices(app)

        await edit_settings(pilot, temp="0", max_tokens="10")
        await apply(pilot)
        history = list(session.messages)
        await send(pilot, "and now greedily")
        assert session.last_stats.reused_tokens > 0  # the tab's cache was used
        fresh = Session(
            demo_model, messages=history, settings=GenerationSettings(max_tokens=10, temp=0.0)
        )
        done = [e for e in fresh.send("and now greedily") if isinstance(e, TurnDone)][0]
        assert fresh.last_stats.reused_tokens == 0  # no cache at all
        assert session.messages[-1]["content"] == done.reply
        assert session.last_stats.generated_tokens == 10  # cut by max_tokens (endless)


async def test_a_new_system_prompt_reuses_the_cache_up_to_the_change(make_app, demo_model):
    app = make_app()
    app.config = app.config.override(system="You are terse.")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        session = conversation.session
        await send(pilot, "hello there")
        before = list(session.ledger)

        await edit_settings(pilot, system="You are verbose.")
        await apply(pilot)
        assert session.system == "You are verbose."
        log = widget_text(conversation.log)
        assert "System prompt: You are verbose." in log and "terse" not in log

        await send(pilot, "next")
        tokenizer = demo_model.tokenizer
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(
                session.messages[:-1], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        shared = common_prefix(before, prompt)
        last = session.last_stats
        assert 0 < shared < len(before)
        assert (last.reused_tokens, last.evaluated_tokens) == (shared, len(prompt) - shared)
        sidebar = widget_text(app.sidebar)
        assert f"reused      {shared:,} of {len(prompt):,}" in sidebar
        assert f"evaluated   {len(prompt) - shared:,}" in sidebar


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temp", "warm", "Temperature must be a number, not 'warm'."),
        ("temp", " ", "Temperature is empty: give a number."),
        ("temp", "9", "Temperature: expected a temperature between 0 and 5."),
        ("temp", "nan", "Temperature: expected a temperature between 0 and 5."),
        ("top_p", "0", "Top-p: must be more than 0 and at most 1 (1: off)."),
        ("top_p", "1.5", "Top-p: must be more than 0 and at most 1 (1: off)."),
        ("max_tokens", "0", "Max tokens: must be at least 1."),
        ("max_tokens", "2.5", "Max tokens must be a whole number, not '2.5'."),
        ("top_k", "-3", "Top-k: must be at least 0."),
        ("repetition_penalty", "0", "Repetition penalty: must be more than 0 and at most 10."),
        ("seed", "lucky", "Seed must be a whole number, not 'lucky'."),
    ],
)
async def test_a_bad_value_says_why_and_changes_nothing(make_app, field, value, message):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        session = app.active_conversation().session
        before = GenerationSettings(**vars(session.settings))
        dialog = await edit_settings(pilot, system="A new prompt.", **{field: value})
        await pilot.click("#settings-apply")
        await pilot.pause()
        assert app.screen is dialog  # still open, to correct it
        assert notices(app)[-1] == message
        await pilot.press("escape")
        await settle(pilot)
        assert session.settings == before and session.system is None


async def test_settings_and_system_prompt_are_saved_and_resumed(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        session = app.active_conversation().session
        name = app.active_conversation().session_name
        await send(pilot, "hello there")
        await edit_settings(
            pilot,
            system="Answer in French.",
            temp="0.7",
            top_p="0.9",
            max_tokens="5",
            top_k="40",
            min_p="0.05",
            repetition_penalty="1.1",
            presence_penalty="0.5",
            seed="11",
        )
        await apply(pilot)
        await send(pilot, "more")
        await pilot.press("ctrl+s")
        await settle(pilot)
        saved = (session.system, session.settings, list(session.ledger))
    kept = store.read(name)["settings"]
    assert (kept["top_p"], kept["top_k"], kept["min_p"], kept["seed"]) == (0.9, 40, 0.05, 11)
    assert (kept["repetition_penalty"], kept["presence_penalty"]) == (1.1, 0.5)

    again = make_app(resume=name)
    async with again.run_test(size=SIZE) as pilot:
        await settle(pilot)
        resumed = again.active_conversation().session
        assert (resumed.system, resumed.settings, resumed.ledger) == saved
        dialog = await edit_settings(pilot)
        values = [
            dialog.query_one(f"#settings-{n}", Input).value
            for n in ("temp", "top-p", "max-tokens", "top-k", "seed", "frequency-penalty")
        ]
        assert values == ["0.7", "0.9", "5", "40", "11", "0"]
        assert dialog.query_one(TextArea).text == "Answer in French."


async def test_the_palette_reaches_the_settings_and_a_model_tab(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "Settings" in await palette_pick(pilot, "settings")
        await until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        await pilot.press("escape")
        await pilot.pause()
        assert "New tab, model" in await palette_pick(pilot, "new tab model")
        await until(pilot, lambda: isinstance(app.screen, ModelDialog))


async def test_max_tokens_and_temp_flags_win_over_a_resumed_sessions_saved_ones(demo_model, home):
    """`kvchat --resume chat --max-tokens 3 --temp 0`: the flags, not the saved settings,
    make the next turn and are what is saved."""
    from kvchat.tui.run import tui_app

    saved = Session(demo_model, settings=GenerationSettings(max_tokens=40, temp=0.9))
    [e for e in saved.send("Hello there.") if isinstance(e, TurnDone)]
    store.save(saved, "chat")
    greedy = Session(
        demo_model,
        messages=list(saved.messages),
        settings=GenerationSettings(max_tokens=40, temp=0.0),
    )
    reference = [e for e in greedy.send("Tell me more.") if isinstance(e, TurnDone)][0]
    assert reference.stats.generated_tokens > 3  # so a cut at 3 is the flag's doing

    app = tui_app(resume="chat", flags={"max_tokens": 3, "temp": 0.0, "top_k": None})
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.conversations(), timeout=60)
        await settle(pilot)
        session = app.active_conversation().session
        assert (session.settings.max_tokens, session.settings.temp) == (3, 0.0)
        await send(pilot, "Tell me more.")
        assert session.last_stats.generated_tokens == 3
        assert reference.reply.startswith(session.messages[-1]["content"])
        await pilot.press("ctrl+s")
        await settle(pilot)
    assert store.read("chat")["settings"]["max_tokens"] == 3
    assert store.read("chat")["settings"]["temp"] == 0.0


async def test_a_seed_set_in_f9_makes_a_regenerate_give_the_same_sampled_reply(make_app, endless):
    app = make_app(max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        session = app.active_conversation().session
        await edit_settings(pilot, temp="1.5", seed="5")
        await apply(pilot)
        await send(pilot, "hello there")
        first = session.messages[-1]["content"]
        await pilot.press("f5")
        await settle(pilot)
        assert session.messages[-1]["content"] == first
        assert (
            "Seed 5 is set: the same reply came again; clear it in the tab's settings (F9)."
        ) in notices(app)
        await edit_settings(pilot, seed="")
        await apply(pilot)
        assert session.settings.seed is None
        await pilot.press("f5")
        await settle(pilot)
        assert session.messages[-1]["content"] != first  # sampled at 1.5, unseeded
