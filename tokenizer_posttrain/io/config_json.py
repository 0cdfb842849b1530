"""The settings a network is built from when they come with its weights: a ``config.json`` (ours, or diffusers'
``AutoencoderKLCosmos`` one) and the ``tokenizer_config`` entry of our exports and training checkpoints.

These files come from anywhere, and every value in them sizes something: a layer count is a loop, a width is a
tensor's dimension. So each value is checked for its type and a range before anything is built from it: a file
asking for a hundred million blocks (which filled the memory while the layout was built) or a billion channels
(which overflowed torch's size arithmetic) is refused in one line naming the file, the field, the value and the
range. The ranges are wide around the released tokenizers' values, so a wider or deeper variant still loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..core.errors import CheckpointError
from ..core.untrusted import read_regular_file, why_unreadable
from ..network.cosmos import REGISTRY

MAX_CONFIG_BYTES = 16 * 2**20
"""Largest config.json read: ours hold under 1 KiB, diffusers' (with the latent statistics) about 10 KiB."""
MAX_WIDTH = 16384
"""Most channels of any layer (the released tokenizers' widest has 512)."""
MAX_LATENT = 4096
"""Most channels of the latent and of the encoder's output (released: 16, and 256 for DV4x8x8-LowRes)."""
MAX_IO = 64
"""Most channels of the input and output video (released: 3, RGB)."""
MAX_LEVELS = 8
"""Most resolution levels, one per entry of ``channels_mult`` (released: 2 or 3)."""
MAX_BLOCKS = 16
"""Most residual blocks per level (released: 2)."""
MAX_CODES = 2**20
"""Largest FSQ codebook, the product of ``levels`` (released: 64,000); the network stores every code."""
ALTERED = (
    "the file was altered or does not describe a Cosmos tokenizer: export or download it again, or restore it from a "
    "copy"
)
"""What to do about a value out of range (every caller's)."""

POWERS_OF_TWO: dict[str, int] = {"temporal_compression": 32, "spatial_compression": 64, "patch_size": 16}
"""Fields that are powers of two, from 1 to the bound (released: 4 or 8, 8 or 16, 2 or 4)."""
INTEGERS: dict[str, tuple[int, int]] = {
    "channels": (1, MAX_WIDTH),
    "num_res_blocks": (1, MAX_BLOCKS),
    "in_channels": (1, MAX_IO),
    "out_channels": (1, MAX_IO),
    "z_channels": (1, MAX_LATENT),
    "z_factor": (1, 4),
    "latent_channels": (1, MAX_LATENT),
}
"""Integer fields of :class:`~tokenizer_posttrain.network.cosmos.TokenizerConfig`: (lowest, highest)."""
_REQUIRED = ("name", "kind", "temporal_compression", "spatial_compression")
_KNOWN = {*_REQUIRED, *POWERS_OF_TWO, *INTEGERS, "channels_mult", "levels", "legacy_mode", "dropout"}

_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def shown(value: Any) -> str:
    """``repr(value)``, cut to 60 characters: a message quotes a value, never a whole file."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python converts to text
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} characters)"


def integer(value: Any, key: str, low: int, high: int, where: Path, power_of_two: bool = False) -> int:
    """``value`` (the field ``key`` of ``where``) when it is an integer from ``low`` to ``high`` (a power of two,
    with ``power_of_two``); else a one-line :class:`CheckpointError` naming the file, the field, the value and the
    range."""
    fits = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    if not fits or (power_of_two and value & (value - 1)):
        kind = "a power of two" if power_of_two else "an integer"
        raise CheckpointError(f"{where}: {key}={shown(value)} is not {kind} from {low} to {high}; {ALTERED}")
    return value


def integers(value: Any, key: str, low: int, high: int, where: Path, length: tuple[int, int]) -> list[int]:
    """``value`` when it is a list of ``length[0]`` to ``length[1]`` integers, each from ``low`` to ``high``; else
    a one-line :class:`CheckpointError` as :func:`integer`'s."""
    fits = isinstance(value, list) and length[0] <= len(value) <= length[1]
    if not fits or not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value):
        raise CheckpointError(
            f"{where}: {key}={shown(value)} is not a list of {length[0]} to {length[1]} integers from {low} to "
            f"{high}; {ALTERED}"
        )
    return value


def json_type(value: Any) -> str:
    """JSON's name for the type of ``value`` (``array`` for a list), for messages about a file's content."""
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def read_config_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in the config file ``path``. A file that is not a regular file (a FIFO, a device: never
    waited on), is larger than :data:`MAX_CONFIG_BYTES`, is not JSON, or holds anything but an object is a
    one-line :class:`CheckpointError` naming it (and where the JSON breaks), followed by ``fix``, what to do."""
    try:
        # Through a link: Hugging Face's cache links each file of a folder to a blob.
        raw = read_regular_file(path, MAX_CONFIG_BYTES, follow_links=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist (a link to a missing file?); {fix}") from None
    except OSError as err:
        raise CheckpointError(f"{why_unreadable(path, err)}; {fix}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}); {fix}"
        ) from err
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not text (byte {err.start} is not UTF-8); {fix}") from err
    except RecursionError as err:
        raise CheckpointError(f"{path} nests its JSON too deeply to read; {fix}") from err
    except ValueError as err:  # Python refuses to convert integers of thousands of digits
        raise CheckpointError(f"{path} holds a number too long to read; {fix}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {json_type(data)}, not an object of settings; {fix}")
    return data


def tokenizer_settings(data: Any, key: str, where: Path) -> dict[str, Any]:
    """The keyword arguments of :class:`~tokenizer_posttrain.network.cosmos.TokenizerConfig` in ``data``, the
    entry ``key`` of ``where``, every field checked for type and range (lists become tuples). Anything else (not a
    mapping, an unknown or a missing field, a value out of range) is a one-line :class:`CheckpointError` naming
    the file, the field, the value and the range."""
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{where}: {key} is not a mapping of tokenizer settings (it is a JSON {json_type(data)}); {ALTERED}"
        )
    unknown = sorted(str(k) for k in data if k not in _KNOWN)
    missing = [k for k in _REQUIRED if k not in data]
    problems = [f"unknown fields {shown(unknown)}"] * bool(unknown) + [f"missing fields {missing}"] * bool(missing)
    if problems:
        raise CheckpointError(f"{where}: {key} has {' and '.join(problems)}; {ALTERED}")
    name = data["name"]
    if not isinstance(name, str) or name not in REGISTRY:
        raise CheckpointError(f"{where}: {key}.name={shown(name)} is not one of {', '.join(REGISTRY)}; {ALTERED}")
    registered = REGISTRY[name]
    if data["kind"] != registered.kind:
        raise CheckpointError(
            f"{where}: {key}.kind={shown(data['kind'])}, but {name} is of kind {registered.kind!r}; {ALTERED}"
        )
    out: dict[str, Any] = {"name": name, "kind": registered.kind}
    for field, high in POWERS_OF_TWO.items():
        if field in data:
            out[field] = integer(data[field], f"{key}.{field}", 1, high, where, power_of_two=True)
    for field, (low, high) in INTEGERS.items():
        if field in data:
            out[field] = integer(data[field], f"{key}.{field}", low, high, where)
    if "channels_mult" in data:
        mult = integers(data["channels_mult"], f"{key}.channels_mult", 1, MAX_WIDTH, where, (1, MAX_LEVELS))
        out["channels_mult"] = tuple(mult)
    channels, mult = out.get("channels", registered.channels), out.get("channels_mult", registered.channels_mult)
    if channels * max(mult) > MAX_WIDTH:
        raise CheckpointError(
            f"{where}: {key}.channels={channels} x channels_mult={list(mult)} makes a layer of "
            f"{channels * max(mult)} channels, more than {MAX_WIDTH}; {ALTERED}"
        )
    if "levels" in data:
        levels = integers(data["levels"], f"{key}.levels", 2, MAX_CODES, where, (1, 16))
        if math.prod(levels) > MAX_CODES:
            raise CheckpointError(
                f"{where}: {key}.levels={shown(levels)} make a codebook of {math.prod(levels)} codes, more than "
                f"{MAX_CODES}; {ALTERED}"
            )
        out["levels"] = tuple(levels)
    if "legacy_mode" in data:
        if not isinstance(data["legacy_mode"], bool):
            raise CheckpointError(
                f"{where}: {key}.legacy_mode={shown(data['legacy_mode'])} is not true or false; {ALTERED}"
            )
        out["legacy_mode"] = data["legacy_mode"]
    if "dropout" in data:
        dropout = data["dropout"]
        if not isinstance(dropout, int | float) or isinstance(dropout, bool) or not 0 <= dropout < 1:
            raise CheckpointError(f"{where}: {key}.dropout={shown(dropout)} is not a number in [0, 1); {ALTERED}")
        out["dropout"] = float(dropout)
    return out
