"""The native kernels' threads follow the cores actually free (kernels.h's free_threads):
with the cores kept busy by programs of the same priority, a product's parallel region
takes one thread, so that no thread of kvchat's waits awake for a core it does not get."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvchat.engine.cpu import native

pytestmark = pytest.mark.cpu_only


def test_one_thread_while_other_programs_keep_the_cores_busy():
    module = native.built("packed")
    if module is None:
        pytest.skip("kvchat's native kernels were not built (no C compiler at install)")
    cores = len(os.sched_getaffinity(0))
    if cores < 2 or not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("one core, or no schedstat: the kernels take one thread or all alike")
    # twice as many busy processes as cores: this thread gets about half a core
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(2 * cores)]
    try:
        deadline = time.monotonic() + 5
        threads = module.threads()
        while threads != 1 and time.monotonic() < deadline:
            threads = module.threads()  # this thread asks for a core all the while
        assert threads == 1  # within a few looks (LOOK_EVERY: 0.05 s)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
