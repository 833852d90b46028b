"""DeepSeek-V3 (arXiv 2412.19437) in the planner: its attention shape, FP8 GEMMs, node-limited
expert routing, DualPipeV, expert-load imbalance, and its published training run."""

import pytest

from fivefold.planner import HARDWARE, LayoutSpec, ModelSpec, estimate
from fivefold.planner.activations import saved_tensors_per_layer
from fivefold.planner.errors import PlanError
from fivefold.planner.estimate import CostCache
from fivefold.planner.flops import attention_width, hardware_flops_per_step
from fivefold.planner.models import MODELS
from fivefold.planner.params import layer_params
from fivefold.planner.pipeline import (
    bubble_fraction,
    dualpipev_bubble_units,
    dualpipev_exposed,
)
from fivefold.planner.spec import parse_layout
from fivefold.rules.node_routing import link_shares
from fivefold.tools.plan_cli import run_plan_cli

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


# ---- FP8 GEMMs --------------------------------------------------------------------------

SMALL_MOE = ModelSpec(arch="llama", layers=4, hidden=256, heads=4, ffn_hidden=512, vocab=512, seq_len=256,
                      num_experts=8, top_k=2, expert_ffn_hidden=128)


@pytest.mark.parametrize("name", ["H100-80GB", "H800", "H200"])
def test_fp8_peaks_are_twice_bf16_on_hopper(name):
    assert HARDWARE[name].fp8_speedup("fp8") == pytest.approx(2.0, rel=0.001) and HARDWARE[name].fp8_speedup("bf16") == 1.0


def test_fp8_runs_the_covered_linears_twice_as_fast_and_not_the_router():
    lay = LayoutSpec(micro_batch=1)
    cost = CostCache(SMALL_MOE, "fp8").layer(lay, True)
    assert cost.router_mm == 2 * 256 * 256 * 8
    assert cost.gemm_equivalent(2.0) == cost.router_mm + (cost.mm - cost.router_mm) / 2
    bf16 = estimate(SMALL_MOE, lay, "H800", "bf16")
    fp8 = estimate(SMALL_MOE, lay, "H800", "fp8")
    assert fp8.compute_time_s < bf16.compute_time_s
    assert fp8.flops_per_step == bf16.flops_per_step and fp8.mfu > bf16.mfu  # MFU against the bf16 peak
    assert fp8.memory.model_states == bf16.memory.model_states  # bf16 weights, fp32 master and moments


def test_fp8_keeps_linear_inputs_and_sends_the_dispatch_in_one_byte():
    lay = LayoutSpec(dp=2, ep=2, global_batch=2)
    saved = {t.name: t for t in saved_tensors_per_layer(SMALL_MOE, lay, "fp8", moe=True)}
    assert saved["experts.input"].bytes_per_element == 1
    assert saved["router_and_shared.input"].bytes_per_element == 2  # the router stays in bf16
    sends = {c.what: c.nbytes for c in estimate(SMALL_MOE, lay, "H800", "fp8").collectives if c.axis == "ep"}
    routed = 256 * 2 * 256  # tokens x top_k x hidden
    assert sends["dispatch"] == routed and sends["combine grad"] == routed
    assert sends["combine"] == 2 * routed and sends["dispatch grad"] == 2 * routed


# ---- node-aware expert all-to-all --------------------------------------------------------

def test_link_shares_of_plain_and_node_limited_all_to_all():
    plain = link_shares(top_k=8, ep=64, tp=1, gpus_per_node=8)
    assert plain.intra == pytest.approx(7 / 64) and plain.inter == pytest.approx(7 / 8)
    assert plain.intra + plain.inter == pytest.approx(63 / 64)  # every copy not for this rank, once
    limited = link_shares(top_k=8, ep=64, tp=1, gpus_per_node=8, route_nodes=4)
    assert limited.inter == pytest.approx(4 * 7 / 8 / 8)  # one copy per remote node reached
    assert limited.intra == pytest.approx(7 / 8)  # forwarded inside the target nodes
    assert link_shares(top_k=8, ep=8, tp=1, gpus_per_node=8) == (7 / 8, 0.0)


def test_node_limited_routing_shortens_the_all_to_all():
    lay = LayoutSpec(dp=16, ep=16, global_batch=16)
    wide = SMALL_MOE.replace(num_experts=32, top_k=8)
    free = estimate(wide, lay, "H800")
    limited = estimate(wide.replace(route_nodes=1), lay, "H800")
    assert limited.comm_time_s["ep"] < free.comm_time_s["ep"]


def test_route_nodes_beyond_the_ep_group_is_refused_with_the_fix():
    with pytest.raises(PlanError, match=r"route_nodes=4 exceeds the 1 node\(s\) an ep=8 group spans.*"
                                        r"use route_nodes <= 1.*ep >= 32"):
        estimate(V3, LayoutSpec(dp=8, ep=8, global_batch=8, pp=8), "H800")


def test_plan_cli_refuses_route_nodes_beyond_the_ep_group_in_one_line(capsys):
    code = run_plan_cli(["--model", "deepseek-v3", "--hardware", "H800", "--layout", "dp=8,ep=8,pp=8,zero=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "use route_nodes <= 1" in err and "Traceback" not in err


# ---- DualPipeV ----------------------------------------------------------------------------

def test_dualpipev_bubble_follows_its_published_formula():
    # (p - 1)(F&B + B_full - 3W) per chunk, a chunk half a device: (p - 1)(F + 2B - W) / 2
    assert dualpipev_bubble_units(4, 1.0, 1.0, 1.0) == pytest.approx(3 * 2 / 2 / 3)
    assert dualpipev_bubble_units(8, 1.0, 2.0, 1.0) == pytest.approx(7 * 4 / 2 / 4)
    lay = LayoutSpec(pp=4, global_batch=16, schedule="dualpipev")
    assert bubble_fraction(lay, 1.0, 1.0, 1.0) == pytest.approx(1.0 / 16)


def test_dualpipev_hides_communication_up_to_the_paired_compute():
    # p / m of it has no partner; the rest hides behind as much compute as there is
    assert dualpipev_exposed(comm_s=2.0, compute_s=10.0, pp=4, mbs=8) == pytest.approx(1.0)
    assert dualpipev_exposed(comm_s=10.0, compute_s=4.0, pp=4, mbs=8) == pytest.approx(5.0 + 3.0)
    assert dualpipev_exposed(comm_s=10.0, compute_s=4.0, pp=8, mbs=8) == pytest.approx(10.0)


def test_dualpipev_exposes_less_all_to_all_than_zero_bubble():
    wide = SMALL_MOE.replace(num_experts=32, seq_len=2048, layers=8)  # 2 chunks of 1 layer per rank under the V
    lay = LayoutSpec(dp=16, ep=16, pp=4, global_batch=256, schedule="zb-h1")
    zb = estimate(wide, lay, "H800")
    dual = estimate(wide, lay.replace(schedule="dualpipev"), "H800")
    assert dual.comm_time_s["ep"] == pytest.approx(zb.comm_time_s["ep"])
    assert dual.comm_exposed_s["ep"] < zb.comm_exposed_s["ep"] == zb.comm_time_s["ep"]
    assert dual.comm_exposed_s["ep"] >= 4 / 16 * dual.comm_time_s["ep"]  # the unpaired warm-up and cool-down
    assert not lay.replace(schedule="dualpipev").runtime_gaps()  # the runtime runs DualPipeV (vpp=2, a V)
    assert lay.replace(schedule="dualpipev").vpp == 2


# ---- expert-load imbalance -------------------------------------------------------------------

def test_expert_imbalance_slows_expert_gemms_and_all_to_all_of_the_busiest_rank():
    lay = LayoutSpec(dp=2, ep=2, global_batch=2)
    even = estimate(SMALL_MOE, lay, "H800")
    busy = estimate(SMALL_MOE, lay.replace(expert_imbalance=1.5), "H800")
    assert busy.comm_time_s["ep"] == pytest.approx(1.5 * even.comm_time_s["ep"])
    assert busy.compute_time_s > even.compute_time_s
    assert busy.comm_bytes == even.comm_bytes  # bytes are the mean rank's, as the runtime counts them
    assert parse_layout("dp=2,ep=2,imbalance=1.25").expert_imbalance == 1.25
    with pytest.raises(PlanError, match="use a number >= 1.0"):
        parse_layout("dp=2,ep=2,imbalance=0.5")


# ---- DeepSeek-V3's memory rules ---------------------------------------------------------------

def test_selective_recomputation_of_mla_keeps_latents_and_norm_inputs_only():
    lay = LayoutSpec(dp=64, ep=64, global_batch=64, recompute="selective")
    names = {t.name for t in saved_tensors_per_layer(V3, lay, "bf16", moe=True)}
    assert {"q_b.input", "kv_b.input", "attn_norm.input", "mlp_norm.input"} <= names
    assert not names & {"core.q", "core.k", "core.v", "attn_norm.input_fp32", "attn_norm.rstd"}
    extra = hardware_flops_per_step(V3, 1, "selective") - hardware_flops_per_step(V3, 1, "none")
    up = 128 * (1536 * 192 + 512 * 256)
    assert extra > 2.0 * 4096 * 61 * up  # the attention core and the up-projections rerun


def test_fp8_keeps_swiglu_inputs_and_recomputes_its_output():
    saved = {t.name: t for t in saved_tensors_per_layer(SMALL_MOE, LayoutSpec(), "fp8", moe=True)}
    assert saved["experts.gate_out"].bytes_per_element == saved["experts.up_out"].bytes_per_element == 1
    assert "experts.silu_out" not in saved and "experts.down_input" not in saved


# ---- the published run --------------------------------------------------------------------------

# arXiv 2412.19437 Section 3: 2048 H800, PP16 with DualPipe, EP64 over 8 nodes, ZeRO-1 data
# parallel, no tensor parallelism, sequence 4096, batch 15360; recomputation of the norms and
# the MLA up-projections (Section 3.2.3). 2.664M GPU hours for 14.8T tokens (Table 1).
V3_LAYOUT = "dp=128,pp=16,ep=64,zero=1,schedule=dualpipev,recompute=selective,mb=1"
V3_TOKENS_PER_GPU_S = 14.8e12 / (2.664e6 * 3600)  # about 1,543


def _v3_run():
    return estimate(V3, parse_layout(V3_LAYOUT, global_batch=15360), "H800", "fp8", gpus=2048)


def test_deepseek_v3_run_hides_its_all_to_all_and_predicts_its_throughput_within_a_third():
    e = _v3_run()
    assert e.comm_exposed_s["ep"] < 0.15 * e.comm_time_s["ep"]  # DualPipeV and node-limited routing
    ratio = e.tokens_per_s / 2048 / V3_TOKENS_PER_GPU_S
    assert 1.0 < ratio < 1.35, ratio  # the remaining differences: fivefold/planner/README.md
    assert 80 < e.memory.total / 2**30 < 90  # within 15 % of the 80 GB, over it (README)


@pytest.mark.xfail(strict=True, reason="the planner predicts 33 % faster and 86 GiB; see fivefold/planner/README.md")
def test_deepseek_v3_run_fits_and_predicts_within_15_percent():
    e = _v3_run()
    assert e.fits and e.tokens_per_s / 2048 == pytest.approx(V3_TOKENS_PER_GPU_S, rel=0.15)
