"""glibc's allocator as a process-wide run setting (`train.malloc`).

Training allocates and frees the same large tensors every step (activations, gradient
buckets, ZeRO's shards, pipeline micro-batches). Under glibc's default, a block of 128 KiB or
more is its own mmap, returned to the kernel when freed (the threshold then grows with what is
freed, up to 32 MiB), and the top of the heap is returned once 128 KiB of it are free: the next
step takes page faults to get the same memory back. `retain` serves large blocks from the heap
and does not trim it, as jemalloc and tcmalloc behave: freed memory stays with the process for
the next step.

The setting applies to the whole process (every thread, torch's tensors and everything else),
so a benchmark that applies it runs its peers under it too. On a C library other than glibc
(macOS, musl) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import asdict, dataclass

from ..config import MALLOC_SETTINGS

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# mallopt takes a C int: values must stay below 2**31 (ctypes would silently keep the low 32 bits).
RETAIN_MMAP_THRESHOLD = 1 << 30  # only blocks of 1 GiB or more get their own mapping
RETAIN_TRIM_THRESHOLD = (1 << 31) - 1  # the heap is trimmed only when 2 GiB at its top are free
# Environment variables through which glibc takes the same settings at process start.
GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


class MallocError(ValueError):
    """A value of train.malloc (or --malloc) that names no setting."""


@dataclass(frozen=True)
class MallocState:
    """What a process runs under: the setting asked for, whether it took effect, and why not."""

    setting: str
    in_effect: bool
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def check_setting(setting: str) -> str:
    if setting not in MALLOC_SETTINGS:
        raise MallocError(f"malloc setting {setting!r} is unknown; use one of: {', '.join(MALLOC_SETTINGS)}")
    return setting


def glibc_mallopt():
    """glibc's mallopt, or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only
        mallopt = libc.mallopt
    except (OSError, TypeError, AttributeError):  # TypeError: CDLL(None) on Windows
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def glibc_version() -> str:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    return libc.gnu_get_libc_version().decode()


def environment_settings() -> str:
    """The glibc allocator variables set in this process's environment, as 'NAME=value ...'."""
    return " ".join(f"{name}={os.environ[name]}" for name in GLIBC_MALLOC_ENV if os.environ.get(name))


def apply_malloc(setting: str) -> MallocState:
    """Put this process under `setting`; call it before the model is built. Idempotent."""
    check_setting(setting)
    from_env = environment_settings()
    mallopt = glibc_mallopt()
    if mallopt is None:
        return MallocState(setting, setting == "default",
                           f"not glibc ({platform.system()} {platform.libc_ver()[0] or 'C library'}): "
                           f"the system allocator's own behaviour; malloc={setting} changes nothing here")
    if setting == "default":
        own = "glibc's own thresholds" + (f", as set by {from_env}" if from_env else "")
        return MallocState(setting, True, f"glibc {glibc_version()}: {own}")
    accepted = {"mmap threshold": mallopt(M_MMAP_THRESHOLD, RETAIN_MMAP_THRESHOLD),
                "trim threshold": mallopt(M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD)}
    refused = [name for name, ok in accepted.items() if not ok]
    if refused:
        return MallocState(setting, False, f"glibc {glibc_version()} refused the {' and '.join(refused)}: "
                                           "its own in their place")
    overridden = f" (replacing {from_env} from the environment)" if from_env else ""
    return MallocState(setting, True, f"glibc {glibc_version()}: mmap threshold {RETAIN_MMAP_THRESHOLD} B, "
                                      f"trim threshold {RETAIN_TRIM_THRESHOLD} B{overridden}")
