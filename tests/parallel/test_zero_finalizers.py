"""ZeRO-2/3 with gradient finalizers: only the finalized parameters keep full gradients.

Gradient finalizers sum partial gradients over another axis: sequence-parallel norm weights
and MoE routers over tp, kv heads shared by tp ranks (tp > kv heads), the word embedding tied
across the pipeline ends. Their parameters sit in deferred buckets, reduced once per step
after the finalizers; every other bucket is reduce-scattered during each backward
(parallel/zero.py). Each finalizer kind is checked against the single-process run under
ZeRO-2 and ZeRO-3 (ZeRO-3 refuses pipelines) with gradient accumulation, and at the end of
the backward a rank holds exactly the finalized parameters' full gradients plus its shards.
"""

from __future__ import annotations

import pytest
import torch

from fivefold.config import load_config

from helpers import many_layout_parity
from test_planner_agreement import _case as agreement_case
from test_planner_agreement import _case_id as agreement_case_id
from test_planner_agreement import test_every_rank_matches_the_plan_of_its_stage as check_agreement


def _cfg(preset: str, *extra: str, **layout):
    overrides = [f"layout.{k}={v}" for k, v in layout.items()]
    return load_config(preset, ["train.seq_len=16", "model.layers=2", *extra, *overrides])


SP_NORMS = dict(dp=2, tp=2, sequence_parallel=True, grad_accum=2)
ROUTERS = dict(dp=2, tp=2, grad_accum=2)  # tiny-moe: router gradients summed over tp
SHARED_KV = ("model.kv_heads=1",)  # tp=2 over one kv head: both ranks hold it
TIED = ("model.tied_embeddings=true",)

FINALIZER_LAYOUTS = [
    *(_cfg("tiny", zero=z, **SP_NORMS) for z in (2, 3)),
    *(_cfg("tiny-moe", zero=z, **ROUTERS) for z in (2, 3)),
    *(_cfg("tiny", *SHARED_KV, zero=z, dp=2, tp=2, grad_accum=2) for z in (2, 3)),
    _cfg("tiny", *TIED, zero=2, dp=2, pp=2, grad_accum=2),
]


def test_each_finalizer_kind_matches_one_process_under_zero2_and_zero3(pools, reference):
    many_layout_parity(pools, reference, FINALIZER_LAYOUTS)


def _grads_at_end_of_backward(ctx, config) -> dict:
    """One training step on this rank, read when the backward has ended (before finish_grad_sync)."""
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens
    from fivefold.rules.layout import validate
    from fivefold.train import build, train_step

    config = validate(config, ctx.world_size)
    mesh = ctx.mesh(config.layout)
    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    sampler = Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)
    model = build(config, mesh, torch.device("cpu"))
    finish, result = model.optimizer.finish_grad_sync, {}

    def read_then_finish() -> None:
        result.update(_held_gradients(model))
        result["reduce_scatters"] = mesh.stats.calls.get(("dp_cp", "reduce_scatter"), 0)
        finish()
        result["reduce_scatters"] = (result["reduce_scatters"], mesh.stats.calls.get(("dp_cp", "reduce_scatter"), 0))

    model.optimizer.finish_grad_sync = read_then_finish
    mesh.stats.reset()
    train_step(model, sampler, 0)
    return result


def _held_gradients(model) -> dict:
    """Which parameters hold .grad, the gradient bytes held, the bytes the deferred buckets (full)
    and this rank's shards of the others should take, and the number of buckets of each kind."""
    from fivefold.observe.held_memory import held_memory
    from fivefold.parallel.buckets import trainable

    sync = model.optimizer.sync
    deferred = [b for b in sync.buckets if b.extra["deferred"]]
    finalized = {id(seg.param) for b in deferred for seg in b.segments}
    shards = sum(max(0, min(hi, b.used) - lo) for b, (lo, hi) in zip(sync.buckets, sync.ranges)
                 if not b.extra["deferred"])
    return {
        "finalized": len(finalized),
        "only_finalized_hold_grads": {id(p) for _, p in trainable(model.chunks) if p.grad is not None} == finalized,
        "held": held_memory(model.chunks, model.optimizer).without_padding()["grads"],
        "expected": 4 * (sum(b.used for b in deferred) + shards),
        "buckets": (sum(not b.extra["deferred"] and b.axis.name == "dp_cp" for b in sync.buckets),
                    sum(b.extra["deferred"] and b.axis.name == "dp_cp" for b in sync.buckets)),
    }


def test_only_finalized_gradients_stay_full_until_the_end_of_the_step(pools):
    configs = [_cfg("tiny", zero=2, **SP_NORMS), _cfg("tiny-moe", zero=3, ep=2, **ROUTERS)]
    for config in configs:
        for rank, result in enumerate(pools.run(4, _grads_at_end_of_backward, config)):
            where = (config.layout, rank, result)
            assert result["finalized"] > 0 and result["only_finalized_hold_grads"], where
            assert result["held"] == result["expected"], where
            regular, deferred = result["buckets"]
            micro_batches = config.layout.grad_accum
            # every other bucket is reduced in each backward; the deferred ones once, after the finalizers
            assert result["reduce_scatters"] == (micro_batches * regular, micro_batches * regular + deferred), where


# The planner follows: only the finalized gradients are held full and reduced once per step.
# (test_planner_agreement.py covers SP norms under ZeRO-2, routers under ZeRO-2/3 and the tied
# embedding; these are the other finalizer kinds and stages.)
PLANNED = [
    agreement_case("tiny", 4, dp=2, tp=2, zero=3, sequence_parallel=True, grad_accum=2),
    *(agreement_case("tiny", 4, dp=2, tp=2, zero=z, grad_accum=2, **{"model.kv_heads": 1}) for z in (2, 3)),
]


@pytest.mark.parametrize("case", PLANNED, ids=agreement_case_id)
def test_the_planner_predicts_the_bytes_and_memory_of_every_rank(pools, case):
    check_agreement(pools, case)
