"""``export``: a training checkpoint -> the official file set plus a model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..core.errors import CommandError
from ..evaluation.report import card_sections, verdict
from ..io.checkpoint import load_tokenizer
from ..io.export import export_tokenizer
from ..io.model_card import checkpoint_card
from ..network.tokenizer import CausalVideoTokenizer
from .guard import run_guarded


def run(args: argparse.Namespace) -> int:
    """Export the checkpoint of parsed ``args``; the exit code."""
    return run_guarded(lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    checkpoint = Path(args.checkpoint)
    network = load_tokenizer(checkpoint, ema=args.ema)
    if args.latent_stats and network.is_discrete:  # before anything is written
        raise CommandError(
            f"--latent-stats: {network.config.name} is a discrete tokenizer; world models read its token indices, "
            "which have no latent statistics (leave out --latent-stats)"
        )
    if args.stats_clips < 1 or args.stats_batch_size < 1 or (args.stats_workers or 0) < 0:
        raise CommandError("--stats-clips and --stats-batch-size must be positive, --stats-workers at least 0")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out = export_tokenizer(network, args.out, dtype=dtype)
    results_path = Path(args.results) if args.results else checkpoint.parent.parent / "eval" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else None
    judged = verdict(results) if results else None
    card = checkpoint_card(
        checkpoint,
        network.config.full_name,
        results,
        args.ema,
        verdict=judged.line if judged else None,
        sections=card_sections(results) if results else None,
    )
    (out / "README.md").write_text(card)
    files = "encoder.jit, decoder.jit, autoencoder.jit, model.safetensors, config.json, README.md"
    if args.latent_stats:
        files += ", " + ", ".join(p.name for p in _write_latent_stats(network, out, args))
    print(f"exported {network.config.full_name} to {out} ({files})")
    return 0


def _write_latent_stats(network: CausalVideoTokenizer, out: Path, args: argparse.Namespace) -> list[Path]:
    from ..evaluation.latent_stats import dataset_latent_stats, default_stats_workers
    from ..training.acceleration import fast_encoder

    stats = dataset_latent_stats(
        network,
        args.latent_stats,
        args.stats_clips,
        args.stats_size,
        frames=args.stats_frames,
        resize_short_side=args.stats_resize_short_side,
        batch_size=args.stats_batch_size,
        workers=args.stats_workers if args.stats_workers is not None else default_stats_workers(),
        accelerate=fast_encoder,
        seed=args.stats_seed,
    )
    return stats.write(out)


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
    parser.add_argument(
        "--latent-stats",
        metavar="DATA",
        help="energon dataset to compute the latent statistics (mean_std.pt, image_mean_std.pt) from; CV only",
    )
    parser.add_argument(
        "--stats-clips", type=int, default=200, help="clips encoded for the latent statistics (passes repeat)"
    )
    parser.add_argument(
        "--stats-seed", type=int, default=0, help="seed of the clips' random starts and crops (passes repeat)"
    )
    parser.add_argument(
        "--stats-frames", type=int, default=121, help="frames per clip (121: the chunk the world models encode)"
    )
    parser.add_argument("--stats-size", type=int, default=256, help="crop of the clips (the training crop)")
    parser.add_argument("--stats-resize-short-side", type=int, help="resize frames to this short side before the crop")
    parser.add_argument("--stats-batch-size", type=int, default=1, help="clips encoded at once")
    parser.add_argument(
        "--stats-workers",
        type=int,
        help="video decoding processes (0: in this one; default: up to 8 with a GPU, else 0)",
    )
    parser.set_defaults(func=run)
