"""One launch per run folder: a lock file taken by rank 0 before any work and removed when the launch ends.

Two live runs in one folder overwrite each other's checkpoints, export and logs. The launch holds an exclusive
``flock`` on ``<run>/.run.lock`` for its whole life, and the file names the holder (host, PID, start time, SLURM
job), so a second launch can say who holds the folder. The kernel drops the ``flock`` when the holder dies
however it dies, so a lock left by a killed run is recognised as stale by the lock itself, not by guessing from
its PID: that would fail in a restarted container, which keeps its host name while PIDs start again from 1 (the
killed run's PID is soon a live process, often the new launch itself), and in containers that share a host
name and a run folder but not their PID numbers.

Where the ``flock`` may not reach (a record naming another host: a file system whose locks stay on each node),
the record decides as before: the folder stays refused unless the record is an earlier attempt of this SLURM
job (a requeued job may restart on another node). Where the file system has no locks at all, the record alone
decides on this host too: stale when its PID is gone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from ..core.errors import UserError

LOCK_NAME = ".run.lock"


class RunFolderBusy(UserError):
    """Another live launch holds the run folder."""


def _holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    return True


def _parse(text: str) -> dict[str, Any] | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None  # half-written or garbage: nothing can hold it
    return holder if isinstance(holder, dict) else None


def describe(holder: dict[str, Any] | None) -> str:
    """The holder of a lock in words."""
    if holder is None:
        return "a launch that has not written its name yet"
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"PID {holder.get('pid')} on {holder.get('host')} (since {holder.get('started')}{job})"


def record_stale_reason(holder: dict[str, Any] | None, locks_work: bool) -> str | None:
    """Why the record of an unlocked lock file can be taken over, or None while its launch may still run.

    ``locks_work``: this launch got the ``flock``, so no process that shares the file's locks holds it; then a
    record of this host is stale whatever its PID now is. A record of another host is stale only as an earlier
    attempt of this SLURM job."""
    if holder is None:
        return "the lock file is unreadable"
    me = _holder()
    if holder.get("slurm_job") and holder.get("slurm_job") == me["slurm_job"]:
        return f"it was taken by an earlier attempt of SLURM job {me['slurm_job']}"
    if holder.get("host") != me["host"]:
        return None
    pid = holder.get("pid")
    if locks_work:
        return f"no process holds it (PID {pid} on {me['host']} ended without releasing it)"
    if isinstance(pid, int) and not _alive(pid):
        return f"process {pid} on {me['host']} is gone"
    return None


def _busy(run_dir: Path, path: Path, holder: dict[str, Any] | None) -> RunFolderBusy:
    return RunFolderBusy(
        f"{run_dir} is in use by another run: {describe(holder)}; wait for it, choose another "
        f"run folder with log.name=..., or delete {path} if that run is no longer running"
    )


class RunLock:
    """The lock of one run folder; ``acquire`` raises :class:`RunFolderBusy` while a live launch holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # again when the file was replaced between our open and our flock
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as err:  # a planted link (never followed), a folder, no permission
                raise RunFolderBusy(
                    f"cannot open the run lock {self.path} ({err.strerror}); it must be a plain file this user can "
                    "write: remove whatever is there"
                ) from None
            try:
                if self._take(fd):
                    self._fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise RunFolderBusy(f"cannot take the lock {self.path}: other launches keep replacing it")

    def _take(self, fd: int) -> bool:
        """Lock the open lock file ``fd`` and write our name into it; False when it is no longer the file at
        ``self.path`` (a releasing launch removed it meanwhile). Raises RunFolderBusy."""
        locks_work = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(self.run_dir, self.path, _parse(_read_fd(fd))) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            locks_work = False  # a file system without locks: the record decides
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                return False
        except FileNotFoundError:
            return False
        text = _read_fd(fd)
        if text.strip():
            holder = _parse(text)
            reason = record_stale_reason(holder, locks_work)
            if reason is None:
                raise _busy(self.run_dir, self.path, holder)
            warnings.warn(f"taking over the stale lock {self.path} ({reason})", stacklevel=3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            # Removed while still locked: a launch that opened it meanwhile sees it is gone and opens anew.
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_fd(fd: int) -> str:
    return os.pread(fd, 1 << 16, 0).decode(errors="replace")


def run_folder_lock(run_dir: Path) -> AbstractContextManager[object]:
    """The lock of ``run_dir`` on rank 0, which holds it for the whole launch; nothing on the other ranks (they
    are the same launch, and start after rank 0 took it)."""
    from lightning.pytorch.utilities import rank_zero_only

    return RunLock(run_dir) if rank_zero_only.rank == 0 else nullcontext()
