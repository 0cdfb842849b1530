"""The weight files of the frozen networks some terms run (VGG16, RAFT): torchvision's files, found in the torch hub
cache or at a path the user gives, read weights-only and checked against the network before use."""

from pathlib import Path

import torch
from torch import Tensor

from ..core.errors import CheckpointError
from ..core.untrusted import load_torch_file

DOWNLOADS = "https://download.pytorch.org/models"
"""Where torchvision's weight files are published (nothing here downloads them)."""


def find_weights_file(name: str, path: str | None, what: str, key: str, off: str) -> Path:
    """``path`` if given, else torchvision's cache file ``name`` under ``torch.hub.get_dir()``.

    A missing file raises ``FileNotFoundError`` in one line: ``what`` needs it (e.g. "the optical-flow loss"),
    where to put it, the setting ``key`` that names another place, and ``off``, the settings that turn it off.
    """
    url = f"{DOWNLOADS}/{name}"
    if path is not None:
        explicit = Path(path).expanduser()
        if not explicit.is_file():
            raise FileNotFoundError(f"{name} for {what} not found at {explicit} ({key}); download {url} there, {off}.")
        return explicit
    cached = Path(torch.hub.get_dir()) / "checkpoints" / name
    if not cached.is_file():
        raise FileNotFoundError(
            f"torchvision's {name} is needed by {what}, and nothing is downloaded at run time. "
            f"Put {url} at {cached}, or set {key}=/path/to/{name}, {off}."
        )
    return cached


def read_state_dict(path: str | Path, what: str, mmap: bool = False) -> dict[str, Tensor]:
    """The state dict in ``path`` (weights-only; ``mmap`` maps the file instead of reading it, for checks);
    ``ValueError`` when the file holds something else (``what``: the network it should hold)."""
    try:
        try:
            state = load_torch_file(path, mmap=mmap)
        except CheckpointError as err:
            if not mmap or "refusing" in str(err):
                raise
            state = load_torch_file(path)  # an old (non-zip) file cannot be mapped
    except CheckpointError as err:
        # The reader's advice is about checkpoints; for torchvision's file, say which file it should be.
        reason = str(err).split(": ", 1)[-1].split(". Checkpoints written", 1)[0].rstrip(".")
        raise CheckpointError(
            f"cannot use {path} as torchvision's {what} weights: {reason}; use torchvision's own file"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a {what} state dict (got {type(state).__name__})")
    return state


def state_problems(state: dict, expected: dict[str, Tensor]) -> list[str]:
    """The missing, unexpected, non-tensor and wrongly shaped entries of ``state`` against ``expected``, sorted.

    Batch norms' ``num_batches_tracked`` counters may be missing (files saved without them load: torch fills
    them in)."""
    problems = [f"missing {key}" for key in expected.keys() - state.keys() if not key.endswith(".num_batches_tracked")]
    problems += [f"unexpected {key}" for key in state.keys() - expected.keys()]
    for key in expected.keys() & state.keys():
        value = state[key]
        if not isinstance(value, Tensor):
            problems.append(f"{key} is a {type(value).__name__}, not a tensor")
        elif tuple(value.shape) != tuple(expected[key].shape):
            problems.append(f"{key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}")
    return sorted(problems, key=str)
