"""The bench's report: the machine and the run, then every table, as Markdown or as
Rich tables."""

from __future__ import annotations

from typing import Any

from .tables import tables


def _machine_lines(result: dict[str, Any]) -> list[tuple[str, str]]:
    m, model = result["machine"], result["model"]
    return [
        (
            "CPU",
            f"{m['cpu']}, {m['cores']} cores"
            + (f", {m['memory_bytes'] / 2**30:.0f} GiB" if m["memory_bytes"] else ""),
        ),
        ("mlx", f"{m['mlx']} (mlx-lm {m['mlx_lm']}), device {m['device']}"),
        ("BLAS", m["blas"]),
        ("platform", f"{m['platform']}, Python {m['python']}, kvchat {m['kvchat']}"),
        (
            "model",
            f"{model['id']} ({model['parameters'] / 1e6:,.0f}M parameters, {model['dtype']}, "
            f"fingerprint {model['fingerprint']})",
        ),
        (
            "run",
            f"{m['date']}, {'quick' if result['quick'] else 'full'}, "
            + (f"stopped by Ctrl-C in {result['interrupted']}, " if "interrupted" in result else "")
            + f"{result['total_s']:.0f} s, load average (1/5/15 min) at start "
            f"{m['load_average_at_start']}, at end {m.get('load_average_at_end')}",
        ),
    ]


def to_markdown(result: dict[str, Any]) -> str:
    lines = ["# kvchat bench", ""]
    lines += [f"- **{k}**: {v}" for k, v in _machine_lines(result)]
    for title, headers, rows, note in tables(result):
        lines += [
            "",
            f"## {title}",
            "",
            "| " + " | ".join(headers) + " |",
            "|" + "|".join("---" for _ in headers) + "|",
        ]
        lines += [
            "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows
        ]
        if note:
            lines += ["", note]
    return "\n".join(lines) + "\n"


def print_tables(result: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = Table.grid(padding=(0, 2))
    for k, v in _machine_lines(result):
        head.add_row(f"[bold]{k}[/]", v)
    console.print(head)
    for section in tables(result):
        console.print(rich_table(*section))


def rich_table(title: str, headers: list[str], rows: list[list[str]], note: str | None):
    """One section as a Rich table: the first column left-aligned, figures right."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=note, caption_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table
