"""Preparing a folder of tar shards for megatron-energon (``energon prepare``, non-interactive)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path

from .sources import assign_splits

META = ".nv-meta"
MANIFEST = "manifest.jsonl"


class PrepareError(RuntimeError):
    """``energon prepare`` failed or cannot run; the message says why and what to do."""


def _escape(name: str) -> str:
    # energon brace-expands each --split-parts pattern (which eats one level of backslashes) and
    # then uses it as a regex, so regex escapes must be doubled to survive.
    return re.escape(name).replace("\\", "\\\\")


def split_pattern(names: list[str]) -> str:
    """One ``--split-parts`` pattern that matches exactly ``names`` (shard paths relative to the root).

    Our own ``000123.tar`` names collapse into brace ranges, which keeps the command line short for
    thousands of shards; other names become an escaped regex alternation.
    """
    if not names:
        raise ValueError("no shards")
    if not all(re.fullmatch(r"\d+\.tar", n) for n in names):
        return "(?:" + "|".join(_escape(n) for n in names) + ")$"
    stems = sorted((n[:-4] for n in names), key=lambda s: (len(s), s))
    runs: list[list[str]] = []
    for stem in stems:
        last = runs[-1][-1] if runs else None
        if last is not None and len(last) == len(stem) and int(stem) == int(last) + 1:
            runs[-1].append(stem)
        else:
            runs.append([stem])
    items = [run[0] if len(run) == 1 else f"{{{run[0]}..{run[-1]}}}" for run in runs]
    # A single item must not be wrapped: "{x}" is not a brace expansion and would stay literal.
    body = items[0] if len(items) == 1 else "{" + ",".join(items) + "}"
    return body + "[.]tar$"


def find_shards(root: Path) -> list[str]:
    """Every ``*.tar`` under ``root`` (as energon finds them), relative, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.tar") if p.is_file())


def is_prepared(root: Path, shards: list[str]) -> bool:
    """Whether ``root/.nv-meta`` describes exactly these shards as a CrudeWebdataset."""
    meta = root / META
    try:
        info = json.loads((meta / ".info.json").read_text())
        dataset = (meta / "dataset.yaml").read_text()
    except (OSError, ValueError):
        return False
    return (meta / "split.yaml").is_file() and "CrudeWebdataset" in dataset and set(info["shard_counts"]) == set(shards)


def energon_prepare(root: Path, splits: dict[str, list[str]]) -> None:
    """Run ``energon prepare`` on ``root`` with whole shards per split (overwrites an earlier preparation).

    This is energon's own click command with the flags a user would type, run in this process: a
    fresh ``energon`` process would spend ~2 s importing torch again. Raises :class:`PrepareError`
    with energon's message when it fails.
    """
    import click
    from megatron.energon.tools.prepare import command

    if not os.access(root, os.W_OK):
        raise PrepareError(
            f"{root} is not writable: energon prepare writes .nv-meta/ and a .tar.idx per shard there; "
            "copy the shards to a writable folder first"
        )
    args = ["--non-interactive", "--no-progress", "--sample-type", "CrudeWebdataset"]
    args += ["--num-workers", str(min(16, os.cpu_count() or 1))]
    for split, names in splits.items():
        if names:
            args += ["--split-parts", f"{split}:{split_pattern(names)}"]
    if (root / META).exists():
        args.append("--force-overwrite")  # without it a prepared folder is refused; we own this preparation
    args.append(str(root))
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # energon narrates every step; show it only on failure
            command.main(args, prog_name="energon prepare", standalone_mode=False)
    except click.ClickException as err:
        raise PrepareError(f"energon prepare failed on {root}: {err.format_message()}") from err
    except (click.Abort, SystemExit, Exception) as err:
        tail = "\n".join(log.getvalue().strip().splitlines()[-8:])
        raise PrepareError(f"energon prepare failed on {root} ({type(err).__name__}: {err}):\n{tail}") from err
    if not is_prepared(root, [n for names in splits.values() for n in names]):
        raise PrepareError(f"energon prepare ran but {root / META} does not list the expected shards")


def manifest_splits(root: Path) -> dict[str, str]:
    """shard -> split from ``root/manifest.jsonl`` (written by make-shards), empty when there is none."""
    path = root / MANIFEST
    if not path.is_file():
        return {}
    splits = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            splits[entry["shard"]] = entry["split"]
    return splits


def prepare_folder(root: Path, val_fraction: float, seed: int) -> dict[str, list[str]]:
    """Prepare an existing folder of tar shards in place; returns the shards of each split.

    Shards listed in a make-shards ``manifest.jsonl`` keep their split; any others are split
    whole-shard by a hash of their name (same rule as videos in make-shards).
    """
    shards = find_shards(root)
    if not shards:
        raise PrepareError(f"no *.tar shards in {root}")
    known = {name: split for name, split in manifest_splits(root).items() if name in shards}
    new = [name for name in shards if name not in known]
    chosen = {**known, **assign_splits(new, known, val_fraction, seed)}
    splits = {s: [n for n in shards if chosen[n] == s] for s in ("train", "val")}
    energon_prepare(root, splits)
    return splits
