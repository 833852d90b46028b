"""The planner and the runtime describe one system: the planner ranks only layouts that
`fivefold train` accepts, every layout the runtime accepts (within the searched ranges) is
considered, tp > kv heads is planned as the runtime runs it, and the time model never
reports an MFU above the matmul efficiency it assumes."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fivefold.config import Layout
from fivefold.rules.layout import CP_ALGORITHMS, LayoutError, validate
from fivefold.planner import HARDWARE, LayoutSpec, ModelSpec, PlanError, estimate, load_model, search
from fivefold.planner.bridge import layout_spec, model_config, runtime_config
from fivefold.planner.hardware import hardware_for_gpu
from fivefold.planner.params import kv_replica_params
from fivefold.planner.search import DEFAULT_MICRO_BATCHES
from fivefold.planner.spec import divisors

DENSE = ModelSpec(name="dense-gqa", arch="llama", layers=6, hidden=256, heads=8, kv_heads=2, ffn_hidden=512,
                  vocab=1000, seq_len=256)
MOE = ModelSpec(name="moe", arch="llama", layers=4, hidden=128, heads=4, ffn_hidden=256, vocab=512, seq_len=128,
                num_experts=4, top_k=2, expert_ffn_hidden=128, first_dense_layers=1)
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
# memory is not what these tests are about: every layout fits
ROOMY = dataclasses.replace(HARDWARE["H100-80GB"], memory_bytes=1 << 50)


def _structure(lay: LayoutSpec) -> tuple:
    return (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep, lay.vpp, lay.schedule, lay.sequence_parallel,
            lay.cp_kind if lay.cp > 1 else "-", lay.micro_batch)


@pytest.mark.parametrize("model,gpus,batch", [(DENSE, 4, 8), (DENSE, 8, 16), (DENSE, 16, 16), (MOE, 8, 16),
                                              (MOE, 16, 16)])
def test_every_ranked_layout_is_accepted_by_the_runtime(model, gpus, batch):
    ranked = search(model, gpus=gpus, hardware="H100-80GB", global_batch=batch, top=None, schedules=ALL_SCHEDULES)
    assert len(ranked) > 20
    for lay, _ in ranked:
        validate(runtime_config(model, lay), gpus)  # raises LayoutError if fivefold train refuses it
    assert any(lay.tp > model.n_kv_heads for lay, _ in ranked) == (model is DENSE)


@pytest.mark.parametrize("name,gpus,batch", [("llama3-8b", 64, 512), ("mixtral-8x7b", 64, 512)])
def test_the_best_layouts_of_published_models_are_accepted_by_the_runtime(name, gpus, batch):
    model = load_model(name)
    ranked = search(model, gpus=gpus, hardware="H100-80GB", global_batch=batch, top=30)
    assert len(ranked) == 30
    for lay, _ in ranked:
        validate(runtime_config(model, lay), gpus)


def _runtime_accepted(model: ModelSpec, gpus: int, batch: int) -> set[tuple]:
    """Brute force: every layout in the search's ranges that the runtime's validate accepts."""
    base = runtime_config(model, LayoutSpec(global_batch=batch))
    out = set()
    for tp, pp, cp, ep, vpp, sched, sp, kind, mb in itertools.product(
            divisors(gpus), divisors(gpus), divisors(gpus), divisors(gpus), (1, 2, 3, 4), ALL_SCHEDULES,
            (False, True), CP_ALGORITHMS, DEFAULT_MICRO_BATCHES):
        if gpus % (tp * pp * cp) or (cp == 1 and kind != "allgather") or (pp == 1 and (sched != "1f1b" or vpp > 1)):
            continue
        if (sched == "interleaved") != (vpp > 1):
            continue
        layout = Layout(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp, pp_schedule=sched,
                        sequence_parallel=sp, cp_algorithm=kind, micro_batch=mb)
        try:
            config = validate(base.replace(layout=layout), gpus)
        except LayoutError:
            continue
        out.add(_structure(layout_spec(config.layout, batch)))
    return out


@pytest.mark.parametrize("model,gpus,batch", [(DENSE, 8, 16), (MOE, 8, 16)])
def test_every_layout_the_runtime_accepts_is_considered(model, gpus, batch):
    ranked = search(model, gpus=gpus, hardware=ROOMY, global_batch=batch, top=None, schedules=ALL_SCHEDULES)
    assert {_structure(lay) for lay, _ in ranked} == _runtime_accepted(model, gpus, batch)


def test_planner_refuses_what_the_runtime_refuses_with_its_message():
    with pytest.raises(PlanError, match="layout.dp_shard=2 shards ZeRO state but zero=0"):
        estimate(DENSE, LayoutSpec(dp=4, dp_shard=2, zero=0, global_batch=4))
    assert all(lay.zero or not lay.dp_shard for lay, _ in search(DENSE, gpus=8, global_batch=16, top=None))


def test_tp_beyond_kv_heads_repeats_them_as_the_runtime_does():
    tp = 8  # 2 kv heads: each rank holds one whole head, repeated on 4 ranks
    e = estimate(DENSE, LayoutSpec(tp=tp, global_batch=1), "H100-80GB", precision="fp32")
    d, h = DENSE.head_dim, DENSE.hidden
    extra, _ = kv_replica_params(DENSE, tp)
    assert extra == 2 * h * d * (1 - 2 / tp)
    even = DENSE.num_params() / tp  # norms are replicated, so an even split is a lower bound
    assert e.memory.params >= 4 * (even + DENSE.layers * extra)
    shared = [c for c in e.collectives if c.what == "shared kv heads"]
    assert len(shared) == 1 and shared[0].nbytes == 2 * 2 * DENSE.layers * d * h * 4


def test_runtime_model_round_trip():
    for m in (DENSE, MOE, load_model("llama3-405b"), load_model("deepseek-v3")):
        assert dataclasses.replace(m) == m
        config = model_config(m)
        assert config.ffn == m.ffn and config.n_kv_heads == m.n_kv_heads and config.is_moe == m.is_moe
        assert [config.is_moe_layer(i) for i in range(m.layers)] == list(m.moe_layers)


@pytest.mark.parametrize("seq_len", [1024, 4096, 8192, 32768, 65536, 131072])
def test_mfu_never_exceeds_the_matmul_efficiency(seq_len):
    hw = HARDWARE["H100-80GB"]
    m = load_model("llama3-8b").replace(seq_len=seq_len)
    cp = max(1, seq_len // 8192)
    for lay in (LayoutSpec(tp=8, cp=cp, global_batch=1, cp_kind="ring"),
                LayoutSpec(tp=8, cp=cp, global_batch=1, cp_kind="allgather", recompute="selective"),
                LayoutSpec(dp=8, cp=cp, global_batch=8, zero=1, recompute="full")):
        e = estimate(m, lay, hw)
        assert e.mfu <= e.hfu <= hw.matmul_efficiency, (lay.short(), e.mfu, e.hfu)


def test_gpu_names_map_to_presets():
    assert hardware_for_gpu("NVIDIA H100 80GB HBM3", 85_000_000_000).name == "H100-80GB"
    assert hardware_for_gpu("NVIDIA A100-SXM4-40GB", 42_000_000_000).name == "A100-40GB"
    assert hardware_for_gpu("NVIDIA H200", 150_000_000_000).name == "H200"
    with pytest.raises(PlanError, match="no hardware preset for the GPU 'Radeon 7'.*fivefold plan --hardware"):
        hardware_for_gpu("Radeon 7")


@pytest.mark.parametrize("call,pattern", [
    (lambda: search(DENSE, gpus=0), "gpus must be a positive integer"),
    (lambda: search(DENSE, gpus=8, hardware="B300"), "unknown hardware 'B300'; use one of .*H100-80GB"),
    (lambda: estimate(DENSE, LayoutSpec(tp=3, global_batch=1)), "tp=3 does not divide 8 attention heads"),
    (lambda: estimate(DENSE, LayoutSpec(cp=3, global_batch=1)), "seq_len=256 is not divisible by 3"),
    (lambda: estimate(MOE, LayoutSpec(dp=2, ep=3, global_batch=2)), "ep=3 must divide dp x cp = 2"),
    (lambda: search(DENSE, gpus=7, global_batch=8), "no layout of 7 devices divides dense-gqa"),
])
def test_bad_input_names_the_fix(call, pattern):
    with pytest.raises(PlanError, match=pattern):
        call()


def test_estimate_of_a_runtime_config():
    from fivefold.config import load_config
    from fivefold.planner import estimate_run
    from fivefold.planner.bridge import model_spec

    config = load_config("llama3-70b", ["layout.tp=8", "layout.pp=4", "layout.dp=2", "layout.zero=1",
                                        "layout.micro_batch=1"])
    e = estimate_run(config, "H100-80GB")
    layout = LayoutSpec(tp=8, pp=4, dp=2, zero=1, micro_batch=1, cp_kind="ring", global_batch=512)
    want = estimate(model_spec(config.model, 8192), layout, "H100-80GB")
    assert e.layout == want.layout and e.memory == want.memory and e.step_time_s == want.step_time_s
    with pytest.raises(LayoutError, match="layout.dp_shard=3 does not divide dp=2"):
        estimate_run(config.replace(layout=dataclasses.replace(config.layout, dp_shard=3)))


@pytest.mark.parametrize("lay", [
    LayoutSpec(dp=2, pp=3, global_batch=12), LayoutSpec(dp=2, tp=2, pp=2, vpp=3, schedule="interleaved", global_batch=8),
    LayoutSpec(dp=4, ep=2, global_batch=8), LayoutSpec(dp=2, pp=4, schedule="gpipe", global_batch=8)])
def test_memory_grid_equals_the_estimates_it_stands_for(lay):
    from fivefold.planner import memory_grid
    from fivefold.planner.estimate import CostCache

    model = MOE.replace(layers=6) if lay.ep > 1 else DENSE
    zeros = (0, 1, 2) if lay.pp > 1 else (0, 1, 2, 3)
    def estimates(cache):
        return {(z, r): estimate(model, lay.with_states(z, r), "H100-80GB", cache=cache).memory.total
                for z in zeros for r in ("none", "selective", "full")}

    cache = CostCache(model, "bf16")  # estimates first, then the grid on the same cache
    first = estimates(cache)
    assert memory_grid(model, lay, "H100-80GB", zeros=zeros, cache=cache) == first
    cache = CostCache(model, "bf16")  # and the other way round
    assert memory_grid(model, lay, "H100-80GB", zeros=zeros, cache=cache) == first == estimates(cache)
