"""The one exception type the planner raises for bad input."""

from __future__ import annotations


class PlanError(ValueError):
    """A request the planner cannot answer; the message says what to change."""

    def __str__(self) -> str:  # keep plain text even when mixed with KeyError
        return str(self.args[0]) if self.args else ""


class UnknownNameError(PlanError, KeyError):
    """An unknown model, hardware, schedule or field name (also a KeyError for mappings)."""


def choices(values) -> str:
    """Render a short list of valid values for an error message."""
    vals = list(values)
    return ", ".join(str(v) for v in vals) if vals else "none"
