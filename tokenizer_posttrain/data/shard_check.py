"""Tar shards that are cut short or damaged: found before they are read (from energon's index of a
prepared shard), or while reading one member after the other (any tar).

An interrupted copy or a full disk leaves a shard whose first samples are whole and whose rest is
gone, while energon's ``<shard>.tar.idx`` beside it still lists every sample. Python's ``tarfile``
then stops early without a word when a header is cut, and raises ``ReadError`` ("unexpected end of
data") when a member's bytes are. Plain files only: no energon, no video stack.
"""

from __future__ import annotations

import io
import re
import struct
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..core.untrusted import one_line
from .layout import read_dataset_file

INDEX_SUFFIX = ".tar.idx"
"""energon's per-shard index: one little-endian uint64 byte offset per sample, plus the end of the last."""
FIX = "re-create it (python -m data_tools make-shards) or restore the file"
INDEX_BYTES = 64 << 20
"""Largest index read: 8 million samples in one shard, far more than any shard holds."""
_END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE  # two zero blocks close every tar written by tarfile and GNU tar


@dataclass(frozen=True)
class ShardDamage:
    """A shard whose samples after the first ``readable`` cannot be read."""

    shard: str
    readable: int
    total: int | None
    """Samples the shard should hold (from its index); None when it has no index."""
    detail: str
    """What is wrong, e.g. ``"the file ends at byte 28672, but its index expects 68608"``."""

    @property
    def lost(self) -> int | None:
        return None if self.total is None else self.total - self.readable

    def message(self) -> str:
        """One line: what is wrong, how many samples are readable, what to do."""
        if self.total is None:
            count = f"{self.readable} samples readable before it, how many are lost is unknown (no energon index)"
        else:
            count = f"{self.readable} of {self.total} samples readable"
        return f"damaged tar shard: {self.detail}; {count}; {FIX}"


def index_offsets(shard: Path) -> tuple[int, ...] | None:
    """The sample byte offsets of energon's index beside ``shard`` (count + 1 of them), or None when there is no
    index. An index that is no regular file of at most :data:`INDEX_BYTES` (a FIFO would block this read and
    energon's) raises a one-line :class:`~tokenizer_posttrain.core.errors.DataError` naming it."""
    index = shard.with_name(shard.name.removesuffix(".tar") + INDEX_SUFFIX)
    fix = f"run python -m data_tools prepare on the dataset folder again (it writes each {INDEX_SUFFIX} anew)"
    try:
        raw = read_dataset_file(index, INDEX_BYTES, fix)
    except FileNotFoundError:
        return None
    if len(raw) < 16 or len(raw) % 8:
        return None
    return struct.unpack(f"<{len(raw) // 8}Q", raw)


def indexed_damage(shard: Path) -> ShardDamage | None:
    """Compare a prepared shard with its energon index: the samples whose bytes end past the end of
    the file are lost. None when every listed sample is there (or there is no index to compare)."""
    offsets = index_offsets(shard)
    if offsets is None:
        return None
    try:
        size = shard.stat().st_size
    except OSError as err:
        return ShardDamage(shard.name, 0, len(offsets) - 1, f"cannot be read ({err.strerror})")
    total = len(offsets) - 1
    readable = next((i for i in range(total) if offsets[i + 1] > size), total)
    if readable == total:
        return None
    detail = f"the file ends at byte {size}, but its index ({INDEX_SUFFIX}) expects {offsets[-1]}"
    return ShardDamage(shard.name, readable, total, detail)


PREPARE_AGAIN = "python -m data_tools prepare"
# How energon's prepare groups regular tar members into samples, which must be matched exactly: names starting
# "__...__" are skipped, and a sample's key is the name up to the first dot of its last part (no dot: skipped).
_ENERGON_META = re.compile(r"__[^/]*__($|/)")
_ENERGON_PART = re.compile(r"((?:.*/)?[^.]+)\.[^/]*")


@dataclass(frozen=True)
class ShardChange:
    """A prepared shard whose tar no longer holds the samples its energon index lists (replaced or rewritten)."""

    shard: str
    detail: str
    """What differs, e.g. ``"sample 1 of 10 (at byte 0) ends at byte 9216, its index says 8704"``."""

    def message(self, root: Path | str) -> str:
        """One line: the shard, what differs, what to do (``root``: the dataset folder to prepare again)."""
        detail = one_line(self.detail, 200)  # member names come from the tar
        return (
            f"{self.shard}: tar shard changed since it was prepared: {detail}; energon would read the samples "
            f"its old index ({INDEX_SUFFIX}) lists, not the ones it holds now. Run {PREPARE_AGAIN} {root} again"
        )


def index_change(shard: Path, every_sample: bool = False) -> ShardChange | None:
    """Compare a prepared shard's tar headers with its energon index; None when they agree, when the shard has
    no index, or when it is only cut short (its whole samples are where the index says: :func:`indexed_damage`).

    Each sample checked must start at its indexed offset and end where the next one starts, one sample key in
    between; and nothing but the end of the archive may follow the last one. By default only the first, middle
    and last whole samples are walked (a few 512-byte header reads per shard, cheap enough at every launch);
    ``every_sample`` walks them all.
    """
    offsets = index_offsets(shard)
    if offsets is None:
        return None
    total = len(offsets) - 1
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            whole = next((i for i in range(total) if offsets[i + 1] > size), total)
            picks = range(whole) if every_sample else sorted({i for i in (0, whole // 2, whole - 1) if 0 <= i < whole})
            for i in picks:
                problem = _sample_problem(f, offsets[i], offsets[i + 1])
                if problem:
                    return ShardChange(shard.name, f"sample {i + 1} of {total} (at byte {offsets[i]}) {problem}")
            if whole == total:
                extra = _member_at(f, offsets[-1])
                if extra is not None:
                    return ShardChange(
                        shard.name, f"it holds {extra} and more after the {total} samples its index lists"
                    )
    except OSError:
        return None  # unreadable: the preflight and the loader name it as damaged
    return None


def _sample_key(member: tarfile.TarInfo) -> str | None:
    """energon's sample key of a tar member, None for a member that is part of no sample."""
    if not member.isreg() or _ENERGON_META.match(member.name):
        return None
    part = _ENERGON_PART.fullmatch(member.name)
    return None if part is None else part.group(1)


def _sample_problem(f: BinaryIO, start: int, end: int) -> str | None:
    """How the tar bytes ``[start, end)`` of ``f`` differ from one energon sample; None when they are one."""
    f.seek(start)
    keys: list[str] = []
    first = boundary = None
    try:
        with tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if member.offset >= end:
                    boundary = member.offset
                    break
                key = _sample_key(member)
                if key is not None:
                    first = member.offset if first is None else first
                    if key not in keys:
                        keys.append(key)
            else:
                boundary = tar.offset
    except (tarfile.TarError, OSError, EOFError, ValueError) as err:  # ValueError: a crafted PAX header
        return f"cannot be read as its index says ({type(err).__name__}: {err})"
    if first != start:
        return "does not begin where its index says" if first is not None else "holds no member where its index says"
    if len(keys) > 1:
        return f"holds samples {', '.join(keys[:3])} where its index lists one"
    if boundary != end:
        return f"ends at byte {boundary}, its index says {end}"
    return None


def _member_at(f: BinaryIO, offset: int) -> str | None:
    """The name of the tar member whose header lies at ``offset`` (None: end of archive, or none there)."""
    f.seek(offset)
    try:
        # tarfile, not one header block: a long name sits in an extended header before the member's own.
        with tarfile.open(fileobj=f, mode="r:") as tar:
            member = tar.next()
    except (tarfile.TarError, OSError, EOFError, ValueError):
        return None
    return None if member is None else member.name


def whole_members(tar: tarfile.TarFile, size: int) -> list[tarfile.TarInfo]:
    """The regular members of an open tar (of ``size`` bytes) whose bytes are all there, read from the
    headers only. ``getmembers`` would raise ``ReadError`` at the first member cut off."""
    found: list[tarfile.TarInfo] = []
    try:
        for member in tar:
            if member.isfile() and member.offset_data + member.size <= size:
                found.append(member)
    except (tarfile.TarError, OSError, EOFError):
        pass  # the members before the damage are whole; the caller reports the damage itself
    return found


class MemberScan:
    """Every regular member of a tar file whose bytes are all there, as ``(member, file)`` in order (the
    file, seekable, reads the member until the next item); iteration stops at the first damage, which
    ``damage`` then describes (None for a whole file).

    ``total`` (the count of samples the shard should hold, when known) only words the damage message;
    ``counts`` picks which members are samples (default: all regular files).
    """

    def __init__(
        self, path: Path, total: int | None = None, counts: Callable[[tarfile.TarInfo], bool] | None = None
    ) -> None:
        self.path = path
        self.total = total
        self._counts = counts or (lambda member: True)
        self.samples = 0
        self.damage: ShardDamage | None = None

    def __iter__(self) -> Iterator[tuple[tarfile.TarInfo, BinaryIO]]:
        self.samples, self.damage = 0, None
        try:
            size = self.path.stat().st_size
            with tarfile.open(self.path, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    if member.offset_data + member.size > size:
                        self._damaged(f"the file ends at byte {size}, inside {member.name}")
                        return
                    handle = tar.extractfile(member)
                    if self._counts(member):
                        self.samples += 1
                    yield member, handle if handle is not None else io.BytesIO()
                if not self._ends_cleanly(tar.offset, size):
                    self._damaged(f"the archive stops at byte {tar.offset} of {size} without tar's end marker")
        except (tarfile.TarError, OSError, EOFError) as err:
            self._damaged(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)

    def _ends_cleanly(self, offset: int, size: int) -> bool:
        # tarfile stops without an error at a cut (or garbled) header: only the zero blocks tell.
        if size - offset < _END_OF_ARCHIVE:
            return False
        with open(self.path, "rb") as f:
            f.seek(offset)
            return f.read(_END_OF_ARCHIVE) == bytes(_END_OF_ARCHIVE)

    def _damaged(self, detail: str) -> None:
        if self.total is not None and self.samples >= self.total:
            return  # every sample is there; only the padding after them is not
        self.damage = ShardDamage(self.path.name, self.samples, self.total, detail)
