"""Sharded, atomic, layout-independent checkpoints; Hugging Face export and import.

One module per idea:

- `regions`: shard geometry — the region of a full tensor a shard holds, and `assemble`,
  which fills a rank's region from every stored shard that overlaps it (resharding);
- `state`: what a rank saves (its primary shards, RNG states) and the optimizer protocol;
- `format`: the files on disk, the manifest, the atomic commit and the manifest's checks;
- `reader`: whether a checkpoint holds this model, and reading a rank's regions from it;
- `resume`: saving during a run, resuming from the newest usable checkpoint, SIGTERM;
- `convert`: Hugging Face export and import (`fivefold convert`), a run's full weights.

The names other modules use are importable from `fivefold.checkpoint` itself.
"""

from __future__ import annotations

from ..parallel.sharding import ShardSpec
from .convert import (
    export_hf,
    find_checkpoint,
    full_state_of_run,
    import_hf,
    read_final_weights,
    run_convert_cli,
)
from .errors import CheckpointError, CorruptCheckpoint, IncompatibleCheckpoint
from .format import MANIFEST, checkpoint_root, list_checkpoints, prune, read_manifest, step_dir
from .reader import CheckpointReader
from .regions import assemble, clip_to_global
from .resume import StopRequest, resume_latest, save_checkpoint
from .state import RUNTIME_BUFFERS

__all__ = [
    "MANIFEST", "RUNTIME_BUFFERS", "CheckpointError", "CheckpointReader", "CorruptCheckpoint",
    "IncompatibleCheckpoint", "ShardSpec", "StopRequest", "assemble", "checkpoint_root", "clip_to_global",
    "export_hf", "find_checkpoint", "full_state_of_run", "import_hf", "list_checkpoints", "prune",
    "read_final_weights", "read_manifest", "resume_latest", "run_convert_cli", "save_checkpoint", "step_dir",
]
