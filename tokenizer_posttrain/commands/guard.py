"""Every command's failure handling, in one place: expected errors become one ``error:`` line on stderr
and exit code 1; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import torch

from ..core.errors import UserError

EXPECTED_ERRORS: tuple[type[BaseException], ...] = (UserError, ValueError, OSError)
"""Errors whose message says what is wrong: our own (:class:`UserError`), bad values (configs validate in
``__post_init__``), and files that are missing or cannot be read or written. Anything else is a bug."""

OOM_HINT = "use a smaller clip, batch or tile (or --dtype bf16)"


def fail(message: str, code: int = 1) -> int:
    """Print ``error: message`` to stderr; the exit code ``code``."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def run_guarded(
    command: Callable[[], int | None],
    oom_hint: str = OOM_HINT,
    also_expected: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``command``; its exit code (0 for None), or 1 with a one-line message for an expected error
    (:data:`EXPECTED_ERRORS` and ``also_expected``; a :class:`UserError` gives its own ``exit_code``), 130 on
    Ctrl-C, and 1 with the traceback for anything else."""
    try:
        code = command()
    except torch.OutOfMemoryError:
        return fail(f"out of memory; {oom_hint}")
    except (*EXPECTED_ERRORS, *also_expected) as err:
        return fail(str(err), err.exit_code if isinstance(err, UserError) else 1)
    except KeyboardInterrupt:
        fail("interrupted")
        return 130
    except Exception:  # noqa: BLE001 - anything else is a bug: show where it happened
        traceback.print_exc()
        return fail("the command failed (traceback above)")
    return 0 if code is None else code
