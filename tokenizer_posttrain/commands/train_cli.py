"""Run a NeMo-Run entry point so that failures exit non-zero and nothing waits at a prompt.

NeMo-Run's CLI prints "Unexpected error" and exits 0 on any failure unless ``-v`` is
given, and asks "Continue? [y/N]" without ``--yes``. We add both flags, then map failures
to exit codes as every command does (:func:`.guard.run_guarded`).

``--help`` is ours: NeMo-Run's lists the override groups but none of their settings. A ``--yaml`` file
and the ``--factory`` name are checked before NeMo-Run reads them, whose errors for them are a
traceback or a message that names neither the file nor the key.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from ..core.errors import CommandError
from .guard import EXPECTED_ERRORS, fail, run_guarded
from .overrides import (
    VALUE_OPTIONS,
    built_values,
    check_override_keys,
    check_yaml_file,
    groups,
    recipe_values,
    settings_help,
    show_value,
)

FIDDLE_CONTEXT = "\n\nFiddle context:"
OOM_HINT = "lower data.micro_batch_size or the clip size, or set model.activation_checkpointing=true"


def cli_error_message(err: Exception) -> str:
    """A one-line message for a NeMo-Run override error (its own nests three levels deep)."""
    context = getattr(err, "context", {}) or {}
    if "key" in context:
        return (
            f"cannot apply override {context['key']}={context.get('value')}: no such setting "
            "(docs/overrides.md lists them, as does --help)"
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
  --dryrun            show every setting, run every launch check, and exit without training
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


NEMO_RUN_MODES = ("--to-yaml", "--to-toml", "--to-json", "--repl", "-r", "--load", "-l", "--detach", "--lazy")
"""NeMo-Run's options that do something other than run the entry here: NeMo-Run itself handles them."""
FLAGS = ("--dryrun", "--yes", "-y", "-v", "--verbose", "--direct", "--no-direct", "--tail-logs", "--no-tail-logs")
"""Options without a value that a launch accepts (those other than ``--dryrun`` change nothing here: a run never
prompts and always runs in this process)."""


def _overrides(argv: list[str]) -> list[str]:
    """The ``GROUP.SETTING=VALUE`` arguments of ``argv``; an option the launch does not know, or one that lacks its
    value, is refused."""
    found, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg.startswith("-"):
            name = arg.split("=", 1)[0]
            if name in VALUE_OPTIONS:
                skip = "=" not in arg
                if skip and i == len(argv) - 1:
                    example = "tiny" if name in ("--factory", "-f") else "FILE"
                    raise CommandError(f"{arg} needs a value (e.g. {arg} {example})")
            elif arg not in FLAGS:
                raise CommandError(f"unknown option {arg}; train_tokenizer.py --help lists the options")
            continue
        found.append(arg)
    return found


def _is_rank_zero() -> bool:
    # Every torchrun process parses the command line; one of them speaks for the launch.
    return os.environ.get("RANK", "0") == "0"


def _changed(recipe: dict[str, Any], resolved: dict[str, Any]) -> list[str]:
    """``key=value`` for each setting whose resolved value differs from the recipe's (nested groups are
    named by their leaves)."""
    return [
        f"{key}={show_value(value)}"
        for key, value in resolved.items()
        if not dataclasses.is_dataclass(value) and (key not in recipe or recipe[key] != value)
    ]


def resolved_settings(resolved: dict[str, Any], recipe: dict[str, Any], recipe_name: str) -> str:
    """Every setting of a launch with its value, defaults included, one per line; those that differ from the
    recipe ``recipe_name`` say what the recipe has."""
    lines = []
    for key, value in resolved.items():
        if dataclasses.is_dataclass(value):
            continue
        line = f"  {key} = {show_value(value)}"
        if key in recipe and recipe[key] != value:
            line += f"  (recipe {recipe_name}: {show_value(recipe[key])})"
        lines.append(line)
    return "\n".join(lines)


def _launch(fn: Callable, factory: Callable, given: list[str], dry_run: Callable[..., list[str]] | None) -> int:
    """Build ``fn``'s configs from the recipe ``factory``, a ``--yaml`` file and the overrides with NeMo-Run's
    parser, then run ``fn`` here, or for ``--dryrun`` show every setting and run ``dry_run`` (the launch's
    checks, same arguments as ``fn``; it returns lines to show)."""
    import fiddle as fdl
    from nemo_run.cli.api import RunContext

    context = RunContext(name=fn.__name__, factory=factory, yaml=_option_value(given, "--yaml"), skip_confirmation=True)
    try:
        task = context.parse_fn(fn, _overrides(given))
        built = fdl.build(task)
    except TypeError as err:
        # A value of the wrong type for a setting: the user's, and only here (a TypeError in training is a bug,
        # shown with its traceback). Fiddle appends its call context: our message already names the key.
        raise CommandError(str(err).split(FIDDLE_CONTEXT)[0]) from None
    recipe, resolved = recipe_values(factory()), built_values(built)
    speak = _is_rank_zero()
    if "--dryrun" in given:
        if speak:
            print(f"Dry run of recipe {factory.__name__}: every setting of this launch\n", flush=True)
            print(resolved_settings(resolved, recipe, factory.__name__) + "\n", flush=True)
        if dry_run is not None:
            lines = dry_run(*built.args, **built.keywords)
            if speak:
                print("\n".join([*lines, "dry run: every launch check passed; nothing was written"]), flush=True)
        return 0
    if speak:
        changed = _changed(recipe, resolved)
        print(f"recipe: {factory.__name__}" + (f", changed: {' '.join(changed)}" if changed else ""), flush=True)
    built()
    return 0


def run_cli(
    fn: Callable,
    default_factory: Callable,
    argv: list[str] | None = None,
    dry_run: Callable[..., list[str]] | None = None,
) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) as NeMo-Run overrides of ``fn`` and run it. ``dry_run`` (same
    arguments as ``fn``) runs the launch's checks for ``--dryrun`` and returns lines to show."""
    import nemo_run as run
    from nemo_run.cli.cli_parser import CLIException

    given = list(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *_with_flags(given)]

    def main() -> int:
        if "--help" in given or "-h" in given:
            print(help_text(fn, default_factory, given), end="", flush=True)
            return 0
        factory = _chosen_factory(fn, default_factory, given)
        check_override_keys(given, fn)
        yaml_file = _option_value(given, "--yaml")
        if yaml_file is not None:
            check_yaml_file(yaml_file, fn)
        _quiet_nemo_run_parser()
        try:
            if not any(arg.split("=", 1)[0] in NEMO_RUN_MODES for arg in given):
                return _launch(fn, factory, given, dry_run)
            try:
                run.cli.main(fn, default_factory=default_factory)
            except TypeError as err:  # NeMo-Run builds the configs from the overrides: a wrong type is the user's
                return fail(str(err).split(FIDDLE_CONTEXT)[0])
        except SystemExit as exit_:
            code = exit_.code
            return code if isinstance(code, int) else (0 if code is None else 1)
        except CLIException as err:
            return fail(cli_error_message(err))
        except EXPECTED_ERRORS as err:
            # Fiddle appends its call context to an error raised while it builds a config from the overrides
            # ("\n\nFiddle context: failed to construct OptimConfig ..."): our message already names the key.
            return fail(str(err).split(FIDDLE_CONTEXT)[0])
        return 0

    return run_guarded(main, oom_hint=OOM_HINT)
