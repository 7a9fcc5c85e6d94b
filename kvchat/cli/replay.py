"""``kvchat replay``: run a scripted conversation through one Session, no terminal UI.

A script is JSON::

    {"system": "You are terse.",
     "turns": ["first message", "second", {"op": "regenerate"}, {"op": "undo"},
               {"op": "cache", "kind": "quantized:8"}, {"op": "reset"}, "..."]}

A string is a user message; an object is an operation on the session. The
result lists one entry per step; steps that produce a reply carry the reply
and the turn's stats under the engine's field names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table
from rich.text import Text

from kvchat.engine.caches.kinds import CacheKind, CacheKindError, parse_kind
from kvchat.engine.conversation.session import GenerationSettings, SessionError, TurnDone
from kvchat.runtime.sessions import new_session

from ..safety import printable, read_limited

OPS = ("regenerate", "undo", "cache", "reset")
MAX_SCRIPT_BYTES = 16 << 20


class ReplayError(ValueError):
    """A script that cannot be run; the message says where and why."""


@dataclass(frozen=True)
class Step:
    op: str  # "send" or one of OPS
    text: str | None = None  # the message, for "send"
    kind: str | None = None  # the new kind, for "cache"


@dataclass(frozen=True)
class Script:
    system: str | None
    steps: tuple[Step, ...]


def parse_script(data: object) -> Script:
    """Validate a decoded script; raise :class:`ReplayError` naming the bad part."""
    if not isinstance(data, dict):
        raise ReplayError("A replay script is a JSON object with a 'turns' list.")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ReplayError("'system' must be a string.")
    turns = data.get("turns")
    if not isinstance(turns, list) or not turns:
        raise ReplayError("'turns' must be a non-empty list.")
    steps = []
    for i, turn in enumerate(turns, 1):
        where = f"turn {i}"
        if isinstance(turn, str):
            if not turn.strip():
                raise ReplayError(f"{where}: the message is empty.")
            steps.append(Step("send", text=turn))
            continue
        if not isinstance(turn, dict) or turn.get("op") not in OPS:
            raise ReplayError(
                f"{where}: expected a message string or an object with 'op' one of {', '.join(OPS)}."
            )
        kind = turn.get("kind")
        if turn["op"] == "cache":
            try:
                kind = parse_kind(kind if isinstance(kind, str) else "").name
            except CacheKindError as e:
                raise ReplayError(f"{where}: {e}") from None
        steps.append(Step(turn["op"], kind=kind))
    return Script(system=system, steps=tuple(steps))


def load_script(path: Path) -> Script:
    """Read and validate a script file.

    pydantic-core's JSON parser stops at 200 levels of nesting, where
    ``json.loads`` would raise RecursionError.
    """
    from pydantic_core import from_json

    try:
        raw = read_limited(Path(path), MAX_SCRIPT_BYTES)
    except OSError as e:
        raise ReplayError(f"Cannot read {path}: {e.strerror}.") from None
    except ValueError as e:  # not a regular file, or too large
        raise ReplayError(f"Cannot read {path}: {e}.") from None
    try:
        data = from_json(raw)
    except ValueError as e:  # not UTF-8, not JSON, or nested too deeply
        raise ReplayError(f"{path} is not valid JSON: {e}.") from None
    return parse_script(data)


def run_script(
    lm,
    script: Script,
    *,
    kind: str | CacheKind = "standard",
    settings: GenerationSettings | None = None,
    no_cache: bool = False,
) -> dict:
    """Run every step; with ``no_cache`` each turn starts from an empty cache (the baseline)."""
    session = new_session(lm, kind=kind, system=script.system, settings=settings)
    steps = []
    for step in script.steps:
        entry: dict = {"op": step.op}
        try:
            if step.op in ("send", "regenerate"):
                if no_cache:
                    session.reset()
                # parse_script gave each send its text, and each cache step its kind
                events = (
                    session.send(step.text or "") if step.op == "send" else session.regenerate()
                )
                done = next(e for e in events if isinstance(e, TurnDone))
                entry.update(input=step.text, reply=done.reply, stopped=done.stopped)
                entry.update(done.stats.to_dict())
            elif step.op == "undo":
                session.undo()
            elif step.op == "cache":
                entry["kind"] = step.kind
                entry["rebuilt"] = session.set_kind(step.kind or "")
            elif step.op == "reset":
                session.reset()
            entry["cache_tokens"] = session.cache_tokens
        except (SessionError, CacheKindError) as e:
            entry["error"] = str(e)
        steps.append(entry)
    return {
        "model": lm.model_id,
        "cache_kind": session.kind.name,
        "no_cache": no_cache,
        "turns": steps,
    }


def result_table(result: dict) -> Table:
    """A readable table of a :func:`run_script` result; model text is never markup."""
    title = f"{result['model']} · cache {result['cache_kind']}"
    if result["no_cache"]:
        title += " · no cache (baseline)"
    table = Table(title=title)
    columns = (
        "#",
        "step",
        "prompt",
        "reused",
        "eval",
        "eval s",
        "ttft s",
        "gen",
        "tok/s",
        "cache",
        "KiB",
    )
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True, min_width=len(name))
    table.add_column("reply / note", no_wrap=True, overflow="ellipsis", max_width=40)
    for i, t in enumerate(result["turns"], 1):
        if "prompt_tokens" in t:
            numbers = [
                str(t["prompt_tokens"]),
                str(t["reused_tokens"]),
                str(t["evaluated_tokens"]),
                f"{t['prompt_eval_s']:.3f}",
                f"{t['ttft_s']:.3f}",
                str(t["generated_tokens"]),
                f"{t['gen_tps']:.0f}",
                str(t["cache_tokens"]),
                f"{t['cache_bytes'] / 1024:.0f}",
            ]
        else:
            numbers = [""] * 7 + [str(t.get("cache_tokens", "")), ""]
        note = t.get("error") or t.get("reply") or t.get("kind") or ""
        if t.get("rebuilt"):
            note = f"(rebuilt: {t['rebuilt']}) {note}"
        table.add_row(str(i), t["op"], *numbers, Text(printable(note).replace("\n", "↵")))
    return table
