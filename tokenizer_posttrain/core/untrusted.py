"""Reading files that may come from anywhere without running code planted in them.

A torch file is loaded only with ``weights_only=True`` (tensors, numbers, strings, lists and dicts; any other
object is refused), and pickled bytes found in a file are unpickled only in :func:`unpickle_legacy_state`,
behind an explicit opt-in. Nothing else in the package unpickles (``tests/test_security.py`` checks this).
"""

from __future__ import annotations

import re
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

from .errors import CheckpointError

PICKLED_STATES_OPT_IN = "resume.allow_pickled_states=true"
"""The override that lets a resume unpickle the states of checkpoints written by earlier releases."""

_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_torch_file(path: str | Path, mmap: bool = False) -> Any:
    """The content of a ``torch.save`` file, loaded weights-only onto the CPU (``mmap`` maps it instead of
    reading it). A file holding other objects, or one that cannot be read, raises a one-line
    :class:`CheckpointError` naming the file."""
    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except UnpicklingError as err:
        found = _UNSUPPORTED_GLOBAL.search(str(err))
        what = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"refusing to load {path}: it holds a pickled Python object{what}, not only tensors and plain data, "
            "and unpickling it could run code planted in the file. Checkpoints written by tokenizer-posttrain "
            "never hold one: use a checkpoint you trust, or an export (model.safetensors)"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for damaged archives
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot read {path}: {first}. The file looks truncated or is not a torch checkpoint."
        ) from err


def unpickle_legacy_state(data: bytes, allowed: bool, what: str) -> Any:
    """The object pickled in ``data``: a state (``what``, e.g. "the random states (rng_states)") that releases
    before plain-data checkpoints stored as pickled bytes. Unpickling runs whatever code the bytes name, so it
    happens only when ``allowed`` (the user's :data:`PICKLED_STATES_OPT_IN`); otherwise a one-line
    :class:`CheckpointError` says so and names the override. The one place in the package that unpickles."""
    if not allowed:
        raise CheckpointError(
            f"the checkpoint holds {what} as pickled bytes (written before tokenizer-posttrain stored such states "
            "as plain data), and unpickling can run code planted in a file. If you wrote this checkpoint yourself, "
            f"resume once with {PICKLED_STATES_OPT_IN} (later checkpoints are plain data), or start a new run "
            "with another log.name"
        )
    import pickle

    return pickle.loads(data)
