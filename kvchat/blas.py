"""Route mlx's CPU matmul to an optimised BLAS on Linux.

The Linux ``mlx-cpu`` wheel links a reference BLAS (about 5 GFLOP/s for float32
matmul on two cores). Loading OpenBLAS with ``RTLD_GLOBAL`` *before*
``mlx.core`` is imported makes the dynamic linker resolve mlx's ``cblas_sgemm``
to it instead (about 35x faster). This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field

# Debian/Ubuntu's libopenblas0-pthread, by soname first, then by path.
DEFAULT_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


@dataclass
class BlasInfo:
    """What `preload` did: ``status`` is one of loaded, disabled, not-found,
    not-linux, too-late (mlx.core was imported first) or pending."""

    status: str = "pending"
    path: str | None = None
    errors: list[str] = field(default_factory=list)


info = BlasInfo()


# OpenBLAS worker threads spin for about 2^28 cycles after each call before they
# sleep. On the CPU fast path two OpenBLAS libraries (mlx's and numpy's) and mlx's own
# stream thread take turns on the same cores many times a token, and the spinning
# threads delay the next one's work; 2^4 lets them sleep at once. Read by each OpenBLAS
# when it loads, so it is set before mlx and numpy are; a value the user set is kept.
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
THREAD_TIMEOUT = "4"


def preload() -> BlasInfo:
    """Load an optimised BLAS globally, once; return what happened."""
    if info.status != "pending":
        return info
    os.environ.setdefault(THREAD_TIMEOUT_ENV, THREAD_TIMEOUT)
    if not sys.platform.startswith("linux"):
        info.status = "not-linux"
    elif os.environ.get("KVCHAT_NO_BLAS") == "1":
        info.status = "disabled"
    elif "mlx.core" in sys.modules:
        info.status = "too-late"
    else:
        info.status = "not-found"
        for candidate in _candidates():
            try:
                lib = ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
                info.path = _mapped_file(lib)
            except (OSError, AttributeError) as exc:  # missing file, or no cblas_sgemm
                info.errors.append(f"{candidate}: {exc}")
                continue
            info.status = "loaded"
            break
    return info


def describe() -> str:
    """One line for humans: which BLAS mlx's CPU matmul uses and why."""
    explicit = os.environ.get("KVCHAT_BLAS")
    failed = f"; KVCHAT_BLAS={explicit} could not be loaded" if explicit and info.errors else ""
    if info.status == "loaded":
        return f"OpenBLAS preloaded from {info.path}{failed}"
    return {
        "pending": "BLAS not preloaded yet",
        "not-linux": "platform BLAS (preloading is only needed on Linux)",
        "disabled": "mlx's bundled reference BLAS (KVCHAT_NO_BLAS=1)",
        "too-late": "mlx's bundled reference BLAS (mlx.core was imported before kvchat)",
        "not-found": "mlx's bundled reference BLAS, slow: install libopenblas0-pthread "
        f"or set KVCHAT_BLAS to a libopenblas.so path{failed}",
    }[info.status]


def _candidates() -> list[str]:
    explicit = os.environ.get("KVCHAT_BLAS")
    return ([explicit] if explicit else []) + list(DEFAULT_CANDIDATES)


def _mapped_file(lib: ctypes.CDLL) -> str:
    """The file that holds ``lib``'s ``cblas_sgemm``, read from /proc/self/maps."""
    address = ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value or 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *_, path = line.split(maxsplit=5)
            start, end = (int(part, 16) for part in span.split("-"))
            if start <= address < end:
                return path.strip()
    return lib._name
