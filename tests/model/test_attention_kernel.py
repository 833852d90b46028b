"""Which devices and dtypes keep grouped K/V heads for SDPA (else they are repeated first)."""

from __future__ import annotations

import pytest
import torch

from fivefold.model.attention import grouped_query_attention
from fivefold.model.attention import keeps_grouped_kv


@pytest.mark.parametrize("device, dtype, masked, expected", [
    ("cpu", torch.float32, False, True), ("cpu", torch.float32, True, True), ("cpu", torch.bfloat16, True, True),
    ("cuda", torch.bfloat16, False, True), ("cuda", torch.float16, False, True),
    ("cuda", torch.bfloat16, True, False), ("cuda", torch.float32, False, False),  # math kernel's s x s otherwise
])
def test_grouped_heads_are_kept_only_where_a_fused_kernel_takes_them(device, dtype, masked, expected):
    assert keeps_grouped_kv(device, dtype, masked) is expected


def test_repeated_heads_give_the_grouped_result():
    """The repeat (CUDA's fp32 path) and the grouped kernel agree; shown on the CPU with the
    repeat forced through the same function the runtime calls."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    grouped = grouped_query_attention(q, k, v)
    repeated = grouped_query_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(grouped, repeated, rtol=1e-12, atol=1e-12)
