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
        state = load_torch_file(path, mmap=mmap)
    except CheckpointError:
        if not mmap:
            raise
        state = load_torch_file(path)  # an old (non-zip) file cannot be mapped
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a {what} state dict (got {type(state).__name__})")
    return state


def state_problems(state: dict[str, Tensor], expected: dict[str, Tensor]) -> list[str]:
    """The missing, unexpected and wrongly shaped keys of ``state`` against ``expected``, sorted."""
    problems = [f"missing {key}" for key in expected.keys() - state.keys()]
    problems += [f"unexpected {key}" for key in state.keys() - expected.keys()]
    for key in expected.keys() & state.keys():
        if tuple(state[key].shape) != tuple(expected[key].shape):
            problems.append(f"{key} has shape {tuple(state[key].shape)}, expected {tuple(expected[key].shape)}")
    return sorted(problems)
