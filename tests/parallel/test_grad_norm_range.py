"""The gradient norm holds over fp32's whole range, as the exact fp64 sum of squares does.

Both optimizers take every tensor's (or flat run's) norm in fp32 with one fused kernel for
speed (SquaredNormShare); squares of elements above ~1e19 overflow that sum to inf and squares below
~1e-19 fall under fp32's smallest normal. The norm must then still be the exact one.
"""

from __future__ import annotations

import math

import pytest
import torch

from fivefold.config import load_config
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.data_parallel import DataParallelAdamW
from fivefold.parallel.optim import AdamWSettings, ReplicatedAdamW, SquaredNormShare, reduced_norm

SETTINGS = AdamWSettings(0.9, 0.95, 1e-8, 0.1)
SCALES = [1e20, 1e30, 1e-20, 1e-25, 1e-40]  # overflowing squares; squares under the smallest normal


def _exact(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


def squared_sum(grad: torch.Tensor) -> float:
    """The sum of squares of one gradient, through the optimizers' norm (one rank, one copy)."""
    return reduced_norm(SquaredNormShare([grad], [1], "cpu"), None) ** 2


def test_out_of_range_tensors_are_widened_alone_and_in_range_ones_kept():
    """A share of tensors inside and outside fp32's range: the in-range ones keep their fp32
    norm, each divided by its copies; only the others are taken again in fp64."""
    normal, huge = torch.randn(1_000), torch.randn(1_000) * 1e30
    share = SquaredNormShare([normal, huge], [2, 4], "cpu")
    assert share.sums()[1].item() == 1.0
    fp32 = torch.linalg.vector_norm(normal).double() ** 2
    assert share.widened().tolist() == [float(fp32 / 2 + huge.double().norm() ** 2 / 4), 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
def test_squared_sum_is_the_fp64_sum_outside_fp32s_range(scale, dtype):
    grad = (torch.randn(4_099, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)
    assert grad.abs().max() > 0  # a bf16 1e-40 is still representable
    got = float(squared_sum(grad))
    assert got == pytest.approx(_exact(grad), rel=1e-6, abs=0)


@pytest.mark.parametrize("special", [float("inf"), float("nan")])
def test_squared_sum_keeps_a_non_finite_element(special):
    grad = torch.ones(100)
    grad[17] = special
    got = float(squared_sum(grad))
    assert math.isnan(got) if math.isnan(special) else got == special


def test_squared_sum_of_zeros_is_zero():
    assert float(squared_sum(torch.zeros(1_000))) == 0.0


def _tiny_model() -> torch.nn.Module:
    from fivefold.model import Transformer
    from fivefold.parallel.sharding import materialize

    config = load_config("tiny")
    with torch.device("meta"):
        model = Transformer(config.model)
    return materialize(model, config.model, seed=0)


@pytest.mark.parametrize("optimizer", [ReplicatedAdamW, DataParallelAdamW])
@pytest.mark.parametrize("scale", [1e30, 1e-25])  # gradients up to ~1e25; down to ~1e-31
def test_clipping_norm_is_exact_for_huge_and_tiny_gradients(optimizer, scale):
    """The per-tensor norm (ReplicatedAdamW) and the flat-buffer one (DataParallelAdamW,
    whose gradients reach its buckets through backward's hooks). Its buckets are kept to
    ~5k elements: its fp32 vector norm drifts from the exact sum by ~1e-5 on the whole
    model's 170k, a rounding matter apart from the range this test is about."""
    model = _tiny_model()
    small_buckets = {"bucket_mb": 0.02} if optimizer is DataParallelAdamW else {}
    opt = optimizer([model], Mesh.single(), SETTINGS, **small_buckets)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits, _ = model(tokens)
    (logits.pow(2).mean() * scale).backward()
    expected = sum(_exact(p.grad) for p in model.parameters() if p.grad is not None) ** 0.5
    assert 0 < expected < float("inf")
    opt.finish_grad_sync()
    norm = opt.clip_grad_norm(1.0)
    assert norm == pytest.approx(expected, rel=1e-6, abs=0)
    opt.step(1e-3)
    assert all(torch.isfinite(p).all() for p in model.parameters())
