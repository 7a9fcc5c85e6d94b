"""kvchat's optional native kernels: ``rows`` (rows.c, a few rows' products reading the
weights once), ``fused`` (fused.c, every row's attention in one call, SwiGLU in one
pass) and ``packed`` (packed.c, products with packed and 16-bit weights as stored).

pyproject.toml builds them at install where a C compiler is found; where none was, or
with ``KVCHAT_NATIVE=0`` (to compare), the numpy step computes the same without them.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

# The kernels' OpenMP threads sleep while they wait rather than spin (libgomp reads this
# when it loads: with the first kernel module imported, in built()); their number is
# libgomp's default, the cores this process may run on (its affinity mask), and the
# kernels hand work out as threads come free. On this 2-core machine with other work
# running, qwen2.5-0.5b's q4 projections for one token took 69-82 ms passive, 68-571 ms
# spinning (libgomp's default), 38-186 ms spinning 10000 rounds.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ENV = "KVCHAT_NATIVE"  # "0": kvchat's native kernels off, numpy and its BLAS instead
# each kernel module, and what it does in the numpy step, for kvchat doctor
KERNELS = {
    "rows": "weights read once for 2 to 16 rows",
    "fused": "fused attention",
    "packed": "packed and 16-bit weights widened in registers",
}


@functools.cache
def built(name: str) -> ModuleType | None:
    """The native module ``kvchat.engine.cpu.<name>``, or None where it was not built."""
    try:
        return importlib.import_module(f"kvchat.engine.cpu.{name}")
    except ImportError:  # no C compiler at install (pyproject.toml's ext-modules)
        return None


def module(name: str) -> ModuleType | None:
    """:func:`built`'s module, or None where it was not built or is switched off."""
    return None if os.environ.get(ENV, "1") == "0" else built(name)


def route() -> str:
    """Which native kernels the numpy step uses, in a phrase for ``kvchat doctor``."""
    used = [what for name, what in KERNELS.items() if module(name) is not None]
    if used:
        return "kvchat's native kernels: " + ", ".join(used)
    if any(built(name) is not None for name in KERNELS):
        return f"numpy and its BLAS ({ENV}=0)"
    return "numpy and its BLAS (kvchat's native kernels were not built: no C compiler at install)"
