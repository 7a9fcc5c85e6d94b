"""The one decoding loop: a core per loaded model runs every session's prefill and decode
steps, batching the sequences that decode at the same time into one forward pass a step."""

from .core import GenerationCore, core_for
from .gate import GATE
from .sequence import Left, Sequence

__all__ = ["GATE", "GenerationCore", "Left", "Sequence", "core_for"]
