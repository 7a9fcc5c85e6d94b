"""kvchat: a terminal chat for local LLMs on MLX with a live KV cache per conversation."""

from kvchat import blas

__version__ = "0.1.0"

# Before anything imports mlx.core, so mlx's CPU matmul uses OpenBLAS (see blas.py).
blas.preload()
