"""The ``kvchat`` command itself: the TUI, ``--version``, ``doctor``, ``replay`` and ``bench``."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib.metadata import version as package_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

import kvchat
from kvchat import blas, locations
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
    if not value:
        return
    import mlx.core as mx

    from kvchat.engine.caches import fit

    typer.echo(f"kvchat {kvchat.__version__}")
    version = mx.__version__  # type: ignore[attr-defined]  # mlx.core's stubs leave it out
    typer.echo(f"mlx {version}, device {fit.device()}")
    typer.echo(f"BLAS: {blas.describe()}")
    raise typer.Exit()


@app.callback(invoke_without_command=True)
@setting_options
def root(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="demo, demo:<shape> (either may end in @q4 or @q8), a Hugging Face id or a "
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
        from kvchat.engine.distributed.link import current  # (mlx-lm: under mlx.launch)

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
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="The model whose CPU fast path to show (default: the config's)."
        ),
    ] = None,
    batch: Annotated[
        bool,
        typer.Option(
            "--batch",
            help="Instead: decode conversations together on the model and check that each "
            "reply is the reply alone, on each path its batches can take.",
        ),
    ] = False,
    rounds: Annotated[int, typer.Option(help="With --batch: rounds of 4 conversations.")] = 2,
) -> None:
    """Show versions, the MLX device, the BLAS, the CPU fast path a model gets, the path that
    decodes its batches, and kvchat's directories."""
    if batch:
        _doctor_batch(model, rounds, as_json)
        return
    report = _doctor_report(model)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    width = max(map(len, report))
    for key, value in report.items():
        typer.echo(f"{key:<{width}}  {value}")


def _doctor_report(model: str | None) -> dict[str, Any]:
    import mlx.core as mx

    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "kvchat": kvchat.__version__,
        "mlx": mx.__version__,  # type: ignore[attr-defined]  # mlx.core's stubs leave it out
        "mlx-lm": package_version("mlx-lm"),
        "textual": package_version("textual"),
        **_device_report(),
        "blas": blas.describe(),
        "blas_status": blas.info.status,
        **_model_report(model),
        "matmul_gflops": round(_matmul_gflops(), 1),
        "data_dir": str(locations.data_dir()),
        "config_dir": str(locations.config_dir()),
        "cache_dir": str(locations.cache_dir()),
    }


def _doctor_batch(spec: str | None, rounds: int, as_json: bool) -> None:
    """``doctor --batch``: batched = alone on the model (kvchat/batch_check.py); exit 1 if
    a reply differed."""
    from kvchat.batch_check import check_paths
    from kvchat.config import load_config

    if rounds < 1:
        raise fail("--rounds must be at least 1.", 2)
    lm = load_or_exit(spec or load_config().model)
    checks = check_paths(lm, rounds=rounds)
    if as_json:
        typer.echo(
            dumps_json(
                [
                    {
                        "path": c.path,
                        "replies": len(c.outcomes),
                        "differed": [
                            {"conversation": o.conv.label(), "problems": list(o.problems)}
                            for o in c.differed
                        ],
                    }
                    for c in checks
                ]
            )
        )
    else:
        for check in checks:
            typer.echo("\n".join(check.lines()))
    if any(c.differed for c in checks):
        raise typer.Exit(1)


def _model_report(spec: str | None) -> dict[str, str]:
    """For ``spec`` (the config's model when None): whether it gets the CPU fast path and
    what it runs through numpy, or why not; and which path decodes its batches, and why."""
    from kvchat.config import ConfigError, load_config
    from kvchat.engine.generation.batch import decoding_path
    from kvchat.engine.models.model import ModelLoadError, load_model

    try:
        spec = spec or load_config().model
        lm = load_model(spec)
    except (ConfigError, ModelLoadError) as exc:
        unknown = f"{spec}: unknown, the model could not be loaded ({exc})"
        return {"cpu_fastpath": unknown, "batch_decoding": unknown}
    return {
        "cpu_fastpath": f"{spec}: {lm.fast_path_line()}",
        "batch_decoding": f"{spec}: {decoding_path(lm)}",
    }


def _device_report() -> dict[str, Any]:
    """The default device, the backend that runs on it, and what that backend says of it."""
    import mlx.core as mx

    from kvchat.engine.caches import fit

    info = mx.device_info()
    memory = info.get("total_memory", info.get("memory_size"))
    return {
        "device": _device_name(),
        "backend": fit.backend(),
        "backends": ", ".join(
            f"{name} {'yes' if up else 'no'}"
            for name, up in (("metal", mx.metal.is_available()), ("cuda", mx.cuda.is_available()))
        ),
        "device_name": str(info.get("device_name", "not reported")),
        "device_memory": f"{memory / 2**30:.1f} GiB" if isinstance(memory, int) else "not reported",
    }


def _device_name() -> str:
    import mlx.core as mx

    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def _matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul speed on the default device, n×n by n×n."""
    import mlx.core as mx

    a = mx.random.normal((n, n))
    mx.eval(a @ a)  # warm up
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ a)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


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

    from kvchat.engine.caches.kinds import CacheKindError, parse_kind
    from kvchat.engine.conversation.session import GenerationSettings
    from kvchat.replay import ReplayError, load_script, result_table, run_script

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


@app.command()
def bench(
    model: Annotated[
        str,
        typer.Option(
            "--model", "-m", help="Model to measure (default: a shape-true Qwen2.5-0.5B)."
        ),
    ] = "demo:qwen2.5-0.5b",
    quick: Annotated[
        bool,
        typer.Option(
            "--quick", help="A short run: history sweep up to 2k tokens, smaller article."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print every figure as JSON.")] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write a Markdown report to this file.")
    ] = None,
) -> None:
    """Measure the prompt cache: turns with and without it, history sweep, cache kinds, save/load, BLAS."""
    from kvchat.bench import print_tables, run_bench, to_markdown

    started = time.perf_counter()
    lm = load_or_exit(model)
    result = run_bench(
        model,
        quick=quick,
        lm=lm,
        load_s=time.perf_counter() - started,
        log=lambda msg: typer.echo(msg, err=True),
    )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        from kvchat.atomic import write_atomic

        write_atomic(out, to_markdown(result).encode("utf-8"))
    if as_json:
        typer.echo(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print_tables(result)


@app.command("eval-cache")
def eval_cache(
    model: Annotated[str, typer.Option("--model", "-m", help="Model to measure.")] = "demo",
    kinds: Annotated[
        str, typer.Option(help="Comma-separated cache kinds to compare with standard.")
    ] = "quantized:8,quantized:4,rotated:8,rotated:4",
    max_tokens: Annotated[int, typer.Option(help="At most this many held-out tokens.")] = 1024,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """KL divergence, top-1 agreement and perplexity of each cache kind against standard
    on a held-out text (llama.cpp-style)."""
    from rich.console import Console

    from kvchat.bench.fidelity import evaluate
    from kvchat.bench.report import rich_table
    from kvchat.bench.tables import fidelity_table
    from kvchat.engine.caches.kinds import CacheKindError, parse_kind

    names = [k for k in kinds.split(",") if k.strip()]
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
    command and the other ranks follow it (kvchat/engine/distributed/driver.py); a follower
    passes ``on_token`` to :func:`~kvchat.sharded.follower.follow`. A rank joins the ring
    before it imports mlx-lm (kvchat/engine/distributed/link.py says why).

    It first routes mlx's CPU matmul to OpenBLAS (:func:`kvchat.blas.preload`), which
    must come before anything imports mlx.core: nothing imported so far does."""
    blas.preload()
    if "MLX_RANK" not in os.environ:  # not started by mlx.launch
        app()
        return
    from kvchat.engine.distributed.link import start

    from .ring import READY, READY_ENV

    if os.environ.get(READY_ENV):  # a follower kvchat/cli/ring.py started: rank 0 waits
        print(READY, flush=True)
    link = start()
    if link is None:
        app()
        return
    if link.rank:
        from kvchat.sharded.follower import follow

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
