"""train.compile: each block's computation compiled, hooks eager, parity with the eager run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold.config import load_config
from fivefold.layout import validate
from fivefold.mesh import Mesh
from fivefold.parity import assert_parity, train_trace
from helpers import many_layout_parity

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
