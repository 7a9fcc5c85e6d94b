"""``python -m kvchat.bench --blas-probe``: one BLAS probe in its own process."""

from __future__ import annotations

import json
import sys

from kvchat import blas

from .blas_speed import blas_probe
from .common import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    """``python -m kvchat.bench --blas-probe --model M --tokens N``: one BLAS probe, JSON out."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvchat.bench")
    parser.add_argument("--blas-probe", action="store_true")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if not args.blas_probe:
        parser.error("use `kvchat bench` for the benchmark; this entry point runs --blas-probe")
    blas.preload()  # as kvchat's own entry point does (KVCHAT_NO_BLAS=1 for the reference)
    print(json.dumps(blas_probe(args.model, args.tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
