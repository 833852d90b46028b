"""zb-h1's weight step gives 1F1B's gradients bit for bit, at the sizes real runs use.

The pipeline tests use micro-batches of 16-32 rows. A GEMM splits its inner dimension (the
micro-batch's rows, for dW = dy^T x) into blocks of a few hundred; a weight step that lets
the GEMM add into .grad (beta = 1) adds each block's partial product in turn, which rounds
differently from adding one dW, as a plain backward does, once a micro-batch reaches 512
rows on MKL. These tests use 1024.
"""

from __future__ import annotations

import torch

from fivefold.config import load_config
from fivefold.model.llama import build_model
from fivefold.parallel.pipeline import WeightGradDeferral, apply_deferred_weight_grads
from helpers import traces_on_rank

ROWS = (4, 256)  # sequences x tokens of one micro-batch: 1024 rows
SMALLER = ["model.layers=2"]  # two weight steps of two layers show it; fewer layers, less time


def _micro_batches(count: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, ROWS, generator=generator) for _ in range(count)]


def test_weight_step_accumulates_micro_batches_to_the_bits_of_a_plain_backward():
    model = build_model(load_config("tiny", SMALLER).model, seed=0)
    batches = _micro_batches(2, model.config.vocab_size)  # the second one's W adds into .grad
    for ids in batches:  # what 1F1B does per micro-batch: one backward, autograd accumulates
        model(ids)[0].square().mean().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    deferral = WeightGradDeferral(model)
    order = list(model.parameters())[::-1]
    for ids in batches:
        pending: list = []
        with deferral.collect(pending) as deferred:
            out = model(ids)[0]
        others = [p for p in model.parameters() if id(p) not in deferred]
        grads = torch.autograd.grad([out.square().mean()], others, allow_unused=True)  # B
        held = {id(p): (p, g) for p, g in zip(others, grads) if g is not None}
        apply_deferred_weight_grads(pending, held, order)  # W
    unequal = [name for name, p in model.named_parameters() if not torch.equal(p.grad, expected[name])]
    assert not unequal


def test_zb_h1_trains_to_the_bits_of_1f1b_with_micro_batches_of_1024_rows(pools):
    configs = [
        load_config("tiny", [*SMALLER, "train.seq_len=256", "layout.pp=2", "layout.grad_accum=2",
                             f"layout.pp_schedule={name}"])
        for name in ("1f1b", "zb-h1")
    ]
    one_f_one_b, zero_bubble = pools.run(2, traces_on_rank, configs, 1)[0]
    assert zero_bubble.losses == one_f_one_b.losses
    assert zero_bubble.grad_norms == one_f_one_b.grad_norms
    assert all(torch.equal(zero_bubble.params[k], one_f_one_b.params[k]) for k in one_f_one_b.params)
