"""One launch per run folder: a lock file taken by rank 0 before any work and removed when the launch ends.

Two live runs in one folder overwrite each other's checkpoints, export and logs. The lock names its holder
(host, PID, start time, SLURM job), so a second launch can say who holds the folder, and a lock left by a
killed run is recognised as stale: its PID is gone on this host, or it belongs to an earlier attempt of the
same SLURM job (a requeued job may restart on another node), or its PID now belongs to another process.

That last case is the restarted container: it keeps its host name (Kubernetes StatefulSets, ``--hostname``) while
PIDs start again from 1, so a killed run's PID is soon some live process, often the new launch itself. The lock
therefore records the process's start time as the kernel counts it (``/proc/<pid>/stat``) and the boot it
belongs to, which tell a PID's holder from a later process with the same number.
"""

from __future__ import annotations

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


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux's ``/proc/<pid>/stat``), or None where
    that cannot be read (no such process, no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22, starttime
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This boot of the host (Linux), or None where unknown."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _holder() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "process_start": process_start(os.getpid()),
        "boot_id": boot_id(),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a live process of another user
        return True
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # half-written or garbage: nothing can hold it
    return holder if isinstance(holder, dict) else None


def stale_reason(holder: dict[str, Any] | None) -> str | None:
    """Why the lock of ``holder`` can be taken over, or None while its launch may still be running."""
    if holder is None:
        return "the lock file is unreadable"
    me = _holder()
    if holder.get("slurm_job") and holder.get("slurm_job") == me["slurm_job"]:
        return f"it was taken by an earlier attempt of SLURM job {me['slurm_job']}"
    pid = holder.get("pid")
    if holder.get("host") != me["host"] or not isinstance(pid, int):
        return None
    if not _alive(pid):
        return f"process {pid} on {me['host']} is gone"
    held_boot, held_start = holder.get("boot_id"), holder.get("process_start")
    if held_boot and me["boot_id"] and held_boot != me["boot_id"]:
        return f"{me['host']} has restarted since process {pid} took it"
    now = process_start(pid)
    if isinstance(held_start, int) and now is not None and now != held_start:
        return f"PID {pid} on {me['host']} now belongs to another process (a restarted container reuses PIDs)"
    return None


def describe(holder: dict[str, Any]) -> str:
    """The holder of a lock in words."""
    job = f", SLURM job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"PID {holder.get('pid')} on {holder.get('host')} (since {holder.get('started')}{job})"


class RunLock:
    """The lock of one run folder; ``acquire`` raises :class:`RunFolderBusy` while a live launch holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._held = False

    def acquire(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock is removed and the exclusive create tried again
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                reason = stale_reason(holder)
                if reason is None:
                    assert holder is not None
                    raise RunFolderBusy(
                        f"{self.run_dir} is in use by another run: {describe(holder)}; wait for it, choose another "
                        f"run folder with log.name=..., or delete {self.path} if that run is no longer running"
                    ) from None
                warnings.warn(f"taking over the stale lock {self.path} ({reason})", stacklevel=2)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(_holder(), f)
            self._held = True
            return
        raise RunFolderBusy(f"cannot take the lock {self.path}: another launch keeps creating it")

    def release(self) -> None:
        if self._held:
            holder = _read(self.path)
            if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink(missing_ok=True)
            self._held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def run_folder_lock(run_dir: Path) -> AbstractContextManager[object]:
    """The lock of ``run_dir`` on rank 0, which holds it for the whole launch; nothing on the other ranks (they
    are the same launch, and start after rank 0 took it)."""
    from lightning.pytorch.utilities import rank_zero_only

    return RunLock(run_dir) if rank_zero_only.rank == 0 else nullcontext()
