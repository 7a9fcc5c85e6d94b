"""``kvchat models``: the model folders kvchat knows on this machine, their sizes, and
removing one: the demo models it built (``--model demo…``, in the cache dir) and the
models downloaded into the Hugging Face cache (``--model ORG/NAME``)."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer

from kvchat import locations
from kvchat.safety import dumps_json, printable
from kvchat.units import human_bytes

from .common import app, fail
from .typed import Typer

models_app = Typer(
    help="List the demo models kvchat built and the downloaded ones, and remove one.",
    no_args_is_help=True,
)
app.add_typer(models_app, name="models")

VARIANTS = ("q4", "q8", "bf16")  # a demo folder's suffix before its build version


@dataclass(frozen=True)
class Folder:
    """One model folder: ``name`` is what ``--model`` and ``models rm`` take."""

    name: str
    source: str  # "demo" (built by kvchat) or "hugging face"
    size_bytes: int
    path: Path
    note: str = ""  # e.g. an older demo build that nothing uses any more


def _size(folder: Path) -> int:
    """Bytes under ``folder``, links not followed (the Hugging Face cache links its
    snapshots to its blobs: each counted once, as a blob)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def _demo_spec(folder: str, current: str) -> tuple[str, str]:
    """The ``--model`` value a demo folder was built for, and a note if it is an older
    build (``qwen2.5-0.5b-q4-v3`` → ``demo:qwen2.5-0.5b@q4``)."""
    shape, _, version = folder.rpartition("-")
    note = "" if version == current else f"an older build ({version}): nothing uses it"
    variant = next((v for v in VARIANTS if shape.endswith(f"-{v}")), None)
    if variant is not None:
        shape = shape.removesuffix(f"-{variant}")
    spec = "demo" if shape == "demo" else f"demo:{shape}"
    return spec + (f"@{variant}" if variant else ""), note


def hub_cache() -> Path:
    """Where Hugging Face's hub keeps downloads (``HF_HUB_CACHE``, ``HF_HOME``/hub, or
    ``~/.cache/huggingface/hub``)."""
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "huggingface"
    )
    return Path(home) / "hub"


def known_folders() -> list[Folder]:
    """The demo builds (older builds marked), then the Hugging Face cache's models."""
    from kvchat.engine.models.demo import BUILD_VERSION

    found = []
    demos = locations.models_dir()
    for path in sorted(demos.iterdir()) if demos.is_dir() else []:
        if path.is_dir() and not path.is_symlink() and not path.name.startswith("."):
            spec, note = _demo_spec(path.name, BUILD_VERSION)
            found.append(Folder(spec, "demo", _size(path), path, note))
    hub = hub_cache()
    for path in sorted(hub.glob("models--*")) if hub.is_dir() else []:
        if path.is_dir() and not path.is_symlink():
            name = path.name.removeprefix("models--").replace("--", "/")
            found.append(Folder(name, "hugging face", _size(path), path))
    return found


@models_app.command("list")
def models_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The model folders on this machine with their sizes: demo builds and downloads."""
    found = known_folders()
    if as_json:
        typer.echo(dumps_json([{**asdict(f), "path": str(f.path)} for f in found], indent=2))
        return
    if not found:
        typer.echo("No model folders yet: `kvchat --model demo` builds the demo model.")
        return
    raw = [("NAME", "FROM", "SIZE", "")] + [
        (f.name, f.source, human_bytes(f.size_bytes), f.note) for f in found
    ]
    rows = [tuple(printable(c, one_line=True) for c in r) for r in raw]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    total = sum(f.size_bytes for f in found)
    typer.echo(f"{len(found)} folder(s), {human_bytes(total)} in all.")


@models_app.command("rm")
def models_rm(
    name: Annotated[str, typer.Argument(help="A name as `kvchat models list` shows it.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask first.")] = False,
) -> None:
    """Remove a model folder (a demo is built again on its next use; a download is
    downloaded again). Every folder of that name goes: an older demo build too."""
    chosen = [f for f in known_folders() if f.name == name]
    if not chosen:
        raise fail(f"No model folder named {name!r}; `kvchat models list` shows them.", 2)
    size = sum(f.size_bytes for f in chosen)
    where = ", ".join(str(f.path) for f in chosen)
    if not yes and not typer.confirm(f"Remove {name} ({human_bytes(size)}: {where})?"):
        raise typer.Exit(1)
    for folder in chosen:
        if folder.path.is_symlink():  # found a folder, then a link: never follow it
            raise fail(f"{folder.path} became a symbolic link; left as it is.")
        shutil.rmtree(folder.path)
    typer.echo(f"Removed {name} ({human_bytes(size)}).")
