"""Error types whose message says what is wrong and what to do: commands print them as one
``error:`` line and exit 1, without a traceback (see :mod:`tokenizer_posttrain.commands.guard`)."""

from __future__ import annotations


class UserError(Exception):
    """Base of every error caused by input (a file, a setting, the data) rather than by a bug."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded as asked; the message says why and what to do."""


class DataError(UserError, ValueError):
    """The dataset cannot serve the requested clips; the message names files and the fix."""


class EvaluationError(UserError, ValueError):
    """Evaluation cannot run as asked (bad data path, clip shape, no usable clip); the message says why."""


class CommandError(UserError):
    """A command-line tool cannot do what it was asked (a missing input, an unreadable video)."""


class ExportError(UserError):
    """A network that must not be written as a tokenizer (e.g. weights that are NaN or infinite)."""
