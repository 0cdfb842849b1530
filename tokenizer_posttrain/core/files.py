"""Writing files atomically: to a temporary name beside the target, renamed over it when complete."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_path(path: Path, keep_suffix: bool = False, tag: str = "tmp") -> Path:
    """A fresh, empty file beside ``path`` that ``path`` is written under until it is complete:
    ``.NAME.<random>.TAG``, or ``.STEM.<random>.TAG.SUFFIX`` with ``keep_suffix`` (for writers that pick the
    format from the suffix).

    Created exclusively under an unpredictable name, so that a link planted in the folder (a run folder others
    can write to) is never written through, as a fixed name would be.
    """
    if keep_suffix:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".{tag}{path.suffix}")
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".{tag}")
    os.close(fd)
    return Path(name)


def new_file_mode() -> int:
    """The mode the user's umask gives a new file (0644 under the usual 022). Read from ``/proc`` where there is
    one: ``os.umask`` can only be read by setting it, which for a moment gives other threads' new files mode 0666."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def atomic_path(
    path: str | os.PathLike, keep_suffix: bool = False, fsync: bool = False, tag: str = "tmp"
) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s content to (:func:`temporary_path`); on success it is given the
    mode the umask gives a new file (:func:`new_file_mode`) and renamed over ``path``, on any failure it is
    removed. A kill at any moment leaves either the old file or the new one under ``path``, never a truncated one.
    ``fsync`` flushes the content to disk before the rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(target, keep_suffix, tag)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        # mkstemp made it 0600, private while partial; once whole it gets the mode any new file would, so a team
        # on a shared cluster can read the exports and checkpoints its umask lets it read.
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through :func:`atomic_path` (as ``.NAME.<random>.partial``), for folders others
    may write to: a link planted at ``path`` is replaced, never written through."""
    with atomic_path(path, tag="partial") as tmp:
        tmp.write_bytes(data)
