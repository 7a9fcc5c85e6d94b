"""kvchat: a terminal chat for local LLMs on MLX with a live KV cache per conversation.

Importing it loads nothing: the process's entry point (``kvchat.cli.main``) decides the
BLAS (:func:`kvchat.blas.preload`) before anything imports mlx.core.
"""

__version__ = "0.1.0"
