"""The layout of a prepared energon dataset on disk: which shards each split holds (``.nv-meta/split.yaml``), and
the checks that keep energon from running code or hanging on the files it reads from the dataset folder.

energon builds the dataset from ``.nv-meta/dataset.yaml`` with its ``load_config``, which imports and calls
whatever ``__module__``/``__class__``/``__function__`` the file names, at any depth, and loads Python files that
``sample_loader``/``part_filter`` name; it reads ``split.yaml``, ``.info.json`` and each ``<shard>.tar.idx`` with
a blocking ``open``. :func:`check_prepared` reads the ``.nv-meta`` files first, as regular files of bounded size,
and refuses anything but what ``python -m data_tools prepare`` writes (a ``CrudeWebdataset``), in one line naming
the file. :func:`split_parts` runs it, so every reader of a dataset's splits is covered; the launch's preflight
and ``data_tools check`` read each index the same way (:func:`read_dataset_file`, in :mod:`.shard_check`).

Plain files and YAML only; energon's own YAML reader is imported (lazily) to see the files as energon will.
"""

from __future__ import annotations

import json
import re
import reprlib
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from ..core.errors import DataError
from ..core.untrusted import one_line, read_regular_file, why_unreadable

META = Path(".nv-meta")
SPLIT_FILE = META / "split.yaml"
DATASET_FILE = META / "dataset.yaml"
INFO_FILE = META / ".info.json"

PREPARED_DATASET = {"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}
"""The whole of the ``dataset.yaml`` that ``data_tools prepare`` (``energon prepare --sample-type CrudeWebdataset``)
writes: energon's own class, no settings."""
CODE_KEYS = ("__module__", "__class__", "__function__")
"""Keys by which energon's ``load_config`` imports a module and calls something in it, at any depth."""
CODE_HOOKS = ("sample_loader", "part_filter")
"""``dataset.yaml`` settings that name Python code (``file.py:function``, loaded from ``.nv-meta``)."""

_YAML_BYTES = 64 << 20
"""Largest split.yaml read (a line per shard name that does not collapse into a brace range)."""
_DATASET_YAML_BYTES = 64 << 10
"""Largest dataset.yaml read: the one prepare writes is two lines."""
INFO_BYTES = 64 << 20
"""Largest .info.json read (a line per shard)."""
MAX_SHARD_NAMES = 100_000
"""Most shard names one brace pattern of split.yaml may expand to (prepare writes one pattern per run of shards)."""
_NUMERIC_RANGE = re.compile(r"\{(-?\d{1,30})\.\.(-?\d{1,30})(?:\.\.(-?\d{1,30}))?\}")
_SHOWN = 60
"""Characters of a value quoted in a message."""


def prepare_again(root: Path | str) -> str:
    """The fix for a file of ``.nv-meta`` that is not what prepare writes."""
    return f"run python -m data_tools prepare {root} again (it rewrites .nv-meta), or restore the file"


def read_dataset_file(path: Path, max_bytes: int, fix: str) -> bytes:
    """The bytes of ``path``, a file that energon (or a launch check) reads from a dataset folder: a regular file
    (or a link to one) of at most ``max_bytes``, or a one-line :class:`DataError` naming it and saying ``fix``: a
    FIFO would block the read for ever, so it is never read. ``FileNotFoundError`` passes through."""
    try:
        # Links are followed, as energon follows them: what is read is checked wherever it lies.
        return read_regular_file(path, max_bytes, follow_links=True)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise DataError(f"{why_unreadable(path, err)}: {fix}") from None


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, _SHOWN, _SHOWN


def _show(value: Any) -> str:
    """``value`` quoted on one line, cut to a readable length (its nesting and lists cut too: a value built from
    shared parts would print for ever)."""
    return one_line(_REPR.repr(value), _SHOWN)


def _load_yaml(path: Path, raw: bytes, fix: str) -> Any:
    """``raw`` (the bytes of ``path``) as plain data, read with ``yaml.safe_load`` (no Python tags), and as energon
    reads it (its ``load_yaml``, rapidyaml): the two must agree, or the checks here would judge another file than
    the one energon uses. :class:`DataError` naming ``path`` when it is no YAML, or when they differ."""
    try:
        # Aliases first, from the parser's events (linear): a file that repeats an anchor inside anchors is
        # small, but reading or comparing it expands every repeat. prepare writes none.
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(raw, Loader=yaml.SafeLoader)):
            raise DataError(f"{path} uses YAML aliases (*name), which prepare never writes: {fix}")
        data = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise DataError(f"{path} is not valid YAML ({problem}{at}): {fix}") from None
    except RecursionError:
        raise DataError(f"{path} nests its YAML too deeply to read: {fix}") from None
    if data is None:
        return None  # energon's reader cannot read an empty file at all; the caller says what is missing
    from megatron.energon.eyaml import load_yaml

    try:
        seen = load_yaml(raw)
    except Exception as err:  # noqa: BLE001 - rapidyaml raises its own types
        seen = f"<unreadable: {type(err).__name__}>"
    if seen != data:
        raise DataError(
            f"{path} reads differently with energon's YAML reader ({_show(seen)}) than as standard YAML "
            f"({_show(data)}): write it in plain YAML, as prepare does: {fix}"
        )
    return data


def _code_in(value: Any, where: str) -> str | None:
    """Where in ``value`` (reached by ``where``) a key names code energon would import, or None."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in CODE_KEYS or key in CODE_HOOKS:
                return f"{where}.{key}: {_show(inner)}"
            found = _code_in(inner, f"{where}.{key}")
            if found:
                return found
    if isinstance(value, list):
        for index, inner in enumerate(value):
            found = _code_in(inner, f"{where}[{index}]")
            if found:
                return found
    return None


def check_dataset_yaml(root: Path) -> None:
    """Refuse ``root/.nv-meta/dataset.yaml`` unless it is :data:`PREPARED_DATASET`: one line naming the file and
    the first key that names code (``__module__``/``__class__``/``__function__`` but energon's CrudeWebdataset,
    ``sample_loader``, ``part_filter``) or that prepare does not write."""
    path = root / DATASET_FILE
    fix = prepare_again(root)
    try:
        data = _load_yaml(path, read_dataset_file(path, _DATASET_YAML_BYTES, fix), fix)
    except FileNotFoundError:
        raise DataError(f"{path} is missing, so {root} is not fully prepared: {fix}") from None
    if data == PREPARED_DATASET:
        return
    if not isinstance(data, dict):
        raise DataError(f"{path} holds {_show(data)}, not the dataset description prepare writes: {fix}")
    problem = _dataset_yaml_problem(data)
    if problem:
        raise DataError(
            f"refusing {path}: {problem}; prepare writes only '__module__: megatron.energon' and "
            f"'__class__: CrudeWebdataset' there: {fix}"
        )
    missing = ", ".join(f"{key}: {value}" for key, value in PREPARED_DATASET.items() if data.get(key) != value)
    raise DataError(f"{path} lacks '{missing}', which prepare writes: {fix}")


def _dataset_yaml_problem(data: dict) -> str | None:
    """The first thing in a parsed dataset.yaml that names code (top-level keys first, then nested ones) or that
    prepare does not write; None when there is none (what may still be missing is the caller's)."""
    run = "energon would import and run it"
    for key, value in data.items():
        if key in CODE_KEYS and PREPARED_DATASET.get(key) != value:
            return f"{key}: {_show(value)} names code other than energon's CrudeWebdataset ({run})"
        if key in CODE_HOOKS:
            return f"{key}: {_show(value)} names Python code to load ({run})"
    for key, value in data.items():
        nested = None if key in PREPARED_DATASET else _code_in(value, str(key))
        if nested:
            return f"{nested} names code ({run})"
    unknown = [key for key in data if key not in PREPARED_DATASET]
    return f"key {_show(unknown[0])} is not one prepare writes" if unknown else None


def _shard_name(path: Path, split: str, pattern: Any, fix: str) -> str:
    """A shard name pattern of ``split`` in ``path`` (split.yaml), checked to be a name inside the dataset."""
    from braceexpand import braceexpand

    if not isinstance(pattern, str) or not pattern:
        raise DataError(f"{path}: split {_show(split)} lists {_show(pattern)}, not a shard file name: {fix}")
    for low, high, step in _NUMERIC_RANGE.findall(pattern):
        # braceexpand lists a numeric range whole before yielding its first name: bound it first.
        if abs(int(high) - int(low)) // max(abs(int(step or 1)), 1) >= MAX_SHARD_NAMES:
            raise DataError(f"{path}: split {_show(split)} lists more than {MAX_SHARD_NAMES} shards: {fix}")
    for count, name in enumerate(braceexpand(pattern)):
        if count >= MAX_SHARD_NAMES:  # {0..99999999999}.tar expands for ever
            raise DataError(f"{path}: split {_show(split)} lists more than {MAX_SHARD_NAMES} shards: {fix}")
        parts = PurePosixPath(name).parts
        if name.startswith("/") or "\\" in name or ".." in parts or not parts:
            raise DataError(
                f"{path}: split {_show(split)} lists {_show(name)}, which is not a shard inside the dataset "
                f"folder: {fix}"
            )
    return pattern


def read_split_file(root: Path) -> dict[str, list[str]] | None:
    """Split name -> shard name patterns of ``root/.nv-meta/split.yaml`` as prepare writes it (``split_parts``
    and ``exclude``; names inside ``root``), None when there is none; :class:`DataError` naming the file else."""
    path = root / SPLIT_FILE
    fix = prepare_again(root)
    try:
        data = _load_yaml(path, read_dataset_file(path, _YAML_BYTES, fix), fix)
    except FileNotFoundError:
        return None
    data = {} if data is None else data
    if not isinstance(data, dict) or not set(data) <= {"split_parts", "exclude"}:
        extra = sorted(map(str, set(data) - {"split_parts", "exclude"})) if isinstance(data, dict) else data
        raise DataError(f"{path} holds {_show(extra)}, not the split_parts and exclude prepare writes: {fix}")
    parts = data.get("split_parts") or {}
    excluded = data.get("exclude") or []
    if not isinstance(parts, dict) or not isinstance(excluded, list):
        raise DataError(f"{path}: split_parts is not a mapping of split names to shard lists: {fix}")
    for name in excluded:
        if not isinstance(name, str):
            raise DataError(f"{path}: exclude lists {_show(name)}, not a shard or sample name: {fix}")
    splits: dict[str, list[str]] = {}
    for split, names in parts.items():
        if not isinstance(split, str) or not isinstance(names, list | type(None)):
            raise DataError(f"{path}: split {_show(split)} is not a split name with a list of shards: {fix}")
        splits[split] = [_shard_name(path, split, name, fix) for name in names or []]
    return splits


def read_shard_counts(root: Path) -> dict[str, int]:
    """Shard name -> sample count of ``root/.nv-meta/.info.json``; :class:`DataError` naming the file when it is
    missing, not a regular file or not the counts prepare writes."""
    path = root / INFO_FILE
    fix = prepare_again(root)
    try:
        raw = read_dataset_file(path, INFO_BYTES, fix)
    except FileNotFoundError:
        raise DataError(f"{path} is missing, so {root} is not fully prepared: {fix}") from None
    try:
        info = json.loads(raw)
    except json.JSONDecodeError as err:
        raise DataError(f"{path} is not valid JSON ({err.msg}: line {err.lineno} column {err.colno}): {fix}") from None
    except ValueError:  # bytes that are not UTF-8 text
        raise DataError(f"{path} is not UTF-8 text: {fix}") from None
    except RecursionError:
        raise DataError(f"{path} nests its JSON too deeply to read: {fix}") from None
    counts = info.get("shard_counts") if isinstance(info, dict) else None
    if not isinstance(counts, dict) or not all(
        isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in counts.values()
    ):
        raise DataError(f"{path} holds no shard_counts (shard name -> number of samples) as prepare writes: {fix}")
    return counts


def check_prepared(root: str | Path) -> dict[str, list[str]]:
    """Every file of ``.nv-meta`` that energon reads from a prepared dataset folder ``root``, checked as described
    in the module docstring, before energon reads any of them; returns the split layout (:func:`read_split_file`).
    Raises :class:`DataError` naming the file; also when ``root`` is no folder (energon would read a ``.yaml``
    file as a metadataset, which names code) or is not prepared."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(
            f"data.path={root} is not a folder: give the folder of a dataset prepared by python -m data_tools "
            "(energon metadataset files are not supported)"
        )
    splits = read_split_file(root)
    if splits is None:
        raise DataError(
            f"data.path={root} is not a prepared energon dataset (no .nv-meta/split.yaml). Make one from a folder of "
            f"videos with: python -m data_tools make-shards VIDEOS {root}"
        )
    check_dataset_yaml(root)
    read_shard_counts(root)
    return splits


def split_parts(path: str | Path) -> dict[str, list[str]] | None:
    """Split name -> shard name patterns (energon writes brace ranges, e.g. ``{000000..000009}.tar``) of
    the dataset at ``path``; None when it is not prepared (no ``split.yaml``). A prepared folder is checked
    whole first (:func:`check_prepared`): every caller then hands energon only a folder it may read."""
    root = Path(path)
    if not root.is_dir() or not ((root / SPLIT_FILE).exists() or (root / SPLIT_FILE).is_symlink()):
        return None
    return check_prepared(root)


def dataset_splits(path: str | Path) -> set[str]:
    """Split names (``train``, ``val``, ...) with shards that an energon dataset defines; empty if unprepared."""
    return {name for name, shards in (split_parts(path) or {}).items() if shards}
