"""The batched = alone stress harness (:mod:`kvchat.batch_check`) on tiny models of many
families, with random scheduling delays at the core's hand-offs and, optionally, busy
background processes. tests/test_batch_stress.py runs its default size; the long one:

    .venv/bin/python -m tests.batch_stress --long [--load 2] [--families gpt_neox,...]

The delays are the test's own (:class:`Jitter`), never the product's: each reader
sleeps a random while between the events it reads (a client that reads slowly, a
stop or a join landing anywhere in a step), and a staller thread holds the device
gate for random whiles between the core's steps (the core waits there, while the
readers and the joining turns go on)."""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvchat import batch_check
from kvchat.engine.generation.gate import GATE
from kvchat.runtime.pool import SessionPool

# the families of tests/arch_models.py the harness runs (those of SHAPES and BATCHED)
FAMILIES = [
    "gpt_neox",
    "qwen3_moe",
    "qwen2",
    "llama",
    "gemma3_text",  # sliding-window layers
    "mamba",  # recurrent state
    "falcon_h1",
    "lfm2",
    "gemma2",
    "phi3",
]


@dataclass
class Jitter:
    """Random scheduling delays: ``pause`` (for the readers) and :meth:`stalling`."""

    rng: random.Random
    most_s: float = 0.004

    def pause(self) -> None:
        if self.rng.random() < 0.3:
            time.sleep(self.rng.uniform(0.0, self.most_s))

    @contextmanager
    def stalling(self) -> Iterator[None]:
        """While in the block, hold the device gate for random whiles between steps."""
        done = threading.Event()
        rng = random.Random(self.rng.random())

        def stall() -> None:
            while not done.wait(rng.uniform(0.0, 0.01)):
                with GATE.exclusive():
                    time.sleep(rng.uniform(0.0, self.most_s))

        thread = threading.Thread(target=stall, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` background processes spinning at the lowest priority, killed after."""
    spin = ["nice", "-n", "19", sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def stress(
    lm,
    rounds: int,
    seed: int,
    count: int = 4,
    max_tokens: int = 16,
    long_words: int = 260,
    every: int = 0,
) -> list[batch_check.Outcome]:
    """``rounds`` rounds of ``count`` conversations on ``lm`` (one pool, as a server's),
    under :class:`Jitter`; every conversation's outcome (a line on stderr every ``every``
    rounds, if set)."""
    rng = random.Random(seed)
    jitter = Jitter(random.Random(seed + 1))
    pool = SessionPool(ttl_s=None, memory_budget_bytes=None)
    outcomes = []
    with jitter.stalling():
        for _ in range(rounds):
            convs = batch_check.conversations(rng, count, max_tokens, long_words)
            outcomes += batch_check.check_round(lm, convs, pool, jitter.pause)
            if every and len(outcomes) // count % every == 0:
                bad = sum(bool(o.problems) for o in outcomes)
                print(f"  {len(outcomes) // count} rounds: {bad} differ", file=sys.stderr)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="200 rounds a family")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--load", type=int, default=0, help="busy background processes")
    parser.add_argument("--families", default=",".join(["demo", *FAMILIES]))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rounds = args.rounds or (200 if args.long else 3)

    from kvchat import blas

    blas.preload()
    from kvchat.engine.models.model import load_model
    from tests.arch_models import build

    root = Path(tempfile.mkdtemp(prefix="kvchat-stress-"))
    with busy_processes(args.load):
        for name in args.families.split(","):
            lm = load_model("demo") if name == "demo" else build(root / name, name)
            started = time.perf_counter()
            outcomes = stress(lm, rounds, args.seed, max_tokens=args.tokens, every=25)
            bad = [(i // 4, o) for i, o in enumerate(outcomes) if o.problems]
            flips = [(i // 4, o) for i, o in enumerate(outcomes) if o.flip]
            widest = max(o.got.batch_size for o in outcomes)
            batched = sum(o.got.batch_size > 1 for o in outcomes)
            stopped = sum(o.got.stopped for o in outcomes)
            joined = sum(o.conv.delay > 0 for o in outcomes)
            print(
                f"{name:<12} {rounds} rounds, {len(outcomes)} replies: {len(bad)} differ "
                f"({len({r for r, _ in bad})} rounds), {len(flips)} flipped at a near tie, "
                f"{time.perf_counter() - started:.0f} s; {batched} decoded in batches (up to "
                f"{widest} rows), {joined} sent late, {stopped} stopped",
                flush=True,
            )
            for r, outcome in bad[:5] + flips[:5]:
                why = "; ".join(outcome.problems) or outcome.flip
                print(f"    round {r}, {outcome.conv.label()}: {why}", flush=True)


if __name__ == "__main__":
    main()
