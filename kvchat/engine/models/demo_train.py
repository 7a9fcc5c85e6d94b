"""Train the ``demo`` model's weights, bit for bit the ones shipped in ``demo_weights/``.

``python -m kvchat.engine.models.demo_train`` rewrites ``demo_weights/`` (config.json,
tokenizer.json, model.safetensors); ``--check`` trains into a temporary folder and
compares sha256 digests with the shipped files instead. Training is deterministic:
the tokenizer is trained on the bundled corpus as for every demo shape, weights are
initialised from a fixed seed, batches are drawn from a seeded numpy generator, and
everything runs on the CPU (OpenBLAS splits a matmul among its threads by output
blocks, so the thread count does not change any sum). It takes about three minutes of
CPU time. The shipped files were made with Debian 12's
OpenBLAS 0.3.21 (see :mod:`kvchat.blas`); another BLAS or CPU may round differently,
and ``--check`` then says which files differ.

The text is the corpus minus its last section (held out for
:mod:`kvchat.bench.fidelity`), plus chat exchanges built from it in the demo's
ChatML template: each question in the corpus with its answer, each ``User:`` line
with the ``Assistant:`` line after it, and each paragraph's first sentence with the
sentences that follow, so that the model answers after the assistant header and
ends its turn with ``<|im_end|>``.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvchat import blas

blas.preload()  # a script: it decides the BLAS before mlx.core loads (the weights' rounding)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import qwen2  # noqa: E402

from kvchat.engine.caches.trees import flatten  # noqa: E402
from kvchat.engine.models import demo  # noqa: E402
from kvchat.engine.models.demo_build import write_json  # noqa: E402

WEIGHTS = Path(__file__).with_name("demo_weights")
FILES = ("config.json", "tokenizer.json", "model.safetensors")
SEED, STEPS, BATCH, SEQ, LR, WARMUP = 0, 900, 8, 128, 5e-3, 50

_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def exchanges(text: str) -> list[tuple[str, str]]:
    """(user, assistant) pairs built from the training text."""
    pairs = []
    lines = [line.strip() for line in text.splitlines()]
    for line, after in zip(lines, lines[1:] + [""], strict=True):
        if line.startswith("User:") and after.startswith("Assistant:"):
            pairs.append(
                (line.removeprefix("User:").strip(), after.removeprefix("Assistant:").strip())
            )
        elif line.endswith("?") and len(after) > 40 and not after.startswith(("User:", '"')):
            pairs.append((line, after))
    for paragraph in text.split("\n\n"):
        sentences = _SENTENCE.split(" ".join(paragraph.split()))
        if len(sentences) >= 3:
            pairs.append((sentences[0], " ".join(sentences[1:4])))
    return pairs


def training_text() -> str:
    """Everything the model reads: the training text, then one chat per exchange."""
    body, _ = demo.corpus_parts()
    chats = [
        f"{demo.IM_START}user\n{user}{demo.IM_END}\n{demo.IM_START}assistant\n{reply}{demo.IM_END}\n"
        for user, reply in exchanges(body)
    ]
    return body + "\n" + "".join(chats)


def train(folder: Path, log: Callable[[str], object] = print) -> None:
    """Train the demo model and write its three files into ``folder``."""
    mx.set_default_device(mx.cpu)
    tokenizer = demo.train_tokenizer()
    config = demo.model_config("demo", tokenizer)
    config["eos_token_id"] = [
        tokenizer.token_to_id(demo.IM_END),
        tokenizer.token_to_id(demo.IM_START),
    ]
    ids = np.array(tokenizer.encode(training_text()).ids, dtype=np.int32)
    log(f"{len(ids)} training tokens, {STEPS} steps; BLAS: {blas.describe()}")
    mx.random.seed(SEED)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(LR / 50, LR, WARMUP),
            optim.cosine_decay(LR, STEPS - WARMUP, LR / 50),
        ],
        [WARMUP],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    rng = np.random.default_rng(SEED)

    def loss_fn(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x: mx.array, y: mx.array) -> mx.array:
        loss: mx.array
        loss, grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        return loss

    for step in range(STEPS):
        starts = rng.integers(0, len(ids) - SEQ - 1, size=BATCH)
        window = np.stack([ids[s : s + SEQ + 1] for s in starts])
        loss = train_step(mx.array(window[:, :-1]), mx.array(window[:, 1:]))
        mx.eval(state, loss)
        if step % 150 == 0 or step == STEPS - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}")
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(folder / "config.json", config)
    tokenizer.save(str(folder / "tokenizer.json"))


def digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files")
    args = parser.parse_args(argv)
    if not args.check:
        train(WEIGHTS)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        train(Path(scratch))
        ours, shipped = digests(Path(scratch)), digests(WEIGHTS)
    for name in FILES:
        print(
            f"{name}: {'same' if ours[name] == shipped[name] else 'DIFFERENT'} ({ours[name][:16]})"
        )
    return 0 if ours == shipped else 1


if __name__ == "__main__":
    sys.exit(main())
