"""The one decoding loop: a core per loaded model (``core``; ``per_model.core_for`` finds or
makes it, ``per_model.warm_up`` pays its first turn's once-only costs ahead) runs every
session's prefill and decode steps, batching the sequences that decode at the same time
into one forward pass a step; ``gate`` is the device gate its steps and exclusive work
take turns through, ``scheduler`` the order of that work.

The package imports nothing itself, so that its light modules (the gate, the scheduler)
come without mlx-lm: the TUI makes its scheduler before its first frame."""
