"""``posttrain``: from a base checkpoint and a folder of videos to a better, exported tokenizer.

Its options are :func:`tokenizer_posttrain.workflow.posttrain.posttrain`'s parameters, with their defaults and the
help of its docstring, so this command, the NeMo-Run recipe and Python callers share one set of defaults.

Exit codes: 0 done; 1 failed (one ``error:`` line); 2 a bad command line; 3 done, but the post-trained tokenizer
is worse than the base on the held-out clips (``--allow-worse`` makes it 0); 4 done, but its latents drifted from
the base's past ``--max-drift`` (``--allow-drift`` makes it 0). Files are kept in every case.
"""

from __future__ import annotations

import argparse

from ..workflow.posttrain import posttrain
from .guard import run_guarded
from .signature import add_function_arguments, call_with_arguments


def run(args: argparse.Namespace) -> int:
    """Run the workflow with the parsed ``args``; the exit code."""
    return run_guarded(lambda: call_with_arguments(posttrain, args) and 0)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``posttrain`` subcommand."""
    parser = subparsers.add_parser(
        "posttrain",
        help="the whole job: shards, baseline, train, evaluate, export",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[2].replace("``", ""),
    )
    add_function_arguments(parser, posttrain)
    # The option's earlier name keeps working: the same destination, no default of its own (--max-drift's holds).
    parser.add_argument(
        "--max-latent-drift",
        dest="max_drift",
        type=float,
        default=argparse.SUPPRESS,
        metavar="MAX_DRIFT",
        help="the earlier name of --max-drift",
    )
    parser.set_defaults(func=run)
