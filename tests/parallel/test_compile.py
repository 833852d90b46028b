"""train.compile: each block's computation compiled, hooks eager, parity with the eager run.

Every layout axis is covered: data parallel, ZeRO-3, tensor + sequence parallel, the pipeline
schedules, context parallel (each algorithm), expert parallel, recomputation and bf16. Tiny
models and two steps keep compilation short; layouts whose blocks see the same shapes share a
pool call, since their graphs come from inductor's on-disk cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold.config import load_config
from fivefold.rules.layout import validate
from fivefold.parallel.mesh import Mesh
from fivefold.tools.parity import assert_parity, train_trace
from helpers import many_layout_parity, traces_on_rank
from test_precision import BF16_LOSS_RTOL, BF16_PARAM_DISPLACEMENT_RTOL

STEPS = 2


def compiled_tiny(*overrides: str):
    return load_config("tiny", ["train.seq_len=16", "train.compile=true", *overrides])


def eager(config):
    return config.replace(train=dataclasses.replace(config.train, compile=False))


@pytest.fixture(scope="module")
def eager_reference(reference):
    """The eager single-process run of a config: what a compiled run must match."""
    return lambda config, steps: reference(eager(config), steps)


def test_block_computation_compiles_to_one_graph():
    from fivefold.model.llama import build_model

    config = load_config("tiny", [])
    block = build_model(config.model, seed=0).layers["0"]
    x = torch.randn(2, 8, config.model.hidden)
    rope = build_model(config.model, seed=0).rope(torch.arange(8))
    explanation = torch._dynamo.explain(block._forward)(x, *rope)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


def test_final_norm_head_and_loss_compile_to_one_graph_each():
    from fivefold.model.llama import build_model
    from fivefold.model.step import whole_cross_entropy_sum  # what compile_model_end compiles

    config = load_config("tiny", [])
    model = build_model(config.model, seed=0)
    x = torch.randn(2, 8, config.model.hidden)
    targets = torch.randint(0, config.model.vocab_size, (2, 8))
    for region, args in ((model.final, (x,)), (whole_cross_entropy_sum, (model.final(x), targets))):
        explanation = torch._dynamo.explain(region)(*args)
        assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


def test_compiled_single_process_matches_eager(eager_reference):
    # Two micro-batches give the per-rank shapes of dp=2, so the data-parallel test below
    # finds these graphs in inductor's on-disk cache instead of compiling them again.
    config = validate(compiled_tiny("layout.grad_accum=2"))
    compiled = train_trace(config, Mesh.single(config.layout), STEPS)
    assert_parity(eager_reference(config, STEPS), compiled)


def test_compiled_data_and_tensor_parallel_match_eager(pools, eager_reference):
    # One pool call per layout: each compiles its own graphs (tensor parallel breaks the
    # block's graph at its collectives) and gets the pool's full timeout for it.
    for overrides in (["layout.dp=2"], ["layout.tp=2", "layout.sequence_parallel=true"]):
        many_layout_parity(pools, eager_reference, [compiled_tiny(*overrides)], steps=STEPS)


def test_compiled_pipeline_zero3_and_full_recompute_match_eager(pools, eager_reference):
    # Every layout here runs blocks on micro-batches of the single-process test's shape, so
    # their graphs come from inductor's cache: one pool call holds them all. zb-h1 under
    # compile defers no weight gradient (a compiled block's backward is one node): B does all.
    layouts = [
        ["layout.pp=2", "layout.grad_accum=2"],
        ["layout.pp=2", "layout.vpp=2", "layout.pp_schedule=interleaved", "layout.grad_accum=2"],
        ["layout.pp=2", "layout.pp_schedule=zb-h1", "layout.grad_accum=2"],
        ["layout.dp=2", "layout.zero=3"],
        ["layout.dp=2", "layout.recompute=full"],
    ]
    many_layout_parity(pools, eager_reference, [compiled_tiny(*o) for o in layouts], steps=STEPS)


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses"])
def test_compiled_context_parallel_matches_eager(pools, eager_reference, algorithm):
    # One pool call per algorithm: each has its own attention core and compiles its own graphs.
    config = compiled_tiny("layout.cp=2", f"layout.cp_algorithm={algorithm}")
    many_layout_parity(pools, eager_reference, [config], steps=STEPS)


def test_compiled_selective_recompute_and_expert_parallel_match_eager(pools, eager_reference):
    # The MoE layer runs eagerly inside its compiled block (token counts per expert are data).
    configs = [compiled_tiny("layout.dp=2", "layout.recompute=selective")]
    configs += [load_config("tiny-moe", ["train.seq_len=16", "train.compile=true", "layout.dp=2", "layout.ep=2"])]
    many_layout_parity(pools, eager_reference, configs, steps=STEPS)


@pytest.mark.parametrize("policy", [["train.dtype=bf16", "train.param_dtype=bf16"], ["train.dtype=bf16"]])
def test_compiled_bf16_is_within_bf16_rounding_of_fp32(pools, reference, policy):
    # Inductor computes a fused chain of bf16 element-wise operations in fp32 and rounds once,
    # where eager rounds after every operation: compiled and eager bf16 differ by bf16
    # rounding, not by fp32 rounding. Both policies (bf16 parameters, and fp32 parameters
    # under bf16 autocast) are held to test_precision's bounds against the fp32 run, on what
    # parity compares: the loss of every step and the final parameters.
    config = compiled_tiny("layout.dp=2", *policy)
    trace = pools.run(2, traces_on_rank, [config], STEPS)[0][0]
    fp32 = eager(compiled_tiny("layout.dp=2"))
    expected, initial = reference(fp32, STEPS), reference(fp32, 0)
    assert trace.losses == pytest.approx(expected.losses, rel=BF16_LOSS_RTOL)
    for name, ref in expected.params.items():
        moved = (ref - initial.params[name]).norm()
        relative = float((trace.params[name].float() - ref).norm() / moved)
        assert relative <= BF16_PARAM_DISPLACEMENT_RTOL, (name, relative)
