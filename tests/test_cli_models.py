"""``kvchat models``: the demo builds and the Hugging Face cache's models with their sizes,
an older demo build marked, and removing one."""

from __future__ import annotations

from typer.testing import CliRunner

from kvchat import locations
from kvchat.cli import app
from kvchat.engine.models.demo import BUILD_VERSION, demo_path
from kvchat.units import human_bytes

runner = CliRunner()


def _file(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_models_lists_sizes_and_removes_one(demo_model, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    blob = hub / "models--mlx-community--Tiny-4bit" / "blobs" / "abc"
    _file(blob, 3000)
    snapshot = blob.parent.parent / "snapshots" / "main" / "model.safetensors"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(blob)  # as the hub lays it out: counted once
    old = locations.models_dir() / "demo-v0"
    _file(old / "model.safetensors", 5000)

    listed = runner.invoke(app, ["models", "list"])
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line for line in listed.output.splitlines()}
    assert "mlx-community/Tiny-4bit" in rows and "2.9 KiB" in rows["mlx-community/Tiny-4bit"]
    current = demo_path("demo")
    size = sum(p.stat().st_size for p in current.rglob("*") if p.is_file())
    demo_rows = [line for line in listed.output.splitlines() if line.startswith("demo ")]
    assert any(human_bytes(size) in r and "older" not in r for r in demo_rows)
    assert any("4.9 KiB" in r and "an older build (v0)" in r for r in demo_rows)
    assert current.name.endswith(BUILD_VERSION)

    gone = runner.invoke(app, ["models", "rm", "mlx-community/Tiny-4bit", "--yes"])
    assert gone.exit_code == 0, gone.output
    assert not (hub / "models--mlx-community--Tiny-4bit").exists() and current.exists()

    unknown = runner.invoke(app, ["models", "rm", "nope"])
    assert unknown.exit_code == 2 and "No model folder named 'nope'" in unknown.output

    kept = runner.invoke(app, ["models", "rm", "demo"], input="n\n")  # asked, and said no
    assert kept.exit_code == 1 and current.exists() and old.exists()
