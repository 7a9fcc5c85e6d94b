"""``kvchat doctor``: what kvchat runs on (versions, device, BLAS, directories), how a
model's weights are held and which paths compute it, printed as each is known; and with
``--batch``, whether replies decoded together are the replies alone."""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version as package_version
from typing import Annotated, Any

import typer

import kvchat
from kvchat import blas, locations
from kvchat.safety import dumps_json

from .common import app, build_progress, fail, load_or_exit


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
    probe: Annotated[
        bool, typer.Option(help="Measure the device's float32 matmul speed (seconds).")
    ] = True,
) -> None:
    """Show versions, the MLX device, the BLAS, kvchat's directories, how a model's weights
    are held, the CPU fast path it gets and the path that decodes its batches, and a
    measured matmul speed: each line as soon as it is known, the slow ones last."""
    if batch:
        _doctor_batch(model, rounds, as_json)
        return
    if as_json:
        typer.echo(json.dumps(dict(_doctor_report(model, probe)), indent=2))
        return
    width = len("batch_decoding")  # the longest key
    for key, value in _doctor_report(model, probe):
        typer.echo(f"{key:<{width}}  {value}")


def _doctor_report(model: str | None, probe: bool) -> Iterator[tuple[str, Any]]:
    """The report's lines in order: what is known at once first, then the model (loading
    it takes seconds), then the matmul probe (seconds more), which ``probe`` may skip."""
    import mlx.core as mx

    yield from {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "kvchat": kvchat.__version__,
        "mlx": mx.__version__,  # type: ignore[attr-defined]  # mlx.core's stubs leave it out
        "mlx-lm": package_version("mlx-lm"),
        "textual": package_version("textual"),
        **_device_report(),
        "blas": blas.describe(),
        "blas_status": blas.info.status,
        "data_dir": str(locations.data_dir()),
        "config_dir": str(locations.config_dir()),
        "cache_dir": str(locations.cache_dir()),
    }.items()
    yield from _model_report(model).items()
    if probe:
        yield "matmul_gflops", round(_matmul_gflops(), 1)


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
    """For ``spec`` (the config's model when None): how its weights are held, whether it
    gets the CPU fast path and what it runs through numpy, or why not; and which path
    decodes its batches, and why."""
    from kvchat.config import ConfigError, load_config
    from kvchat.engine.generation.paths import decoding_path
    from kvchat.engine.models.model import ModelLoadError, load_model

    try:
        spec = spec or load_config().model
        lm = load_model(spec, build_progress(spec))  # a first use's build says so
    except (ConfigError, ModelLoadError) as exc:
        unknown = f"{spec}: unknown, the model could not be loaded ({exc})"
        return {"weights": unknown, "cpu_fastpath": unknown, "batch_decoding": unknown}
    return {
        "weights": f"{spec}: {lm.weights}",
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
