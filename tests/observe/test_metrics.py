"""FLOP formulas against values computed by hand, and the MFU / matmul-peak helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fivefold.config import load_config
from fivefold.observe.metrics import measure_matmul_flops, mfu
from fivefold.rules.flops import active_params_per_token, attention_flops_per_token, model_flops_per_token
from fivefold.model import Transformer, count_parameters


def test_tiny_dense_flops_by_hand():
    # tiny: hidden 64, 8 heads of 8, 2 kv heads, ffn 128, 4 layers, vocab 256.
    # per layer: wq 64*64 + wk, wv 2*64*16 + wo 64*64 = 10240; norms 2*64 = 128; SwiGLU 3*64*128 = 24576
    # N = 4 * 34944 + final norm 64 + head 64*256 = 156224
    m = load_config("tiny").model
    assert active_params_per_token(m) == 156224
    assert attention_flops_per_token(m, 32) == 12 * 4 * 8 * 8 * 32 == 98304
    assert model_flops_per_token(m, 32) == 6 * 156224 + 98304 == 1035648


def test_tiny_moe_counts_active_experts_only():
    # tiny-moe: 8 experts of ffn 64, top-2, one shared expert in every layer.
    # MLP per layer: router 64*8 = 512; (2 routed + 1 shared) * 3*64*64 = 36864
    # N = 4 * (10240 + 128 + 37376) + 64 + 16384 = 207424
    m = load_config("tiny-moe").model
    assert active_params_per_token(m) == 207424
    assert model_flops_per_token(m, 32) == 6 * 207424 + 98304


def test_small_moe_every_other_layer():
    # small-moe: layers 1, 3, 5, 7 are MoE (8 experts of 512, top-2), others dense ffn 1024.
    m = load_config("small-moe").model
    attn = 384 * 384 + 2 * 384 * 128 + 384 * 384  # 6 heads of 64, 2 kv heads
    dense = 3 * 384 * 1024
    moe = 384 * 8 + 2 * 3 * 384 * 512
    expected = 4 * (attn + 768 + dense) + 4 * (attn + 768 + moe) + 384 + 384 * 256
    assert active_params_per_token(m) == expected
    assert attention_flops_per_token(m, 128) == 12 * 8 * 6 * 64 * 128


@pytest.mark.parametrize("tied", [False, True])
def test_dense_n_is_every_parameter_but_the_input_embedding(tied):
    m = dataclasses.replace(load_config("small").model, tied_embeddings=tied)
    with torch.device("meta"):
        model = Transformer(m)
    embedding_lookup_only = 0 if tied else model.embed.weight.numel()  # tied: counted as the head
    assert active_params_per_token(m) == count_parameters(model) - embedding_lookup_only


def test_llama3_8b_matches_its_published_size():
    # Llama 3 8B has 8.03e9 parameters, of which 128256 * 4096 are the input embedding.
    n = active_params_per_token(load_config("llama3-8b").model)
    assert n + 128256 * 4096 == pytest.approx(8.03e9, rel=2e-3)


def test_mfu_and_its_input_check():
    assert mfu(tokens_per_s=1000.0, flops_per_token=1e6, peak_flops=1e10) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


def test_measure_matmul_flops_times_at_least_one_gemm():
    flops = measure_matmul_flops(torch.float32, size=(64, 32, 16), seconds=0.0)
    assert 0 < flops < 1e15  # a finite rate from real timings, whatever the machine and its load


def test_step_record_adds_mfu_only_when_the_peak_is_known():
    from fivefold.train import StepResult, step_record

    result = StepResult(step=3, loss=2.0, aux_loss=0.0, grad_norm=1.0, lr=1e-3, seconds=0.5, tokens=1000)
    assert "mfu" not in step_record(result)
    record = step_record(result, flops_per_token=1e6, peak_flops=1e10)
    assert record["tokens_per_s"] == 2000.0
    assert record["mfu"] == pytest.approx(2000.0 * 1e6 / 1e10)
