"""``posttrain``: from a base checkpoint and a folder of videos to a better, exported tokenizer."""

from __future__ import annotations

import argparse
import sys

from ..checkpoint import CheckpointError
from ..data.preflight import DataError


def run(args: argparse.Namespace) -> int:
    from ..workflow import posttrain

    options = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    try:
        posttrain(**options)
    except (CheckpointError, DataError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "posttrain", help="the whole job: shards, baseline, train, evaluate, export", description=__doc__
    )
    parser.add_argument("--base", required=True, help="base checkpoint (folder with autoencoder.jit, or a file)")
    parser.add_argument("--videos", required=True, help="folder of videos, or an energon dataset made by data_tools")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("--model", help="model name (default: inferred from the checkpoint)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--trainable", choices=("all", "decoder", "encoder"), default="all")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--frames", type=int, default=17, help="frames per clip (1 + 8k)")
    parser.add_argument("--size", type=int, default=256, help="square crop size")
    parser.add_argument("--resize-short-side", type=int, help="resize frames before cropping")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--accelerator", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--perceptual-weight", type=float, help="default: 0.1 when VGG16 weights are found, else 0")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="held-out share when making shards")
    parser.add_argument("--eval-clips", type=int, default=32, help="held-out clips to evaluate")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="first try lr x (all, decoder, LoRA) for --sweep-steps each and keep the best",
    )
    parser.add_argument("--sweep-steps", type=int, default=50)
    parser.add_argument("--sweep-lrs", type=float, nargs="+", help="learning rates to try (default lr/3, lr, 3 lr)")
    parser.add_argument(
        "--max-latent-drift",
        type=float,
        default=0.05,
        help="sweep: only configurations whose latent drift (CV) or token flip rate (DV) stays under",
    )
    parser.set_defaults(func=run)
