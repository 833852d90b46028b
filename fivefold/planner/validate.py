"""Check a `LayoutSpec` against a model and a device count with the runtime's own rules.

A layout the planner accepts is one ``fivefold train`` accepts: the candidate is converted to
the runtime's `Config` (`bridge.runtime_config`) and checked by `fivefold.rules.layout.validate`,
the same function a training run calls before it starts any process.
"""

from __future__ import annotations

from ..config import Config
from ..rules.layout import LayoutError, validate
from ..rules.node_routing import RoutingError, check_route_nodes, ep_nodes
from .bridge import runtime_config
from .errors import PlanError
from .hardware import Hardware
from .spec import LayoutSpec, ModelSpec


def check_layout(model: ModelSpec, layout: LayoutSpec, gpus: int | None = None,
                 precision: str = "bf16") -> Config:
    """Raise `PlanError` unless ``fivefold train`` accepts ``layout`` for ``model``.

    The message is the runtime's (it names the offending values and those that would work).
    Returns the validated runtime `Config`.
    """
    if gpus is not None and layout.world != gpus:
        raise PlanError(f"dp*tp*pp*cp = {layout.dp}*{layout.tp}*{layout.pp}*{layout.cp} = {layout.world} devices, "
                        f"but gpus={gpus}; change the degrees so that their product is {gpus}")
    try:
        return validate(runtime_config(model, layout, precision))
    except LayoutError as err:
        raise PlanError(str(err)) from None


def routes(model: ModelSpec, layout: LayoutSpec, hw: Hardware) -> bool:
    """Whether the model's node-limited routing can run on ``layout``'s expert-parallel groups."""
    return not (model.is_moe and model.route_nodes) or model.route_nodes <= ep_nodes(layout.ep, layout.tp,
                                                                                        hw.gpus_per_node)


def check_routing(model: ModelSpec, layout: LayoutSpec, hw: Hardware) -> None:
    """Raise `PlanError` (naming the fix) when node-limited routing asks for more nodes than an
    expert-parallel group of ``layout`` spans on ``hw`` (`fivefold.rules.node_routing`)."""
    if model.is_moe and model.route_nodes:
        try:
            check_route_nodes(model.route_nodes, layout.ep, layout.tp, hw.gpus_per_node)
        except RoutingError as err:
            raise PlanError(str(err)) from None
