"""Check a `LayoutSpec` against a model and a device count with the runtime's own rules.

A layout the planner accepts is one ``fivefold train`` accepts: the candidate is converted to
the runtime's `Config` (`bridge.runtime_config`) and checked by `fivefold.rules.layout.validate`,
the same function a training run calls before it starts any process.
"""

from __future__ import annotations

from ..config import Config
from ..rules.layout import LayoutError, validate
from .bridge import runtime_config
from .errors import PlanError
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
