"""The one decoding loop: a core per loaded model runs every session's prefill and decode
steps, batching the sequences that decode at the same time into one forward pass a step."""

from kvchat.engine.generation.core import GenerationCore
from kvchat.engine.generation.cores import core_for, warm_up
from kvchat.engine.generation.gate import GATE
from kvchat.engine.generation.sequence import Left, Sequence

__all__ = ["GATE", "GenerationCore", "Left", "Sequence", "core_for", "warm_up"]
