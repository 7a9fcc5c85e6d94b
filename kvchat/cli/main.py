"""The ``kvchat`` command itself: the TUI, ``--version``, ``replay``, ``bench`` and ``eval-cache``."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

import kvchat
from kvchat import blas
from kvchat.safety import dumps_json

if TYPE_CHECKING:
    pass

from .common import (
    RANK0_FAILED,
    SHARDED_COMMANDS,
    SHARDED_ONLY,
    app,
    as_text,
    fail,
    load_or_exit,
    setting_options,
)


def _print_version(value: bool) -> None:
    """Print kvchat's, MLX's and the BLAS's versions without importing MLX (or anything
    heavy): ``kvchat doctor`` loads MLX and says which device it runs on."""
    if not value:
        return
    typer.echo(f"kvchat {kvchat.__version__}")
    typer.echo(f"mlx {_installed('mlx') or 'not installed'}, backend {_mlx_backends()}")
    typer.echo(f"BLAS: {blas.describe()}")
    raise typer.Exit()


def _installed(name: str) -> str | None:
    try:
        return package_version(name)
    except PackageNotFoundError:
        return None


def _mlx_backends() -> str:
    """The MLX backend packages installed (mlx-cpu, mlx-metal, mlx-cuda-…), from their
    metadata; on macOS mlx itself carries Metal."""
    found = [name for name in BACKEND_PACKAGES if _installed(name)]
    if not found and platform.system() == "Darwin":
        return "metal"
    return ", ".join(BACKEND_PACKAGES[name] for name in found) or "none found"


BACKEND_PACKAGES = {
    "mlx-cpu": "cpu",
    "mlx-metal": "metal",
    "mlx-cuda": "cuda",
    "mlx-cuda-12": "cuda 12",
    "mlx-cuda-13": "cuda 13",
}


@app.callback(invoke_without_command=True)
@setting_options
def root(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="demo, demo:<shape> (either may end in @q4, @q8 or @bf16), a Hugging Face id or a "
            "folder (default: the config's).",
        ),
    ] = None,
    cache: Annotated[
        str | None, typer.Option(help="Cache kind, e.g. standard, quantized:8, rotating:4096.")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System prompt for new sessions.")] = None,
    resume: Annotated[str | None, typer.Option(help="Open this saved session.")] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Show versions and exit."
        ),
    ] = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Chat with a local model in the terminal (the default when no command is given)."""
    if "MLX_RANK" in os.environ and ctx.invoked_subcommand not in SHARDED_COMMANDS:
        from kvchat.engine.sharding.link import current  # (mlx-lm: under mlx.launch)

        if current():
            raise fail(SHARDED_ONLY, 2)
    if ctx.invoked_subcommand is not None:
        return
    from kvchat.tui.run import run_tui

    if system is not None:
        system = as_text(system, "--system")
    status = run_tui(model=model, cache=cache, system=system, resume=resume, flags=flags)
    if status:
        raise typer.Exit(status)


@app.command()
def replay(
    script: Annotated[Path, typer.Argument(help='A JSON script: {"system": ..., "turns": [...]}.')],
    model: Annotated[str, typer.Option("--model", "-m", help="Model to run it on.")] = "demo",
    cache: Annotated[str, typer.Option(help="Cache kind to start with.")] = "standard",
    max_tokens: Annotated[int, typer.Option(help="Longest reply, in tokens.")] = 64,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Baseline: every turn from an empty cache.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Run a scripted conversation through one session and show what each turn cost."""
    from rich.console import Console

    from kvchat.cli.replay import ReplayError, load_script, result_table, run_script
    from kvchat.engine.caches.kinds import CacheKindError, parse_kind
    from kvchat.engine.conversation.session import GenerationSettings

    try:
        parsed = load_script(script)
        kind = parse_kind(cache)
    except (ReplayError, CacheKindError) as exc:
        raise fail(str(exc), 2) from None
    if max_tokens < 1:
        raise fail("--max-tokens must be at least 1.", 2)
    lm = load_or_exit(model)
    try:
        result = run_script(
            lm,
            parsed,
            kind=kind,
            no_cache=no_cache,
            settings=GenerationSettings(max_tokens=max_tokens),
        )
    except CacheKindError as exc:
        raise fail(str(exc), 2) from None
    if as_json:
        typer.echo(dumps_json(result, indent=2))  # replies are model output
    else:
        Console().print(result_table(result))


@app.command("eval-cache")
def eval_cache(
    model: Annotated[str, typer.Option("--model", "-m", help="Model to measure.")] = "demo",
    kinds: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated cache kinds to compare with standard (default: every "
            "quantized kind the kind picker offers)."
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="At most this many held-out tokens.")] = 1024,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """KL divergence, top-1 agreement and perplexity of each cache kind against standard
    on a held-out text (llama.cpp-style)."""
    from rich.console import Console

    from kvchat.bench.fidelity import DEFAULT_KINDS, evaluate
    from kvchat.bench.report import rich_table
    from kvchat.bench.tables import fidelity_table
    from kvchat.engine.caches.kinds import CacheKindError, parse_kind

    given = DEFAULT_KINDS[1:] if kinds is None else kinds.split(",")
    names = [k for k in given if k.strip()]
    try:
        names = [parse_kind(k).name for k in names]
    except CacheKindError as exc:
        raise fail(str(exc), 2) from None
    if max_tokens < 1:
        raise fail("--max-tokens must be at least 1.", 2)
    lm = load_or_exit(model)
    try:
        rows = [f.as_dict() for f in evaluate(lm, names, max_tokens=max_tokens)]
    except (CacheKindError, ValueError) as exc:
        raise fail(str(exc), 2) from None
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    Console().print(rich_table(*fidelity_table(rows)))


def main(on_token: Callable[[int], object] | None = None) -> None:
    """Console-script entry point. Under ``mlx.launch`` (``kvchat launch``), rank 0 runs the
    command and the other ranks follow it (kvchat/engine/sharding/driver.py); a follower
    passes ``on_token`` to :func:`~kvchat.runtime.sharded.follower.follow`. A rank joins the ring
    before it imports mlx-lm (kvchat/engine/sharding/link.py says why).

    It first routes mlx's CPU matmul to OpenBLAS (:func:`kvchat.blas.preload`), which
    must come before anything imports mlx.core: nothing imported so far does."""
    blas.preload()
    if "MLX_RANK" not in os.environ:  # not started by mlx.launch
        app()
        return
    from kvchat.engine.sharding.link import start

    from .ring import READY, READY_ENV

    if os.environ.get(READY_ENV):  # a follower kvchat/cli/ring.py started: rank 0 waits
        print(READY, flush=True)
    link = start()
    if link is None:
        app()
        return
    if link.rank:
        from kvchat.runtime.sharded.follower import follow

        sys.exit(follow(link, on_token))
    try:
        app()
    except Exception as exc:  # most often a collective failing because another rank died
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        typer.echo(f"{RANK0_FAILED}{first}", err=True)
        raise SystemExit(1) from None
    except SystemExit as exc:
        if not link.broken:  # the followers wait for the next operation: tell them it is the end
            link.broadcast({"op": "end"})
        elif exc.code in (0, None):
            raise SystemExit(1) from None  # a follower mid-turn: mlx.launch must end it
        raise
