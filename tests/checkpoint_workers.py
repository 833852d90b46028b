"""Functions the worker pool runs for the checkpoint tests (importable by module path)."""

from __future__ import annotations

from pathlib import Path

import torch

from fivefold.config import Config, Layout
from fivefold.model import Transformer
from fivefold.parallel.optim import AdamWSettings, ReplicatedAdamW
from fivefold.parallel.sharding import Placement, Split, materialize, set_placement
from fivefold.parallelize import ParallelModel


def hand_sharded_model(ctx, config: Config, dim: int) -> ParallelModel:
    """The model with every matrix split in two along `dim` over tp, as a tensor-parallel layout would.

    Optimizer state is filled with values derived element-wise from the weights, so the
    expected full state is known: exp_avg = 2 w, exp_avg_sq = w * w.
    """
    mesh = ctx.mesh(Layout(tp=2))
    with torch.device("meta"):
        chunk = Transformer(config.model)
    for module_name, module in chunk.named_modules():
        for leaf, param in list(module.named_parameters(recurse=False)):
            if param.dim() < 2 or param.shape[dim] % 2:
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            placement = Placement(name, tuple(param.shape), (Split(dim, mesh.tp.rank, 2),), replicated_over=("dp_cp",))
            local = torch.nn.Parameter(torch.empty(placement.box()[1], device="meta"))
            set_placement(local, placement)
            setattr(module, leaf, local)
    materialize(chunk, config.model, config.train.seed)
    optimizer = ReplicatedAdamW([chunk], mesh, AdamWSettings.from_train(config.train))
    for _, p in optimizer.named:
        m, v = optimizer.state[id(p)]
        m.copy_(2 * p.detach())
        v.copy_(p.detach() * p.detach())
    optimizer.steps = 7
    return ParallelModel(config, mesh, [chunk], optimizer, device=torch.device("cpu"))


def save_column_sharded(ctx, config: Config, root: str) -> str:
    """Two ranks save their column halves in parallel; returns the committed directory."""
    from fivefold.checkpoint import save_checkpoint

    model = hand_sharded_model(ctx, config, dim=1)
    return str(save_checkpoint(model, 5, Path(root), keep=2))


def load_row_sharded(ctx, config: Config, root: str) -> dict:
    """Resume the column-sharded checkpoint with rows split instead; report what each rank got."""
    from fivefold.checkpoint import resume_latest
    from fivefold.parallel.sharding import get_placement

    model = hand_sharded_model(ctx, config, dim=0)
    expected_model = hand_sharded_model(ctx, config, dim=0)  # same placements, initial values
    for p in model.chunks[0].parameters():
        torch.nn.init.zeros_(p)
    for m, v in model.optimizer.state.values():
        m.zero_(), v.zero_()
    step = resume_latest(model, Path(root))
    mismatches, sharded = [], 0
    for (name, p), (_, q) in zip(model.optimizer.named, expected_model.optimizer.named):
        m, v = model.optimizer.state[id(p)]
        if not (torch.equal(p, q) and torch.equal(m, 2 * q) and torch.equal(v, q * q)):
            mismatches.append(name)
        placement = get_placement(p, name)
        if placement.splits:
            assert p.shape[0] * 2 == placement.global_shape[0], (name, p.shape)  # a real row half
            sharded += 1
    return {"step": step, "optimizer_steps": model.optimizer.steps, "mismatches": mismatches, "sharded": sharded > 10}


def _sampler(config: Config):
    from fivefold.data.sources import Sampler, load_tokenizer, load_tokens

    data = load_tokens(config.data, load_tokenizer(config.data.tokenizer))
    return Sampler(data.train, config.train.seq_len, config.train.global_batch, config.train.seed)


def train_and_save(ctx, config: Config, steps: int, root: str) -> None:
    """Train `steps` steps under the config's layout, then checkpoint."""
    from fivefold.checkpoint import save_checkpoint
    from fivefold.rules.layout import validate
    from fivefold.train import build, train_step

    config = validate(config, ctx.world_size)
    model = build(config, ctx.mesh(config.layout), torch.device("cpu"))
    sampler = _sampler(config)
    for step in range(steps):
        train_step(model, sampler, step)
    save_checkpoint(model, steps, Path(root))


def resume_and_train(ctx, config: Config, total_steps: int, root: str):
    """Resume the newest checkpoint under the config's layout and train up to `total_steps`.

    Rank 0 returns a TrainTrace of the resumed steps with the full final parameters.
    """
    from fivefold.checkpoint import resume_latest
    from fivefold.rules.layout import validate
    from fivefold.tools.parity import TrainTrace
    from fivefold.train import build, train_step

    config = validate(config, ctx.world_size)
    mesh = ctx.mesh(config.layout)
    model = build(config, mesh, torch.device("cpu"))
    start = resume_latest(model, Path(root))
    sampler = _sampler(config)
    trace = TrainTrace([], [], [])
    for step in range(start, total_steps):
        result = train_step(model, sampler, step)
        trace.losses.append(result.loss)
        trace.grad_norms.append(result.grad_norm)
    trace.params = model.full_parameters()
    return (start, trace) if mesh.rank == 0 else None
