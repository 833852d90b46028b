"""Multi-node runs across two hosts made on this machine, and the checks of fivefold.job.cluster.

Two network namespaces joined by a veth pair play two hosts: each has its own hostname
(a UTS namespace), its own address on the pair (10.77.0.1, 10.77.0.2) and loopback, and no
other link, so every byte between the nodes crosses the veth pair. Checkpoints go to a
folder both see, as on a cluster's shared filesystem. The tests run exactly the commands of
the README's multi-node section: one torchrun per host with c10d rendezvous on node-a.

- a 2-node x 2-process job (dp=2 across the nodes, tp=2 inside each) trains like one process;
- losing a node mid-run: `fivefold train --resume --layout auto --world-size 2` on the
  survivor continues from the last checkpoint with a re-planned layout, same global batch,
  and its losses and final weights match the uninterrupted single-process run;
- srun-started tasks (Slurm's environment) with different configs stop before training with
  an error naming the host.
Namespaces need root and `ip netns`; elsewhere these tests skip, saying why.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import MANIFEST, checkpoint_root, list_checkpoints
from fivefold.job.cluster import (
    ClusterError,
    check_tp_within_node,
    fingerprint,
    job_settings,
    job_world_size,
    mismatch_error,
    slurm_environment,
    tasks_on_node,
)
from fivefold.config import Layout, load_config
from fivefold.tools.parity import TrainTrace, assert_parity

RDZV_PORT = 29400  # free in a fresh namespace
JOB_TIMEOUT_S = 420  # bound for one job; jobs took up to ~200 s at a load average of 160 on 2 cores
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# Rendezvous gives up within bounded time when a node never comes (default: 10 minutes).
RDZV_CONF = "join_timeout=120,read_timeout=60"
TRAIN = ["--config", "tiny", "--train.steps", "6", "--checkpoint.interval", "2"]
LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT"}


@dataclass(frozen=True)
class Host:
    namespace: str
    hostname: str
    address: str
    interface: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _hosts_named(tag: str) -> list[Host]:
    return [Host(f"ff{tag}{i}", f"node-{c}", f"10.77.0.{i + 1}", f"ff{tag}v{i}") for i, c in enumerate("ab")]


def _create_hosts(hosts: list[Host]) -> None:
    a, b = hosts
    steps = [("netns", "add", a.namespace), ("netns", "add", b.namespace),
             ("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)]
    for h in hosts:
        steps += [("link", "set", h.interface, "netns", h.namespace),
                  ("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface),
                  ("-n", h.namespace, "link", "set", "lo", "up"),
                  ("-n", h.namespace, "link", "set", h.interface, "up")]
    for step in steps:
        result = _ip(*step)
        if result.returncode:
            raise RuntimeError(f"ip {' '.join(step)}: {result.stderr.strip()}")
    names = "".join(f"{h.address} {h.hostname}\n" for h in hosts)
    for h in hosts:  # `ip netns exec` mounts /etc/netns/NAME/* over /etc: per-host name resolution
        etc = Path("/etc/netns") / h.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")
        (etc / "resolv.conf").write_text("")  # no DNS: lookups of unknown names fail at once


def _kill_namespace(host: Host, sig: int = signal.SIGKILL) -> list[int]:
    pids = [int(p) for p in _ip("netns", "pids", host.namespace).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def _remove_hosts(hosts: list[Host]) -> None:
    for h in hosts:
        _kill_namespace(h)
        _ip("netns", "delete", h.namespace)  # with the veth end inside it, and so the pair
        _ip("link", "delete", h.interface)  # a pair never moved into a namespace (failed setup)
        shutil.rmtree(Path("/etc/netns") / h.namespace, ignore_errors=True)


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("two-host tests need root, iproute2's `ip` and util-linux's `unshare` to make network namespaces")
    made = _hosts_named(uuid.uuid4().hex[:6])
    try:
        _create_hosts(made)
    except (RuntimeError, OSError) as err:
        _remove_hosts(made)
        pytest.skip(f"cannot make network namespaces here: {err}")
    try:
        yield made
    finally:
        _remove_hosts(made)


@pytest.fixture
def hosts(two_hosts):
    """The two hosts, with every process a test started on them killed when it ends (pass or fail)."""
    yield two_hosts
    for host in two_hosts:
        _kill_namespace(host)


def _clean_environment() -> dict[str, str]:
    """This machine's environment without the launcher variables of any job the tests run inside."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_")) and k not in LAUNCHER_VARIABLES}


def _env(host: Host, extra: dict[str, str] | None = None) -> dict[str, str]:
    return dict(_clean_environment(), GLOO_SOCKET_IFNAME=host.interface, OMP_NUM_THREADS="1", **(extra or {}))


def _start_on(host: Host, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Run `command` on `host`: in its network namespace, under its own hostname."""
    wrapped = ["ip", "netns", "exec", host.namespace, "unshare", "--uts",
               "sh", "-c", 'hostname "$0" && exec "$@"', host.hostname, *command]
    return subprocess.Popen(wrapped, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=log.parent)


def torchrun_node(host: Host, rdzv_host: Host, run_dir: Path, log: Path) -> subprocess.Popen:
    """The README's per-node command: torchrun with c10d rendezvous on node-a."""
    command = [
        TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rdzv_host.address}:{RDZV_PORT}", "--rdzv-id", "job1",
        "--rdzv-conf", RDZV_CONF, "--local-addr", host.address,
        "-m", "fivefold.cli", "train", *TRAIN, "--layout", "dp=2,tp=2", "--run-dir", str(run_dir),
    ]
    return _start_on(host, command, log, _env(host))


def _wait(proc: subprocess.Popen, log: Path, timeout: float = JOB_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"no exit within {timeout} s; log:\n{log.read_text()[-3000:]}")


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from fivefold.checkpoint import final_weights_of

    found = final_weights_of(run_dir)
    assert found is not None, f"{run_dir} has no final weights"
    return found.read_all()


def _reference_of_train_args(reference) -> TrainTrace:
    """The single-process run of the TRAIN flags (cached for the session by conftest)."""
    steps = int(TRAIN[TRAIN.index("--train.steps") + 1])
    return reference(load_config("tiny", [f"train.steps={steps}"]), steps)


def _trace_of(run_dir: Path, first_step: int) -> TrainTrace:
    """The losses of steps first_step.. (their last record: a resumed run logs them again)."""
    by_step = dict(_losses(run_dir))
    return TrainTrace([by_step[s] for s in sorted(by_step) if s >= first_step], [], [], params=_final_weights(run_dir))


def _start_two_nodes(hosts: list[Host], run_dir: Path, tmp: Path) -> list[subprocess.Popen]:
    return [torchrun_node(h, hosts[0], run_dir, tmp / f"{h.hostname}.log") for h in hosts]


def test_two_hosts_train_like_one_process(hosts, tmp_path, reference):
    run_dir = tmp_path / "run"
    procs = _start_two_nodes(hosts, run_dir, tmp_path)
    codes = [_wait(p, tmp_path / f"{h.hostname}.log") for p, h in zip(procs, hosts)]
    logs = "".join((tmp_path / f"{h.hostname}.log").read_text() for h in hosts)
    assert codes == [0, 0], logs[-4000:]
    assert_parity(_reference_of_train_args(reference), _trace_of(run_dir, 0))
    identities = json.loads((run_dir / "hosts.json").read_text())
    host_of = {i["rank"]: i["host"] for i in identities}
    assert set(host_of.values()) == {"node-a", "node-b"}
    assert host_of[0] == host_of[1] and host_of[2] == host_of[3]  # each tp pair inside one node
    assert "4 processes on 2 nodes: node 0 = " in logs


def _endpoint(hex_endpoint: str) -> tuple[str, int]:
    address, port = hex_endpoint.split(":")
    return ".".join(str(b) for b in bytes.fromhex(address)[::-1]), int(port, 16)


def _tcp_sockets(host: Host) -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """(local, remote, state) of the IPv4 TCP sockets in the host's namespace (state 0A: listening)."""
    out = subprocess.run(["ip", "netns", "exec", host.namespace, "cat", "/proc/net/tcp"],
                         capture_output=True, text=True, timeout=30).stdout.splitlines()[1:]
    rows = (line.split()[1:4] for line in out)
    return [(_endpoint(local), _endpoint(remote), state) for local, remote, state in rows]


def _gloo_pairs_between(survivor: Host, lost: Host) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """Established connections between the hosts to a listener bound to a veth address.

    Gloo listens on the address of GLOO_SOCKET_IFNAME's interface; torch's stores listen on
    every address (0.0.0.0 / ::), so these connections are gloo's pairs.
    """
    sockets = {h: _tcp_sockets(h) for h in (survivor, lost)}
    veth_listeners = {local for socks in sockets.values() for local, _, state in socks
                      if state == "0A" and local[0] in (survivor.address, lost.address)}
    return [(local, remote) for local, remote, state in sockets[survivor]
            if state == "01" and remote[0] == lost.address and (local in veth_listeners or remote in veth_listeners)]


def _wait_for_checkpoint(run_dir: Path, step: int, procs: list[subprocess.Popen]) -> None:
    manifest = checkpoint_root(run_dir) / f"step_{step:06d}" / MANIFEST
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not manifest.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"no checkpoint at step {step} (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.02)


def _planner_machine(tmp_path: Path) -> dict[str, str]:
    """The planner's view of this machine for `--layout auto`: the default CPU description.

    Seeded in a private cache so that the test neither measures the machine (seconds of
    work, and a choice that varies with the load) nor writes the user's cache.
    """
    from fivefold.planner.hardware import CPU_DEFAULT, save_calibration

    save_calibration(CPU_DEFAULT, tmp_path / "cache" / "cpu_calibration.json")
    return {"FIVEFOLD_CACHE_DIR": str(tmp_path / "cache")}


def test_lost_node_resumes_on_survivor_with_replanned_layout(hosts, tmp_path, reference):
    survivor, lost = hosts
    run_dir = tmp_path / "run"
    procs = _start_two_nodes(hosts, run_dir, tmp_path)
    _wait_for_checkpoint(run_dir, 2, procs)
    _kill_namespace(lost, signal.SIGSTOP)  # freeze node-b at once: every step waits for it
    assert _gloo_pairs_between(survivor, lost)  # gloo bound the veth addresses and talks over them
    _kill_namespace(lost)
    _wait(procs[1], tmp_path / "node-b.log", timeout=30)
    try:  # node-a's workers fail on the broken connections; bound the wait all the same
        procs[0].wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_namespace(survivor)
    saved = int(list_checkpoints(checkpoint_root(run_dir))[0].name.split("_")[1])
    assert 2 <= saved < 6, f"the job was not interrupted (newest checkpoint: step {saved})"

    log = tmp_path / "resume.log"
    command = [sys.executable, "-m", "fivefold.cli", "train", *TRAIN, "--run-dir", str(run_dir),
               "--resume", "--layout", "auto", "--world-size", "2"]
    code = _wait(_start_on(survivor, command, log, _env(survivor, _planner_machine(tmp_path))), log)
    assert code == 0, log.read_text()[-4000:]
    assert f"resuming at step {saved}" in log.read_text()
    resumed = json.loads((run_dir / "config.json").read_text())
    assert resumed["train"]["global_batch"] == load_config("tiny").train.global_batch
    layout = Layout(**{k: v for k, v in resumed["layout"].items() if k != "pp_layers"})
    assert layout.world_size == 2
    uninterrupted = _reference_of_train_args(reference)
    after = TrainTrace(uninterrupted.losses[saved:], [], [], params=uninterrupted.params)
    assert_parity(after, _trace_of(run_dir, saved))


def _srun_task(host: Host, rank: int, master: Host, run_dir: Path, extra: list[str], log: Path) -> subprocess.Popen:
    """One task as `srun --nodes 2 --ntasks-per-node 2` starts it: Slurm's variables, no torchrun."""
    slurm = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2),
             "SLURM_NODEID": str(rank // 2), "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
             "MASTER_ADDR": master.address, "MASTER_PORT": str(RDZV_PORT)}
    command = [sys.executable, "-m", "fivefold.cli", "train", *TRAIN, "--layout", "dp=2,tp=2",
               "--run-dir", str(run_dir), *extra]
    return _start_on(host, command, log, _env(host, slurm))


def test_srun_tasks_with_different_configs_stop_naming_the_host(hosts, tmp_path):
    a, b = hosts
    tasks = [(a, 0, []), (a, 1, []), (b, 2, ["--train.lr", "0.02"]), (b, 3, ["--train.lr", "0.02"])]
    procs = [_srun_task(h, r, a, tmp_path / "run", extra, tmp_path / f"task{r}.log") for h, r, extra in tasks]
    codes = [_wait(p, tmp_path / f"task{r}.log") for p, (_, r, _) in zip(procs, tasks)]
    assert codes == [2, 2, 2, 2]
    message = (tmp_path / "task2.log").read_text()
    assert ("fivefold: error: host node-b (rank 2, local rank 0, node 1): nodes were started with different "
            "configs: host node-b (ranks 2, 3) differ from host node-a (rank 0) in train.lr: 0.01 vs 0.02") in message
    assert "Traceback" not in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before training


def test_world_size_the_layout_does_not_match_is_refused_naming_the_host(tmp_path):
    """One srun task of two, with a layout of four: refused before any connection is tried."""
    env = dict(_clean_environment(), SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE="2", MASTER_ADDR="127.0.0.1")
    command = [sys.executable, "-m", "fivefold.cli", "train", *TRAIN, "--layout", "dp=2,tp=2",
               "--run-dir", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert result.returncode == 2
    host = socket.gethostname()
    assert result.stderr.startswith(f"fivefold: error: host {host} (rank 1, local rank 1, node 0): "), result.stderr
    assert "4 processes but 2 were started" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------- pure checks, no processes


def test_slurm_environment_maps_srun_tasks_to_torch_variables():
    env = {"SLURM_STEP_NUM_TASKS": "6", "SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "MASTER_ADDR": "n1"}
    assert slurm_environment(env) == {"RANK": "4", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                      "GROUP_RANK": "2", "MASTER_PORT": "29500"}
    assert slurm_environment({**env, "RANK": "4"}) == {}  # torchrun inside the allocation assigns ranks
    assert slurm_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) == {}  # the batch script itself
    with pytest.raises(ClusterError, match="MASTER_ADDR"):
        slurm_environment({k: v for k, v in env.items() if k != "MASTER_ADDR"})
    assert tasks_on_node("4(x3),2", 3) == 2
    assert job_world_size({"RANK": "3", "WORLD_SIZE": "6"}) == 6  # --layout auto plans for the job's world
    assert job_world_size({}) is None


def test_tensor_parallel_groups_must_stay_inside_a_node():
    two_per_node = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}
    check_tp_within_node(Layout(dp=4, tp=2), two_per_node)
    check_tp_within_node(Layout(tp=8), {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})  # one node
    with pytest.raises(ClusterError, match=r"tp=4 does not divide the 2 processes of a node .* Use tp=2"):
        check_tp_within_node(Layout(dp=2, tp=4), two_per_node)
    with pytest.raises(ClusterError, match="tp=2 does not divide the 3 processes"):
        check_tp_within_node(Layout(dp=3, tp=2), {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"})


def test_kubernetes_example_is_a_valid_job():
    """examples/pytorchjob.yaml: its command is a fivefold config whose layout fills the job."""
    yaml = pytest.importorskip("yaml")
    from fivefold.cli import build_parser, config_from_args, split_dotted
    from fivefold.rules.layout import validate

    job = yaml.safe_load((Path(__file__).parents[2] / "examples" / "pytorchjob.yaml").read_text())
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    command = worker["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["torchrun", "-m", "fivefold.cli", "train"]
    rest, overrides = split_dotted(command[3:])
    args = build_parser().parse_args(rest)
    world = worker["replicas"] * int(job["spec"]["nprocPerNode"])
    config = validate(config_from_args(args.config, args.layout, overrides), world)
    assert args.resume and args.run_dir.startswith("/runs/")  # a restarted pod continues from the shared volume
    check_tp_within_node(config.layout, {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": job["spec"]["nprocPerNode"]})


def test_config_mismatch_names_the_hosts_and_keys():
    def record(host: str, rank: int, lr: float, torch_version: str = torch.__version__) -> dict:
        settings = job_settings(load_config("tiny", [f"train.lr={lr}"]))
        settings["versions"]["torch"] = torch_version
        identity = {"host": host, "rank": rank, "local_rank": rank % 2, "node": rank // 2, "pid": 1}
        return {"identity": identity, "fingerprint": fingerprint(settings), "settings": settings}

    same = [record("a", 0, 0.01), record("a", 1, 0.01)]
    assert mismatch_error(same) is None
    error = mismatch_error(same + [record("b", 2, 0.03), record("b", 3, 0.03)])
    assert "host b (ranks 2, 3) differ from host a (rank 0) in train.lr: 0.01 vs 0.03." in str(error)
    error = mismatch_error(same + [record("c", 2, 0.01, "2.0.0")])
    expected = f"host c (ranks 2) differ from host a (rank 0) in versions.torch: {torch.__version__!r} vs '2.0.0'"
    assert expected in str(error)
