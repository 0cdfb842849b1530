"""Energon's loader state as plain data, and back.

``SavableDataLoader.save_state_global`` returns energon's own classes (dataclasses, ``FlexState`` dicts) holding
numbers, strings, bytes, tuples, tensors and NumPy arrays. A checkpoint is loaded with ``weights_only=True``,
which refuses those classes, and unpickling them would run whatever code a crafted file names. So the state is
stored as a tree of dicts, lists, tuples, numbers, strings, bytes and tensors: each energon object becomes a dict
with a ``type`` tag, and only the tags of :data:`CLASSES` (and the containers below) are rebuilt; any other tag
is refused with a :class:`CheckpointError` naming where it was found.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from megatron.energon.flavors.webdataset.sample_loader import SliceState
from megatron.energon.rng import SystemRngState
from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState
from megatron.energon.state import FlexState

from ..core.errors import CheckpointError

FORMAT = "tokenizer_posttrain.energon_state/1"
"""The ``format`` entry of every stored state; a state written in another format is refused."""

CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState, SystemRngState, SliceState)
}
"""The energon state dataclasses megatron-energon 7.4.1 puts in a loader state: the only classes rebuilt."""

MAPPINGS: dict[str, type] = {"dict": dict, "FlexState": FlexState}
"""The dict types of a loader state (``FlexState`` must come back as itself: energon checks its type)."""

NDARRAY = "ndarray"
NUMPY_DTYPES = frozenset(
    ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
)
"""NumPy arrays (the NumPy random state) are stored as bytes of one of these dtypes, never as objects."""

_MAX_DEPTH = 200
"""Energon nests its wrappers about 40 levels deep; a deeper tree is not one of its states."""

_SCALARS = (type(None), bool, int, float, str, bytes)


def to_plain(state: Any) -> dict[str, Any]:
    """``state`` (what ``save_state_global`` returned: a list per rank, or None) as plain data that
    ``torch.load(weights_only=True)`` reads back; :func:`from_plain` rebuilds it."""
    return {"format": FORMAT, "state": _encode(state, "state", 0)}


def _encode(value: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CheckpointError(f"cannot store the energon loader state: it nests deeper than {_MAX_DEPTH} at {where}")
    if isinstance(value, torch.Tensor):
        return value
    if type(value) in _SCALARS:
        return value
    if type(value) is list:
        return [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    kind = type(value).__name__
    if MAPPINGS.get(kind) is type(value):
        return {
            "type": kind,
            "items": [
                [_encode(k, f"{where} key {k!r}", depth + 1), _encode(v, f"{where}[{k!r}]", depth + 1)]
                for k, v in value.items()
            ],
        }
    if CLASSES.get(kind) is type(value):
        return {
            "type": kind,
            "fields": {
                f.name: _encode(getattr(value, f.name), f"{where}.{f.name}", depth + 1)
                for f in dataclasses.fields(value)
            },
        }
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.name in NUMPY_DTYPES:
        array = np.asarray(value)  # tobytes() is C order whatever the layout; 0-d stays 0-d
        return {
            "type": NDARRAY,
            "dtype": array.dtype.name,
            "shape": list(array.shape),
            "scalar": isinstance(value, np.generic),
            "data": array.tobytes(),
        }
    raise CheckpointError(
        f"cannot store the energon loader state as plain data: {where} is a {type(value).__module__}."
        f"{type(value).__qualname__}, which tokenizer-posttrain does not know (it supports the states of "
        "megatron-energon 7.4.1); please report this with your energon version"
    )


def from_plain(data: Any, field: str) -> Any:
    """The loader state stored by :func:`to_plain` in the checkpoint entry ``field``, rebuilt from the known
    classes only; anything else raises a one-line :class:`CheckpointError` naming ``field`` and the place."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or "state" not in data:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(
            f"the checkpoint's {field} is not a loader state tokenizer-posttrain wrote (expected format "
            f"{FORMAT!r}, found {found!r}); resume from another checkpoint, or start a new run with another log.name"
        )
    state = _decode(data["state"], field, "state", 0)
    if state is not None and not (
        type(state) is list and all(s is None or type(s) is SavableDataLoaderState for s in state)
    ):
        raise _refuse(field, "state", "is not a list of one SavableDataLoaderState (or None) per rank")
    return state


def _refuse(field: str, where: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint's {field} is not a loader state tokenizer-posttrain wrote: {where} {problem}; the file was "
        "altered or written by another program. Resume from another checkpoint, or start a new run with another "
        "log.name"
    )


def _decode(value: Any, field: str, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise _refuse(field, where, f"nests deeper than {_MAX_DEPTH} levels")
    if isinstance(value, torch.Tensor) or type(value) in _SCALARS:
        return value
    if type(value) is list:
        return [_decode(v, field, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_decode(v, field, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    if type(value) is not dict:
        raise _refuse(field, where, f"is a {type(value).__name__}")
    kind = value.get("type")
    if kind in MAPPINGS:
        items = value.get("items")
        if type(items) is not list or not all(type(i) in (list, tuple) and len(i) == 2 for i in items):
            raise _refuse(field, where, f"is a {kind} without a list of [key, value] items")
        out = MAPPINGS[kind]()
        for key, item in items:
            key = _decode(key, field, f"{where} key", depth + 1)
            try:
                hash(key)
            except TypeError:
                raise _refuse(field, where, f"has an unhashable key of type {type(key).__name__}") from None
            out[key] = _decode(item, field, f"{where}[{key!r}]", depth + 1)
        return out
    if kind in CLASSES:
        return _decode_dataclass(CLASSES[kind], value.get("fields"), field, where, depth)
    if kind == NDARRAY:
        return _decode_array(value, field, where)
    known = ", ".join([*CLASSES, *MAPPINGS, NDARRAY])
    raise _refuse(field, where, f"has type tag {kind!r}, none of the energon state types it restores ({known})")


def _decode_dataclass(cls: type, fields: Any, field: str, where: str, depth: int) -> Any:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    if type(fields) is not dict or set(fields) != names:
        got = sorted(fields) if type(fields) is dict else type(fields).__name__
        raise _refuse(field, where, f"is a {cls.__name__} with fields {got}, expected {sorted(names)}")
    return cls(**{name: _decode(v, field, f"{where}.{name}", depth + 1) for name, v in fields.items()})


def _decode_array(value: dict[str, Any], field: str, where: str) -> Any:
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if dtype not in NUMPY_DTYPES:
        raise _refuse(field, where, f"is an array of dtype {dtype!r}, not one of {', '.join(sorted(NUMPY_DTYPES))}")
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape) or type(data) is not bytes:
        raise _refuse(field, where, "is an array without a shape (list of sizes) and bytes")
    item = np.dtype(dtype).itemsize
    if len(data) != item * int(np.prod(shape, dtype=np.int64)):
        raise _refuse(field, where, f"is an array of shape {shape} with {len(data)} bytes")
    array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return array[()] if value.get("scalar") else array
