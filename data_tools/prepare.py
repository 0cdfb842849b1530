"""Preparing a folder of tar shards for megatron-energon (``energon prepare``, non-interactive)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from tokenizer_posttrain.core.errors import DataError
from tokenizer_posttrain.core.untrusted import special_file
from tokenizer_posttrain.data.layout import check_prepared, read_shard_counts

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
    """Whether ``root/.nv-meta`` describes exactly these shards as the CrudeWebdataset prepare writes (its files
    as training accepts them: :func:`~tokenizer_posttrain.data.layout.check_prepared`, which reads no FIFO)."""
    try:
        check_prepared(root)
        counts = read_shard_counts(root)
    except DataError:
        return False
    return set(counts) == set(shards)


def energon_prepare(root: Path, splits: dict[str, list[str]]) -> None:
    """Run ``energon prepare`` on ``root`` with whole shards per split (overwrites an earlier preparation).

    This is energon's own click command with the flags a user would type, run in this process: a
    fresh ``energon`` process would spend ~2 s importing torch again. But energon forks its workers,
    and a fork copies whatever lock another thread holds at that moment (a child then hung for good in a
    test process full of threads), so with other Python threads alive it runs in a fresh process
    instead. Raises :class:`PrepareError` with energon's message when it fails.
    """
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
        for planted in (root / META).iterdir():
            # energon opens its files there for writing: a FIFO in their place would block it for ever, and a link
            # would have it write wherever the link points.
            if planted.is_symlink() or (special_file(planted) is not None and not planted.is_dir()):
                planted.unlink()
    args.append(str(root))
    if threading.active_count() > 1:
        _prepare_in_fresh_process(root, args)
    else:
        _run_prepare_command(root, args)
    if not is_prepared(root, [n for names in splits.values() for n in names]):
        raise PrepareError(f"energon prepare ran but {root / META} does not list the expected shards")


def _prepare_in_fresh_process(root: Path, args: list[str]) -> None:
    """:func:`_run_prepare_command` in a new interpreter (no threads to fork with); its error line, if any."""
    code = "import sys; from data_tools.prepare import _prepare_main; _prepare_main(sys.argv[1], sys.argv[2:])"
    package_root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", code, str(root), *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise PrepareError(lines[-1] if lines else f"energon prepare failed on {root} (exit code {done.returncode})")


def _prepare_main(root: str, args: list[str]) -> None:
    """Entry of the fresh process: the prepare command, its failure as one line on stderr and exit code 1."""
    try:
        _run_prepare_command(Path(root), args)
    except PrepareError as err:
        print(str(err).replace("\n", " | "), file=sys.stderr)
        raise SystemExit(1) from None


def _run_prepare_command(root: Path, args: list[str]) -> None:
    """energon's prepare command with ``args``, in this process; :class:`PrepareError` when it fails."""
    import click
    from megatron.energon.tools.prepare import command

    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # energon narrates every step; show it only on failure
            command.main(args, prog_name="energon prepare", standalone_mode=False)
    except click.ClickException as err:
        raise PrepareError(f"energon prepare failed on {root}: {err.format_message()}") from err
    except (click.Abort, SystemExit, Exception) as err:
        tail = "\n".join(log.getvalue().strip().splitlines()[-8:])
        raise PrepareError(f"energon prepare failed on {root} ({type(err).__name__}: {err}):\n{tail}") from err


def read_manifest(root: Path, required: dict[str, type] | None = None) -> list[dict]:
    """The entries of ``root/manifest.jsonl`` (empty list when there is none), each a JSON object with the
    ``required`` keys and value types (default: the shard and split names); :class:`DataError` naming the file
    and line of the first one that is not."""
    required = {"shard": str, "split": str} if required is None else required
    path = root / MANIFEST
    if not path.is_file():
        return []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise DataError(f"{path} cannot be read ({err.strerror}); make it readable or delete it") from None
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            problem = f"is not valid JSON ({err.msg}: column {err.colno})"
        except ValueError:  # bytes that are not UTF-8 text
            problem = "is not UTF-8 text"
        except RecursionError:
            problem = "nests its JSON too deeply to read"
        else:
            missing = [f'"{key}"' for key, kind in required.items() if not isinstance(_get(entry, key), kind)]
            if not missing:
                entries.append(entry)
                continue
            problem = f"is not a make-shards entry (no {', '.join(missing)} of the right type)"
        raise DataError(
            f"{path} line {number} {problem}: fix or delete that line, or delete the file (make-shards writes one "
            "JSON object per video)"
        )
    return entries


def _get(entry: object, key: str) -> object:
    """``entry[key]`` of a JSON object, None for anything else."""
    return entry.get(key) if isinstance(entry, dict) else None


def manifest_splits(root: Path) -> dict[str, str]:
    """shard -> split from ``root/manifest.jsonl`` (written by make-shards), empty when there is none."""
    return {entry["shard"]: entry["split"] for entry in read_manifest(root)}


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
