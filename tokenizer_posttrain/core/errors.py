"""Error types whose message says what is wrong and what to do: commands print them as one
``error:`` line and exit 1, without a traceback (see :mod:`tokenizer_posttrain.commands.guard`)."""

from __future__ import annotations


class UserError(Exception):
    """Base of every error caused by input (a file, a setting, the data) rather than by a bug."""

    exit_code = 1
    """The exit code of a command that stops with this error."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded as asked; the message says why and what to do."""


class DataError(UserError, ValueError):
    """The dataset cannot serve the requested clips; the message names files and the fix."""


class EvaluationError(UserError, ValueError):
    """Evaluation cannot run as asked (bad data path, clip shape, no usable clip); the message says why."""


class CommandError(UserError):
    """A command-line tool cannot do what it was asked (a missing input, an unreadable video)."""


class WorseThanBaseError(UserError):
    """A job that ran to its end, but whose result is worse than what it started from (``posttrain``: the
    post-trained tokenizer reconstructs the held-out clips worse than the base). Its files are kept."""

    exit_code = 3
    """Not 1 (the job failed) and not 2 (argparse's exit code for a bad command line): a script can tell that the
    job ran and its result is worse."""


class DriftedFromBaseError(UserError):
    """A post-training that ran to its end, but whose latents (DV: tokens) moved from the base's past the drift
    limit: a world model trained on the base's would need fine-tuning on them. Its files are kept."""

    exit_code = 4
    """Not 3 (worse): a script can tell latents that moved from reconstructions that got worse."""


class ExportError(UserError):
    """A network that must not be written as a tokenizer (e.g. weights that are NaN or infinite)."""
