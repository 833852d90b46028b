"""Sampling from logits that hold inf (finite weights that overflow) stops with one clear error
instead of torch.multinomial's "probability tensor contains either inf, nan or element < 0"."""

from __future__ import annotations

import pytest
import torch

from fivefold.config import load_config
from fivefold.model import build_model
from fivefold.tools.generate import DivergedWeightsError, sample


def test_overflowing_logits_are_refused_by_name():
    model = build_model(load_config("tiny").model, seed=0).eval()
    with torch.no_grad():
        model.norm.weight.fill_(3e38)  # finite, but the head's products overflow to inf
    with pytest.raises(DivergedWeightsError, match="logits hold NaN or inf"):
        sample(model, [1, 2, 3], max_new_tokens=2)
