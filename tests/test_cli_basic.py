"""The kvchat command: --version, doctor, and model errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from typer.testing import CliRunner

import kvchat
from kvchat.cli import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0] == f"kvchat {kvchat.__version__}"
    assert lines[1].startswith("mlx ")
    assert lines[2].startswith("BLAS: ")


def test_doctor_json(kvchat_dirs):
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0
    report = json.loads(result.output)
    assert report["kvchat"] == kvchat.__version__
    assert report["device"] in ("cpu", "gpu")
    assert report["backend"] in (("cpu",) if report["device"] == "cpu" else ("cuda", "metal"))
    assert report["backends"] in [
        f"metal {m}, cuda {c}" for m in ("yes", "no") for c in ("yes", "no")
    ]
    info = mx.device_info()
    assert report["device_name"] == info["device_name"]
    memory = info.get("total_memory", info.get("memory_size"))
    assert report["device_memory"] == (f"{memory / 2**30:.1f} GiB" if memory else "not reported")
    assert report["matmul_gflops"] > 0
    assert report["cache_dir"] == kvchat_dirs["KVCHAT_CACHE_DIR"]
    assert report["data_dir"] == kvchat_dirs["KVCHAT_HOME"]


def test_doctor_text():
    """Printed as each line is known: the model's lines after the quick ones, the matmul
    probe last (``--no-probe`` skips it)."""
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0
    keys = [line.split()[0] for line in result.output.splitlines()]
    assert keys[0] == "python" and keys[-1] == "matmul_gflops"
    assert keys.index("cache_dir") < keys.index("weights") < keys.index("batch_decoding")
    quick = runner.invoke(app, ["doctor", "--no-probe"])
    assert quick.exit_code == 0 and "matmul_gflops" not in quick.output
    assert [line.split()[0] for line in quick.output.splitlines()] == keys[:-1]


def test_bad_model_is_one_line_and_exit_2(tmp_path):
    """Run as a real process: stderr holds one line, no traceback."""
    missing = tmp_path / "missing"
    result = subprocess.run(
        [Path(sys.executable).with_name("kvchat"), "ask", "--model", str(missing), "hello"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"kvchat: Could not load model '{missing}'")
    assert "Traceback" not in result.stderr
