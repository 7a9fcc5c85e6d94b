"""The serve request's sampling fields as a type checker sees them are exactly those the
settings table declares for the API, with their types; the model is made from the table."""

from __future__ import annotations

import typing

from kvchat.serve.schema import ChatRequest, SamplingFields
from kvchat.settings import API
from tests.helpers import mypy_errors


def test_the_typed_sampling_fields_are_the_tables():
    hints = typing.get_type_hints(SamplingFields)
    assert list(hints) == [s.api for s in API]
    for s in API:
        assert hints[s.api] == s.type | None, s.api  # None: not given, the server's value
    built = ChatRequest.model_fields
    assert all(built[s.api].annotation == s.type | None for s in API)


def test_mypy_sees_a_misspelled_sampling_field(tmp_path):
    """``req.temprature`` is a type error, as a misspelled setting of Config is."""
    errors = mypy_errors(
        tmp_path,
        "from kvchat.serve.schema import ChatRequest\n"
        "def f(req: ChatRequest) -> float | None:\n"
        "    ok = req.temperature\n"
        "    return req.temprature\n",
    )
    assert len(errors) == 1, errors
    assert 'use.py:4: error: "ChatRequest" has no attribute "temprature"' in errors[0]
