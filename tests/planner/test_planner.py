"""Cost-model checks against hand-computed and published formulas."""

import math

import pytest

from fivefold.planner import HARDWARE, LayoutSpec, ModelSpec, estimate
from fivefold.planner.activations import activation_bytes_per_layer, saved_tensors_per_layer
from fivefold.planner.flops import gpt_hardware_flops_full_recompute, gpt_model_flops
from fivefold.planner.model_states import StateBytes, zero_model_states
from fivefold.planner.models import MODELS
from fivefold.planner.params import gpt_formula_params, layer_params
from fivefold.planner.pipeline import bubble_fraction, in_flight

GPT3 = ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048, arch="gpt")


# ---- parameter counts ------------------------------------------------------------------

def test_gpt3_params_match_megatron_formula():
    assert GPT3.num_params() == pytest.approx(gpt_formula_params(96, 12288, 51200, 2048), abs=1)
    assert GPT3.num_params() / 1e9 == pytest.approx(174.6, abs=0.05)


@pytest.mark.parametrize("name,expected", [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)])
def test_llama3_exact_counts(name, expected):
    m = MODELS[name]
    assert m.num_params() == expected
    assert m.active_params() == expected


def test_mixtral_total_and_active():
    m = MODELS["mixtral-8x7b"]
    assert m.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)
    assert m.active_params() / 1e9 == pytest.approx(12.9, abs=0.05)


def test_llama_layer_by_hand():
    m = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=100)
    d = 16
    per_layer = 64 + 64 * 64 + 2 * 64 * 2 * d + 64 * 64 + 64 + 3 * 64 * 96
    assert m.num_params() == 100 * 64 + 2 * per_layer + 64 + 64 * 100
    assert m.replace(tied_embeddings=True).num_params() == m.num_params() - 64 * 100


def test_moe_layer_rule_and_shared_experts():
    m = ModelSpec(arch="llama", layers=6, hidden=32, heads=4, ffn_hidden=64, vocab=50, num_experts=4,
                  top_k=2, expert_ffn_hidden=16, moe_every=2, shared_experts=1, first_dense_layers=2)
    assert [m.is_moe_layer(i) for i in range(6)] == [False, False, False, True, False, True]
    expert = 3 * 32 * 16
    moe_extra = 32 * 4 + 4 * expert + expert - 3 * 32 * 64  # router + experts + shared - dense MLP
    dense = ModelSpec(arch="llama", layers=6, hidden=32, heads=4, ffn_hidden=64, vocab=50)
    assert m.num_params() == dense.num_params() + 2 * moe_extra
    assert m.num_params() - m.active_params() == 2 * 2 * expert


def test_deepseek_v3_shape():
    m = MODELS["deepseek-v3"]
    assert m.num_moe_layers == 58
    assert 640e9 < m.num_params() < 700e9 and 35e9 < m.active_params() < 41e9


# ---- activations (Korthikanti et al. 2022) ---------------------------------------------

S, B, H, A, T = 2048, 2, 1024, 16, 4
SMALL_GPT = ModelSpec(layers=4, hidden=H, heads=A, vocab=1000, seq_len=S, arch="gpt")


def _act(**kw):
    return activation_bytes_per_layer(SMALL_GPT, LayoutSpec(micro_batch=B, **kw), "bf16")


def test_korthikanti_no_parallelism():
    assert _act() == S * B * H * (34 + 5 * A * S / H)


def test_korthikanti_tensor_parallel():
    assert _act(tp=T) == S * B * H * (10 + 24 / T + 5 * A * S / (H * T))


def test_korthikanti_sequence_parallel():
    assert _act(tp=T, sequence_parallel=True) == S * B * H * (34 / T + 5 * A * S / (H * T))


def test_korthikanti_selective_and_full_recompute():
    assert _act(tp=T, sequence_parallel=True, recompute="selective") == S * B * H * 34 / T
    assert _act(tp=T, recompute="selective") == S * B * H * (10 + 24 / T)
    assert _act(recompute="full") == 2 * S * B * H
    assert _act(tp=T, sequence_parallel=True, recompute="full") == 2 * S * B * H / T


def test_llama_saved_tensors_listed_explicitly():
    """fivefold's layer: K/V at their own grouped heads (SDPA's enable_gqa), the attention output
    once (it is the output projection's input), each RMSNorm's input, rstd and x * rstd."""
    m = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=100, seq_len=32)
    saved = saved_tensors_per_layer(m, LayoutSpec(micro_batch=1), "fp32")
    names = [t.name for t in saved]
    for want in ("sdpa.q", "sdpa.k", "sdpa.v", "sdpa.out_and_o_proj.input", "sdpa.logsumexp", "mlp.silu_out",
                 "attn_norm.normalised", "mlp_norm.rstd"):
        assert want in names
    assert len(names) == len(set(names))
    by = {t.name: t for t in saved}
    assert by["sdpa.k"].elements == 32 * 2 * 16 and by["sdpa.logsumexp"].elements == 32 * 4
    total = sum(e * b for _, e, b in saved)
    assert total == 4 * 32 * (8 * 64 + 2 * (2 * 16) + 4 * 96 + 2 + 4)
    assert activation_bytes_per_layer(m, LayoutSpec(), "fp32") == total
    selective = {t.name: t for t in saved_tensors_per_layer(m, LayoutSpec(micro_batch=1, recompute="selective"), "fp32")}
    assert selective["core.k"].elements == 32 * 2 * 16 and "sdpa.logsumexp" not in selective  # checkpoint keeps grouped K/V


def test_interleaved_in_flight_factor():
    # fivefold's interleaved table holds v p - i chunk forwards on stage i: p stages' worth on
    # the first, less than Megatron-LM's p (1 + (p - 1)/(p v)) (Korthikanti et al. 2022), whose
    # warm-up is longer; test_shared_rules.py replays the tables.
    p, v = 4, 2
    lay = LayoutSpec(pp=p, vpp=v, schedule="interleaved", global_batch=16)
    assert in_flight(lay, 0) == pytest.approx(p)
    assert in_flight(lay, p - 1) == pytest.approx((v * p - (p - 1)) / v)
    assert in_flight(LayoutSpec(pp=p, global_batch=16), 0) == p
    assert in_flight(LayoutSpec(pp=p, global_batch=16, schedule="gpipe"), 0) == 16


# ---- ZeRO ------------------------------------------------------------------------------

@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stage_formulas(zero):
    psi, n, k = 1_000_000, 8, 12
    got = zero_model_states(psi, n, zero, StateBytes(2, 2, k))
    want = {0: (2 * psi, 2 * psi, k * psi), 1: (2 * psi, 2 * psi, k * psi / n),
            2: (2 * psi, 2 * psi / n, k * psi / n), 3: (2 * psi / n, 2 * psi / n, k * psi / n)}[zero]
    assert got == tuple(math.ceil(x) for x in want)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_estimate_memory_uses_zero_formulas(zero):
    m = ModelSpec(arch="llama", layers=4, hidden=256, heads=8, ffn_hidden=512, vocab=1024, seq_len=128)
    e = estimate(m, LayoutSpec(dp=4, zero=zero, global_batch=4), "A100-80GB")
    assert (e.memory.params, e.memory.grads, e.memory.optimizer) == zero_model_states(
        m.num_params(), 4, zero, StateBytes(2, 2, 12))
    f32 = estimate(m, LayoutSpec(dp=4, zero=zero, global_batch=4), "A100-80GB", precision="fp32")
    assert (f32.memory.params, f32.memory.grads, f32.memory.optimizer) == zero_model_states(
        m.num_params(), 4, zero, StateBytes(4, 4, 8))


def test_zero3_gathering_once_per_step_holds_the_full_parameters_and_no_gather_buffers():
    """Gathering per micro-batch holds the unit in use and the one prefetched; gathering once per
    step holds every unit full beside its shard, which already covers the units in use."""
    m = ModelSpec(arch="llama", layers=4, hidden=256, heads=8, ffn_hidden=512, vocab=1024, seq_len=128)
    for lay in (LayoutSpec(dp=4, zero=3, global_batch=8), LayoutSpec(dp=4, pp=2, zero=3, global_batch=8)):
        per_micro_batch = estimate(m, lay, "A100-80GB").memory
        per_step = estimate(m, LayoutSpec(**{**lay.__dict__, "zero3_gather": "step"}), "A100-80GB").memory
        assert per_micro_batch.buffers > 0 and per_step.buffers == 0
        assert per_step.params - per_micro_batch.params == pytest.approx(4 * per_micro_batch.params, abs=4)
        assert (per_step.grads, per_step.optimizer) == (per_micro_batch.grads, per_micro_batch.optimizer)


def test_expert_states_shard_over_expert_data_parallel():
    m = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, ffn_hidden=128, vocab=128, seq_len=64,
                  num_experts=8, top_k=2, expert_ffn_hidden=32)
    lay = LayoutSpec(dp=8, ep=4, zero=1, global_batch=8)
    e = estimate(m, lay, "H100-80GB")
    expert = 2 * 8 * 3 * 64 * 32
    dense = m.num_params() - expert
    want = math.ceil(12 * dense / 8) + math.ceil(12 * (expert / 4) / 2)
    assert e.memory.optimizer == want


# ---- FLOPs, bubble, communication ------------------------------------------------------

def test_gpt_flops_formulas():
    lay = LayoutSpec(dp=2, tp=8, pp=8, global_batch=64, recompute="full")
    e = estimate(GPT3, lay, "A100-80GB")
    assert e.flops_per_step == pytest.approx(gpt_model_flops(64, 2048, 96, 12288, 51200))
    assert e.hardware_flops_per_step == pytest.approx(gpt_hardware_flops_full_recompute(64, 2048, 96, 12288, 51200))


def test_bubble_formulas():
    p, m, v = 8, 32, 3
    assert bubble_fraction(LayoutSpec(pp=p, global_batch=m)) == pytest.approx((p - 1) / m)
    assert bubble_fraction(LayoutSpec(pp=p, global_batch=m, schedule="gpipe")) == pytest.approx((p - 1) / m)
    inter = LayoutSpec(pp=p, global_batch=m, schedule="interleaved", vpp=v)
    assert bubble_fraction(inter) == pytest.approx((p - 1) / (m * v))
    zb = LayoutSpec(pp=p, global_batch=m, schedule="zb-h1")
    assert bubble_fraction(zb) == pytest.approx((p - 1) / m / 3)
    e1 = estimate(GPT3, LayoutSpec(tp=8, pp=8, global_batch=m), "A100-80GB")
    ez = estimate(GPT3, LayoutSpec(tp=8, pp=8, global_batch=m, schedule="zb-h1"), "A100-80GB")
    assert e1.bubble_fraction == pytest.approx(7 / m)
    assert e1.bubble_fraction / 3 <= ez.bubble_fraction < e1.bubble_fraction


def test_dp_and_tp_ring_volumes():
    m = ModelSpec(arch="llama", layers=4, hidden=256, heads=8, ffn_hidden=512, vocab=1024, seq_len=128)
    n, psi = 4, m.num_params()
    e0 = estimate(m, LayoutSpec(dp=n, global_batch=n), "A100-80GB")
    assert e0.comm_bytes["dp"] == pytest.approx(2 * (n - 1) / n * 2 * psi)
    assert e0.comm_bytes_by_kind["dp"] == {"all_reduce": pytest.approx(2 * (n - 1) / n * 2 * psi)}
    e1 = estimate(m, LayoutSpec(dp=n, zero=1, global_batch=n), "A100-80GB")
    assert e1.comm_bytes["dp"] == pytest.approx(e0.comm_bytes["dp"])
    e3 = estimate(m, LayoutSpec(dp=n, zero=3, global_batch=n), "A100-80GB")
    kept = psi - 3 * layer_params(m, 0).total  # root and last layer: gathered once, kept for the backward
    assert e3.comm_bytes["dp"] == pytest.approx((n - 1) / n * 2 * (3 * psi - kept))
    t, x = 4, 128 * 256 * 2
    et = estimate(m, LayoutSpec(tp=t, global_batch=1), "A100-80GB")
    layers = 4 * 4 * 2 * (t - 1) / t * x  # 4 all-reduces per layer
    ends = 2 * 2 * (t - 1) / t * x + 3 * 2 * (t - 1) / t * 128 * 4  # embedding, head, loss
    assert et.comm_bytes["tp"] == pytest.approx(layers + ends)
    assert set(et.comm_bytes) == {"dp", "tp", "pp", "cp", "ep"}
    for axis, kinds in et.comm_bytes_by_kind.items():
        assert sum(kinds.values()) == pytest.approx(et.comm_bytes[axis])


def test_ep_cp_pp_volumes():
    m = ModelSpec(arch="llama", layers=4, hidden=64, heads=4, ffn_hidden=128, vocab=128, seq_len=256,
                  num_experts=4, top_k=2, expert_ffn_hidden=32)
    e = estimate(m, LayoutSpec(dp=2, cp=2, ep=4, pp=2, global_batch=4), "H100-80GB")
    x = 256 // 2 * 64 * 2  # b s h / cp bytes
    counts = 4 * 8 * 3 / 4  # the 4 experts' int64 slot counts before each dispatch
    assert e.comm_bytes["ep"] == pytest.approx(2 * 2 * (4 * 3 / 4 * x * 2 + counts))  # 2 layers/stage, 2 mb, 4 a2a, k=2
    kv = 256 // 2 * 64 * 2
    stats = 1 * (2 * 4 + 2) * 4  # per MoE layer pass: per-sequence statistics (fp32); dropless: no capacity base
    assert e.comm_bytes["cp"] == pytest.approx(2 * 2 * (4 * (2 - 1) / 2 * kv * 2 + stats))
    assert e.comm_bytes["pp"] == pytest.approx(2 * x)  # one send per micro-batch on the edge stages


def test_links_follow_rank_order():
    hw = HARDWARE["H100-80GB"]
    e_in = estimate(GPT3, LayoutSpec(tp=8, pp=8, global_batch=8), hw)
    e_out = estimate(GPT3, LayoutSpec(tp=8, pp=8, cp=2, global_batch=8), hw)
    tp_time = e_in.comm_time_s["tp"]
    assert tp_time > 0 and e_out.comm_time_s["cp"] > 0
    slow = [c for c in e_out.collectives if c.axis == "cp"]
    assert all(c.span > hw.gpus_per_node for c in slow)


def test_time_metrics_are_consistent():
    e = estimate(GPT3, LayoutSpec(dp=16, tp=8, pp=8, global_batch=1536, sequence_parallel=True,
                                  recompute="selective", schedule="interleaved", vpp=3), "A100-80GB")
    assert e.fits
    assert e.tokens_per_s * e.step_time_s == pytest.approx(1536 * 2048)
    assert e.mfu == pytest.approx(e.tflops_per_device * 1e12 / HARDWARE["A100-80GB"].peak_flops)
    assert 0.40 < e.mfu < 0.60  # Megatron-LM reports about half of peak for this setting
    assert e.hfu >= e.mfu


def test_hardware_presets(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE_DIR", str(tmp_path))  # "cpu": the defaults, not this user's calibration
    for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H800", "H200", "cpu"):
        hw = HARDWARE[name]
        assert hw.peak_flops > 0 and hw.memory_bytes > 0 and hw.gpus_per_node >= 1
        assert hw.intra_node_bw >= hw.inter_node_bw > 0
    assert HARDWARE["a100-80gb"] is HARDWARE["A100-80GB"]
