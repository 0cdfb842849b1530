"""What a launch prints before its first step: the few lines a user needs, not the libraries' chatter.

Lightning announces at INFO what the launch summary already says or what is noise for this app (the AMP
choice, "GPU available: False", a TPU count, a litlogger advert, "`Trainer.fit` stopped: `max_steps` reached");
those stay off while a launch runs. Its warnings stay on, each shown on one line without the source line Python
would print under it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning")
KEEP_INFO = ("lightning.pytorch.trainer.connectors.signal_connector",)
"""Lightning's loggers whose INFO lines stay: Slurm's requeue and signal messages belong in a job's log."""

NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not"
"""The start of Lightning's warning that a resumed data stream is not exact. False here: the data modules keep
their position in the checkpoint (energon's saved state, the synthetic clips' step) and resume the stream exactly
(tests/data/test_energon.py); Lightning only looks for a ``state_dict`` on the loader object itself."""

PYTREE_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
"""Lightning's own use of a torch API that torch deprecated: nothing a user can act on."""

ITERABLE_WITH_LEN = "Your `IterableDataset` has `__len__` defined"
"""Lightning's caution that workers of an iterable dataset with a length may duplicate data: energon's loaders give
each worker its own slice of the shards, and the synthetic clips are a map-style dataset, so nothing repeats
(the sample traces of tests/data/test_energon.py show it)."""

CHECKPOINTS_NOT_EMPTY = "Checkpoint directory .* exists and is not empty"
"""Lightning's note when the run's checkpoint folder already holds files: filtered only around a resumed fit
(:func:`resumed_fit`), where that is how the run goes on (a new run in such a folder keeps the warning)."""

ONLINE_SOFTMAX = r"\s*Online softmax is disabled on the fly"
"""Inductor's five-line note that it compiled a softmax another way: an internal choice of the compiler that a
user cannot act on (seen on the first compiled step of CV8x8x8 under torch 2.11)."""

PIN_MEMORY_ON_CPU = ".*'pin_memory' argument is set as true but no accelerator is found"
"""torch's note, once per loader, that energon's loaders ask for pinned memory on a machine without a GPU: it is
then simply not used, which is right on a CPU."""


def one_line_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """A warning as ``warning: <message>`` (the message is written for users; the file and source line of the
    ``warn`` call would only be noise under it)."""
    return f"warning: {message}\n"


@contextmanager
def quiet_launch() -> Iterator[None]:
    """Lightning's INFO lines off, warnings on one line, and the warnings that are false or not the user's
    filtered, for the duration of a launch; everything as it was afterwards."""
    levels: dict[str, Any] = {}
    # The format, not ``showwarning``: replacing that would also bypass whoever records warnings around us.
    formatting = warnings.formatwarning
    warnings.formatwarning = one_line_warning
    for name in (*LIGHTNING_LOGGERS, *KEEP_INFO):
        logger = logging.getLogger(name)
        levels[name] = logger.level
        logger.setLevel(logging.INFO if name in KEEP_INFO else logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NOT_RESUMABLE)
            warnings.filterwarnings("ignore", message=PYTREE_LEAFSPEC)
            warnings.filterwarnings("ignore", message=PIN_MEMORY_ON_CPU)
            warnings.filterwarnings("ignore", message=ITERABLE_WITH_LEN)
            warnings.filterwarnings("ignore", message=ONLINE_SOFTMAX)
            yield
    finally:
        warnings.formatwarning = formatting
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextmanager
def resumed_fit(resuming: bool) -> Iterator[None]:
    """Around the fit: Lightning's note that the checkpoint folder is not empty is off when the launch resumes
    from it, and stays on for a new run there (``resume.resume_if_exists=false``), whose saves overwrite the old
    run's checkpoints of the same names."""
    with warnings.catch_warnings():
        if resuming:
            warnings.filterwarnings("ignore", message=CHECKPOINTS_NOT_EMPTY)
        yield
