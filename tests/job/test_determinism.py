"""train.deterministic: deterministic kernels and cuBLAS's workspace setting in every rank."""

from __future__ import annotations

import os

import pytest
import torch

from fivefold.config import ConfigError, load_config
from fivefold.job.determinism import apply_determinism, runs_tf32, tf32
from fivefold.run import run_training


@pytest.fixture(autouse=True)
def restore_determinism(monkeypatch):
    """The setting is process-wide: every test leaves torch and the environment as it found them."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    previous = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(previous)


def test_the_setting_turns_on_deterministic_kernels_and_cublas_workspaces(monkeypatch):
    torch.use_deterministic_algorithms(False)
    assert apply_determinism(False) is False
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert apply_determinism(True) is True
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.parametrize("given, kept", [(":16:8", ":16:8"), (":4096:8", ":4096:8"), (":0:0", ":4096:8")])
def test_a_deterministic_workspace_of_the_users_is_kept_any_other_replaced(monkeypatch, given, kept):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
    apply_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == kept


def test_a_run_with_the_key_trains_under_deterministic_algorithms(tmp_path):
    torch.use_deterministic_algorithms(False)
    config = load_config("tiny", ["model.layers=1", "train.steps=1", "train.seq_len=16", "train.global_batch=2",
                                  "train.eval_interval=0", "train.deterministic=true"])
    records = run_training(config, tmp_path / "run", show_progress=False)
    assert len(records) == 1 and records[0]["loss"] > 0
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_the_key_defaults_to_off_and_takes_only_booleans():
    assert load_config("tiny").train.deterministic is False
    with pytest.raises(ConfigError, match="train.deterministic"):
        load_config("tiny", ["train.deterministic=sometimes"])


@pytest.mark.parametrize("dtype, device, deterministic, expected", [
    ("fp32", "cuda", False, True), ("fp32", "cuda", True, False), ("bf16", "cuda", False, False),
    ("fp32", "cpu", False, False), ("fp32", "meta", False, False),
])
def test_fp32_runs_on_cuda_train_in_tf32_unless_deterministic(dtype, device, deterministic, expected):
    assert runs_tf32(dtype, device, deterministic) is expected


def _matmul_precision() -> str:
    matmul = torch.backends.cuda.matmul
    return matmul.fp32_precision if hasattr(matmul, "fp32_precision") else str(matmul.allow_tf32)


def test_tf32_is_switched_for_the_block_and_restored_after():
    before = _matmul_precision()
    with tf32(True):
        assert _matmul_precision() in ("tf32", "True")
        with tf32(False):
            assert _matmul_precision() in ("ieee", "False")
        assert _matmul_precision() in ("tf32", "True")
    assert _matmul_precision() == before


def test_a_run_asks_the_rule_with_its_own_device_and_settings(tmp_path, monkeypatch):
    import fivefold.run

    asked = []
    monkeypatch.setattr(fivefold.run, "runs_tf32", lambda *args: asked.append(args) or False)
    config = load_config("tiny", ["model.layers=1", "train.steps=1", "train.seq_len=16", "train.global_batch=2",
                                  "train.eval_interval=0"])
    run_training(config, tmp_path / "run", show_progress=False)
    assert asked == [("fp32", "cpu", False)]
