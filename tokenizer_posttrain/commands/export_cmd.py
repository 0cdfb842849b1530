"""``export``: a training checkpoint -> the official file set and/or a diffusers folder, plus a model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..core.errors import CommandError
from ..evaluation.latent_shift import shift_from_base, shift_line, shift_markdown
from ..evaluation.latent_stats import STATS_CLIPS, LatentStats
from ..evaluation.report import card_sections, drift_warning, verdict
from ..io.checkpoint import load_tokenizer, read_checkpoint
from ..io.export import refuse_non_finite
from ..io.formats import (
    FORMATS,
    ExportFormat,
    check_formats,
    formats_help,
    formats_metavar,
    native_format,
    placements,
)
from ..io.formats import parse_formats as _parse_formats
from ..io.model_card import checkpoint_card
from ..network import VideoTokenizer
from ..network.family import NetworkConfig
from .guard import run_guarded


def parse_formats(value: str) -> tuple[str, ...]:
    """``--format``: ``cosmos``, ``diffusers`` or both (any format of :data:`~..io.formats.FORMATS`),
    comma-separated, in any order."""
    try:
        return _parse_formats(value)
    except ValueError as error:  # argparse shows an ArgumentTypeError's own message, not "invalid value"
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    """Export the checkpoint of parsed ``args``; the exit code."""
    return run_guarded(lambda: _export(args))


def _check(network: VideoTokenizer, args: argparse.Namespace, out: Path, kept: LatentStats | None) -> None:
    """Every refusal, before anything is written (or the latent statistics are computed). ``kept``: the base's
    constants a decoder-only run keeps (:func:`_kept_stats`), which a format that needs statistics can take."""
    refuse_non_finite(network, out)
    check_formats(args.format, network.config)  # ExportError: a format its family lacks, or one that refuses it
    for fmt, subfolder in placements(args.format):
        if fmt.needs_stats and not args.latent_stats and kept is None:
            raise CommandError(f"--format {fmt.name} needs --latent-stats DATA: {fmt.needs_stats}")
        if not subfolder:
            _refuse_overwriting(fmt, args.format, out)
    if args.latent_stats and network.is_discrete:
        raise CommandError(
            f"--latent-stats: {network.config.name} is a discrete tokenizer; world models read its token indices, "
            "which have no latent statistics (leave out --latent-stats)"
        )
    if args.stats_clips < 1 or args.stats_batch_size < 1 or (args.stats_workers or 0) < 0:
        raise CommandError("--stats-clips and --stats-batch-size must be positive, --stats-workers at least 0")


def _refuse_overwriting(fmt: ExportFormat, chosen: tuple[str, ...], out: Path) -> None:
    """A :class:`CommandError` when ``out``, which ``fmt`` writes into, holds a format not ``chosen`` that shares
    a file with it (that file would be replaced, leaving a folder of neither format)."""
    for other in FORMATS.values():
        shared = next((name for name in fmt.files if name in other.files), None)
        if other.name in chosen or shared is None or not other.found_in(out):
            continue
        message = f"{out} holds a {other.what}, whose {shared} --format {fmt.name} would replace"
        if fmt.subfolder:  # both fit: this format then goes into its subfolder
            both = ",".join(_parse_formats((other.name, fmt.name)))
            message += f": use --format {both} (the {fmt.what} goes to {out / fmt.subfolder}) or another --out"
        raise CommandError(message)


def _export(args: argparse.Namespace) -> int:
    checkpoint, out = Path(args.checkpoint), Path(args.out)
    network = load_tokenizer(checkpoint, ema=args.ema)
    config = network.config
    native = native_format(config).name
    args.format = args.format or (native,)  # the model family's own format
    model = _run_model(checkpoint)
    kept = _kept_stats(model, network)
    _check(network, args, out, kept)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    stats = _latent_stats(network, args) if args.latent_stats else None
    shift = shift_from_base(stats, config, model.get("jit_ckpt_pth")) if stats is not None else None
    if shift is not None:
        print(shift_line(shift), flush=True)
    files: list[str] = []
    carried: list[Path] = []
    for fmt, subfolder in placements(args.format):
        prefix = f"{subfolder}/" if subfolder else ""
        files += [prefix + name for name in fmt.write(network, out / subfolder, stats or kept, dtype)]
        if not fmt.stats_beside:
            continue
        if stats is not None:
            files += [prefix + p.name for p in stats.write(out / subfolder)]
        elif not network.is_discrete:
            carried = _carried_stats(model, config, out / subfolder)
            files += [prefix + p.name for p in carried]
    results_path = Path(args.results) if args.results else checkpoint.parent.parent / "eval" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else None
    judged = verdict(results) if results else None
    sections = card_sections(results) if results else []
    if shift is not None and not (results or {}).get("latent_stats_shift"):
        sections += shift_markdown(shift)
    card = checkpoint_card(
        checkpoint,
        network.config.full_name,
        results,
        args.ema,
        verdict=judged.line if judged else None,
        formats=args.format,
        sections=sections or None,
        channels=network.config.channels,
        drift=drift_warning(results) if results else None,
        latent_stats=_stats_line(network, stats, kept, carried, args.latent_stats),
    )
    (out / "README.md").write_text(card)
    print(f"exported {network.config.full_name} to {out} ({', '.join([*files, 'README.md'])})")
    return 0


def _run_model(checkpoint: Path) -> dict:
    """The ``model`` settings of the run a training checkpoint comes from (empty for other files)."""
    if checkpoint.suffix != ".ckpt":
        return {}
    return (read_checkpoint(checkpoint, mmap=True).get("hyper_parameters") or {}).get("model") or {}


def _kept_stats(model: dict, network: VideoTokenizer) -> LatentStats | None:
    """The base's hard-coded constants, when the checkpoint's run trained only the decoder of a family that has
    them: still exact (the latents did not move), and what a diffusers config then holds."""
    from ..evaluation.latent_stats import base_latent_stats, kept_base_stats

    if kept_base_stats(model.get("trainable", "all"), network.config) is None:
        return None
    return base_latent_stats(network.config)


def _carried_stats(model: dict, config: NetworkConfig, out: Path) -> list[Path]:
    """The base's statistics files, copied when the checkpoint's run trained only the decoder (latents
    unchanged)."""
    from ..evaluation.latent_stats import carry_base_stats

    return carry_base_stats(model.get("trainable", "all"), model.get("jit_ckpt_pth"), out, config)


def _stats_line(
    network: VideoTokenizer, stats: LatentStats | None, kept: LatentStats | None, carried: list[Path], data: str | None
) -> str | None:
    """The model card's row on the latent statistics (None for a discrete tokenizer)."""
    from ..evaluation.latent_stats import files_note, kept_base_stats

    if network.is_discrete:
        return None
    if stats is not None:
        return f"measured on {stats.clips} clips of `{data}`; {files_note(network.config)}"
    if carried:
        return f"{', '.join(f'`{p.name}`' for p in carried)} copied from the base (the encoder did not train)"
    if kept is not None:
        return kept_base_stats("decoder", network.config)
    return "none written (export --latent-stats DATA computes them)"


def _latent_stats(network: VideoTokenizer, args: argparse.Namespace) -> LatentStats:
    from ..evaluation.latent_stats import dataset_latent_stats, default_stats_workers
    from ..training.acceleration import fast_encoder

    return dataset_latent_stats(
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


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write encoder.jit/decoder.jit/autoencoder.jit and/or a diffusers folder, and a model card",
        description=__doc__,
    )
    parser.add_argument("--checkpoint", required=True, help="RUN/checkpoints/last.ckpt, or any loadable checkpoint")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument(
        "--format",
        type=parse_formats,
        default=None,
        metavar=formats_metavar(),
        help=formats_help(),
    )
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (runs with model.ema_decay)")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="weights of the .jit files and the diffusers folder (the official release is bf16)",
    )
    parser.add_argument(
        "--results",
        help="results.json of an evaluation to put in the model card (default: RUN/eval/results.json when it exists)",
    )
    parser.add_argument(
        "--latent-stats",
        metavar="DATA",
        help="energon dataset to compute the latent statistics from: Cosmos CV mean_std.pt and image_mean_std.pt, "
        "the Wan2.1 VAE Cosmos-Predict2.5's video_mean_std.pt and images_mean_std.pt (relative to its hard-coded "
        "constants, whose shift is printed and put in the model card); with --format diffusers its "
        "latents_mean/latents_std; continuous tokenizers only (a decoder-only Wan run keeps the base's constants)",
    )
    parser.add_argument(
        "--stats-clips", type=int, default=STATS_CLIPS, help="clips encoded for the latent statistics (passes repeat)"
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
