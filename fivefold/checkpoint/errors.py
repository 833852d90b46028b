"""What goes wrong with a checkpoint, in three kinds a caller can tell apart."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which and why."""


class CorruptCheckpoint(CheckpointError):
    """Missing, truncated or altered files: an older checkpoint may still be usable."""


class IncompatibleCheckpoint(CheckpointError):
    """A checkpoint of another model: no checkpoint of this run directory will load."""
