"""The one decoding loop: a core per loaded model (``core``; ``per_model.core_for`` finds or
makes it, ``per_model.warm_up`` pays its first turn's once-only costs ahead) runs every
session's prefill and decode steps, batching the sequences that decode at the same time
into one forward pass a step; ``sequence`` is what a turn submits (its request, state and
channel), ``paths`` the ways a core's steps run (MLX's merged batch, the CPU fast path's
numpy rows, a sharded model's rows); ``gate`` is the device gate its steps and exclusive
work take turns through, ``scheduler`` the order of that work.

The package imports nothing itself, so that its light modules (the gate, the scheduler)
come without mlx-lm: the TUI makes its scheduler before its first frame."""
