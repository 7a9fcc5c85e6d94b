"""Cache kinds: the families and their mlx-lm classes, the probes of what a model and backend can run, checkpoints of sliding and recurrent layers."""
