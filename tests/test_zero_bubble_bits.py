"""zb-h1's weight step gives 1F1B's gradients bit for bit, at the sizes real runs use.

The pipeline tests use micro-batches of 16-32 rows. A GEMM splits its inner dimension (the
micro-batch's rows, for dW = dy^T x) into blocks of a few hundred; a weight step that lets
the GEMM add into .grad (beta = 1) adds each block's partial product in turn, which rounds
differently from adding one dW, as a plain backward does, once a micro-batch reaches 512
rows on MKL. This test trains with 1024; test_pipeline.py checks one weight step at the
same size.
"""

from __future__ import annotations

import torch

from fivefold.config import load_config
from helpers import traces_on_rank

SMALLER = ["model.layers=2"]  # two weight steps of two layers show it; fewer layers, less time


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
