"""The CPU fast path: linear layers, attention, SwiGLU and decoding steps through numpy.

On the CPU backend, :func:`prepare` gives a loaded model kvchat's own layers in
place of mlx-lm's (``update_modules``, as ``mlx.nn.quantize`` does; nothing of
mlx-lm is patched): numpy-backed linear and embedding layers (:mod:`.linear`) for
any architecture, computing with the weights as stored (float32, 16-bit, or MLX's
affine packed format: :mod:`.stored`; :func:`held` says which, in words) and,
for llama-family models (mlx-lm's ``llama`` and ``qwen2``
modules, any of mlx-lm's RoPE variants), an attention, MLP and model body
(:mod:`.layers`) whose single-token step runs whole in numpy (:mod:`.decode`).
It returns the model's :class:`FastPath`, which says what the model got and why
not the rest, and switches the model's layers between numpy and mlx (``on``).

On other devices, or with ``KVCHAT_CPU_FASTPATH=0``, it returns the reason as a
string; a llama-family model still gets kvchat's attention (computing with mlx
there), which is what reads ``rotated:N`` caches.

:func:`decode_batch` is one decoding step of B sequences for a batched loop (a row may
feed several tokens: a short prompt joining the step).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import switch_layers

from kvchat.engine.cpu import decode, experts, linear, step_weights, stored
from kvchat.engine.cpu.fast_path import MLX_MODE, FastPath
from kvchat.engine.cpu.layers import MLP, Attention, Body
from kvchat.engine.cpu.rope import rope_form

__all__ = ["ENV", "FastPath", "prepare", "held", "step_problem", "decode_batch", "wanted"]

ENV = "KVCHAT_CPU_FASTPATH"  # "0" turns the fast path off (read when a model is loaded)
FAMILY = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")  # the blocks layers.py computes
# the layers whose weights held() describes: linear, embedding and stacked experts'
MATRICES = (
    nn.Linear,
    nn.Embedding,
    *linear.PACKED,
    switch_layers.SwitchLinear,
    switch_layers.QuantizedSwitchLinear,
)


def wanted() -> str | None:
    """None when the fast path applies in this process, else why not."""
    if os.environ.get(ENV, "1") == "0":
        return f"off ({ENV}=0)"
    if mx.default_device() != mx.cpu:
        return "off (MLX runs on the GPU: its own kernels are used)"
    return None


def step_problem(model: nn.Module) -> str | None:
    """None when ``model`` has the shape of kvchat's llama-family layers, else why not:
    every attribute they read is checked (module classes, heads, scale, RoPE, norms)."""
    body = model.get("model") if isinstance(model, nn.Module) else None
    if not isinstance(body, nn.Module) or type(model).__module__ not in FAMILY:
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        return f"model type {kind!r} (it computes mlx-lm's llama and qwen2 models)"
    if getattr(body, "pipeline_size", 1) != 1:
        return "the model is split into a pipeline"
    for name in ("embed_tokens", "norm"):
        if name not in body:
            return f"the model has no {name}"
    if type(body.norm) is not nn.RMSNorm:
        return f"its final norm is {type(body.norm).__name__}, not RMSNorm"
    for i, layer in enumerate(body.layers):
        problem = _layer_problem(layer)
        if problem:
            return f"layer {i}: {problem}"
    return None


def _layer_problem(layer: nn.Module) -> str | None:
    if getattr(layer, "use_sliding", False):
        return "sliding-window attention"
    for name in ("input_layernorm", "post_attention_layernorm"):
        if type(layer.get(name)) is not nn.RMSNorm:
            return f"{name} is not RMSNorm"
    attn, mlp = layer.get("self_attn"), layer.get("mlp")
    if attn is None or type(attn).__name__ != "Attention" or type(attn).__module__ not in FAMILY:
        return f"its attention is {type(attn).__name__}"
    if type(mlp).__name__ != "MLP" or type(mlp).__module__ not in FAMILY:
        return f"its MLP is {type(mlp).__name__}"
    heads, kv_heads, scale = (getattr(attn, n, None) for n in ("n_heads", "n_kv_heads", "scale"))
    if not (
        isinstance(heads, int)
        and isinstance(kv_heads, int)
        and kv_heads > 0
        and heads % kv_heads == 0
    ):
        return f"{heads!r} query heads over {kv_heads!r} key/value heads"
    if not isinstance(scale, float):
        return f"attention scale {scale!r}"
    rope = rope_form(attn.rope)
    if isinstance(rope, str):
        return rope
    if rope.dims > attn.q_proj.weight.shape[0] // heads:
        return f"its RoPE turns {rope.dims} features of {attn.q_proj.weight.shape[0] // heads}"
    return None


def _linears_problem(model: nn.Module) -> str | None:
    """Why the numpy step cannot read a llama-family model's weights (a packed mode no
    kernel reads), or None."""
    body = model.model
    head = (model["lm_head"],) if "lm_head" in model else ()
    for m in (body.embed_tokens, *head, *(p for x in body.layers for p in linear.projections(x))):
        if stored.stored(m) is None:
            return f"its {getattr(m, 'mode', m.weight.dtype)} layers run on {MLX_MODE}"
    return None


def _give_layers(model: nn.Module, fast: FastPath | None) -> None:
    """kvchat's attention and MLP in each block of ``model``; its body too when ``fast``."""
    for layer in model.model.layers:
        form = rope_form(layer.self_attn.rope) if fast is not None else None
        attn = Attention(layer.self_attn, fast, form)
        layer.update_modules({"self_attn": attn, "mlp": MLP(layer.mlp, fast)})
    if fast is not None:
        model.update_modules({"model": Body(model.model, fast)})


def prepare(model: nn.Module) -> FastPath | str:
    """Give ``model`` the fast path's layers (its weights as they are: nothing cast or
    dequantized) and return its :class:`FastPath`; or, where the fast path does not
    apply, the reason (a llama-family model then still gets kvchat's attention, for
    rotated caches)."""
    off = wanted()
    shape = step_problem(model)
    if off is not None:
        if shape is None:
            _give_layers(model, None)
        return off
    fast = FastPath()
    fast.kept = tuple(linear.replace(model, fast))
    experts.replace(model, fast)  # mixture-of-experts layers: only chosen experts read
    fast.step = shape or _linears_problem(model)
    if shape is None:
        _give_layers(model, fast)
    return fast


def held(model: nn.Module, brief: bool = False) -> str:
    """How a prepared model's linear, expert and embedding weights are held and multiplied,
    in a phrase for ``kvchat doctor``: ``float32``, ``bfloat16, kept as stored, native
    kernels (…)``, ``4-bit, groups of 64, kept packed, native kernels (…)``; the form of
    most of the bytes first, any other after it. ``brief``: that first form alone, in a
    few words, for the sidebar (``4-bit packed``)."""
    sizes: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, MATRICES):
            weights = stored.stored(m)
            mode = getattr(m, "mode", m.weight.dtype)
            if weights is not None:
                form = weights.describe(brief)
            else:
                form = f"{mode}" if brief else f"{mode}: {MLX_MODE}"
            size = weights.nbytes if weights is not None else m.weight.nbytes
            sizes[form] = sizes.get(form, 0) + size
    if not sizes:
        return "as stored"
    forms = sorted(sizes, key=lambda form: -sizes[form])
    if brief:
        return forms[0]
    line = forms[0] + (f" (also {'; '.join(forms[1:])})" if forms[1:] else "")
    read = any(form != "float32" and MLX_MODE not in form for form in forms)
    return f"{line}, {stored.kernels()}" if read else line


def decode_batch(
    model: nn.Module, tokens: list[list[int]], caches: list[list[Any]]
) -> mx.array | None:
    """One decoding step of B sequences: the tokens ``tokens[b]`` (one, or several on a
    plain ``KVCache``) appended to ``caches[b]`` (one cache per layer, as mlx-lm's step
    would with ``update_and_fetch``); returns the logits after each row's last token
    ``(B, vocab)`` float32, or None, with nothing changed, when the model has no numpy
    decoding step (or it is switched off) or a cache is of a class it does not read."""
    body = model.get("model") if isinstance(model, nn.Module) else None
    if not isinstance(body, Body) or not body.fast.decodes or not tokens:
        return None
    if len(tokens) != len(caches) or any(
        len(c) != len(body.layers) or not decode.takes(c) for c in caches
    ):
        return None
    head = model["lm_head"] if "lm_head" in model else body.embed_tokens
    h = decode.hidden(body, [[int(t) for t in row] for row in tokens], caches, extra=(head,))
    if h is None:
        return None
    return mx.array(linear.multiply(step_weights.matrix(head), h))
