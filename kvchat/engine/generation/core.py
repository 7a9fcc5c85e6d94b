"""The generation core of a loaded model: its step loop, the only place replies are decoded.

A session's turn submits a :class:`~.sequence.Sequence` with :meth:`GenerationCore.run`
and reads its messages (``Prefill`` progress, sampled token ids, a final ``Left``). The
sequences decoding on a core are held by its decoding path (:mod:`.paths`: MLX's merged
batch, the CPU fast path's numpy rows, or a sharded model's rows), chosen in one place
(:func:`.paths.choose`), which runs their forward passes. Each step of the loop, under
the device gate (:mod:`.gate`):

1. **gather**: from idle, wait a moment for turns sent at once (:meth:`GenerationCore.expect`);
2. **prefill**: joining sequences evaluate their prompts in chunks, one chunk's worth of
   tokens a step among them, fewer while others decode (:mod:`.pace`), several in one
   forward pass where their caches merge (:mod:`.prefill`); those whose prompts are in
   (but the last token, which the decode step feeds with the other rows) join the path;
3. **decode**: the path feeds every decoding sequence its last sampled token (or a
   prompt's last) and samples the next, posting it (:meth:`.paths.base.Path.decode`);
   on MLX's path the step also feeds the tokens it samples before they are read, so the
   next step computes while they are read and posted, and newcomers join the step after;
4. **leave**: sequences that ended (an end token, the length limit, a stop, a consumer
   gone) leave with their caches their own again, and the rest go on.

A batch of one is the same loop. The loop runs on its own thread (ended at interpreter
exit: :mod:`.per_model`); a sharded model's core runs it on the caller's thread, one
sequence at a time, so every rank does the same operations in the same order.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from kvchat.engine.conversation.events import Prefill
from kvchat.engine.generation import invariant
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.pace import Pace
from kvchat.engine.generation.paths import Path, choose
from kvchat.engine.generation.sequence import Left, Sequence
from kvchat.engine.generation.threads import clear_mlx_at_thread_end

GATHER_S = 0.005  # from idle, a step waits while turns keep arriving this close together
GATHER_MAX_S = 0.1  # or while announced turns (expect) are on their way, no longer than this


class GenerationCore:
    """Runs the forward passes of one model for every sequence submitted to it."""

    def __init__(self, model: nn.Module, *, threaded: bool = True, fast_path: Any = None):
        self._model = weakref.ref(model)  # the core never keeps an unloaded model alive
        self.threaded = threaded
        self.fast_path = fast_path  # the model's CPU fast path (kvchat.engine.cpu), if any
        self._cond = threading.Condition()
        self._joining: list[Sequence] = []  # submitted, prompt not all in the cache yet
        self.path: Path = choose(threaded, fast_path)()  # the decoding sequences, and how they run
        self._thread: threading.Thread | None = None
        self._expected: list[float] = []  # announced turns' deadlines (monotonic), see expect
        self._ending = False  # the interpreter is exiting: the loop's thread ends (end)
        self.pace = Pace()  # a step's prompt tokens while others decode
        self.debug = invariant.debugging()  # check every sequence's cache after each step

    @property
    def model(self) -> nn.Module | None:
        return self._model()

    @property
    def _forward(self) -> nn.Module:
        """The model the loop's steps run (a step fails, and its sequences leave with
        the error, should it have been unloaded meanwhile)."""
        model = self._model()
        if model is None:
            raise RuntimeError("The model was unloaded while it was generating.")
        return model

    def expect(self) -> None:
        """Announce a turn that is being prepared (its prompt templated and tokenized) and will be
        submitted shortly: a first step from idle waits for it, up to :data:`GATHER_MAX_S`, so that
        turns sent at once (tabs, a server's clients) go in one pass rather than the first few alone
        and the rest a whole step later. One never submitted only expires."""
        with self._cond:
            self._expected.append(time.monotonic() + GATHER_MAX_S)

    def run(self, seq: Sequence) -> Generator[Prefill | int | Left, None, None]:
        """Submit ``seq`` and yield its messages until its :class:`Left`. Closing the
        iterator early cancels the sequence and returns once it has left (its cache
        and ledger agree again)."""
        if not self.threaded or GATE.held_here():
            yield from self._inline(seq)
            return
        with self._cond:
            self._joining.append(seq)
            if self._expected:
                self._expected.pop(0)
            self._start()
            self._cond.notify_all()
        channel = seq.channel
        try:
            while True:
                message = channel.messages.get()
                yield message
                if isinstance(message, Left):
                    return
        finally:
            if not channel.left.is_set():
                channel.cancelled.set()
                with self._cond:
                    self._cond.notify_all()
                channel.left.wait()

    def _inline(self, seq: Sequence) -> Iterator[Prefill | int | Left]:
        """The loop on the caller's thread, which holds the device gate (a sharded model's
        core, or a caller that has the model to itself): it steps every sequence of
        this core until ``seq`` leaves.

        Closed early (a stop, or the reader failed: on a sharded model, most often a
        collective of the shared stop flag after a rank was lost), ``seq`` leaves at
        once, between two steps, where its cache and ledger agree, its last sampled
        token not fed. No further step runs for it: a sharded model's forward pass
        waits on every rank, and after a lost rank it would never return."""
        channel = seq.channel
        with self._cond:
            self._joining.append(seq)
        try:
            while not channel.left.is_set():
                with GATE.step():
                    self._step()
                yield from channel.pending()
        finally:
            if not channel.left.is_set():
                channel.cancelled.set()
                with GATE.step():
                    self._leave([seq])
            channel.pending()  # what it did not read

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name="kvchat-generation", daemon=True
            )
            self._thread.start()

    def end(self) -> None:
        """End the loop's thread now."""
        with self._cond:
            self._ending = True
            self._cond.notify_all()
        if (thread := self._thread) is not None:
            thread.join(5)

    def _loop(self) -> None:
        clear_mlx_at_thread_end()
        while True:
            with self._cond:
                if not self._cond.wait_for(self._called, timeout=30.0) or self._ending:
                    self._thread = None  # idle: the next submit starts a new thread
                    return
                self._gather()
            with GATE.step():
                self._step()

    def _gather(self) -> None:
        """From idle (nothing decoding, no prompt begun), let turns sent at once all join
        the first step: wait while announced turns (:meth:`expect`) are still on their
        way, or submissions keep coming, each within :data:`GATHER_S` of the one before
        (:data:`GATHER_MAX_S` at most), so their prompts go in one pass rather than the
        first alone and the rest a step later. A long prompt's later chunks do not wait.
        Called holding the condition."""
        if self.path.seqs or any(s.state.fed for s in self._joining):
            return
        deadline = time.monotonic() + GATHER_MAX_S
        while (left := deadline - time.monotonic()) > 0:
            held = len(self._joining)
            if self._awaited():
                self._cond.wait(min(GATHER_S, left))  # a submission notifies
            elif not self._cond.wait_for(self._arrival(held), min(GATHER_S, left)):
                return

    def _awaited(self) -> bool:
        """Whether an announced turn has yet to be submitted (expired ones dropped)."""
        now = time.monotonic()
        self._expected = [t for t in self._expected if t > now]
        return bool(self._expected)

    def _arrival(self, held: int) -> Callable[[], bool]:
        """Whether a sequence joined since there were ``held`` joining."""
        return lambda: len(self._joining) > held

    def _called(self) -> bool:
        """Whether the loop has work, or must end."""
        return self._ending or bool(self._joining or self.path.seqs)

    def _step(self) -> None:
        """Prefill, decode, leave: one step of every sequence of this core."""
        with self._cond:
            joining = list(self._joining)
        try:
            with mx.stream(generation_stream):
                path, model = self._path(), self._forward
                if not path.fed_ahead():  # else newcomers join the step after
                    # a prompt all in decodes in this same step, its first token not waiting
                    ready, gone = path.prefill(model, joining, self.pace)
                    self._leave(gone)
                    with self._cond:
                        self._joining = [s for s in self._joining if s not in ready]
                    path.join(model, ready)
                self._leave(path.decode(model, newcomers=bool(joining)))
                if self.debug:
                    invariant.check([*self._joining, *path.apart], path.merged)
        except Exception as error:  # noqa: BLE001  every sequence learns why, and leaves
            self._fail(error)

    def _path(self) -> Path:
        """The decoding path for this step: chosen anew while none decodes (a model's CPU
        fast path can be switched on or off between turns: ``FastPath.on``)."""
        if not self.path.seqs:
            chosen = choose(self.threaded, self.fast_path)
            if type(self.path) is not chosen:
                self.path = chosen()
        return self.path

    def _leave(self, ended: list[Sequence]) -> None:
        """``ended`` leave the core: their caches their own again, their readers told."""
        self.path.leave(ended)
        for seq in ended:
            with self._cond:
                if seq in self._joining:
                    self._joining.remove(seq)
            seq.channel.close(Left(stopped=seq.halted()))

    def _fail(self, error: BaseException) -> None:
        """A step failed: every sequence leaves with the error (their caches are not
        trusted: the sessions empty them)."""
        with self._cond:
            everyone = [*self._joining, *self.path.seqs]
            self._joining, self.path = [], type(self.path)()
        for seq in everyone:
            seq.channel.close(Left(stopped=False, error=error))
