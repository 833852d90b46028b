"""Multi-node jobs: who each process is, Slurm's environment, and whether all nodes run one job.

fivefold does not launch across machines itself: torchrun's rendezvous (under Slurm,
Kubernetes or by hand) or `srun` starts the processes. This module covers what a
multi-node job needs beyond that:

- `process_identity`: host, rank, local rank and node of this process, for logs, errors and
  the run's `hosts.json`;
- `slurm_environment`: the torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, ...)
  derived from Slurm's, so `srun python -m fivefold.cli train ...` joins one job;
- `check_tp_within_node`: tensor parallelism all-reduces activations twice per layer, so
  its groups must stay inside a node (tp ranks are neighbours in the rank order, and
  torchrun and srun give each node consecutive ranks);
- `check_same_job`: every process sends a fingerprint of its config to all others right
  after the process group forms and before any group of the mesh is built, so nodes
  started with different configs stop with an error naming the hosts and the keys that
  differ, instead of deadlocking or training different models.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import Config, Layout


class ClusterError(ValueError):
    """A multi-node job that cannot run as started; the message names the hosts and the fix."""


@dataclass(frozen=True)
class ProcessIdentity:
    host: str
    rank: int
    local_rank: int
    node: int  # torchrun's GROUP_RANK, or Slurm's SLURM_NODEID
    pid: int

    def describe(self) -> str:
        return f"host {self.host} (rank {self.rank}, local rank {self.local_rank}, node {self.node})"


def process_identity(environ: Mapping[str, str] = os.environ) -> ProcessIdentity:
    return ProcessIdentity(
        host=socket.gethostname(),
        rank=int(environ.get("RANK", 0)),
        local_rank=int(environ.get("LOCAL_RANK", 0)),
        node=int(environ.get("GROUP_RANK", environ.get("SLURM_NODEID", 0))),
        pid=os.getpid(),
    )


def where_prefix(environ: Mapping[str, str] = os.environ) -> str:
    """'host h (rank r, local rank l, node n): ' inside a multi-process job, '' otherwise."""
    if int(environ.get("WORLD_SIZE", 1)) <= 1:
        return ""
    return process_identity(environ).describe() + ": "


def job_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """The number of processes of the job this process belongs to (torchrun or srun), if any."""
    return int(environ["WORLD_SIZE"]) if "RANK" in environ and "WORLD_SIZE" in environ else None


# ------------------------------------------------------------------------------------- Slurm


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Slurm's compressed task counts ("2(x3),1": three nodes of 2, then one of 1) at `node`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ClusterError(f"cannot read Slurm's task counts {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if node >= len(counts):
        raise ClusterError(f"Slurm lists tasks for {len(counts)} nodes ({tasks_per_node!r}) but this is node {node}")
    return counts[node]


def slurm_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables for a task started by `srun` with more than one task.

    Empty outside srun, for a single task, and under torchrun (RANK already set): torchrun
    inside an sbatch script assigns ranks itself. MASTER_ADDR must name the node of rank 0
    (the sbatch example sets it from the first host of SLURM_JOB_NODELIST).
    """
    tasks = int(environ.get("SLURM_STEP_NUM_TASKS", 0))  # only srun sets it, not the batch script
    if "RANK" in environ or tasks <= 1:
        return {}
    if not environ.get("MASTER_ADDR"):
        raise ClusterError(
            "srun started this task but MASTER_ADDR is not set; export the first host of the job, e.g. "
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)"
        )
    node = int(environ["SLURM_NODEID"])
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", "1"))
    local_world = tasks_on_node(counts, node)
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": str(tasks),
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node),
        "MASTER_PORT": environ.get("MASTER_PORT", "29500"),
    }


def adopt_slurm_environment() -> None:
    """Under srun, set this process's torch.distributed variables from Slurm's."""
    os.environ.update(slurm_environment(os.environ))


# ------------------------------------------------------------------------ checks at job start


def check_tp_within_node(layout: Layout, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse a tensor-parallel group that would span nodes (LOCAL_WORLD_SIZE processes each)."""
    world = int(environ.get("WORLD_SIZE", 1))
    local = int(environ.get("LOCAL_WORLD_SIZE", world))
    if local >= world or layout.tp == 1 or local % layout.tp == 0:
        return
    fits = [d for d in range(1, local + 1) if local % d == 0 and layout.tp % d == 0]
    raise ClusterError(
        f"tp={layout.tp} does not divide the {local} processes of a node (LOCAL_WORLD_SIZE), so tensor-parallel "
        f"groups would span nodes: tensor parallelism all-reduces activations in every layer and across nodes "
        f"it is bound by the network. Use tp={max(fits)} (or another divisor of {local}) and put the remaining "
        f"factor into dp, pp or cp, or start {layout.tp} processes per node"
    )


def job_settings(config: Config) -> dict[str, Any]:
    """What every node of one job must agree on: the config and the versions that run it."""
    import torch

    from .. import __version__

    return {**config.to_dict(), "versions": {"fivefold": __version__, "torch": torch.__version__}}


def fingerprint(settings: Mapping[str, Any]) -> str:
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 0.01}} -> {"train.lr": 0.01}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differences(reference: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    ours, theirs = flatten(reference), flatten(other)
    keys = sorted(set(ours) | set(theirs))
    return [f"{k}: {ours.get(k)!r} vs {theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]


def job_start_record(config: Config) -> dict[str, Any]:
    """What each process tells the others at job start."""
    settings = job_settings(config)
    return {"identity": asdict(process_identity()), "fingerprint": fingerprint(settings), "settings": settings}


def mismatch_error(records: list[dict[str, Any]]) -> ClusterError | None:
    """An error naming the hosts whose settings differ from rank 0's, and how; None if all agree."""
    first = records[0]
    odd = [r for r in records if r["fingerprint"] != first["fingerprint"]]
    if not odd:
        return None
    by_host: dict[str, list[int]] = {}
    for r in odd:
        by_host.setdefault(r["identity"]["host"], []).append(r["identity"]["rank"])
    hosts = "; ".join(f"host {h} (ranks {', '.join(map(str, ranks))})" for h, ranks in by_host.items())
    what = "; ".join(differences(first["settings"], odd[0]["settings"])[:8])
    return ClusterError(
        f"nodes were started with different configs: {hosts} differ from host {first['identity']['host']} "
        f"(rank 0) in {what}. Start every node with the same command, config and versions of fivefold and torch"
    )


def check_same_job(config: Config) -> None:
    """Refuse tp across nodes; exchange config fingerprints over the world; raise on any mismatch.

    Called once the default process group exists and before the mesh's groups are built
    (nodes with other layouts would otherwise wait forever for each other's groups). Rank 0
    of a multi-node job then logs which host runs which ranks.
    """
    import torch.distributed as dist

    check_tp_within_node(config.layout)
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, job_start_record(config))
    error = mismatch_error(records)
    if error is not None:
        raise error
    identities = [r["identity"] for r in records]
    if dist.get_rank() == 0 and len({i["node"] for i in identities}) > 1:
        print(f"{len(records)} processes on {describe_nodes(identities)}")


def describe_nodes(identities: list[dict[str, Any]]) -> str:
    """'2 nodes: node 0 = node-a (ranks 0-1), node 1 = node-b (ranks 2-3)'."""
    by_node: dict[int, list[dict[str, Any]]] = {}
    for ident in identities:
        by_node.setdefault(ident["node"], []).append(ident)
    parts = []
    for node, members in sorted(by_node.items()):
        ranks = sorted(m["rank"] for m in members)
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
        parts.append(f"node {node} = {members[0]['host']} (ranks {span})")
    return f"{len(by_node)} node{'s' if len(by_node) > 1 else ''}: " + ", ".join(parts)


def record_hosts(run_dir: Path, is_main: bool) -> None:
    """hosts.json in the run directory: host, rank, local rank, node and pid of every process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    identities: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(identities, asdict(process_identity()))
    if is_main:
        (Path(run_dir) / "hosts.json").write_text(json.dumps(identities, indent=1))
