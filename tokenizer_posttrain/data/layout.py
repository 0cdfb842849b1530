"""The layout of a prepared energon dataset on disk: which shards each split holds (``.nv-meta/split.yaml``).

Plain files only (no energon, no video stack), so launch checks and the workflow read it cheaply.
"""

from __future__ import annotations

from pathlib import Path

import yaml

SPLIT_FILE = Path(".nv-meta") / "split.yaml"


def split_parts(path: str | Path) -> dict[str, list[str]] | None:
    """Split name -> shard name patterns (energon writes brace ranges, e.g. ``{000000..000009}.tar``) of
    the dataset at ``path``; None when it is not prepared."""
    split_file = Path(path) / SPLIT_FILE
    if not split_file.is_file():
        return None
    return (yaml.safe_load(split_file.read_text()) or {}).get("split_parts", {}) or {}


def dataset_splits(path: str | Path) -> set[str]:
    """Split names (``train``, ``val``, ...) with shards that an energon dataset defines; empty if unprepared."""
    return {name for name, shards in (split_parts(path) or {}).items() if shards}
