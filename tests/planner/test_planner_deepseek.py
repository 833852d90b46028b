"""DeepSeek-V3 (arXiv 2412.19437) in the planner: its attention shape, FP8 GEMMs, node-limited
expert routing, DualPipeV, expert-load imbalance, and its published training run."""

import pytest

from fivefold.planner import LayoutSpec, ModelSpec, estimate
from fivefold.planner.activations import saved_tensors_per_layer
from fivefold.planner.errors import PlanError
from fivefold.planner.flops import attention_width
from fivefold.planner.models import MODELS
from fivefold.planner.params import layer_params

V3 = MODELS["deepseek-v3"]


# ---- multi-head latent attention -------------------------------------------------------

def test_deepseek_v3_matches_its_published_parameter_counts():
    # Section 4.2: 671B total parameters, 37B activated for each token
    assert V3.num_params() / 1e9 == pytest.approx(671, rel=0.005)
    assert V3.active_params() / 1e9 == pytest.approx(37, rel=0.02)


def test_mla_attention_parameters_flops_and_saved_tensors():
    h, heads, ql, kvl, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    lp = layer_params(V3, 0)
    attention = (h * ql + ql * heads * (nope + rope) + h * (kvl + rope) + kvl * heads * (nope + v)
                 + heads * v * h)
    assert lp.dense.matmul == attention + 3 * h * 18432
    assert lp.dense.replicated == h * ql + h * (kvl + rope) + ql + kvl + 2 * h  # down-projections, norms
    assert attention_width(V3) * 2 == heads * (nope + rope + v)  # scores at 192 per head, weighted sum at 128
    saved = {t.name: t for t in saved_tensors_per_layer(V3, LayoutSpec(micro_batch=1), "bf16", moe=False)}
    assert saved["core.k"].elements == 4096 * heads * (nope + rope)
    assert saved["core.v"].elements == 4096 * heads * v
    assert saved["kv_b.input"].elements == 4096 * kvl


def test_mla_fields_are_checked():
    with pytest.raises(PlanError, match="qk_nope_dim, qk_rope_dim and v_head_dim"):
        ModelSpec(arch="llama", layers=2, hidden=64, heads=4, vocab=100, kv_lora_rank=16)


def test_runtime_gaps_name_what_fivefold_train_cannot_train():
    assert any("multi-head latent attention" in g for g in V3.runtime_gaps())
    assert MODELS["llama3-8b"].runtime_gaps() == ()
