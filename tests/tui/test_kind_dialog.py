"""The cache-type dialog: any N typed and validated, the active kind marked whatever its N,
and the quantized lines' figures matching what they say."""

from __future__ import annotations

import pytest

from kvchat.engine.caches import fit, kinds
from kvchat.engine.caches.sizes import kind_bytes_per_token
from kvchat.tui.screens.kind import KindDialog
from kvchat.tui.tab.jobs import JobRunner
from kvchat.tui.textual_compat import notifications
from kvchat.tui.widgets.messages import NoticeMessage

from .conftest import SIZE, send, settle, until, widget_text

pytestmark = pytest.mark.anyio


async def _open(pilot) -> KindDialog:
    app = pilot.app
    await pilot.press("f4")
    await until(pilot, lambda: isinstance(app.screen, KindDialog))
    await pilot.pause()
    return app.screen


async def test_typed_kind_is_validated_used_and_marked(make_app, demo_model):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        session = app.active_conversation().session
        await send(pilot, "hello")

        dialog = await _open(pilot)
        shown = " ".join(widget_text(dialog.query_one("#kind-dialog")).split())
        standard = kind_bytes_per_token(demo_model.model, "standard")
        assert dialog.names == [
            "standard",
            "quantized:8",
            "quantized:4",
            "rotated:8",
            "rotated:4",
            "rotating:4096",
            "chunked:2048",
            "concatenate",
        ]
        for name in ("quantized:8", "quantized:4", "rotated:8", "rotated:4"):
            share = kind_bytes_per_token(demo_model.model, name) / standard
            assert f"{name}" in shown and f"({share:.2f} × standard)" in shown
        assert "1/2" not in shown and "1/4" not in shown
        assert "● standard" in shown

        typed = dialog.query_one("#kind-input")
        typed.value = "rotating:12"
        await pilot.click("#kind-use")
        await pilot.pause()
        assert isinstance(app.screen, KindDialog) and typed.value == "rotating:12"  # kept
        assert "rotating:N needs N of at least 64 tokens (got 12)." in [
            n.message for n in notifications(app)
        ]
        typed.value = "rotating:1024"
        typed.focus()
        await pilot.press("enter")
        await settle(pilot)
        assert session.kind.name == "rotating:1024"
        assert session.cache_tokens == len(session.render(session.messages, False))
        await send(pilot, "and on")
        assert session.last_stats.reused_tokens > 0

        dialog = await _open(pilot)
        assert dialog.names.index("rotating:1024") == dialog.names.index("rotating:4096") + 1
        options = dialog.query_one("#kind-options")
        assert options.highlighted == dialog.names.index("rotating:1024")
        shown = widget_text(dialog.query_one("#kind-dialog"))
        assert "● rotating:1024" in shown and "● rotating:4096" not in shown
        assert "(now rotating:1024)" in shown


async def test_kinds_a_model_cannot_take_are_refused_and_not_listed(arch, home):
    from kvchat.config import Config
    from kvchat.tui.app import KvChatApp

    lm = arch("gemma2")  # its attention cannot read a quantized cache
    config = Config(model=str(lm.path), cache="quantized:8", max_tokens=4, autosave=False)
    app = KvChatApp(config, lm=lm, volatile=False)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.active_conversation().session.kind.name == "standard"
        assert (
            "Cache kind 'quantized:8' cannot apply to this model: its attention cannot read "
            "a quantized cache (TypeError). Use 'standard'. This tab uses 'standard'."
        ) in [n.message for n in notifications(app)]
        conversation = app.active_conversation()
        await send(pilot, "hello there")
        session = conversation.session
        cache, ledger = session.cache, list(session.ledger)
        dialog = await _open(pilot)
        assert dialog.names == ["standard", "rotating:4096", "concatenate"]

        typed = dialog.query_one("#kind-input")
        typed.value = "chunked:1024"  # not listed, typed: the switch itself refuses it
        typed.focus()
        await pilot.press("enter")
        await settle(pilot, conversation)
        shown = [str(n.render()) for n in conversation.log.query(NoticeMessage)]
        assert shown[-1] == (
            "Switching cache failed: CacheKindError: Cache kind 'chunked:1024' cannot apply to "
            "this model: its attention cannot read a chunked cache (ValueError). Use 'standard'."
        )
        assert (
            session.kind.name == "standard" and session.cache is cache and session.ledger == ledger
        )


async def test_the_kinds_are_found_once_then_the_dialog_opens_without_a_job(make_app, monkeypatch):
    monkeypatch.setattr(fit, "_FOUND", {})  # nothing found about the model yet
    made, jobs = [], []
    real_make, real_job = kinds.make_cache, JobRunner.run

    def make(model, kind, keep=0):
        made.append(kind.name)
        return real_make(model, kind, keep)

    def job(self, label, *args, **kwargs):
        jobs.append(label)
        return real_job(self, label, *args, **kwargs)

    monkeypatch.setattr(kinds, "make_cache", make)
    monkeypatch.setattr(JobRunner, "run", job)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        made.clear()  # the configured kind, tried as the model loaded
        dialog = await _open(pilot)
        assert jobs == ["checking cache kinds"]
        assert sorted(made) == sorted(kinds.OFFERED_KINDS)  # each kind tried once, no more
        names = dialog.names
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, KindDialog))
        made.clear()
        jobs.clear()
        await pilot.press("f4")
        await pilot.pause()
        assert isinstance(app.screen, KindDialog) and app.screen.names == names
        assert jobs == [] and made == []  # shown from the answers kept


async def test_esc_stops_checking_the_kinds_and_f4_goes_on_from_there(make_app, monkeypatch):
    """The check of which kinds a model takes shows its progress in kinds and stops at Esc;
    the kinds checked keep their answers, so the next F4 checks only the rest."""
    monkeypatch.setattr(fit, "_FOUND", {})  # nothing found about the model yet
    made: list[str] = []
    real_make = kinds.make_cache

    def make(model, kind, keep=0):
        made.append(kind.name)
        return real_make(model, kind, keep)

    monkeypatch.setattr(kinds, "make_cache", make)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        conversation = app.active_conversation()
        made.clear()
        with app.scheduler.turn("held by the test"):  # the check waits for the model
            await pilot.press("f4")
            await until(pilot, lambda: conversation.state == "checking cache kinds")
            await pilot.press("escape")
        await settle(pilot, conversation)
        assert made == [] and not isinstance(app.screen, KindDialog)
        said = [str(n.message) for n in notifications(app)]
        assert "Stopped checking cache kinds; F4 goes on from where it stopped." in said

        first = kinds.OFFERED_KINDS[0]
        kinds.applicable_kinds(app.lm.model, [first])  # one answer known already
        made.clear()
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, KindDialog))
        assert sorted(made) == sorted(k for k in kinds.OFFERED_KINDS if k != first)
