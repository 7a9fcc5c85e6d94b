"""OpenBLAS is preloaded before mlx on Linux by kvchat's entry point, unless turned off;
importing kvchat loads nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvchat import blas

pytestmark = pytest.mark.cpu_only

PROBE = """
import json
from kvchat import blas
blas.preload()
import mlx.core
maps = open("/proc/self/maps").read()
print(json.dumps({"status": blas.info.status, "path": blas.info.path,
                  "mapped": "openblas" in maps, "describe": blas.describe()}))
"""

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def probe(**env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**environment, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@linux_only
def test_preload_loads_openblas():
    result = probe()
    if result["status"] == "not-found":
        pytest.skip("libopenblas0-pthread is not installed here")
    assert result["status"] == "loaded"
    assert result["mapped"]
    assert os.path.isfile(result["path"])
    assert result["path"] in result["describe"]


@linux_only
def test_kvchat_no_blas_turns_it_off():
    result = probe(KVCHAT_NO_BLAS="1")
    assert (result["status"], result["path"], result["mapped"]) == ("disabled", None, False)
    assert "KVCHAT_NO_BLAS" in result["describe"]


@linux_only
def test_explicit_path_that_fails_falls_back_and_says_so(tmp_path):
    bogus = tmp_path / "libnothing.so"
    bogus.write_bytes(b"not a library")
    result = probe(KVCHAT_BLAS=str(bogus))
    assert result["status"] in ("loaded", "not-found")
    assert "KVCHAT_BLAS" in result["describe"]


def test_too_late_when_mlx_came_first():
    code = "import mlx.core; from kvchat import blas; print(blas.preload().status)"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True
    )
    expected = "too-late" if sys.platform.startswith("linux") else "not-linux"
    assert out.stdout.strip() == expected


def test_blas_module_does_not_import_mlx():
    code = "import sys; from kvchat import blas; blas.preload(); print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_importing_kvchat_loads_nothing_the_entry_point_decides():
    """``import kvchat`` (and its CLI package) leaves the BLAS alone; ``kvchat --version``,
    through the console script's function, has decided it before mlx is imported."""
    code = (
        "import sys, kvchat, kvchat.cli; from kvchat import blas; "
        "print(blas.info.status, 'mlx.core' in sys.modules)"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "pending False"
    entry = "from kvchat.cli import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", entry, "--version"],
        env={**environment, "KVCHAT_NO_BLAS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    want = "mlx's bundled reference BLAS (KVCHAT_NO_BLAS=1)"
    if not sys.platform.startswith("linux"):
        want = "platform BLAS (preloading is only needed on Linux)"
    assert out.stdout.splitlines()[2] == f"BLAS: {want}"


def test_describe_is_one_line():
    assert "\n" not in blas.describe()


@linux_only
def test_openblas_threads_sleep_between_calls_unless_the_user_says_otherwise():
    """Set before mlx and numpy load their OpenBLAS; a value the user gave is kept."""
    script = (
        "import os; from kvchat import blas; blas.preload(); import numpy; "
        "print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    )
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for env, want in (
        (base, blas.THREAD_TIMEOUT),
        ({**base, "OPENBLAS_THREAD_TIMEOUT": "20"}, "20"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want
