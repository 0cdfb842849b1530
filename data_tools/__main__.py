"""Command line: ``python -m data_tools {make-shards,prepare,check} ...`` (run from the repository root)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from tokenizer_posttrain.core.errors import UserError

from .check import EXAMPLES, Findings, NoSamples, check_dataset, print_summary, write_report
from .make_shards import Options, UsageError, make_shards
from .prepare import PrepareError, find_shards, prepare_folder
from .sources import find_videos, parse_size

MAKE_HELP = """\
Pack a folder of videos into webdataset tar shards (OUT/000000.tar, ... with one <key>.mp4 per video) and
prepare OUT for megatron-energon (CrudeWebdataset, train/val split by whole shards).

SRC is searched recursively for .mp4 .mov .m4v .mkv .webm .avi (any case). mp4/mov/m4v files are copied byte
for byte; mkv/webm/avi (and everything with --transcode, or anything taller than --max-height) are re-encoded
to h264 yuv420p mp4 at CRF 18 (a keyframe every 16 frames, tuned for fast decoding) with the same frames and
frame rate. OUT also gets manifest.jsonl (one line per video: key, source, frames, fps, size, codec, shard,
split, bytes, sha1) and skipped.jsonl (unreadable files).

Re-running is safe: videos already in OUT/manifest.jsonl are not packed again, new ones go to new shards and
OUT is re-prepared; with nothing new it prints "up to date" and rewrites nothing.

With --val-fraction 0 the split has no val part, and energon's get_val_dataset(OUT) raises for it.
The packing options (--transcode, --max-height, --seed, --val-fraction) must stay the same across re-runs.

If SRC holds *.tar shards and no videos, make-shards SRC only prepares SRC in place (same as: prepare SRC).

Exit status: 0 ok; 1 when some videos could not be read (unless --allow-skips); 2 bad arguments or input."""

PREPARE_HELP = """\
Prepare an existing folder of webdataset tar shards for megatron-energon in place (writes DIR/.nv-meta and a
.tar.idx per shard, so DIR must be writable). Shards listed in a make-shards manifest.jsonl keep their split;
other shards are split whole by a hash of their name. Re-preparing a prepared folder overwrites its metadata."""

CHECK_HELP = """\
Probe every sample of DATA (a folder of tar shards, prepared or not, or a plain folder of videos) and report
what keeps it from giving a FRAMES x CROP x CROP clip: unreadable, no_video_stream, partial_video,
unsupported_rotation, too_few_frames, too_small (errors); low_resolution, variable_fps, odd_fps, duplicate
(warnings); damaged_shard (error) for a tar shard that is cut short or damaged, with how many of the
samples its energon index lists can still be read; and pickled_member (error) for a .pkl/.pickle/.pyd/.pth tar
member: training never reads it, but other webdataset readers unpickle it, running any code planted in it;
changed_shard (error) for a prepared shard replaced or rewritten since: its tar no longer holds the samples its
energon index lists (every tar header is compared with the index), so prepare it again. A prepared DATA whose
.nv-meta files are not what prepare writes (a dataset.yaml naming code energon would run, a FIFO) is refused
at once, as training refuses it (exit 1).

Probing reads every packet of a video and decodes from its last keyframe to the end: a file cut short (e.g. an
mp4 written with its index at the front) is reported as partial_video with "N of M frames readable". --deep
decodes every frame instead, which also finds damage in the middle of a file whose packets are all whole.

Videos with a display matrix (phone videos, stored sideways) are decoded upright, in training and by
reconstruct; sizes here are as displayed. A matrix that is not a multiple of 90 degrees is an error
(unsupported_rotation).

Prints a table per problem code and writes every problem as a json line to --report.
Exit status: 0 no errors (warnings allowed); 1 some sample has an error or a shard is damaged (0 with
--allow-skips), or a shard holds a pickled member or changed since it was prepared; 2 DATA missing or without
samples."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m data_tools`` argument parser."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m data_tools",
        description="Turn a folder of videos into a megatron-energon dataset, and check datasets before training.",
        formatter_class=fmt,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{make-shards,prepare,check}")

    make = sub.add_parser(
        "make-shards",
        help="pack videos into tar shards and prepare them for energon",
        description=MAKE_HELP,
        formatter_class=fmt,
    )
    make.add_argument("src", type=Path, metavar="SRC", help="folder of videos (or of *.tar shards to prepare)")
    make.add_argument("out", type=Path, metavar="OUT", nargs="?", help="output folder (omit when SRC holds shards)")
    make.add_argument(
        "--shard-size", metavar="SIZE", type=_size, default="1GB", help="max bytes per tar: 500MB, 1GB, 2GiB, 123456"
    )
    make.add_argument(
        "--val-fraction",
        metavar="F",
        type=_fraction,
        default=0.01,
        help="fraction of videos for val, by a hash of the key (default 0.01; 0 = no val split at all)",
    )
    make.add_argument(
        "--transcode", action="store_true", help="re-encode every video to h264 mp4, not only mkv/webm/avi"
    )
    make.add_argument(
        "--max-height", metavar="N", type=_positive, help="re-encode videos taller than N down to height N"
    )
    make.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the train/val hash (default 0)")
    make.add_argument("--allow-skips", action="store_true", help="exit 0 even when some videos could not be read")

    prep = sub.add_parser(
        "prepare",
        help="prepare an existing folder of tar shards for energon",
        description=PREPARE_HELP,
        formatter_class=fmt,
    )
    prep.add_argument("dir", type=Path, metavar="DIR", help="folder of *.tar shards (must be writable)")
    prep.add_argument(
        "--val-fraction", metavar="F", type=_fraction, default=0.01, help="fraction of shards for val (default 0.01)"
    )
    prep.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the train/val hash (default 0)")

    check = sub.add_parser(
        "check",
        help="probe every sample of a dataset for a clip shape and report problems",
        description=CHECK_HELP,
        formatter_class=fmt,
    )
    check.add_argument("data", type=Path, metavar="DATA", help="folder of tar shards or of videos")
    check.add_argument(
        "--frames", metavar="N", type=_positive, default=33, help="frames per training clip (default 33)"
    )
    check.add_argument(
        "--crop", metavar="PX", type=_positive, default=256, help="square crop side in pixels (default 256)"
    )
    check.add_argument(
        "--resize-short-side", metavar="PX", type=_positive, help="short side the trainer resizes frames to first"
    )
    check.add_argument(
        "--model",
        metavar="NAME",
        help="the model the clips are for (e.g. Cosmos-1.0-Tokenizer-CV8x8x8, Wan2.1-VAE): --frames and --crop are "
        "first checked against its clip rule (1 + 8k frames for the 8x Cosmos models, 1 + 4k for the 4x ones and "
        "the Wan2.1 VAE; a crop that is a multiple of its spatial compression)",
    )
    check.add_argument("--allow-skips", action="store_true", help="exit 0 even when samples have errors")
    check.add_argument(
        "--deep",
        action="store_true",
        help="decode every frame of every video (slower), to find damage in the middle of files whose "
        "packets are all whole; by default only the frames from the last keyframe on are decoded",
    )
    check.add_argument(
        "--report",
        metavar="PATH",
        type=Path,
        default=Path("check_report.jsonl"),
        help="where to write every problem as json lines (default ./check_report.jsonl)",
    )
    return parser


def _fail(message: str, status: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


def _prepare(root: Path, val_fraction: float, seed: int) -> int:
    splits = prepare_folder(root.resolve(), val_fraction, seed)
    print(f"prepared {root} for energon: train {len(splits['train'])} shards, val {len(splits['val'])} shards")
    return 0


def make_shards_command(src: Path, out: Path | None, opts: Options) -> int:
    """``make-shards SRC OUT`` as a function, for a caller in its own process (the posttrain workflow): prints what
    the command prints and returns its exit status, bad input as one ``error:`` line on stderr as the command
    line gives it (``opts.val_fraction`` is checked here, as the command line's parser checks it)."""
    if not 0 <= opts.val_fraction < 1:
        return _fail(f"argument --val-fraction: must be in [0, 1), got {opts.val_fraction}")
    return _guarded(lambda: _make_shards(src, out, opts))


def _make_shards(src: Path, out: Path | None, opts: Options) -> int:
    if not src.is_dir():
        return _fail(f"SRC {src} is not a folder; give the folder that holds your videos")
    has_videos = bool(find_videos(src))
    if not has_videos and not find_shards(src):
        return _fail(f"no videos in {src} (looked recursively for .mp4 .mov .m4v .mkv .webm .avi)")
    if not has_videos:
        if out is not None and out.resolve() != src.resolve():
            return _fail(
                f"{src} holds tar shards, not videos; prepare it in place with: python -m data_tools prepare {src}"
            )
        return _prepare(src, opts.val_fraction, opts.seed)
    if out is None:
        return _fail("OUT is required when SRC holds videos: python -m data_tools make-shards SRC OUT")
    return make_shards(src, out, opts)


def _check(args: argparse.Namespace) -> int:
    if args.model is not None:
        from tokenizer_posttrain.network import get_config

        try:
            config = get_config(args.model)
        except ValueError as err:
            return _fail(f"--model: {err}")
        problems = config.clip_problems(args.frames, args.crop, args.crop, ("--frames", "--crop", "--crop"))
        if problems:
            return _fail(f"the clips do not fit {config.full_name}: {'; '.join(dict.fromkeys(problems))}")
    console = Console(width=None if sys.stdout.isatty() else 160)  # logs are read later; keep rows unwrapped
    found = check_dataset(args.data, args.frames, args.crop, args.resize_short_side, deep=args.deep)
    try:
        write_report(found, args.report)
    except OSError as err:
        return _fail(
            f"cannot write the report to {args.report} ({err.strerror}); pass --report PATH somewhere writable"
        )
    print_summary(found, console, args.report)
    status = _skips_status(found, args, console)
    if found.pickled:
        # Not a sample training skips, so --allow-skips does not cover it: other readers would run the code.
        console.print(
            f"[red]error:[/] {len(found.pickled)} tar members are pickles (see the report): training never reads "
            "them, other webdataset readers would run them; remove them from the shards"
        )
        status = 1
    if found.changed:
        names = ", ".join(shard for shard, _ in found.changed[:EXAMPLES])
        folder = args.data.parent if args.data.is_file() else args.data
        console.print(
            f"[red]error:[/] {len(found.changed)} tar shards changed since they were prepared ({names}): training "
            f"refuses them; run python -m data_tools prepare {folder} again (see the report)"
        )
        status = 1
    return status


def _skips_status(found: Findings, args: argparse.Namespace, console: Console) -> int:
    """Exit status for the samples training would skip (errors, damaged shards), with its summary line."""
    bad = found.bad_samples("error")
    if not bad and not found.damaged:
        return 0
    lost = f" and {len(found.damaged)} tar shards are damaged" if found.damaged else ""
    if args.allow_skips:
        console.print(f"[yellow]warning:[/] {len(bad)} samples cannot give the clip{lost}; --allow-skips given, exit 0")
        return 0
    console.print(
        f"[red]error:[/] {len(bad)} of {found.samples} samples cannot give a {args.frames}x{args.crop}x{args.crop} "
        f"clip{lost}; fix or remove them (see the report), or pass --allow-skips to let training skip them"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "make-shards":
        opts = Options(args.shard_size, args.val_fraction, args.transcode, args.max_height, args.seed, args.allow_skips)
        return make_shards_command(args.src, args.out, opts)
    if args.command == "prepare":
        return _guarded(lambda: _prepare_command(args.dir, args.val_fraction, args.seed))
    return _guarded(lambda: _check(args))


def _prepare_command(folder: Path, val_fraction: float, seed: int) -> int:
    if not folder.is_dir() or not find_shards(folder):
        return _fail(f"DIR {folder} is not a folder of *.tar shards (for videos use make-shards SRC OUT)")
    return _prepare(folder, val_fraction, seed)


def _guarded(command: Callable[[], int]) -> int:
    """``command``'s exit status, with the errors a user can fix said in one ``error:`` line (no traceback)."""
    try:
        return command()
    except (UsageError, NoSamples) as err:
        return _fail(str(err))
    except PrepareError as err:
        return _fail(str(err), 1)
    except UserError as err:  # bad input found on the way (e.g. a manifest line), one line like the trainer's
        return _fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted; re-run the same command to continue where it stopped", 130)


if __name__ == "__main__":
    sys.exit(main())
