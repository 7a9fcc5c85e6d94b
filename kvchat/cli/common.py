"""What every kvchat command shares: the Typer app, errors in one sentence, model loading, text repair."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvchat.safety import printable
from kvchat.settings import FLAGS

from .typed import Typer

if TYPE_CHECKING:
    from kvchat.engine.models.model import LoadedModel

SHARDED_COMMANDS = ("ask", "replay")
SHARDED_ONLY = (
    "A sharded run runs the TUI (`kvchat launch -n N -- [options]`; mlx.launch gives rank 0 "
    "no terminal), `kvchat ask` and `kvchat replay`; serve, bench and the other commands "
    "run on one machine."
)
RANK0_FAILED = "kvchat (rank 0): the run failed: "  # kvchat launch drops it if a follower died

app = Typer(
    name="kvchat",
    help="A terminal chat for local LLMs on MLX with a live KV cache per conversation.",
    add_completion=False,
    pretty_exceptions_enable=False,
)


def setting_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``command`` a ``--name`` option for each setting kvchat/settings.py marks as a
    flag (``--temp``, ``--top-k``, ...); it receives them as ``flags``, a dict by setting
    name with None for an option not given. The values are checked where they are applied
    (``kvchat.settings.apply_overrides``)."""
    signature = inspect.signature(command, eval_str=True)
    kept = [p for p in signature.parameters.values() if p.name != "flags"]
    added = [
        inspect.Parameter(
            s.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[s.type | None, typer.Option(s.option, help=s.help)],
        )
        for s in FLAGS
    ]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        flags = {s.name: kwargs.pop(s.name, None) for s in FLAGS}
        return command(*args, flags=flags, **kwargs)

    run.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
    return run


def load_or_exit(spec: str) -> LoadedModel:
    """Load a model, or print the one-line reason to stderr and exit with status 2. A demo
    model built on its first use says so on stderr, with the disk it takes and how far
    its build and load are (:func:`build_progress`)."""
    from kvchat.engine.models.model import ModelLoadError, load_model
    from kvchat.engine.sharding import driver, link

    try:
        return driver.load_model(spec) if link.current() else load_model(spec, build_progress(spec))
    except ModelLoadError as exc:
        typer.echo(f"kvchat: {printable(str(exc))}", err=True)
        raise typer.Exit(2) from None


def build_progress(spec: str) -> Callable[[int, int, str], None] | None:
    """For a demo model whose first use builds its weights (else None): say so on stderr,
    and return the printer of its build's and load's progress there, whose first line
    says the bytes the weights take. On a terminal the count goes up in place; elsewhere
    each stage prints its first and last count."""
    from kvchat.engine.models.demo import builds_weights, demo_path, parse_demo_spec

    if not builds_weights(spec):
        return None
    folder = demo_path(parse_demo_spec(spec) or spec)
    typer.echo(f"kvchat: building {spec} on its first use, into {folder}", err=True)
    terminal = sys.stderr.isatty()

    def show(done: int, total: int, what: str) -> None:
        line = f"kvchat: {spec}: {done:,} of {total:,} {what}"
        if terminal:  # over the last count, the line's rest cleared
            typer.echo(f"\r{line}\x1b[K", err=True, nl=done == total)
        elif done in (0, total):
            typer.echo(line, err=True)

    return show


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``kvchat: message`` on stderr (made safe: it may quote a file); return the Exit."""
    typer.echo(f"kvchat: {printable(message)}", err=True)
    return typer.Exit(code)


def as_text(raw: bytes | str, what: str) -> str:
    """``raw`` (stdin's bytes, or an argument holding bytes Python could not decode) as
    text: bytes that are not UTF-8 become U+FFFD, and stderr says so."""
    if isinstance(raw, str):
        text = raw
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        typer.echo(
            f"kvchat: {what} is not valid UTF-8; the bytes that are not were replaced with U+FFFD.",
            err=True,
        )
        return raw.decode("utf-8", "replace")
