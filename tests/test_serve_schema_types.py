"""The serve request's sampling fields as a type checker sees them are exactly those the
settings table declares for the API, with their types; the model is made from the table."""

from __future__ import annotations

import typing

from kvchat.serve.schema import ChatRequest, SamplingFields
from kvchat.settings import API


def test_the_typed_sampling_fields_are_the_tables():
    hints = typing.get_type_hints(SamplingFields)
    assert list(hints) == [s.api for s in API]
    for s in API:
        assert hints[s.api] == s.type | None, s.api  # None: not given, the server's value
    built = ChatRequest.model_fields
    assert all(built[s.api].annotation == s.type | None for s in API)


def test_mypy_sees_a_misspelled_sampling_field(tmp_path):
    """``req.temprature`` is a type error (mypy in a process of its own, as for Config)."""
    import subprocess
    import sys

    use = tmp_path / "use.py"
    use.write_text(
        "from kvchat.serve.schema import ChatRequest\n"
        "def f(req: ChatRequest) -> float | None:\n"
        "    ok = req.temperature\n"
        "    return req.temprature\n",
        encoding="utf-8",
    )
    argv = [sys.executable, "-m", "mypy", str(use), "--no-error-summary"]
    done = subprocess.run([*argv, "--cache-dir", str(tmp_path)], capture_output=True, text=True)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert done.returncode == 1 and len(errors) == 1, done.stdout + done.stderr
    assert 'use.py:4: error: "ChatRequest" has no attribute "temprature"' in errors[0]
