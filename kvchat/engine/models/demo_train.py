"""Train the ``demo`` model's weights, bit for bit the ones shipped in ``demo_weights/``.

``python -m kvchat.engine.models.demo_train`` rewrites ``demo_weights/`` (config.json,
tokenizer.json, model.safetensors); ``--check`` trains into a temporary folder and
compares sha256 digests with the shipped files instead. Training is deterministic:
the tokenizer is trained on the bundled corpus as for every demo shape, weights are
initialised from a fixed seed, batches are drawn from a seeded numpy generator, and
everything runs on the CPU (OpenBLAS splits a matmul among its threads by output
blocks, so the thread count does not change any sum). It takes about twenty minutes of
CPU time on two cores. The shipped files were made with Debian 12's
OpenBLAS 0.3.21 (see :mod:`kvchat.blas`); another BLAS or CPU may round differently,
and ``--check`` then says which files differ.

The text is the corpus minus its last section (held out for
:mod:`kvchat.bench.fidelity`), plus chat exchanges built from it in the demo's
ChatML template: each question in the corpus with its answer, each ``User:`` line
with the ``Assistant:`` line after it, and each paragraph's first sentence with the
sentences that follow, so that the model answers after the assistant header and
ends its turn with ``<|im_end|>``. Then it learns to call tools (:func:`learn_tools`):
chats with tools (:mod:`kvchat.engine.models.demo_tools`) as the demo's chat template
writes them, the loss on their replies only, so that offered a tool and asked for its
work it writes a call with the question's values, and sent the result, says it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
from tokenizers import Tokenizer  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from kvchat.engine.caches.trees import flatten  # noqa: E402
from kvchat.engine.models import demo  # noqa: E402
from kvchat.engine.models.demo_build import write_json  # noqa: E402
from kvchat.engine.models.demo_template import CHAT_TEMPLATE  # noqa: E402
from kvchat.engine.models.demo_tools import exchanges, ordinary_pairs, tool_chats  # noqa: E402

WEIGHTS = Path(__file__).with_name("demo_weights")
FILES = ("config.json", "tokenizer.json", "model.safetensors")
SEED, STEPS, BATCH, SEQ, LR, WARMUP = 0, 900, 8, 128, 5e-3, 50
# then TOOL_STEPS steps that also read TOOL_BATCH chats with tools each, learning their replies
TOOL_SEED, TOOL_STEPS, TOOL_BATCH, TOOL_CHATS, TOOL_LR, PAD_TO = 7, 2400, 4, 4800, 4e-3, 64
VALUE_WEIGHT = 4.0  # a call's argument values weigh this much more than its other tokens
_REPLY = re.compile(
    re.escape(f"{demo.IM_START}assistant\n") + r"(.*?" + re.escape(demo.IM_END) + ")", re.S
)


def training_text() -> str:
    """Everything the model reads: the training text, then one chat per exchange."""
    body, _ = demo.corpus_parts()
    chats = [
        f"{demo.IM_START}user\n{user}{demo.IM_END}\n{demo.IM_START}assistant\n{reply}{demo.IM_END}\n"
        for user, reply in exchanges(body)
    ]
    return body + "\n" + "".join(chats)


def tool_examples(
    tokenizer: Tokenizer, count: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` chats with tools (:mod:`kvchat.engine.models.demo_tools`) as the demo's
    chat template writes them (transformers renders it, as for the served model): each
    as its token ids and, per token, its weight in the loss: 0 outside the assistant's
    replies, 1 in them, ``VALUE_WEIGHT`` in a call's argument values (what the question
    says, the part hardest to learn)."""
    template = PreTrainedTokenizerFast(tokenizer_object=tokenizer)  # type: ignore[no-untyped-call]
    template.chat_template = CHAT_TEMPLATE
    examples = []
    for messages, tools in tool_chats(count, ordinary_pairs(), seed):
        text = template.apply_chat_template(messages, tools=list(tools), tokenize=False)
        assert isinstance(text, str)
        encoding = tokenizer.encode(text)
        replies = [m.span(1) for m in _REPLY.finditer(text)]
        values = [
            (at, at + len(said))
            for message in messages
            for call in message.get("tool_calls", [])
            for value in call["function"]["arguments"].values()
            if (at := text.find(said := json.dumps(value), replies[0][0])) >= 0
        ]
        weight = [
            VALUE_WEIGHT
            if any(a <= start < b for a, b in values)
            else float(any(a <= start < b for a, b in replies))
            for start, _ in encoding.offsets
        ]
        examples.append((np.array(encoding.ids, np.int32), np.array(weight, np.float32)))
    return examples


def _optimizer(rate: float, steps: int) -> optim.Optimizer:
    """AdamW warming up to ``rate`` over ``WARMUP`` steps, then decaying to a fiftieth of it."""
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(rate / 50, rate, WARMUP),
            optim.cosine_decay(rate, steps - WARMUP, rate / 50),
        ],
        [WARMUP],
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=0.01)


def _windows(ids: np.ndarray, rng: np.random.Generator) -> tuple[mx.array, mx.array]:
    """``BATCH`` windows of ``SEQ`` tokens of the text, drawn by ``rng``, and the tokens
    each position should predict."""
    starts = rng.integers(0, len(ids) - SEQ - 1, size=BATCH)
    window = np.stack([ids[s : s + SEQ + 1] for s in starts])
    return mx.array(window[:, :-1]), mx.array(window[:, 1:])


def _stepper(
    model: nn.Module, optimizer: optim.Optimizer, loss_fn: Callable[..., mx.array]
) -> Callable[..., mx.array]:
    """One compiled training step of ``model`` on ``loss_fn(model, *batch)``: it updates
    the model, evaluates, and gives the step's loss."""
    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(*batch: mx.array) -> mx.array:
        loss: mx.array
        loss, grads = grad_fn(model, *batch)
        optimizer.update(model, grads)
        return loss

    def step(*batch: mx.array) -> mx.array:
        loss = train_step(*batch)
        mx.eval(state, loss)
        return loss

    return step


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
    rng = np.random.default_rng(SEED)

    def loss_fn(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    step_with = _stepper(model, _optimizer(LR, STEPS), loss_fn)
    for step in range(STEPS):
        loss = step_with(*_windows(ids, rng))
        if step % 150 == 0 or step == STEPS - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}")
    learn_tools(model, ids, tool_examples(tokenizer, TOOL_CHATS, SEED), log)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(folder / "config.json", config)
    tokenizer.save(str(folder / "tokenizer.json"))


def learn_tools(
    model: nn.Module,
    ids: np.ndarray,
    chats: list[tuple[np.ndarray, np.ndarray]],
    log: Callable[[str], object],
) -> None:
    """Go on training ``model``: each step reads windows of the text, as before (so it
    keeps what it learnt), and ``TOOL_BATCH`` whole chats with tools, learning only their
    replies (the loss of the other tokens, the tools' specs and the questions, is 0)."""
    rng = np.random.default_rng(TOOL_SEED)

    def loss_fn(
        model: nn.Module, x: mx.array, y: mx.array, cx: mx.array, cy: mx.array, mask: mx.array
    ) -> mx.array:
        text = nn.losses.cross_entropy(model(x), y, reduction="mean")
        replies = nn.losses.cross_entropy(model(cx), cy) * mask
        return text + replies.sum() / mask.sum()

    step_with = _stepper(model, _optimizer(TOOL_LR, TOOL_STEPS), loss_fn)
    for step in range(TOOL_STEPS):
        x, y = _windows(ids, rng)
        picked = [chats[i] for i in rng.integers(0, len(chats), size=TOOL_BATCH)]
        width = -(-max(len(tokens) for tokens, _ in picked) // PAD_TO) * PAD_TO + 1
        tokens = np.zeros((TOOL_BATCH, width), np.int32)
        reply = np.zeros((TOOL_BATCH, width), np.float32)
        for row, (chat, learnt) in enumerate(picked):
            tokens[row, : len(chat)], reply[row, : len(chat)] = chat, learnt
        loss = step_with(
            x, y, *(mx.array(part) for part in (tokens[:, :-1], tokens[:, 1:], reply[:, 1:]))
        )
        if step % 150 == 0 or step == TOOL_STEPS - 1:
            log(f"tools step {step:4d}  loss {loss.item():.3f}")


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
