"""Sample text from the final weights a run saved (its safetensors set + config.json)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..checkpoint import (
    RUNTIME_BUFFERS,
    CheckpointError,
    checkpoint_root,
    final_weights_of,
    list_checkpoints,
    read_final_weights,
)
from ..config import Config
from ..data.sources import load_tokenizer
from ..model import Transformer
from ..parallel.mesh import device_for, unavailable_device


class RunDirError(ValueError):
    """A run directory without usable weights; the message says what is missing."""


class DivergedWeightsError(RunDirError):
    """Weights (or the logits they give) hold NaN or inf: sampling from them has no meaning."""


def earlier_weights_hint(run_dir: Path) -> str:
    """What to sample from instead: the run's checkpoints, exported, or a retrain from one."""
    steps = [p.name for p in list_checkpoints(checkpoint_root(run_dir))]
    if not steps:
        return "the run kept no checkpoint: train again with a lower --train.lr or --train.grad_clip"
    return (f"its checkpoints ({', '.join(steps[:5])}) may be finite: export one "
            f"(fivefold convert export --run-dir {run_dir} --step N --out DIR) or resume from it with a lower --train.lr")


def check_finite_weights(run_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Refuse weights holding NaN/inf, naming the first such tensor; a diverged run samples garbage or crashes."""
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise DivergedWeightsError(f"the weights in {run_dir} hold NaN or inf ({bad[0]}{more}): training diverged; "
                                   f"{earlier_weights_hint(run_dir)}")


SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a signed 64-bit seed


def check_sampling_args(max_new_tokens: int, temperature: float, seed: int) -> None:
    """Refuse sampling settings that have no meaning, naming the flag."""
    if max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens={max_new_tokens} must be 0 or more")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"--temperature={temperature} must be a finite number >= 0 (0 picks the likeliest token)")
    if not -SEED_LIMIT <= seed < SEED_LIMIT:
        raise ValueError(f"--seed={seed} must fit in 64 bits (between {-SEED_LIMIT} and {SEED_LIMIT - 1})")


def generation_device(preference: str) -> torch.device:
    """The device `--device` names (auto: the GPU when there is one), refused where it is missing."""
    missing = unavailable_device(preference)
    if missing:
        raise ValueError(f"--device {preference} but {missing}; use --device cpu or auto")
    return device_for(preference)


def load_trained(run_dir: str | Path, device: torch.device = torch.device("cpu")) -> tuple[Transformer, Config]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"--run {run_dir} is not a folder; give the run folder of a finished training run")
    try:
        found = final_weights_of(run_dir)
    except CheckpointError as err:
        raise RunDirError(str(err)) from None
    if found is None:
        raise RunDirError(f"{run_dir / 'model.safetensors'} is missing (no final weights); "
                          f"train first (fivefold train --run-dir {run_dir})")
    if not (run_dir / "config.json").is_file():
        raise RunDirError(f"{run_dir / 'config.json'} is missing; train first (fivefold train --run-dir {run_dir})")
    config, state = read_final_weights(run_dir)
    check_finite_weights(run_dir, state)
    with torch.device("meta"):
        model = Transformer(config.model)
    model.to_empty(device=device)
    model.load_state_dict(state, strict=False)
    for name, buf in model.named_buffers():
        if name.endswith(RUNTIME_BUFFERS):
            buf.zero_()
    return model.eval(), config


@torch.no_grad()
def sample(
    model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> list[int]:
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    ids = torch.tensor([prompt_ids or [0]], dtype=torch.long, device=device)
    limit = model.config.max_seq_len
    for _ in range(max_new_tokens):
        logits, _ = model(ids[:, -limit:])
        logits = logits[0, -1].float() / max(temperature, 1e-5)
        if not bool(torch.isfinite(logits).all()):
            # finite weights can still overflow (e.g. in half precision); multinomial would crash on them
            raise DivergedWeightsError("the model's logits hold NaN or inf although its weights are finite; "
                                       "sample on --device cpu, or from an earlier checkpoint")
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, next_id[None]], dim=1)
    return ids[0].tolist()


def generate_text(
    run_dir: str, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, seed: int = 0, device: str = "cpu"
) -> str:
    model, config = load_trained(run_dir, generation_device(device))
    tokenizer = load_tokenizer(config.data.tokenizer)
    ids = sample(model, tokenizer.encode(prompt), max_new_tokens, temperature, seed=seed)
    return tokenizer.decode(ids)
