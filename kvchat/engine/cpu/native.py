"""kvchat's optional native kernels: ``rows`` (rows.c, a few rows' products reading the
weights once), ``fused`` (fused.c, every row's attention in one call, SwiGLU in one
pass) and ``packed`` (packed.c, products with packed and 16-bit weights as stored, and
such a model's decoder layers whole in one call).

pyproject.toml builds them at install where a C compiler is found; where none was, or
with ``KVCHAT_NATIVE=0`` (to compare), the numpy step computes the same without them.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

# The kernels' OpenMP threads wait for the next parallel region awake for 2000 rounds (tens
# of µs: libgomp reads this when it loads, with the first kernel module imported, in
# built()), then sleep. A decoding step starts a region every few tens of µs, and waking a
# sleeping thread took 25-40 µs on a 2-core VM: qwen2.5-0.5b@q4's step 17-18 ms sleeping
# at once, 13.5-14.5 ms awake 1000-3000 rounds (libgomp's default, 300000, ~8 ms, kept a
# core busy between steps). Where other programs keep the cores busy the regions take one
# thread (kernels.h's free_threads: nobody waits awake then). Their number is otherwise
# libgomp's default, the cores this process may run on (its affinity mask), and the
# kernels hand work out as threads come free.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

ENV = "KVCHAT_NATIVE"  # "0": kvchat's native kernels off, numpy and its BLAS instead
# each kernel module, and what it does in the numpy step, for kvchat doctor
KERNELS = {
    "rows": "weights read once for 2 to 16 rows",
    "fused": "fused attention",
    "packed": "packed and 16-bit weights widened in registers, their layers whole in one call",
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
