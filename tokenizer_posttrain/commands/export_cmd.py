"""``export``: a training checkpoint -> the official file set plus a model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..evaluation.report import verdict
from ..io.checkpoint import load_tokenizer
from ..io.export import export_tokenizer
from ..io.model_card import checkpoint_card
from .guard import run_guarded


def run(args: argparse.Namespace) -> int:
    """Export the checkpoint of parsed ``args``; the exit code."""
    return run_guarded(lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    checkpoint = Path(args.checkpoint)
    network = load_tokenizer(checkpoint, ema=args.ema)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out = export_tokenizer(network, args.out, dtype=dtype)
    results_path = Path(args.results) if args.results else checkpoint.parent.parent / "eval" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else None
    judged = verdict(results) if results else None
    card = checkpoint_card(
        checkpoint, network.config.full_name, results, args.ema, verdict=judged.line if judged else None
    )
    (out / "README.md").write_text(card)
    print(
        f"exported {network.config.full_name} to {out} (encoder.jit, decoder.jit, autoencoder.jit, "
        "model.safetensors, config.json, README.md)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write encoder.jit/decoder.jit/autoencoder.jit and a model card", description=__doc__
    )
    parser.add_argument("--checkpoint", required=True, help="RUN/checkpoints/last.ckpt, or any loadable checkpoint")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (runs with model.ema_decay)")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="weights of the .jit files (the official release is bf16)",
    )
    parser.add_argument(
        "--results",
        help="results.json of an evaluation to put in the model card (default: RUN/eval/results.json when it exists)",
    )
    parser.set_defaults(func=run)
