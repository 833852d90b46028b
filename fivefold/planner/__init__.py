"""Planner: an analytic cost model for fivefold layouts and a search over them."""

from .errors import PlanError
from .models import MODELS, load_model
from .spec import LayoutSpec, ModelSpec, parse_layout
from .validate import check_layout

__all__ = ["PlanError", "ModelSpec", "LayoutSpec", "parse_layout", "check_layout", "MODELS", "load_model"]
