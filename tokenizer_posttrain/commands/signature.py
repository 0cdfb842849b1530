"""Command-line options made from a typed function, litgpt's way: the signature gives each option's name,
type and default, the docstring's ``Args:`` section its help. The function stays the one source of both,
so the command, the NeMo-Run recipe and Python callers cannot disagree."""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union


def docstring_args(fn: Callable) -> dict[str, str]:
    """``name -> help`` from the ``Args:`` section of ``fn``'s Google-style docstring (continuation lines joined)."""
    doc = inspect.getdoc(fn) or ""
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, flags=re.M)
    helps: dict[str, str] = {}
    name = None
    for line in (section.group(1) if section else "").splitlines():
        entry = re.match(r"^ {4}(\w+): ?(.*)$", line)
        if entry:
            name, text = entry.groups()
            helps[name] = text.strip()
        elif name and line.strip():
            helps[name] += " " + line.strip()
    return helps


def _unwrap_optional(annotation: Any) -> Any:
    """``X`` of ``Optional[X]`` (``X | None``); other annotations as they are."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_function_arguments(parser: argparse.ArgumentParser, fn: Callable) -> None:
    """One ``--kebab-case`` option per parameter of ``fn`` (required when it has no default).

    Supported annotations: ``str``, ``int``, ``float``, ``bool`` (``--x`` / ``--no-x``), ``Literal[...]``
    (choices), ``list[int|float|str]`` (one or more values), each optionally ``Optional``.
    """
    hints = typing.get_type_hints(fn)
    helps = docstring_args(fn)
    for name, param in inspect.signature(fn).parameters.items():
        if name not in hints:
            raise TypeError(f"{fn.__name__}({name}): annotate the parameter to give it a command-line form")
        annotation = _unwrap_optional(hints[name])
        flag = "--" + name.replace("_", "-")
        required = param.default is inspect.Parameter.empty
        default = None if required else param.default
        shown = "" if required or default is None else f" (default: {default})"
        options: dict[str, Any] = {"help": helps.get(name, "") + shown, "dest": name}
        origin = typing.get_origin(annotation)
        if annotation is bool:
            options.update(action=argparse.BooleanOptionalAction, default=default)
        elif origin is Literal:
            choices = typing.get_args(annotation)
            options.update(choices=choices, type=type(choices[0]), default=default)
        elif origin is list:
            (item,) = typing.get_args(annotation)
            options.update(nargs="+", type=item, default=default)
        elif annotation in (str, int, float):
            options.update(type=annotation, default=default)
        else:
            raise TypeError(f"{fn.__name__}({name}): no command-line form for the annotation {hints[name]}")
        if required:
            options["required"] = True
        parser.add_argument(flag, **options)


def call_with_arguments(fn: Callable, args: argparse.Namespace) -> Any:
    """``fn`` called with the parsed options that :func:`add_function_arguments` added for it."""
    return fn(**{name: getattr(args, name) for name in inspect.signature(fn).parameters})
