"""Run a NeMo-Run entry point so that failures exit non-zero and nothing waits at a prompt.

NeMo-Run's CLI prints "Unexpected error" and exits 0 on any failure unless ``-v`` is
given, and asks "Continue? [y/N]" without ``--yes``. We add both flags, then map failures
to exit codes as every command does (:func:`.guard.run_guarded`).

``--help`` is ours: NeMo-Run's lists the override groups but none of their settings. A ``--yaml`` file
and the ``--factory`` name are checked before NeMo-Run reads them, whose errors for them are a
traceback or a message that names neither the file nor the key.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections.abc import Callable

from ..core.errors import CommandError
from .guard import EXPECTED_ERRORS, fail, run_guarded
from .overrides import check_override_keys, check_yaml_file, groups, settings_help

FIDDLE_CONTEXT = "\n\nFiddle context:"
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


def _option_value(argv: list[str], *names: str) -> str | None:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` of ``names`` in ``argv``."""
    found = None
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            found = argv[i + 1]
        for name in names:
            if arg.startswith(f"{name}="):
                found = arg.split("=", 1)[1]
    return found


def _factories(fn: Callable) -> dict[str, Callable]:
    from nemo_run.cli.api import list_factories
    from nemo_run.config import get_type_namespace

    return {factory.__name__: factory for factory in list_factories(get_type_namespace(fn))}


def _chosen_factory(fn: Callable, default_factory: Callable, argv: list[str]) -> Callable:
    """The recipe ``--factory`` names (``default_factory`` without one); an unknown name is refused."""
    name = _option_value(argv, "--factory", "-f")
    if name is None:
        return default_factory
    factories = _factories(fn)
    if name not in factories:
        raise CommandError(f"--factory {name}: no such recipe; the recipes are {', '.join(sorted(factories))}")
    return factories[name]


def help_text(fn: Callable, default_factory: Callable, argv: list[str], prog: str = "train_tokenizer.py") -> str:
    """The ``--help`` of the entry ``fn``: usage, NeMo-Run's options, and every override group with each
    setting's type, default (and the chosen recipe's value where it differs) and documentation."""
    factory = _chosen_factory(fn, default_factory, argv)
    names = ", ".join(groups(fn))
    summary = (inspect.getdoc(fn) or "").split("\n\n")[0]
    recipes = ", ".join(sorted(_factories(fn)))
    usage = f"""Usage: {prog} [--factory NAME] [--yaml FILE] [--dryrun] [--yes] [GROUP.SETTING=VALUE ...]

{summary}

Options (NeMo-Run's):
  --factory, -f NAME  recipe to start from (default: {default_factory.__name__}); one of {recipes}
  --yaml FILE         read overrides from FILE: a mapping of groups, e.g. 'model: {{channels: 16}}'
                      (write --yaml in full: -y means --yes)
  --dryrun            print the resolved configuration and exit without training
  --yes, -y           no confirmation prompt (added when missing, so a run never waits)
  --to-yaml FILE      write the resolved configuration to FILE and exit
  --help, -h          this help

Overrides: GROUP.SETTING=VALUE with Python literals as values (model.channels=16, model.channels=None,
log.export_on_end=False, "model.lora.targets=['decoder.*']"); +=, -= and *= change a number.
Command-line overrides apply after --yaml. The groups are {names}.
Each setting shows its type and default, and in [brackets] what the recipe {factory.__name__} sets instead.
"""
    return usage + settings_help(fn, factory.__name__, factory()) + "\n"


def _quiet_nemo_run_parser() -> None:
    # NeMo-Run logs every override error (with the whole configuration) before raising it; we print it as
    # one line (cli_error_message), so its log would only bury that line.
    logger = logging.getLogger("nemo_run.cli.cli_parser")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False


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

    given = list(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *_with_flags(given)]

    def main() -> int:
        if "--help" in given or "-h" in given:
            print(help_text(fn, default_factory, given), end="", flush=True)
            return 0
        _chosen_factory(fn, default_factory, given)
        check_override_keys(given, fn)
        yaml_file = _option_value(given, "--yaml")
        if yaml_file is not None:
            check_yaml_file(yaml_file, fn)
        _quiet_nemo_run_parser()
        try:
            run.cli.main(fn, default_factory=default_factory)
        except SystemExit as exit_:
            code = exit_.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        except CLIException as err:
            return fail(cli_error_message(err))
        except (*EXPECTED_ERRORS, TypeError) as err:
            # Fiddle appends its call context to an error raised while it builds a config from the overrides
            # ("\n\nFiddle context: failed to construct OptimConfig ..."): our message already names the key.
            return fail(str(err).split(FIDDLE_CONTEXT)[0])
        return 0

    # NeMo-Run builds the configs from the overrides: a wrong type there is the user's, not a bug.
    return run_guarded(main, oom_hint=OOM_HINT, also_expected=(TypeError,))
