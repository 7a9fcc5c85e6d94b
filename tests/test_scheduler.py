"""The scheduler serves model requests one at a time, first come first served."""

from __future__ import annotations

import threading

import pytest

from kvchat.engine.generation.scheduler import Cancelled, Scheduler
from tests.helpers import wait_until


def test_one_at_a_time_in_arrival_order():
    scheduler = Scheduler()
    order: list[str] = []
    first = scheduler.request("a")
    scheduler.wait(first)  # runs at once
    assert scheduler.running == "a"

    def worker(name: str) -> None:
        with scheduler.turn(name):
            order.append(name)

    threads = []
    for name in ("b", "c"):
        thread = threading.Thread(target=worker, args=(name,))
        thread.start()
        threads.append(thread)
        wait_until(lambda name=name: name in scheduler.waiting(), every=0.001)
    assert scheduler.waiting() == ["b", "c"]
    assert scheduler.position("c") == 2
    assert order == []
    scheduler.done(first)
    for thread in threads:
        thread.join(5)
    assert order == ["b", "c"]
    assert scheduler.running is None and scheduler.waiting() == []


def test_on_wait_reports_how_many_are_ahead_and_cancel_withdraws():
    scheduler = Scheduler()
    holder = scheduler.request("a")
    scheduler.wait(holder)
    seen: list[int] = []
    outcome: list[str] = []

    def worker() -> None:
        try:
            with scheduler.turn("b", on_wait=seen.append):
                outcome.append("ran")
        except Cancelled:
            outcome.append("cancelled")

    thread = threading.Thread(target=worker)
    thread.start()
    wait_until(lambda: "b" in scheduler.waiting(), every=0.001)
    assert scheduler.cancel("b") is True
    thread.join(5)
    assert seen == [1] and outcome == ["cancelled"]
    scheduler.done(holder)
    assert scheduler.running is None


def test_timeout_leaves_the_queue():
    scheduler = Scheduler()
    holder = scheduler.request("a")
    ticket = scheduler.request("b")
    with pytest.raises(TimeoutError):
        scheduler.wait(ticket, timeout=0.01)
    assert scheduler.waiting() == []
    scheduler.done(holder)
