"""Sharded, atomic, layout-independent checkpoints; Hugging Face export and import.

One module per idea:

- `regions`: shard geometry — the region of a full tensor a shard holds, and `assemble`,
  which fills a rank's region from every stored shard that overlaps it (resharding);
- `state`: what a rank saves (its primary shards, RNG states) and the optimizer protocol;
- `format`: the files on disk, the manifest, the atomic commit and the manifest's checks;
- `reader`: whether a checkpoint holds this model, and reading a rank's regions from it;
- `resume`: saving during a run, resuming from the newest usable checkpoint, SIGTERM;
- `sets`: a Hugging Face-style set of safetensors files with an index: streamed writes,
  reads, and replacing a folder's set as a whole;
- `final`: the weights at the end of a run, written by many ranks without any of them
  gathering the model;
- `convert`: Hugging Face export and import (`fivefold convert`), a run's newest weights.

The names other modules use are importable from `fivefold.checkpoint` itself.
"""

from __future__ import annotations

from ..parallel.sharding import ShardSpec
from .convert import (
    RunWeights,
    export_hf,
    final_weights_of,
    find_checkpoint,
    full_state_of_run,
    import_hf,
    newest_weights,
    steps_trained,
    read_final_weights,
    run_convert_cli,
)
from .errors import CheckpointError, CorruptCheckpoint, IncompatibleCheckpoint
from .final import FinalWeightsError, what_is_kept, write_final_weights
from .format import MANIFEST, checkpoint_root, list_checkpoints, prune, read_manifest, step_dir
from .reader import CheckpointReader
from .regions import assemble, clip_to_global
from .resume import StopRequest, resume_latest, resume_newest, save_checkpoint
from .sets import TensorSet
from .state import RUNTIME_BUFFERS

__all__ = [
    "MANIFEST", "RUNTIME_BUFFERS", "CheckpointError", "CheckpointReader", "CorruptCheckpoint", "FinalWeightsError",
    "IncompatibleCheckpoint", "RunWeights", "ShardSpec", "StopRequest", "TensorSet", "assemble", "checkpoint_root",
    "clip_to_global", "export_hf", "final_weights_of", "find_checkpoint", "full_state_of_run", "import_hf",
    "list_checkpoints", "newest_weights", "prune", "read_final_weights", "read_manifest", "resume_latest",
    "resume_newest", "run_convert_cli", "save_checkpoint", "step_dir", "steps_trained", "what_is_kept",
    "write_final_weights",
]
