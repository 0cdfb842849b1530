"""Writing files atomically: to a temporary name beside the target, renamed over it when complete."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_path(path: Path, keep_suffix: bool = False) -> Path:
    """The hidden name ``path`` is written under until it is complete: ``.NAME.tmp``, or
    ``.STEM.tmp.SUFFIX`` with ``keep_suffix`` (for writers that pick the format from the suffix)."""
    if keep_suffix:
        return path.with_name(f".{path.stem}.tmp{path.suffix}")
    return path.with_name(f".{path.name}.tmp")


@contextmanager
def atomic_path(path: str | os.PathLike, keep_suffix: bool = False, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s content to; on success it is renamed over ``path``,
    on any failure it is removed. A kill at any moment leaves either the old file or the new one
    under ``path``, never a truncated one. ``fsync`` flushes the content to disk before the rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(target, keep_suffix)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a fresh, unpredictably named temporary file renamed over it, for folders
    others may write to: a link planted at ``path`` (or at a fixed temporary name, as :func:`atomic_path` uses) is
    replaced, never written through."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)
