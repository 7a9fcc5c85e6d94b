"""``kvchat bench``: every section of :mod:`kvchat.bench` in one run, its phases shown as
they go (a bar over the phases, the current step, the time taken); Ctrl-C ends it at
once and prints what was measured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from .common import app, load_or_exit


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
            "--quick", help="A short run (about 3 minutes on 2 cores): smaller article and sweep."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print every figure as JSON.")] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write a Markdown report to this file.")
    ] = None,
) -> None:
    """Measure start-up and the prompt cache: turns with and without it, history sweep,
    cache kinds, save/load, BLAS. Ctrl-C stops it and prints what was measured."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvchat.bench import PHASES, print_tables, run_bench, to_markdown

    started = time.perf_counter()
    lm = load_or_exit(model)
    err = Console(stderr=True)
    with Progress(
        TextColumn("bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=err,
    ) as progress:
        phases = progress.add_task("", total=len(PHASES))
        result = run_bench(
            model,
            quick=quick,
            lm=lm,
            load_s=time.perf_counter() - started,
            log=lambda msg: progress.console.print(msg, markup=False, highlight=False),
            on_phase=lambda i, name: progress.update(phases, completed=i, description=name),
        )
        if "interrupted" not in result:
            progress.update(phases, completed=len(PHASES), description="done")
    if "interrupted" in result:
        err.print(
            f"kvchat: stopped in {result['interrupted']}; what was measured before it follows.",
            markup=False,
            highlight=False,
        )
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        from kvchat.atomic import write_atomic

        write_atomic(out, to_markdown(result).encode("utf-8"))
    if as_json:
        typer.echo(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print_tables(result)
    if "interrupted" in result:
        raise typer.Exit(130)
