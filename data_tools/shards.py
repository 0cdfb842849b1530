"""Writing tar shards of ``<key>.mp4`` members, and the manifest that makes re-runs incremental."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from .prepare import MANIFEST, read_manifest

TMP_SUFFIX = ".tmp"  # energon only looks at *.tar, so a half-written shard is never indexed


@dataclass
class Packed:
    """One source video as it goes into a shard (``path`` is the source or its transcoded copy)."""

    relpath: str
    source: Path
    path: Path
    key: str
    split: str
    info: dict
    transcoded: bool


class _HashingReader:
    """Feeds tarfile while hashing, so each video is read once for both."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha1 = f, hashlib.sha1()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha1.update(data)
        return data


def tar_member_size(size: int, name: str) -> int:
    """Bytes a member takes in a tar: header, data padded to 512, a PAX header for long names."""
    return 512 + -(-size // 512) * 512 + (1536 if len(name) > 99 else 0)


def tar_file_size(members: int) -> int:
    """Size of a tar file whose members take ``members`` bytes: end marker, padded to 10240-byte records."""
    return -(-(members + 1024) // 10240) * 10240


# What make-shards reads back from each manifest entry on a re-run.
_ENTRY_KEYS = {"key": str, "relpath": str, "shard": str, "split": str, "source_bytes": int, "source_mtime_ns": int}


def load_manifest(out: Path) -> list[dict]:
    """The entries of ``out/manifest.jsonl`` (empty list when there is none); a line that is not an entry
    raises :class:`~tokenizer_posttrain.core.errors.DataError` naming the file and line."""
    return read_manifest(out, _ENTRY_KEYS)


def write_manifest(out: Path, entries: list[dict]) -> None:
    """Replace ``out/manifest.jsonl`` atomically (temp file + rename)."""
    tmp = out / (MANIFEST + TMP_SUFFIX)
    with open(tmp, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / MANIFEST)


def next_shard_index(out: Path, entries: list[dict]) -> int:
    """One past the highest shard number in use (in the manifest or on disk)."""
    numbers = [int(e["shard"][:-4]) for e in entries if e["shard"][:-4].isdigit()]
    numbers += [int(p.name[:-4]) for p in out.glob("*.tar") if p.name[:-4].isdigit()]
    return max(numbers, default=-1) + 1


@dataclass
class ShardWriter:
    """Packs videos into ``out/NNNNNN.tar`` shards of at most ``max_bytes`` (one oversize video per shard).

    A shard is written as ``NNNNNN.tar.tmp``; when it is full its manifest lines are committed and
    only then is it renamed to ``.tar``. A run killed at any point therefore leaves no half shard,
    and manifest lines whose shard is missing are dropped (and re-packed) by the next run.
    """

    out: Path
    max_bytes: int
    index: int
    entries: list[dict]
    written: list[str] = field(default_factory=list)
    _tar: tarfile.TarFile | None = None
    _name: str = ""
    _bytes: int = 0
    _pending: list[dict] = field(default_factory=list)

    def add(self, item: Packed) -> dict:
        """Append one video; returns its manifest entry."""
        member = f"{item.key}.mp4"
        size = item.path.stat().st_size
        cost = tar_member_size(size, member)
        if self._tar is not None and tar_file_size(self._bytes + cost) > self.max_bytes:
            self.close()
        if self._tar is None:
            self._name = f"{self.index:06d}.tar"
            self.index += 1
            self._tar = tarfile.open(self.out / (self._name + TMP_SUFFIX), "w", format=tarfile.PAX_FORMAT)
            self._bytes = 0
        info = tarfile.TarInfo(member)
        info.size, info.mode = size, 0o644
        info.mtime = int(item.source.stat().st_mtime)  # reproducible: same sources give the same tar
        with open(item.path, "rb") as f:
            reader = _HashingReader(f)
            self._tar.addfile(info, reader)
        self._bytes += cost
        stat = item.source.stat()
        entry = {
            "key": item.key,
            "source": str(item.source),
            "relpath": item.relpath,
            **item.info,
            "shard": self._name,
            "split": item.split,
            "bytes": size,
            "sha1": reader.sha1.hexdigest(),
            "transcoded": item.transcoded,
            "source_bytes": stat.st_size,
            "source_mtime_ns": stat.st_mtime_ns,
        }
        self._pending.append(entry)
        return entry

    def close(self) -> None:
        """Finish the open shard: fsync, commit its manifest lines, rename it into place."""
        if self._tar is None:
            return
        self._tar.close()
        tmp = self.out / (self._name + TMP_SUFFIX)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        self.entries.extend(self._pending)
        write_manifest(self.out, self.entries)
        os.replace(tmp, self.out / self._name)
        self.written.append(self._name)
        self._tar, self._pending = None, []
