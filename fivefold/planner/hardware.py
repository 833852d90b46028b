"""Accelerator presets, and a calibrated ``cpu`` entry for gloo runs on this machine.

Bandwidths are per device and per direction, in bytes/s. ``intra_node_bw`` is the
NVLink/NVSwitch bandwidth a device can drive; ``inter_node_bw`` its share of the node's
network adapters. ``link_efficiency`` converts them to what ring collectives reach.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from ..rules.fp8 import base_policy, is_fp8
from ..rules.precision import parse_policy
from .errors import PlanError, UnknownNameError, choices

GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One kind of device and how it is connected.

    ``matmul_efficiency`` is the fraction of ``peak_flops`` that the matrix
    multiplications of a transformer layer sustain in training (large-GEMM throughput of
    cuBLAS on the device, below the datasheet peak because of clock limits, tile
    quantisation and wave effects). The time model divides FLOPs by
    ``peak * matmul_efficiency`` and adds memory-bound and communication time separately.
    ``memory_reserved_bytes`` is held back for the runtime context, communication buffers
    and allocator fragmentation when deciding whether a layout fits.
    """

    name: str
    peak_flops: float
    memory_bytes: int
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int
    hbm_bw: float
    peak_flops_fp32: float
    matmul_efficiency: float = 0.7
    link_efficiency: float = 0.8
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 20e-6
    memory_reserved_bytes: int = 3 * GiB
    peak_flops_fp8: float = 0.0  # dense FP8 tensor-core peak; 0: the device has none
    sm_count: int = 0  # streaming multiprocessors; 0: not modelled

    def peak(self, precision: str) -> float:
        """Dense peak for the precision's matmuls (bf16/fp16 tensor cores, or fp32). Under
        "fp8" the 16-bit peak: MFU is quoted against it, and the GEMMs FP8 does not cover
        run at it (`fp8_speedup` gives the others)."""
        return self.peak_flops_fp32 if parse_policy(base_policy(precision)).compute == "fp32" else self.peak_flops

    def fp8_speedup(self, precision: str) -> float:
        """How much faster the GEMMs FP8 covers run than at `peak`: 1 unless ``precision`` is
        "fp8"; raises `PlanError` for a device without FP8 tensor cores."""
        if not is_fp8(precision):
            return 1.0
        if self.peak_flops_fp8 <= 0:
            raise PlanError(f"hardware {self.name!r} has no FP8 tensor cores; use --precision bf16, "
                            "or an FP8 device (H100-80GB, H800, H200)")
        return self.peak_flops_fp8 / self.peak_flops

    @property
    def usable_memory_bytes(self) -> int:
        return self.memory_bytes - self.memory_reserved_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_PRESETS: dict[str, Hardware] = {
    # NVIDIA Tesla V100 SXM2 32GB datasheet: 125 TFLOP/s fp16 tensor, 15.7 fp32, 900 GB/s
    # HBM2, NVLink 300 GB/s (both directions). DGX-1: 8 GPUs, 4 x 100 Gb/s EDR InfiniBand.
    "V100-32GB": Hardware("V100-32GB", peak_flops=125e12, memory_bytes=32 * GiB,
                          intra_node_bw=150e9, inter_node_bw=4 * 12.5e9 / 8, gpus_per_node=8,
                          hbm_bw=900e9, peak_flops_fp32=15.7e12, matmul_efficiency=0.70,
                          memory_reserved_bytes=2 * GiB),
    # NVIDIA A100 datasheet (SXM4): 312 TFLOP/s bf16 dense, 19.5 fp32, 1,555 GB/s (40GB) or
    # 2,039 GB/s (80GB) HBM, NVLink 600 GB/s (both directions). DGX A100: 8 GPUs,
    # 8 x 200 Gb/s HDR InfiniBand (one adapter per GPU).
    "A100-40GB": Hardware("A100-40GB", peak_flops=312e12, memory_bytes=40 * GiB,
                          intra_node_bw=300e9, inter_node_bw=25e9, gpus_per_node=8,
                          hbm_bw=1555e9, peak_flops_fp32=19.5e12, matmul_efficiency=0.75),
    "A100-80GB": Hardware("A100-80GB", peak_flops=312e12, memory_bytes=80 * GiB,
                          intra_node_bw=300e9, inter_node_bw=25e9, gpus_per_node=8,
                          hbm_bw=2039e9, peak_flops_fp32=19.5e12, matmul_efficiency=0.75),
    # NVIDIA H100 SXM5 datasheet (132 SMs): 989 TFLOP/s bf16 dense (1,979 with sparsity), 1,979 FP8 dense
    # (3,958 with sparsity), 67 fp32,
    # 3.35 TB/s HBM3, NVLink 900 GB/s (both directions). DGX H100: 8 GPUs,
    # 8 x 400 Gb/s ConnectX-7 (NDR InfiniBand).
    "H100-80GB": Hardware("H100-80GB", peak_flops=989e12, memory_bytes=80 * GiB,
                          intra_node_bw=450e9, inter_node_bw=50e9, gpus_per_node=8,
                          hbm_bw=3.35e12, peak_flops_fp32=67e12, matmul_efficiency=0.70,
                          peak_flops_fp8=1979e12, sm_count=132),
    # H800 SXM: the H100 SXM compute (FP8 included) and memory with NVLink cut to 400 GB/s (both
    # directions) for export; DeepSeek-V3 report (Section 3.1): 8 GPUs per node over
    # NVLink/NVSwitch, InfiniBand between nodes (50 GB/s per GPU).
    "H800": Hardware("H800", peak_flops=989e12, memory_bytes=80 * GiB,
                     intra_node_bw=200e9, inter_node_bw=50e9, gpus_per_node=8,
                     hbm_bw=3.35e12, peak_flops_fp32=67e12, matmul_efficiency=0.70,
                     peak_flops_fp8=1979e12, sm_count=132),
    # NVIDIA H200 SXM datasheet: H100 compute (1,979 TFLOP/s FP8 dense), 141 GB HBM3e (about 140 GiB usable as
    # reported by the driver) at 4.8 TB/s, NVLink 900 GB/s; 8 x 400 Gb/s per HGX node.
    "H200": Hardware("H200", peak_flops=989e12, memory_bytes=140 * GiB,
                     intra_node_bw=450e9, inter_node_bw=50e9, gpus_per_node=8,
                     hbm_bw=4.8e12, peak_flops_fp32=67e12, matmul_efficiency=0.70,
                     peak_flops_fp8=1979e12, sm_count=132),
}

# Conservative stand-ins for "cpu" until `calibrate()` has measured this machine: a few
# cores' fp32 matmul throughput, loopback gloo bandwidth, 1 Gb/s Ethernet between machines.
CPU_DEFAULT = Hardware("cpu", peak_flops=2e10, memory_bytes=8 * GiB, intra_node_bw=1e9,
                       inter_node_bw=1.25e8, gpus_per_node=8, hbm_bw=5e9,
                       peak_flops_fp32=2e10, matmul_efficiency=1.0, link_efficiency=1.0,
                       intra_latency_s=50e-6, inter_latency_s=200e-6,
                       memory_reserved_bytes=1 * GiB)


def calibration_path() -> Path:
    """``$FIVEFOLD_CACHE_DIR`` or ``$XDG_CACHE_HOME/fivefold`` (``~/.cache/fivefold``)."""
    root = os.environ.get("FIVEFOLD_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fivefold")
    return Path(root) / "cpu_calibration.json"


def save_calibration(hw: Hardware, path: Path | None = None) -> Path:
    path = Path(path) if path is not None else calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hw.to_dict(), indent=2))
    return path


def load_calibration(path: Path | None = None) -> Hardware | None:
    """The saved ``cpu`` calibration, or None when there is none (or it is unreadable)."""
    path = Path(path) if path is not None else calibration_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    known = {f.name for f in dataclasses.fields(Hardware)}
    try:
        return Hardware(**{k: v for k, v in data.items() if k in known})
    except TypeError:
        return None


def cpu_hardware() -> Hardware:
    """``HARDWARE["cpu"]``: the saved calibration, else the conservative defaults."""
    return load_calibration() or CPU_DEFAULT


class _HardwareTable(Mapping[str, Hardware]):
    """Read-only name -> `Hardware` mapping; case-insensitive; ``cpu`` read from cache."""

    def _canonical(self, key: str) -> str | None:
        low = str(key).lower()
        for name in (*_PRESETS, "cpu"):
            if name.lower() == low:
                return name
        return None

    def __getitem__(self, key: str) -> Hardware:
        name = self._canonical(key)
        if name is None:
            raise UnknownNameError(f"unknown hardware {key!r}; use one of {choices(self)}")
        return cpu_hardware() if name == "cpu" else _PRESETS[name]

    def __iter__(self) -> Iterator[str]:
        return iter((*_PRESETS, "cpu"))

    def __len__(self) -> int:
        return len(_PRESETS) + 1

    def __contains__(self, key: object) -> bool:
        return self._canonical(str(key)) is not None


HARDWARE: Mapping[str, Hardware] = _HardwareTable()


def get_hardware(hardware: str | Hardware) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else HARDWARE[hardware]


def hardware_for_gpu(device_name: str, memory_bytes: int | None = None) -> Hardware:
    """The preset of a CUDA device, from its name (``torch.cuda.get_device_name``) and memory.

    The family (V100, A100, H100, H800, H200) is read from the name; among its presets the
    one whose memory is closest to ``memory_bytes`` wins (an "A100-SXM4-40GB" is the 40 GB
    preset). Raises `PlanError` for a device without a preset.
    """
    name = device_name.upper()
    family = [hw for key, hw in _PRESETS.items() if key.split("-")[0] in name]
    if not family:
        raise UnknownNameError(
            f"no hardware preset for the GPU {device_name!r} (presets: {choices(_PRESETS)}); pick a layout "
            f"with `fivefold plan --hardware <the closest preset>` and pass it to --layout instead of auto")
    if memory_bytes is None:
        return family[-1]
    return min(family, key=lambda hw: abs(hw.memory_bytes - memory_bytes))


# ---- calibration ---------------------------------------------------------------------


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_operands(size: int | tuple[int, int, int], dtype, device="cpu"):
    """Random operands of an (m, k) @ (k, n) GEMM; an int size means m = k = n."""
    import torch

    m, k, n = (size, size, size) if isinstance(size, int) else size
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
    return a, b


def measure_matmul_flops(dtype="float32", size: int | tuple[int, int, int] = 1024, seconds: float = 0.25,
                         device="cpu") -> float:
    """FLOP/s of repeated (m, k) @ (k, n) GEMMs, 2 * m * k * n FLOPs each, best of short bursts.

    `dtype` is a torch dtype or its name. `seconds` bounds the whole call, warm-up included
    (one untimed GEMM, then at least one timed one). The fastest burst is reported, since on
    a shared machine the slow ones measure other processes, not the hardware. The planner's
    calibration and the training log's MFU both use this one measurement.
    """
    import torch

    device = torch.device(device)
    start_all = time.perf_counter()
    a, b = matmul_operands(size, dtype, device)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    out = a @ b  # warm-up: thread pool, allocator, kernel selection
    _synchronize(device)
    best = 0.0
    while best == 0.0 or time.perf_counter() - start_all < seconds:
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        _synchronize(device)
        best = max(best, flops / (time.perf_counter() - start))
    return best


def measure_copy_bandwidth(mib: int = 64, seconds: float = 0.3) -> float:
    """Memory bandwidth (bytes/s, read + write) of a large tensor copy, best of repeated copies
    (as for the matmul rate: on a shared machine the slow ones measure other processes)."""
    import torch

    src = torch.ones(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    start_all = time.perf_counter()
    dst.copy_(src)  # warm-up: page faults of the destination
    best = 0.0
    while best == 0.0 or time.perf_counter() - start_all < seconds:
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2.0 * src.numel() * 4 / (time.perf_counter() - start))
    return best


def _allreduce_worker(rank: int, init_file: str, nbytes: int, iters: int, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        buf = torch.ones(nbytes // 4)
        dist.all_reduce(buf)  # warm-up and connection set-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        elapsed = time.perf_counter() - start
        if rank == 0:
            queue.put(elapsed / iters)
    finally:
        dist.destroy_process_group()


def measure_gloo_allreduce_bandwidth(mib: int = 16, iters: int = 5, timeout_s: float = 120.0) -> float:
    """Bus bandwidth (bytes/s) of a gloo all-reduce between 2 local processes.

    For n = 2 ranks the ring all-reduce moves 2(n - 1)/n = 1 buffer per rank.
    """
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    nbytes = mib * (1 << 20)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_allreduce_worker, args=(r, init_file, nbytes, iters, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            per_call = queue.get(timeout=timeout_s)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    return nbytes / per_call


def calibrate(save: bool = True, path: Path | None = None, quick: bool = False) -> Hardware:
    """Measure this machine and return (and by default save) the ``cpu`` `Hardware`.

    Measures fp32 and bf16 matmul throughput with torch (``peak_flops_fp32`` and
    ``peak_flops``; ``matmul_efficiency`` is 1 since these are achieved rates), tensor-copy
    bandwidth (``hbm_bw``), physical memory, and the gloo all-reduce bandwidth between two
    local processes (``intra_node_bw``). The network between machines cannot be measured
    from one machine and keeps the conservative default.
    """
    secs = 0.1 if quick else 0.5
    size = 512 if quick else 1024
    fp32 = measure_matmul_flops("float32", size, secs)
    bf16 = measure_matmul_flops("bfloat16", size, secs)
    copy_bw = measure_copy_bandwidth(16 if quick else 64, secs)
    ar_bw = measure_gloo_allreduce_bandwidth(4 if quick else 16, 3 if quick else 5)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = CPU_DEFAULT.memory_bytes
    hw = dataclasses.replace(CPU_DEFAULT, peak_flops=bf16, peak_flops_fp32=fp32,
                             memory_bytes=int(mem), hbm_bw=copy_bw, intra_node_bw=ar_bw,
                             inter_node_bw=min(CPU_DEFAULT.inter_node_bw, ar_bw),  # no faster than loopback
                             gpus_per_node=os.cpu_count() or CPU_DEFAULT.gpus_per_node,
                             memory_reserved_bytes=max(int(mem * 0.25), GiB))
    if save:
        save_calibration(hw, path)
    return hw


def check_hardware(hw: Hardware) -> None:
    for name in ("peak_flops", "memory_bytes", "intra_node_bw", "inter_node_bw", "gpus_per_node",
                 "hbm_bw", "peak_flops_fp32", "matmul_efficiency"):
        if getattr(hw, name) <= 0:
            raise PlanError(f"hardware {hw.name!r}: {name} must be positive")
