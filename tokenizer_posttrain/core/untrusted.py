"""Reading files that may come from anywhere without running code planted in them.

A torch file is loaded only with ``weights_only=True`` (tensors, numbers, strings, lists and dicts; any other
object is refused), and pickled bytes found in a file are never unpickled (:func:`skip_pickled_state`): nothing
in the package unpickles (``tests/test_security.py`` checks this).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import warnings
from pathlib import Path
from pickle import UnpicklingError
from typing import Any, BinaryIO

from .errors import CheckpointError

PICKLED_STATES_OPT_IN = "resume.skip_pickled_states=true"
"""The override that lets a resume go on without the pickled states of checkpoints written by earlier releases."""

_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""How torch's weights-only reader names the global it refused ("Unsupported global: GLOBAL x.y", or "unsupported
GLOBAL posix.system whose module posix is blocked")."""
_UNSUPPORTED_OPERAND = re.compile(r"Unsupported operand \d+")


def load_torch_file(path: str | Path, mmap: bool = False) -> Any:
    """The content of a ``torch.save`` file, loaded weights-only onto the CPU (``mmap`` maps it instead of
    reading it). A file holding other objects, one that cannot be read, or anything but a regular file (a FIFO is
    never opened for reading: that would block) raises a one-line :class:`CheckpointError` naming the file."""
    import torch

    try:
        if mmap:  # torch maps a file by its name: the name is checked, then mapped
            special = special_file(path)
            if special is not None:
                raise OSError(errno.EINVAL, f"is {special}, not a regular file", str(path))
            source: str | BinaryIO = str(path)
        else:
            source = open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{why_unreadable(path, err)}; give the path of the checkpoint file itself") from None
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except UnpicklingError as err:
        found = _UNSUPPORTED_GLOBAL.search(str(err))
        if found is None:  # an opcode the weights-only reader does not know: damage, or pickled objects
            operand = _UNSUPPORTED_OPERAND.search(str(err))
            raise CheckpointError(
                f"cannot read {path}: it is damaged, or holds more than tensors and plain data"
                f"{f' ({operand.group(0)})' if operand else ''}, which is never unpickled (that could run code "
                "planted in it). Use a checkpoint you trust, or an export (model.safetensors)"
            ) from None
        named = one_line(found.group(1), 120)
        raise CheckpointError(
            f"refusing to load {path}: it holds a pickled Python object ({named}), not only tensors and "
            "plain data, and unpickling it could run code planted in the file. Checkpoints written by "
            "tokenizer-posttrain never hold one: use a checkpoint you trust, or an export (model.safetensors)"
        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for damaged archives
        first = one_line(str(err).strip().splitlines()[0], 120) if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"cannot read {path}: {first}. The file looks truncated or is not a torch checkpoint."
        ) from err
    finally:
        if not isinstance(source, str):
            source.close()


def skip_pickled_state(what: str, skip: bool) -> None:
    """A state (``what``, e.g. "the random states (rng_states)") that releases before plain-data checkpoints
    stored as pickled bytes. It is never unpickled (that would run whatever code the bytes name): without
    ``skip`` (the user's :data:`PICKLED_STATES_OPT_IN`) a one-line :class:`CheckpointError` says so and names the
    override; with it, a warning says the state is not restored and the caller goes on without it."""
    if not skip:
        raise CheckpointError(
            f"the checkpoint holds {what} as pickled bytes (written before tokenizer-posttrain stored such states "
            "as plain data), and unpickling can run code planted in a file, so it is never done. Resume without "
            f"that state with {PICKLED_STATES_OPT_IN} (the weights and optimizer resume, but not exactly: random "
            "numbers and the data stream start afresh), or start a new run with another log.name"
        )
    warnings.warn(f"{what} of the checkpoint are pickled bytes of an earlier release: not restored", stacklevel=3)


_SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((what for test, what in _SPECIAL_FILES if test(mode)), "a special file")


def special_file(path: str | Path) -> str | None:
    """What is at ``path`` when it is not a regular file ("a FIFO", "a folder", "a link to a missing file", ...);
    None for a regular file (or a link to one) and for nothing at all. A file the app reads is opened only when
    this is None (or through :func:`open_regular`): opening a FIFO blocks until something writes into it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"a link to {one_line(os.readlink(path), 120)}, which does not exist" if os.path.islink(path) else None
    except (OSError, ValueError) as err:  # a loop of links, no permission, a NUL in the name
        return f"a path that cannot be read ({getattr(err, 'strerror', None) or err})"
    return None if stat.S_ISREG(mode) else _kind(mode)


def open_regular(path: str | Path, max_bytes: int | None = None, follow_links: bool = True) -> BinaryIO:
    """``path`` opened for reading if it is a regular file of at most ``max_bytes``: a FIFO, device or folder
    planted at the path neither blocks the open nor is read, and the checks are made on the open file (nothing can
    be swapped in between). Without ``follow_links`` a link is refused too (a file in a shared folder cannot
    redirect the read). Else ``OSError`` whose ``strerror`` says what is there, e.g. "is a FIFO, not a regular
    file"."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"is {_kind(info.st_mode)}, not a regular file"
    elif max_bytes is not None and info.st_size > max_bytes:
        problem = f"is {info.st_size} bytes, more than the {max_bytes} it may hold"
    if problem is not None:
        os.close(fd)
        raise OSError(errno.EINVAL, problem, str(path))
    return os.fdopen(fd, "rb")


def read_regular_file(path: str | Path, max_bytes: int, follow_links: bool = False) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``max_bytes`` (:func:`open_regular`; links refused
    unless ``follow_links``); else ``OSError``."""
    with open_regular(path, max_bytes, follow_links) as f:
        return f.read()


def why_unreadable(path: str | Path, err: OSError | ValueError) -> str:
    """``path`` and why it cannot be opened, for a message: "P is a FIFO, not a regular file" (from
    :func:`open_regular`), "cannot open P: Permission denied"."""
    why = getattr(err, "strerror", None) or str(err)  # ValueError: a NUL in the path
    return f"{path} {why}" if why.startswith("is ") else f"cannot open {path}: {why}"


def one_line(text: str, most: int | None = None) -> str:
    """``text`` from a file (a name, a complaint about it) fit for a one-line message: its whitespace runs made one
    space, and cut to ``most`` characters."""
    text = " ".join(text.split())
    return text if most is None or len(text) <= most else text[: most - 3] + "..."
