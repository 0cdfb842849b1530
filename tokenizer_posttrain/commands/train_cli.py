"""Run a NeMo-Run entry point so that failures exit non-zero and nothing waits at a prompt.

NeMo-Run's CLI prints "Unexpected error" and exits 0 on any failure unless ``-v`` is
given, and asks "Continue? [y/N]" without ``--yes``. We add both flags, then map failures
to exit codes as every command does (:func:`.guard.run_guarded`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from .guard import fail, run_guarded

OOM_HINT = "lower data.micro_batch_size or the clip size, or set model.activation_checkpointing=true"


def cli_error_message(err: Exception) -> str:
    """A one-line message for a NeMo-Run override error (its own nests three levels deep)."""
    context = getattr(err, "context", {}) or {}
    if "key" in context:
        return (
            f"cannot apply override {context['key']}={context.get('value')}: no such setting "
            "(see the override table in README.md, or run with --help)"
        )
    override = str(context.get("expected_type", ""))
    found = re.search(r"Failed to parse '([^']*)' as <class '(\w+)'>", str(getattr(err, "arg", err)))
    if "=" in override and found:
        return f"invalid override {override}: {found.group(1)!r} is not a valid {found.group(2)}"
    return str(err).split(" (Argument:")[0]


def _with_flags(argv: list[str]) -> list[str]:
    args = list(argv)
    if not any(a in ("--help", "-h") for a in args):
        if "--yes" not in args and "-y" not in args:
            args.append("--yes")
        if "-v" not in args and "--verbose" not in args:
            args.append("-v")
    return args


def run_cli(fn: Callable, default_factory: Callable, argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) as NeMo-Run overrides of ``fn`` and run it."""
    import nemo_run as run
    from nemo_run.cli.cli_parser import CLIException

    sys.argv = [sys.argv[0], *_with_flags(sys.argv[1:] if argv is None else argv)]

    def main() -> int:
        try:
            run.cli.main(fn, default_factory=default_factory)
        except SystemExit as exit_:
            code = exit_.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        except CLIException as err:
            return fail(cli_error_message(err))
        return 0

    # NeMo-Run builds the configs from the overrides: a wrong type there is the user's, not a bug.
    return run_guarded(main, oom_hint=OOM_HINT, also_expected=(TypeError,))
