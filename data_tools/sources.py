"""Finding source videos, naming their samples, sizes and the train/val split."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

VIDEO_SUFFIXES = (".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi")
COPY_SUFFIXES = (".mp4", ".mov", ".m4v")  # ISO-BMFF: packed as-is into ``<key>.mp4``

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30})
_UNITS["tib"] = 2**40


def is_video(path: Path) -> bool:
    """Whether ``path`` has one of the video suffixes (any case)."""
    return path.suffix.lower() in VIDEO_SUFFIXES


def find_videos(src: Path, exclude: Path | None = None) -> list[Path]:
    """Every video file under ``src`` (recursive, sorted by relative path), skipping ``exclude``."""
    found = []
    for path in src.rglob("*"):
        if exclude is not None and path.is_relative_to(exclude):
            continue
        if is_video(path) and path.is_file() and not any(p.startswith(".") for p in path.relative_to(src).parts):
            found.append(path)
    return sorted(found, key=lambda p: p.relative_to(src).as_posix())


def parse_size(text: str) -> int:
    """``"500MB"``, ``"1GB"``, ``"2GiB"`` or ``"123456"`` -> bytes (decimal units, binary for *iB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 500MB, 1GB, 2GiB or a number of bytes)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def base_key(relpath: str) -> str:
    """A webdataset key for a relative path: no '.', no '/', only ``[A-Za-z0-9_-]``.

    webdataset and energon split a member name at its first '.', and '/' would make a folder.
    """
    stem = relpath.rsplit(".", 1)[0] if "." in Path(relpath).name else relpath
    parts = [re.sub(r"[^A-Za-z0-9_-]+", "_", part).strip("_") or "_" for part in stem.split("/")]
    return "__".join(parts)


def assign_keys(relpaths: Iterable[str], taken: set[str]) -> dict[str, str]:
    """Unique keys for new relative paths, never reusing one in ``taken`` (updated in place).

    A clash (``a b.mp4`` vs ``a_b.mp4``, ``x.mp4`` vs ``x.mkv``) gets a short hash of the path,
    so the key depends on the path alone, not on what else is in the folder.
    """
    keys = {}
    for rel in relpaths:
        key = base_key(rel)
        if key in taken:
            key = f"{key}-{hashlib.sha1(rel.encode()).hexdigest()[:8]}"
        n = 1
        while key in taken:  # only if the hashed name clashes too
            key = f"{base_key(rel)}-{hashlib.sha1(f'{rel}#{n}'.encode()).hexdigest()[:8]}"
            n += 1
        taken.add(key)
        keys[rel] = key
    return keys


def split_score(key: str, seed: int) -> float:
    """A stable number in [0, 1) per key and seed; keys below the val fraction go to val."""
    digest = hashlib.sha1(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_splits(new_keys: list[str], old_splits: dict[str, str], val_fraction: float, seed: int) -> dict[str, str]:
    """``"train"``/``"val"`` for each new key; old keys keep their split.

    At least one val video when ``val_fraction > 0`` and there are two or more videos in all, and
    never all of them: a dataset needs something to train on.
    """
    if val_fraction <= 0:
        return dict.fromkeys(new_keys, "train")
    splits = {k: ("val" if split_score(k, seed) < val_fraction else "train") for k in new_keys}
    by_score = sorted(new_keys, key=lambda k: split_score(k, seed))
    if by_score and len(old_splits) + len(splits) >= 2 and "val" not in {*old_splits.values(), *splits.values()}:
        splits[by_score[0]] = "val"
    if by_score and "train" not in {*old_splits.values(), *splits.values()}:
        splits[by_score[-1]] = "train"
    return splits
