"""Planner: an analytic cost model for fivefold layouts and a search over them.

Memory (`model_states`, `activations`), FLOPs, communication (`comm`), the pipeline bubble
and the time of a layout (`estimate`, `stages`), and the search over valid layouts
(`search`, `explain`), from the runtime's own rules (`fivefold.rules`). Pure Python: nothing
here starts processes or touches torch.distributed, except `calibrate()`, which measures
this machine for the ``cpu`` hardware entry. Its command line is `fivefold.tools.plan_cli`.
"""

from .activations import activation_bytes_per_layer, saved_tensors_per_layer
from .errors import PlanError
from .estimate import Estimate, MemoryBreakdown, estimate, estimate_run, memory_grid
from .explain import explain
from .hardware import HARDWARE, Hardware, calibrate, load_calibration, save_calibration
from .models import MODELS, load_model
from .search import search
from .spec import LayoutSpec, ModelSpec, parse_layout
from .validate import check_layout

__all__ = [
    "ModelSpec", "LayoutSpec", "parse_layout", "check_layout", "estimate", "estimate_run", "Estimate",
    "MemoryBreakdown", "memory_grid", "search", "explain", "HARDWARE", "Hardware", "calibrate",
    "load_calibration", "save_calibration", "MODELS", "load_model", "PlanError",
    "activation_bytes_per_layer", "saved_tensors_per_layer",
]
