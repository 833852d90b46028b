"""Run folders: one run at a time, no silent overwrite, outputs replaced atomically.

A run folder holds one run's metrics, checkpoints and final weights. Three rules keep them:

- a lock (`.lock`, an advisory `flock` held by rank 0 for the whole run, naming its pid and
  host, removed at the end) refuses a second run into the same folder while the first is
  alive; the kernel drops the lock when its holder dies, so a crashed run never blocks the next;
- a folder that already holds something is refused unless the run continues it (`--resume`)
  or replaces it (`--overwrite`, which deletes a previous run's outputs first, keeps any other
  file, and refuses a folder that does not look like a run, so a mistyped `--run-dir ~` deletes
  nothing);
- a resumed run continues the folder's own config (config.json, or the config.toml that
  `convert import` writes) unless `--config` names another;
- files a reader may open at any time (config.json, an index) are written to a side file,
  flushed to disk, then renamed over the old one: a crash or a full disk leaves the old file
  whole; the final weights, several files, are written whole into a staging folder first and
  replace the previous set together (fivefold/checkpoint/sets.py).

Nothing here imports torch, so the launcher checks a folder before it starts any process.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import fnmatch
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Callable, Iterator

from ..config import Config, config_from_dict, load_config

LOCK_FILE = ".lock"
RUNS_ROOT = Path("runs")
RUN_MARKERS = ("metrics.jsonl", "checkpoints", "model.safetensors", "config.toml")
# Everything a run, its launcher, its report or `convert import` writes into a run folder (shell
# patterns): what --overwrite deletes. Anything else in the folder is the user's and is kept.
RUN_OUTPUTS = (
    "config.json", "config.toml", "metrics.jsonl", "prediction.json", "hosts.json", "malloc.json", "trace.json",
    "timeline.png", "tokenizer.json", "checkpoints", "flight_records", "tensorboard", "profile", "report",
    "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors",
    ".tmp_final_weights", ".replaced_weights",
)


class RunFolderError(ValueError):
    """A run folder that cannot be used as asked; the message says what to do instead."""


class WriteFailed(OSError):
    """An output that could not be written (full disk, read-only folder); the old file is kept."""


def default_run_dir(model_name: str) -> Path:
    """A new folder under runs/ named after the model and the time (model.name is a plain name)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return RUNS_ROOT / f"{model_name}-{stamp}"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_write_error(err: BaseException) -> str:
    """The reason of an OSError, or of a safetensors error wrapping one (e.g. a full disk)."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    found = re.search(r'message: "([^"]+)"', str(err))
    return found.group(1) if found else str(err)


def write_errors() -> tuple[type[BaseException], ...]:
    """Exceptions a failed write raises: OSError, and safetensors' own error type."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return (OSError,)
    return (OSError, SafetensorError)


def atomic_write(path: Path, write: Callable[[Path], None]) -> Path:
    """`write(side_file)`, flush it to disk, then rename it over `path`; on failure `path` is untouched."""
    path = Path(path)
    side = path.with_name(path.name + ".part")
    try:
        write(side)
        fsync_path(side)
        os.replace(side, path)
    except write_errors() as err:
        side.unlink(missing_ok=True)
        raise WriteFailed(errno.EIO, f"could not write {path}: {describe_write_error(err)}") from None
    return path


def write_json(path: Path, value: object) -> Path:
    def write(side: Path) -> None:
        side.write_text(json.dumps(value, indent=1, sort_keys=True))

    return atomic_write(path, write)


# ----------------------------------------------------------------------------------- the lock


class RunLock:
    """An exclusive advisory lock on a run folder, held until `release` (or the process dies).

    The lock file is removed on release, so a finished run leaves its folder as it was. A
    claimant that locked a file just unlinked by the previous holder notices (the path no
    longer names the file it locked) and tries again on the new file.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path, self._fd = Path(run_dir), Path(run_dir) / LOCK_FILE, -1
        for _ in range(100):
            fd = self._open()
            if self._lock(fd):
                self._fd = fd
                break
        else:  # pragma: no cover - a hundred holders in a row released while we looked
            raise RunFolderError(f"run folder {run_dir} changes hands too often to claim; try again")
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunFolderError(f"run folder {self.run_dir} is not writable ({describe_write_error(err)}); "
                                 "choose another --run-dir") from None

    def _lock(self, fd: int) -> bool:
        """Lock `fd`; False if it was unlinked meanwhile (retry). Raises if another run holds it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = self.path.read_text().strip() or "a process that is starting"
            except OSError:
                holder = "a process that is ending"
            raise RunFolderError(
                f"run folder {self.run_dir} is in use by another run ({holder}); wait for it to end or "
                "choose another --run-dir"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
        return same

    def release(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)  # while still locked: nobody can have locked this file
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ------------------------------------------------------------------------- existing contents


def existing_entries(run_dir: Path) -> list[str]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)


def looks_like_run(run_dir: Path) -> bool:
    """True for a folder a fivefold run or `convert import` wrote (what --overwrite may delete)."""
    run_dir = Path(run_dir)
    if any((run_dir / marker).exists() for marker in RUN_MARKERS):
        return True
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and {"model", "layout", "train"} <= set(saved)


def is_run_output(name: str) -> bool:
    """Whether an entry of a run folder is something a run writes (`RUN_OUTPUTS`)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_OUTPUTS)


def _delete(run_dir: Path, entries: list[str]) -> None:
    for name in entries:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_resume_or_overwrite(resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise RunFolderError("--resume continues the run in --run-dir and --overwrite deletes it; give only one")


def check_contents(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a folder holding something unless the run continues it; --overwrite empties a previous run."""
    check_resume_or_overwrite(resume, overwrite)
    entries = existing_entries(run_dir)
    if not entries or resume:
        return
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if not overwrite:
        raise RunFolderError(
            f"run folder {run_dir} is not empty ({shown}); continue that run with --resume, replace it with "
            "--overwrite, or choose another --run-dir"
        )
    if not looks_like_run(run_dir):
        raise RunFolderError(
            f"--overwrite deletes a previous run, but {run_dir} does not hold one ({shown}); "
            "choose another --run-dir"
        )
    _delete(Path(run_dir), [name for name in entries if is_run_output(name)])
    kept = [name for name in entries if not is_run_output(name)]
    if kept:
        print(f"--overwrite: kept {', '.join(kept)} in {run_dir} (not written by a run)", flush=True)


def claim(run_dir: Path, resume: bool, overwrite: bool, check: bool = True) -> RunLock:
    """Create and lock the run folder and (with `check`) apply the rules on existing contents.

    `check` is False for a process that continues a job whose folder was already checked:
    a worker started by the fivefold launcher, or a restart of a torchrun job.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"--run-dir {run_dir} is a file; give a folder")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunFolderError(f"cannot create run folder {run_dir}: {describe_write_error(err)}") from None
    lock = RunLock(run_dir)
    try:
        if check:
            check_contents(run_dir, resume, overwrite)
    except BaseException:
        lock.release()
        raise
    return lock


def continues_a_checked_job() -> bool:
    """A worker of a job whose launcher checked the folder, or a torchrun restart of this job."""
    launched = os.environ.get("FIVEFOLD_LAUNCHED") == "1"
    return launched or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


@contextlib.contextmanager
def removed_if_left_empty(run_dir: Path) -> Iterator[None]:
    """Around a run: a folder that did not exist before and holds no file afterwards (the run
    was refused before it wrote anything) is removed, so a refusal leaves nothing behind. A
    folder that existed before is never touched, and only empty folders are removed (rmdir
    fails on anything else), so no rank or attempt can delete what another wrote."""
    run_dir = Path(run_dir)
    existed = run_dir.exists()
    try:
        yield
    finally:
        if not existed and run_dir.is_dir():
            _remove_empty_folders(run_dir)


def _remove_empty_folders(root: Path) -> None:
    for folder, _subfolders, _files in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):  # not empty: a file was written, keep it
            os.rmdir(folder)


# ---------------------------------------------------------------------------- a run's own record


def saved_run_config(run_dir: Path) -> Config | None:
    """The config the run in `run_dir` was started with: config.json (every run writes it), else the
    config.toml of `convert import`; None for a folder holding neither."""
    run_dir = Path(run_dir)
    saved_json, saved_toml = run_dir / "config.json", run_dir / "config.toml"
    if saved_json.is_file():
        try:
            return config_from_dict(json.loads(saved_json.read_text()))
        except (ValueError, UnicodeDecodeError) as err:
            raise RunFolderError(f"{saved_json} is not a run's config ({err}); name the run's settings with "
                                 "--config PRESET_OR_TOML") from None
    if saved_toml.is_file():
        return load_config(str(saved_toml))
    return None


def _kept_before(step: int | None, start: int) -> bool:
    """A row without a step (not a step's record) is kept; a step's row only before `start`."""
    return step is None or step < start


def _write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(lines))


def supersede_metrics(run_dir: Path, start: int) -> int:
    """Drop the metrics.jsonl rows of steps `start` and later, which a run resumed at `start` trains
    again: the file never repeats a step. Returns how many rows were dropped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    kept = [line for line in lines if _kept_before(_logged_step(line), start)]
    if len(kept) < len(lines):
        atomic_write(path, lambda side: _write_lines(side, kept))
    return len(lines) - len(kept)


def _logged_step(line: str) -> int | None:
    """The step of one metrics.jsonl row; None for a line that is not a step record (kept as it is)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None
