"""`fivefold parity` finds where a layout diverges: deliberately broken collectives are localised."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fivefold.config import load_config
from fivefold.tools.diagnose import first_divergence, probe, stream_module_names
from fivefold.rules.layout import validate
from fivefold.parallel.mesh import Mesh
from fivefold.tools.parity import reference_config


def _drop_row_parallel_reduction(model) -> None:
    """Test-only break: layer 1's attention output projection keeps its partial sum."""
    wo = model.chunks[0].layers["1"].attn.wo
    wo.forward = lambda x: F.linear(x, wo.weight)  # the all-reduce over tp is left out


def _drop_gradient_finalizers(model) -> None:
    """Test-only break: sequence-parallel norm gradients are not summed over tp."""
    model.optimizer.grad_finalizers.clear()


def _probe_on_rank(ctx, config, break_name: str | None):
    resolved = validate(config, ctx.world_size)
    breaks = {None: None, "row": _drop_row_parallel_reduction, "finalizers": _drop_gradient_finalizers}
    return probe(resolved, ctx.mesh(resolved.layout), after_build=breaks[break_name])


def _reference_probe(config):
    ref = validate(reference_config(config))
    return probe(ref, Mesh.single(ref.layout))


def _first(config, ref, got):
    return first_divergence(ref[0], got[0], ref[1], got[1], stream_module_names(config))


def test_intact_layout_shows_no_divergence_and_broken_ones_are_localised(pools):
    config = load_config("tiny", ["layout.tp=2", "layout.sequence_parallel=true"])
    ref = _reference_probe(config)
    assert _first(config, ref, pools.run(2, _probe_on_rank, config, None)[0]) is None

    plain_tp = load_config("tiny", ["layout.tp=2"])  # the row-parallel break keeps shapes without SP
    found = _first(plain_tp, ref, pools.run(2, _probe_on_rank, plain_tp, "row")[0])
    assert found is not None and found.kind == "forward output" and found.module == "layers.1.attn", found
    assert found.max_abs_diff > 1e-3

    found = _first(config, ref, pools.run(2, _probe_on_rank, config, "finalizers")[0])
    assert found is not None and found.kind == "gradient", found
    assert found.module.endswith("norm") and found.tensor == "weight gradient", found


def _check_layout_on_rank(ctx, config, steps, path):
    from fivefold.tools.parity_cli import check_layout

    resolved = validate(config, ctx.world_size)
    return check_layout(resolved, ctx.mesh(resolved.layout), steps, path)


def test_parity_command_passes_an_intact_layout(pools, tmp_path, capsys):
    from fivefold.tools.parity_cli import reference_file

    config = validate(load_config("tiny", ["layout.dp=2", "layout.zero=1"]))
    path = tmp_path / "reference.pt"
    reference_file(config, 2, path)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == {"losses", "params", "outputs", "grads"}
    assert pools.run(2, _check_layout_on_rank, config, 2, str(path)) == [0, 0]
