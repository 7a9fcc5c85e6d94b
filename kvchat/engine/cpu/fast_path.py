"""What the CPU fast path gave one loaded model (:class:`FastPath`), on its own so that the
layers it describes can name it without importing the package that makes them."""

from __future__ import annotations

from dataclasses import dataclass

MLX_MODE = "MLX's own kernels (the CPU fast path does not read this mode)"


@dataclass(eq=False)
class FastPath:
    """What the CPU fast path gave one loaded model.

    ``on`` switches that model's kvchat layers between numpy and mlx's own
    arithmetic (the bench and tests compare both on one model); ``step`` is None
    when its decoding step runs whole in numpy, else why not, in a phrase.
    """

    step: str | None = None
    kept: tuple[str, ...] = ()  # packed modes left to MLX's own kernels (no kernel reads them)
    on: bool = True

    @property
    def decodes(self) -> bool:
        """Whether :func:`kvchat.engine.cpu.decode_batch` takes this model's decoding steps now."""
        return self.on and self.step is None

    def describe(self) -> str:
        """One line: what this model runs through numpy."""
        if not self.on:
            return "off (switched off for this model)"
        if self.step is None:
            return "on (numpy decoding step, attention, SwiGLU and linear layers)"
        line = f"on for linear layers only: no numpy decoding step, {self.step}"
        if self.kept and MLX_MODE not in self.step:
            line += f"; {'/'.join(self.kept)} layers on {MLX_MODE}"
        return line
