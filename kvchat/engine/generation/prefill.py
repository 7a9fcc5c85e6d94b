"""How a step evaluates the prompts of joining sequences: chunks chosen among them, and
several sequences' chunks in one forward pass; or none, where a short prompt goes
whole into the decode step.

:func:`folded` picks, on the CPU fast path, the short remaining prompts that
the decode step feeds whole beside its decoding rows (its numpy step takes
several tokens a row), so they need no pass of their own.

:func:`plan` picks this step's chunks within the step's token budget: shortest
remainder first, all cut to one width with little padding, so a handful of short
follow-ups go in together while a long paste goes on a chunk at a time beside
them (the first in line is always among them, so a steady stream of short ones
cannot starve it).

:func:`feed` evaluates them. Chunks whose caches merge go in one forward pass
as ``mlx_lm.generate.BatchGenerator`` prefills: the caches merged into mlx-lm's
``BatchKVCache`` (left-padded to the longest), the chunks right-padded to the
width (the cache's ``prepare``/``finalize`` move that padding to the left),
then each row extracted back into its own cache. The weights stream once for
every row, and on the CPU the products of many rows run several times faster a
row than those of a few. The others go one forward pass each.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from kvchat.engine.conversation.events import Prefill
from kvchat.engine.generation.batch import give_back, merge
from kvchat.engine.generation.sequence import Sequence

Chunk = tuple[Sequence, list[int]]


def body_left(seq: Sequence) -> int:
    """Prompt tokens still to evaluate before the last one (which goes alone, or with a
    decode step, for its log probabilities)."""
    return max(0, seq.prompt_left() - 1)


def started(seq: Sequence) -> None:
    """Tell the turn its prompt's evaluation begins, if none of it is in yet."""
    if seq.state.fed == 0:
        seq.channel.post(Prefill(0, len(seq.request.prompt)))


FOLD = 64  # a remaining prompt this short goes whole into the decode step (CPU fast path)


def folded(joining: list[Sequence], budget: int) -> list[Sequence]:
    """The joining sequences whose remaining prompt (at most :data:`FOLD` tokens, all of
    them within ``budget``, in line order) the decode step feeds whole with its other
    rows, for the CPU fast path's numpy step: on the decode step's 2-core products, a
    few dozen more rows cost little more than the decoding rows alone, where a separate
    pass would stream the weights once more. Only plain ``KVCache`` caches (the step
    extends no other kind by several tokens) and prompts that pass no checkpoint mark."""
    chosen, used = [], 0
    for seq in joining:
        left = seq.prompt_left()
        held = len(seq.state.ledger)
        if (
            1 < left <= FOLD
            and used + left <= budget
            and all(type(c) is KVCache for c in seq.state.cache)
            and not any(held < m < held + left for m in seq.request.marks)
        ):
            chosen.append(seq)
            used += left
    return chosen


def plan(joining: list[Sequence], budget: int) -> list[Chunk]:
    """This step's chunks among ``joining`` (in line order): the sequences with the least
    prompt left first, none longer than ``budget`` or its prefill step, as many as
    ``budget`` tokens hold once every chunk is padded to the widest, while padding stays
    under a third of the pass; the first in line always gets one (cut to that width). A
    chunk also ends at the next checkpoint mark it would pass."""
    waiting = [s for s in joining if body_left(s) > 0]
    if not waiting:
        return []
    chosen: list[Sequence] = []
    width = evaluated = 0
    for seq in sorted(waiting, key=body_left):
        size = min(body_left(seq), max(1, seq.request.prefill_step), budget)
        wider, padded = max(width, size), (len(chosen) + 1) * max(width, size)
        if chosen and (padded > budget or 3 * (evaluated + size) < 2 * padded):
            break  # over the budget, or a third of the pass would be padding
        chosen.append(seq)
        width, evaluated = wider, evaluated + size
    if waiting[0] not in chosen:
        chosen.append(waiting[0])
    chunks = []
    for seq in joining:  # in line order
        if seq in chosen:
            size = min(width, body_left(seq))
            held = len(seq.state.ledger)
            size = min([size, *(m - held for m in seq.request.marks if held < m < held + size)])
            fed = seq.state.fed
            chunks.append((seq, seq.request.prompt[fed : fed + size]))
    return chunks


def feed(model: nn.Module, chunks: list[Chunk], together: bool) -> None:
    """Evaluate each chunk into its sequence's cache and ledger (in one forward pass when
    ``together`` and there are several), reporting progress and checkpoint marks."""
    for seq, _ in chunks:
        started(seq)
    if together and len(chunks) > 1:
        _forward_together(model, chunks)
    else:
        for seq, tokens in chunks:
            model(mx.array(tokens)[None], cache=seq.state.cache)
            mx.eval([c.state for c in seq.state.cache])
    for seq, tokens in chunks:
        state, request = seq.state, seq.request
        state.ledger.extend(tokens)
        state.fed += len(tokens)
        if request.on_mark is not None and len(state.ledger) in request.marks:
            request.on_mark(len(state.ledger))
        seq.channel.post(Prefill(state.fed, len(request.prompt)))
    mx.clear_cache()


def _forward_together(model: nn.Module, chunks: list[Chunk]) -> None:
    """One forward pass over every chunk, each row's keys and values back in its own cache."""
    lengths = [len(tokens) for _, tokens in chunks]
    width = max(lengths)
    padding = [width - n for n in lengths]
    layers = len(chunks[0][0].state.cache)
    batch: list[Any] = [merge([seq.state.cache[i] for seq, _ in chunks]) for i in range(layers)]
    if max(padding):
        for layer in batch:
            layer.prepare(lengths=lengths, right_padding=padding)
    rows = mx.array([tokens + [0] * pad for (_, tokens), pad in zip(chunks, padding)])
    model(rows, cache=batch)
    if max(padding):
        for layer in batch:
            layer.finalize()
    mx.eval([layer.state for layer in batch])
    for i, (seq, _) in enumerate(chunks):
        give_back(batch, i, seq.state.cache)


def first_token(model: nn.Module, seq: Sequence) -> None:
    """Sample and post the first token from the log probabilities at the prompt's end:
    those kept from an earlier turn for an empty prompt, else after the prompt's last
    token, fed here alone (a sharded core's prefill, which samples the first token
    itself)."""
    request, state = seq.request, seq.state
    if seq.prompt_left() > 0:
        started(seq)
        last = request.prompt[-1]
        logits = model(mx.array([[last]]), cache=state.cache)[:, -1, :]
        logprobs = (logits - mx.logsumexp(logits, keepdims=True)).squeeze(0)
        mx.eval(logprobs, [c.state for c in state.cache])
        state.ledger.append(last)
        state.fed += 1
        seq.prompt_done(logprobs)
    elif not request.prompt and state.logprobs is not None:
        seq.prompt_done(state.logprobs)  # the logits kept from an earlier turn
    if state.logprobs is None:  # the prompt is all in: its end's logits are kept
        raise RuntimeError("A prompt was evaluated without its last logits.")
    state.tokens.append(cast(int, seq.sample(state.logprobs[None]).item()))  # a token id
    seq.channel.post(state.tokens[-1])
