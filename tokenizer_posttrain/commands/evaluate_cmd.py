"""evaluate: metrics of a tokenizer on held-out clips, before/after against a baseline, with a report.

Clips are the middle frames and the centre crop of each video of an energon dataset (its val split, else its train
split), then, while --max-clips wants more, random starts and crops drawn from fixed seeds (up to --clips-per-video
per video), so the model and the baseline see the same pixels and reruns give the same numbers. With a baseline, the
verdict is better, worse, inconclusive (fewer than 8 clips, or a change within the clips' spread) or drifted (the
latent drift or token flip rate over --max-drift, PSNR not worse).
Writes OUT/results.json, OUT/report.md, PSNR and error plots, and side-by-side mp4s of the best and worst clips.

Exit codes: 0 done; 1 failed (one error: line); 2 a bad command line; 3 done, but worse than the baseline; 4 done,
but drifted from the baseline (every file written in both cases).
"""

from __future__ import annotations

import argparse

from ..data.batch import CLIP_FRAMES, CLIP_SIZE
from ..evaluation.evaluate import EVAL_CLIPS_PER_VIDEO, NOISE_LEVELS
from ..evaluation.report import LATENT_DRIFT_LIMIT, MIN_VERDICT_CLIPS
from .guard import run_guarded


def run(args: argparse.Namespace) -> int:
    """Run the evaluation of parsed ``args``; prints the summary table and where the report is. Exit code."""
    return run_guarded(lambda: _evaluate(args))


def _evaluate(args: argparse.Namespace) -> int:
    from ..evaluation.evaluate import evaluate
    from ..evaluation.report import drift_warning, exit_code, format_table, verdict

    results = evaluate(
        checkpoint=args.checkpoint,
        data=args.data,
        out_dir=args.out,
        baseline=args.baseline,
        frames=args.frames,
        size=args.size,
        resize_short_side=args.resize_short_side,
        max_clips=args.max_clips,
        device=args.device,
        dtype=args.dtype,
        videos_per_side=args.videos_per_side,
        vgg_weights=args.vgg_weights,
        clips_per_video=args.clips_per_video,
        drift_limit=args.max_drift,
        noise_levels=args.noise_levels,
    )
    data = results["data"]
    clips, videos = results["n_clips"], results["n_videos"]
    counted = f"{clips} clip{'s' if clips != 1 else ''} of {videos} video{'s' if videos != 1 else ''}"
    print(f"{counted} of {data['path']} ({data['source']})")
    print(format_table(results))
    judged = verdict(results)
    if judged is not None:
        print(f"post-trained tokenizer: {judged.line}")
        if judged.word == "inconclusive" and judged.clips < MIN_VERDICT_CLIPS:
            print(f"for a verdict: at least {MIN_VERDICT_CLIPS} clips (--max-clips; up to --clips-per-video per video)")
    drift = drift_warning(results)
    if drift and (judged is None or judged.word != "drifted"):  # a drifted verdict says it already
        print(f"warning: {drift} (--max-drift sets the limit)")
    if results["skipped"]:
        print(f"skipped {len(results['skipped'])} videos (listed in the report)")
    print(f"report: {args.out.rstrip('/')}/report.md")
    # A finished evaluation whose model is worse or drifted: its own exit code, for scripts (the files are written).
    return exit_code(judged)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``evaluate`` subcommand (dispatch: ``args.func(args)``)."""
    parser = subparsers.add_parser(
        "evaluate", help="metrics and a report on held-out clips, against a baseline", description=__doc__
    )
    parser.add_argument(
        "--checkpoint", required=True, help="the model to evaluate: run checkpoint (.ckpt), export or .jit folder"
    )
    parser.add_argument(
        "--data", required=True, help="energon dataset from data_tools make-shards (val split, else train)"
    )
    parser.add_argument("--baseline", help="the tokenizer before post-training (e.g. the official .jit folder)")
    parser.add_argument("--out", default="./eval", help="output folder (default: ./eval)")
    parser.add_argument(
        "--frames",
        type=_positive,
        default=CLIP_FRAMES,
        help=f"frames per clip, 1 + 8k for 8x models (default: {CLIP_FRAMES}, as training)",
    )
    parser.add_argument(
        "--size",
        type=_positive,
        default=CLIP_SIZE,
        help=f"centre crop side, multiple of the spatial compression (default: {CLIP_SIZE}, as training)",
    )
    parser.add_argument(
        "--resize-short-side", type=_positive, default=None, help="resize frames to this short side before cropping"
    )
    parser.add_argument("--max-clips", type=_positive, default=64, help="evaluate at most this many clips (64)")
    parser.add_argument(
        "--clips-per-video",
        type=_positive,
        default=EVAL_CLIPS_PER_VIDEO,
        help=f"clips at most from one video: the centred one, then random starts and crops ({EVAL_CLIPS_PER_VIDEO})",
    )
    parser.add_argument(
        "--max-drift",
        "--max-latent-drift",  # its earlier name
        dest="max_drift",
        type=float,
        default=LATENT_DRIFT_LIMIT,
        help="verdict drifted (exit code 4) when the latent drift (continuous models) or token flip rate (DV) "
        f"against the baseline is above this ({LATENT_DRIFT_LIMIT}; --max-latent-drift is its earlier name)",
    )
    parser.add_argument(
        "--noise-levels",
        type=float,
        nargs="*",
        default=list(NOISE_LEVELS),
        metavar="LEVEL",
        help="continuous models: PSNR also of latents plus Gaussian noise of these levels x each channel's spread "
        f"(default: {' '.join(f'{lv:g}' for lv in NOISE_LEVELS)}; none given: not measured)",
    )
    parser.add_argument("--videos-per-side", type=int, default=2, help="best and worst clips written as mp4 (2)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="network precision (fp32)")
    parser.add_argument("--vgg-weights", help="VGG16 file for the perceptual distance (default: torch hub cache)")
    parser.set_defaults(func=run)
