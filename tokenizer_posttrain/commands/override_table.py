"""``docs/overrides.md``: every override of the training entry as a markdown table, made from the config
dataclasses by the same functions as ``train_tokenizer.py --help`` (:mod:`.overrides`), so the page, the help and
the code cannot drift apart (``tests/commands/test_override_table.py`` compares the page with a fresh one).

    python -m tokenizer_posttrain.commands.override_table            # print the page
    python -m tokenizer_posttrain.commands.override_table --write    # rewrite docs/overrides.md
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .overrides import recipe_values, settings, show_value, type_name
from .train_cli import _factories

PAGE = Path(__file__).resolve().parents[2] / "docs" / "overrides.md"
"""Where ``--write`` puts the page: ``docs/overrides.md`` of the repository."""
COMMAND = "python -m tokenizer_posttrain.commands.override_table --write"
"""The command that rewrites the page (named in the page itself and by the test when they differ)."""

_LONE_UNDERSCORE = re.compile(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")


def cell(text: str) -> str:
    """``text`` as one markdown table cell of plain prose: the pipe ends no cell, ``<run>`` is no HTML tag and
    ``*`` or a word-edge ``_`` starts no emphasis (an underscore inside a word, as in ``prefetch_factor``, cannot)."""
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")
    return _LONE_UNDERSCORE.sub(r"\\_", text)


def code(text: str) -> str:
    """``text`` as inline code in a table cell (the pipe still needs its escape there)."""
    return "`" + text.replace("|", "\\|") + "`"


def _first_sentence(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].replace("``", "`").split())


def settings_table(fn: Callable, recipe_name: str, recipe: Any) -> str:
    """Every group and setting of ``fn``: key, type, default (and ``recipe``'s value where it differs, as
    ``--help`` shows it in brackets) and documentation."""
    chosen = recipe_values(recipe)
    rows = ["| key | type | default | documentation |", "|---|---|---|---|"]
    for setting in settings(fn):
        if setting.group:
            rows.append(f"| {code(setting.key + '.*')} | group | | {cell(setting.doc)} |")
            continue
        default = code(show_value(setting.default))
        if setting.key in chosen and chosen[setting.key] != setting.default:
            default += f" ({recipe_name}: {code(show_value(chosen[setting.key]))})"
        kind = code(type_name(setting.annotation))
        rows.append(f"| {code(setting.key)} | {kind} | {default} | {cell(setting.doc)} |")
    return "\n".join(rows)


def recipe_table(fn: Callable, factories: dict[str, Callable]) -> str:
    """One row per recipe: what it is (its docstring's first paragraph) and the settings it sets to something
    other than the dataclass default."""
    defaults = {s.key: s.default for s in settings(fn) if not s.group}
    rows = ["| `--factory` | what it is | settings it changes from the default |", "|---|---|---|"]
    for name, factory in sorted(factories.items()):
        values = recipe_values(factory())
        changed = [
            code(f"{key}={show_value(value)}")
            for key, value in values.items()
            if key in defaults and not dataclasses.is_dataclass(value) and value != defaults[key]
        ]
        rows.append(f"| {code(name)} | {_first_sentence(inspect.getdoc(factory) or '')} | {', '.join(changed)} |")
    return "\n".join(rows)


def page(fn: Callable, default_factory: Callable, entry: str = "train_tokenizer.py") -> str:
    """The whole ``docs/overrides.md``: how overrides are written, the recipes, then the settings table."""
    name = default_factory.__name__
    return f"""# Every override and its default

<!-- Generated from the config dataclasses by `{COMMAND}`; edit the dataclasses' field
documentation (the string under each field), not this file. tests/commands/test_override_table.py fails when
the two differ, and checks that this table and `{entry} --help` list the same keys. -->

Every setting of a training run is an override `GROUP.SETTING=VALUE` on the command line of `{entry}`
(Python literals as values: `model.channels=16`, `model.channels=None`, `"model.lora.targets=['decoder.*']"`;
`+=`, `-=` and `*=` change a number), a key of a `--yaml` file (`model: {{channels: 16}}`; the command line applies
after it), or an attribute of a NeMo-Run task (`task.model.trainable = "decoder"`, [multi-gpu.md](multi-gpu.md)).
`{entry} --help` prints the same list in the terminal, with the values of the recipe `--factory` names.

An unknown group or setting stops the launch before any work, naming the closest known key; so does a value of
the wrong type. The table's defaults are the dataclasses' own; where the default recipe, `{name}`, sets another
value, it follows in brackets. What the other recipes set is in the first table.

## Recipes (`--factory`)

{recipe_table(fn, _factories(fn))}

## Settings

{settings_table(fn, name, default_factory())}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenizer_posttrain.commands.override_table",
        description="Print docs/overrides.md, the table of every override of train_tokenizer.py, as the config "
        "dataclasses give it.",
    )
    parser.add_argument("--write", action="store_true", help=f"write it to {PAGE} instead of printing it")
    args = parser.parse_args(argv)
    # The entry and its default recipe, as train_tokenizer.py passes them to run_cli. recipes is the repository's
    # package of NeMo-Run factories, beside this one (python -m from the repository root finds it).
    import recipes
    from tokenizer_posttrain.training.train import train

    text = page(train, recipes.cv8x8x8.cv8x8x8)
    if args.write:
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
