"""The override groups of a NeMo-Run entry function, read from its config dataclasses: every setting's key,
type, default and documentation (the string literal under each field), for ``--help``, and the check of a
``--yaml`` file's keys before NeMo-Run reads it.

The dataclasses stay the one source: a field added to a config appears in the help and is accepted in YAML
files without any change here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..core.errors import CommandError

NEMO_RUN_KEYS = ("_factory_", "run")
"""Top-level keys NeMo-Run itself reads from a ``--yaml`` file (the factory to start from)."""


@dataclass
class Setting:
    """One override: a field of a config dataclass, or a nested config (``group``) holding more of them."""

    key: str
    """Dotted override name, e.g. ``model.lora.rank``."""
    annotation: Any
    default: Any
    """The dataclass default (``dataclasses.MISSING`` when the field has none)."""
    doc: str
    """The field's documentation on one line ('' when it has none)."""
    group: bool = False


def field_docs(cls: type) -> dict[str, str]:
    """``field -> documentation`` of a dataclass: the string literal right after each field, on one line.

    A field without one takes the documentation of the same field in a base class (``L1Config.weight``
    redeclares ``TermConfig.weight`` for its default only)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (e.g. a class made at run time): no documentation
            continue
        (node,) = ast.parse(source).body
        body = node.body if isinstance(node, ast.ClassDef) else []
        for statement, after in zip(body, body[1:], strict=False):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                if isinstance(after.value.value, str):
                    # One line for the terminal, without the reST literal quotes.
                    docs[statement.target.id] = " ".join(after.value.value.replace("``", "").split())
    return docs


def _class_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    # dataclasses make up a signature docstring for undocumented classes: not documentation.
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split("\n\n")[0].replace("``", "").split())


def _dataclass_of(annotation: Any) -> type | None:
    """The dataclass that ``annotation`` (or ``Optional[...]`` of it) names, else None."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else None
    return annotation if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) else None


def _fields(cls: type, prefix: str) -> list[Setting]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    found = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        nested = _dataclass_of(hints[f.name])
        found.append(Setting(key, hints[f.name], default, docs.get(f.name, ""), group=nested is not None))
        if nested is not None:
            found += _fields(nested, key)
    return found


def groups(fn: Callable) -> dict[str, type]:
    """``name -> config dataclass`` of the parameters of ``fn`` that are override groups."""
    hints = typing.get_type_hints(fn)
    found = {}
    for name in inspect.signature(fn).parameters:
        cls = _dataclass_of(hints.get(name))
        if cls is not None:
            found[name] = cls
    return found


def settings(fn: Callable) -> list[Setting]:
    """Every override of ``fn``: each group, then its fields (nested configs as groups of their own), in the
    order the dataclasses declare them."""
    found = []
    for name, cls in groups(fn).items():
        found.append(Setting(name, cls, dataclasses.MISSING, _class_doc(cls), group=True))
        found += _fields(cls, name)
    return found


def type_name(annotation: Any) -> str:
    """``annotation`` as it is written in Python: ``int``, ``str | None``, ``list[str]``, ``dict[str, float]``."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        return " | ".join(type_name(a) for a in args if a is not type(None)) + (" | None" if type(None) in args else "")
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def show_value(value: Any) -> str:
    """A value as an override writes it (a Python literal: ``'outputs'``, ``True``, ``None``, ``['*']``)."""
    return "(required)" if value is dataclasses.MISSING else repr(value)


def recipe_values(recipe: Any) -> dict[str, Any]:
    """``key -> value`` of every setting that a recipe (a ``run.Partial`` of the entry) builds, or {} when it
    cannot be built."""
    import fiddle as fdl

    try:
        built = fdl.build(recipe)
    except Exception:  # noqa: BLE001 - the help still shows the defaults
        return {}
    return built_values(built)


def built_values(built: Any) -> dict[str, Any]:
    """``key -> value`` of every setting of a built entry (the ``functools.partial`` that ``fdl.build`` makes of a
    recipe): each group's fields, nested configs too."""
    values: dict[str, Any] = {}

    def walk(prefix: str, config: Any) -> None:
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            values[f"{prefix}.{f.name}"] = value
            if dataclasses.is_dataclass(value):
                walk(f"{prefix}.{f.name}", value)

    for name, value in getattr(built, "keywords", {}).items():
        if dataclasses.is_dataclass(value):
            walk(name, value)
    return values


def settings_help(fn: Callable, recipe_name: str | None = None, recipe: Any = None) -> str:
    """The overrides part of ``--help``: per group, ``group.field: type = default  [recipe: value]  — doc``.

    ``recipe`` (a ``run.Partial`` of ``fn``, named ``recipe_name``) adds what it sets where that differs from
    the default."""
    chosen = recipe_values(recipe) if recipe is not None else {}
    lines = []
    for setting in settings(fn):
        depth = setting.key.count(".")
        indent = "  " * depth
        if setting.group:
            if depth == 0:
                lines.append("")
            lines.append(f"{indent}{setting.key}.*" + (f"  — {setting.doc}" if setting.doc else ""))
            continue
        line = f"{indent}{setting.key}: {type_name(setting.annotation)} = {show_value(setting.default)}"
        if setting.key in chosen and chosen[setting.key] != setting.default:
            line += f"  [{recipe_name}: {show_value(chosen[setting.key])}]"
        if setting.doc:
            line += f"  — {setting.doc}"
        lines.append(line)
    return "\n".join(lines)


# -- command-line overrides ---------------------------------------------------------------------------------

VALUE_OPTIONS = ("--factory", "-f", "--yaml", "--name", "-n", "--load", "-l", "--to-yaml", "--to-toml", "--to-json")
"""NeMo-Run options followed by a value (which is not an override)."""
_OVERRIDE = re.compile(r"^([A-Za-z_][\w.]*)([-+*/]?=)")


def check_override_keys(argv: list[str], fn: Callable) -> None:
    """Refuse an override of a group or setting that ``fn`` does not have, naming the closest one: NeMo-Run's
    own message for an unknown group is "Invalid attribute 'modle' for modle". Values are left to NeMo-Run."""
    names = list(groups(fn))
    parameters = set(inspect.signature(fn).parameters)
    known = {s.key: s for s in settings(fn)}
    skip = False
    for arg in argv:
        if skip or arg.startswith("-"):
            skip = arg in VALUE_OPTIONS
            continue
        match = _OVERRIDE.match(arg)
        if match is None:
            continue  # not an override (NeMo-Run says so itself)
        key = match.group(1)
        top = key.split(".")[0]
        if top not in parameters:
            raise CommandError(
                f"cannot apply override {arg}: {top!r} is not an override group{_suggestion(top, names)}; "
                f"the groups are {', '.join(names)}"
            )
        if top in known and key not in known:
            raise CommandError(
                f"cannot apply override {arg}: no such setting{_suggestion(key, list(known))} "
                "(train_tokenizer.py --help lists them)"
            )


# -- --yaml files -------------------------------------------------------------------------------------------


def _load(path: Path) -> Any:
    """The data of a ``--yaml`` file (YAML, or JSON/TOML by their suffix, as NeMo-Run reads them)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CommandError(f"--yaml {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CommandError(f"--yaml {path}: cannot read it ({err})") from None
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise CommandError(f"{path}: not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    if suffix == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise CommandError(f"{path}: not valid TOML: {err}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise CommandError(f"{path}: not valid YAML: {err.problem or err.context}{where}") from None
    except yaml.YAMLError as err:
        raise CommandError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None


def _suggestion(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def check_yaml_file(path: str | Path, fn: Callable) -> None:
    """Refuse, in one line naming the file and the key, a ``--yaml`` file that NeMo-Run would fail on with a
    traceback or a message naming neither: a syntax error, a top level that is not a mapping of override
    groups, an unknown group or setting. Values are left to NeMo-Run, which checks their types."""
    path = Path(path)
    data = _load(path)
    names = list(groups(fn))
    hint = f"the top level must be a mapping of override groups ({', '.join(names)}), e.g. 'model: {{channels: 16}}'"
    if data is None:  # NeMo-Run fails on it with "argument of type 'NoneType' is not iterable"
        raise CommandError(f"{path} is empty; {hint} (or leave out --yaml)")
    if not isinstance(data, dict):
        raise CommandError(f"{path}: {hint}, not a {type(data).__name__}")
    parameters = set(inspect.signature(fn).parameters)
    known = {s.key: s for s in settings(fn)}
    for key, value in data.items():
        key = str(key)
        if key in ("_partial_", "_target_"):
            raise CommandError(
                f"{path}: delete its top-level {key} line (--to-yaml writes _partial_ and _target_ there; --yaml "
                "takes only the override groups)"
            )
        if key not in parameters and key not in NEMO_RUN_KEYS:
            raise CommandError(f"{path}: {key!r} is not an override group{_suggestion(key, names)}; {hint}")
        if key in known and isinstance(value, dict):
            _check_group(path, key, value, known)


def _check_group(path: Path, prefix: str, values: dict, known: dict[str, Setting]) -> None:
    for name, value in values.items():
        name = str(name)
        if name.startswith("_") and name.endswith("_"):
            continue  # NeMo-Run's own keys (_target_ of each config in a --to-yaml file)
        key = f"{prefix}.{name}"
        if key not in known:
            siblings = [k for k in known if k.rsplit(".", 1)[0] == prefix]
            raise CommandError(
                f"{path}: {key} is not a setting{_suggestion(key, siblings)} (train_tokenizer.py --help lists them)"
            )
        if known[key].group and isinstance(value, dict):
            _check_group(path, key, value, known)
