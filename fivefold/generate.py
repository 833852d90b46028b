"""Sample text from the weights a run saved (model.safetensors + config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import config_from_dict
from .data import load_tokenizer
from .model import Transformer


class RunDirError(ValueError):
    """A run directory without usable weights; the message says what is missing."""


def load_trained(run_dir: str | Path) -> tuple[Transformer, object]:
    from safetensors.torch import load_file

    run_dir = Path(run_dir)
    weights, cfg = run_dir / "model.safetensors", run_dir / "config.json"
    for path in (weights, cfg):
        if not path.is_file():
            raise RunDirError(f"{path} is missing; train first (fivefold train --train.run_dir {run_dir})")
    config = config_from_dict(json.loads(cfg.read_text()))
    with torch.device("meta"):
        model = Transformer(config.model)
    model.to_empty(device="cpu")
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("tokens_per_expert", "dropped_slots"))]
    if missing or unexpected:
        raise RunDirError(f"{weights} does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, buf in model.named_buffers():
        if name.endswith(("tokens_per_expert", "dropped_slots")):
            buf.zero_()
    return model.eval(), config


@torch.no_grad()
def sample(
    model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids or [0]], dtype=torch.long)
    limit = model.config.max_seq_len
    for _ in range(max_new_tokens):
        logits, _ = model(ids[:, -limit:])
        logits = logits[0, -1].float() / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, next_id[None]], dim=1)
    return ids[0].tolist()


def generate_text(run_dir: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    model, config = load_trained(run_dir)
    tokenizer = load_tokenizer(config.data.tokenizer)
    ids = sample(model, tokenizer.encode(prompt), max_new_tokens, temperature, seed=seed)
    return tokenizer.decode(ids)
