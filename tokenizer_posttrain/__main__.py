"""``python -m tokenizer_posttrain COMMAND``: export, evaluate, reconstruct, encode, decode, posttrain."""

from __future__ import annotations

import argparse
import importlib
import sys

# Command modules, imported lazily so that `--help` and light commands stay fast.
_COMMANDS = ("export_cmd", "infer", "evaluate_cmd", "posttrain_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tokenizer_posttrain", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(f"tokenizer_posttrain.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
