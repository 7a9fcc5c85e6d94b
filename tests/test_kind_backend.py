"""A cache kind the backend cannot run is refused when it is chosen, with the reason, and
`kvchat bench` reports it as not available and goes on. MLX's CUDA backend cannot read a
quantized cache in attention; here a test-side model fails the same way on the CPU."""

from __future__ import annotations

import dataclasses

import mlx.nn as nn
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from kvchat.bench.experiments import Bench
from kvchat.engine.caches import fit
from kvchat.engine.caches.kinds import OFFERED_KINDS, CacheKindError, applicable_kinds, parse_kind
from kvchat.engine.conversation.events import GenerationSettings
from kvchat.engine.conversation.session import Session
from tests.helpers import turn

GREEDY = GenerationSettings(max_tokens=6, temp=0.0)
CUDA_SAYS = "[quantized_matmul] No implementation for these arguments on the GPU."


class NoQuantizedAttention(nn.Module):
    """The demo model as MLX's CUDA backend runs it: attention over a quantized cache
    raises a RuntimeError; everything else is the demo's."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model

    @property
    def layers(self) -> list[nn.Module]:
        return self.inner.layers

    def __call__(self, inputs, cache=None, **kwargs):
        if cache is not None and any(isinstance(c, QuantizedKVCache) for c in cache):
            raise RuntimeError(CUDA_SAYS)
        return self.inner(inputs, cache=cache, **kwargs)


@pytest.fixture(scope="module")
def cuda_like(demo_model):
    return dataclasses.replace(demo_model, model=NoQuantizedAttention(demo_model.model))


def test_kinds_say_what_they_need_of_the_backend():
    assert parse_kind("quantized:4").needs == (fit.QUANTIZED_ATTENTION,)
    assert parse_kind("rotated:8").needs == (fit.QUANTIZED_ATTENTION,)
    assert parse_kind("rotating:4096").needs == () and parse_kind("standard").needs == ()
    # a group mlx does not quantize in: the backend's own words come back
    assert fit.backend_problem(fit.QUANTIZED_ATTENTION, 8, 48).startswith("ValueError: ")


@pytest.mark.cpu_only
def test_the_cpu_backend_runs_quantized_attention():
    assert fit.device() == "cpu"
    for bits in (8, 4):
        assert fit.backend_problem(fit.QUANTIZED_ATTENTION, bits, 64) is None


@pytest.mark.quantized_attention
def test_a_kind_the_attention_cannot_run_is_refused_when_chosen(cuda_like):
    assert applicable_kinds(cuda_like.model, list(OFFERED_KINDS)) == [
        k for k in OFFERED_KINDS if parse_kind(k).family not in ("quantized", "rotated")
    ]
    with pytest.raises(
        CacheKindError,
        match=r"^Cache kind 'quantized:8' cannot apply to this "
        r"model: its attention cannot read a quantized cache \(RuntimeError\)",
    ):
        Session(cuda_like, kind="quantized:8")

    session = Session(cuda_like, settings=GREEDY)
    first = turn(session, "hello there")
    cache, ledger = session.cache, list(session.ledger)
    with pytest.raises(CacheKindError, match="rotated cache"):
        session.set_kind("rotated:4")
    assert session.kind.name == "standard" and session.cache is cache and session.ledger == ledger
    again = turn(session, "and again")
    assert again.stats.rebuilt is None and again.stats.reused_tokens >= len(first.tokens)


@pytest.mark.quantized_attention
def test_bench_reports_a_kind_it_cannot_run_and_goes_on(cuda_like):
    bench = Bench(cuda_like, quick=True)
    bench.plan.update(
        kinds_history=160,
        agree_tokens=4,
        kinds=["standard", "quantized:8", "concatenate", "rotated:4"],
    )
    kinds = bench.kinds()
    assert [r["kind"] for r in kinds["rows"]] == ["standard", "concatenate"]
    assert list(kinds["unavailable"]) == ["quantized:8", "rotated:4"]
    assert "its attention cannot read a quantized cache" in kinds["unavailable"]["quantized:8"]
    assert all(r["gen_tps"] > 0 for r in kinds["rows"])
