"""Helpers shared by the engine and store tests (fixtures live in conftest.py)."""

from __future__ import annotations

from kvchat.engine.session import Session, TurnDone


def turn(session: Session, text: str) -> TurnDone:
    """Run one turn of ``session`` to its end; return its ``TurnDone``."""
    return [e for e in session.send(text) if isinstance(e, TurnDone)][0]
