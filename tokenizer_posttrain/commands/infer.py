"""``reconstruct``, ``encode``, ``decode``: run a tokenizer over whole video files.

Video in and out goes through PyAV. ``reconstruct`` and ``decode`` write h264 with the
input's frame rate and its exact size: yuv420p (plays everywhere) when width and height
are even, yuv444p otherwise (4:2:0 cannot store odd sizes; 4:4:4 keeps every pixel).
Latents are safetensors files: ``latent`` (CV) or ``indices`` (DV) with the metadata
tensors of :func:`tokenizer_posttrain.evaluation.inference.encode`, and the model name and frame rate
in the file's metadata.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..core.errors import CommandError
from ..core.files import atomic_path
from ..core.progress import progress
from ..core.untrusted import special_file
from ..data.orientation import Orientation, UnsupportedOrientation, frame_orientation
from ..data.probe import index_sizes, is_cut_off
from ..evaluation import inference
from ..io.checkpoint import MODEL_FLAG, load_tokenizer
from ..network import VideoTokenizer, resolve_name
from .guard import run_guarded

FORMAT = "tokenizer_posttrain.latents/1"
"""Written into the metadata of every latents file."""
DEFAULT_FPS = Fraction(24)
OOM_HINT = "pass --tile 256 (or smaller) and/or a smaller --window, or --dtype bf16"


# -- files --------------------------------------------------------------------------------


def _existing(path: str, what: str, folder_too: bool = False) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise CommandError(f"{what} {p} does not exist")
    special = None if folder_too and p.is_dir() else special_file(p)
    if special is not None:  # a FIFO would block the read until something writes into it
        raise CommandError(f"{what} {p} is {special}, not a file; give the path of the file itself")
    return p


@dataclass(frozen=True)
class InputVideo:
    """What :func:`read_video` decoded: upright frames, their rate, and what was turned or missing."""

    frames: np.ndarray
    """uint8 ``[T, H, W, 3]`` RGB, as displayed (the display matrix applied)."""
    fps: Fraction
    orientation: Orientation
    promised: int
    """Frames the file's header promises (0: it states none)."""
    damage: str
    """Why not every frame could be read (only with ``allow_partial``); empty for a whole file."""

    def note(self) -> str:
        """What a command should say about the input besides its size: turned, partial, or nothing."""
        notes = []
        if not self.orientation.is_identity:
            notes.append(f"display matrix applied: {self.orientation.describe()}")
        if self.damage:
            of = f" of {self.promised}" if self.promised else ""
            notes.append(f"partial input: {len(self.frames)}{of} frames, {self.damage}")
        return f" ({'; '.join(notes)})" if notes else ""


def read_video(path: Path, allow_partial: bool = False) -> InputVideo:
    """All frames of the first video stream, upright, and the frame rate.

    A file cut short or damaged (fewer whole frames than its header promises, a cut-off packet, a frame
    that does not decode) raises :class:`CommandError` saying how many frames are readable, unless
    ``allow_partial``: then the frames before the damage are returned, with a warning on stderr.
    """
    if not path.is_file():
        raise CommandError(f"input video {path} is not a file")
    frames: list[np.ndarray] = []
    size: tuple[int, int] | None = None
    turn: Orientation | None = None

    def keep(frame: av.VideoFrame) -> None:
        nonlocal size, turn
        if turn is None:
            try:
                turn = frame_orientation(frame)
            except UnsupportedOrientation as err:
                raise CommandError(f"{path}: {err}") from None
        size = size or (frame.width, frame.height)
        # A stream may change size midway; keep the first size so the frames stack.
        frames.append(turn.apply_numpy(frame.to_ndarray(format="rgb24", width=size[0], height=size[1])))

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise CommandError(f"{path} has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            promised, sizes = max(0, stream.frames), index_sizes(stream)
            packets, damage = 0, ""
            try:
                for packet in container.demux(stream):
                    if packet.size == 0:
                        continue
                    if is_cut_off(packet, packets, sizes):
                        damage = f"the file ends inside frame {packets + 1}"
                        break
                    packets += 1
                    for frame in stream.decode(packet):
                        keep(frame)
            except av.FFmpegError as err:
                if not frames:
                    raise
                damage = f"frame {len(frames) + 1} does not decode ({err})"
            try:
                for frame in stream.decode(None):  # the frames still inside the decoder
                    keep(frame)
            except av.FFmpegError:
                damage = damage or f"frame {len(frames) + 1} does not decode"
            if not damage and promised and packets < promised:
                damage = f"the file ends after frame {packets}"
    except av.FFmpegError as err:
        raise CommandError(f"cannot read video {path}: {err}") from err
    if not frames:
        raise CommandError(f"{path} holds no decodable video frames")
    if damage:
        of = f" of {promised}" if promised else ""
        message = f"{path}: only {len(frames)}{of} frames are readable ({damage})"
        if not allow_partial:
            raise CommandError(f"{message}; pass --allow-partial to use those frames, or re-encode the file")
        print(f"warning: {message}; --allow-partial: using those {len(frames)} frames", file=sys.stderr, flush=True)
    fps = Fraction(rate) if rate else DEFAULT_FPS
    return InputVideo(np.stack(frames), fps, turn or Orientation(), promised, damage)


def write_video(path: Path, frames: np.ndarray, fps: Fraction, crf: int = 18) -> None:
    """Write uint8 ``[T, H, W, 3]`` frames as h264 at exactly their size (see module docstring)."""
    height, width = frames.shape[1:3]
    pix_fmt = "yuv420p" if height % 2 == 0 and width % 2 == 0 else "yuv444p"
    # Written under a temporary name (with the suffix PyAV picks the format from), so a failure never leaves
    # a truncated file under the real one.
    try:
        with atomic_path(path, keep_suffix=True) as tmp, av.open(str(tmp), mode="w") as container:
            stream = container.add_stream("libx264", rate=fps.limit_denominator(1001))
            stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
            stream.options = {"crf": str(crf)}
            for image in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")))
            container.mux(stream.encode())
    except (av.FFmpegError, ValueError) as err:
        raise CommandError(f"cannot write video {path}: {err}") from err


def save_latents(path: Path, encoded: dict[str, torch.Tensor], model: str, fps: Fraction, source: Path) -> None:
    meta = {"format": FORMAT, "model": model, "fps": str(fps), "source": str(source)}
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in encoded.items()}, str(tmp), metadata=meta)


def load_latents(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CommandError(f"cannot read latents {path}: {err}") from err
    if meta.get("format") != FORMAT:
        raise CommandError(f"{path} was not written by `encode` (no {FORMAT!r} in its metadata)")
    return tensors, meta


# -- shared options -------------------------------------------------------------------------


def _setup(args: argparse.Namespace, encoding: bool) -> tuple[VideoTokenizer, inference.Options]:
    """Load the network and check every option, before any long work; returns (network, options) with the
    context resolved."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda was given but no CUDA GPU is available (use --device cpu)")
    dtype = inference.DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    network = load_tokenizer(
        _existing(args.checkpoint, "checkpoint", folder_too=True), name=args.model, setting_names=MODEL_FLAG
    )
    # decode checks only the tiles here: its window and context come from the latents file.
    if getattr(args, "window", None) is None and hasattr(args, "window"):
        args.window = inference.default_window(network)
    window, context = getattr(args, "window", 17), getattr(args, "context", None)
    options = inference.Options(
        window,
        context,
        tile=args.tile,
        tile_overlap=args.tile_overlap,
        dtype=dtype,
        device=device,
        time_chunk=args.time_chunk,
    )
    context = inference.check_options(network, options, encoding)
    if hasattr(args, "window"):
        args.context = context
    return network, replace(options, context=context)


def _decode_options(options: inference.Options) -> dict[str, object]:
    """The keyword arguments of :func:`~tokenizer_posttrain.evaluation.inference.decode` among ``options``
    (the window and context are the latents file's)."""
    return {
        "dtype": options.dtype,
        "device": options.device,
        "tile": options.tile,
        "tile_overlap": options.tile_overlap,
        "time_chunk": options.time_chunk,
    }


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _describe(frames: np.ndarray, fps: Fraction) -> str:
    t, h, w = frames.shape[:3]
    return f"{t} frames {w}x{h} at {float(fps):.4g} fps"


# -- commands -------------------------------------------------------------------------------


def _reconstruct(args: argparse.Namespace) -> int:
    source = _existing(args.input, "input video")
    network, options = _setup(args, encoding=False)
    read = read_video(source, args.allow_partial)
    video, fps = read.frames, read.fps
    start = time.perf_counter()
    if args.save_latents:
        # Reconstruct through the saved latents, so that the file and the video agree exactly.
        with progress("encode", len(video), "frames") as shown:
            encoded = inference.encode(network, torch.from_numpy(video), options, on_window=shown.update)
        save_latents(Path(args.save_latents), encoded, network.config.full_name, fps, source)
        with progress("decode", len(video), "frames") as shown:
            output = inference.decode(network, encoded, **_decode_options(options), on_window=shown.update).numpy()
    else:
        with progress("reconstruct", len(video), "frames") as shown:
            output = inference.reconstruct(network, torch.from_numpy(video), options, on_window=shown.update)
        output = output.numpy()
    seconds = time.perf_counter() - start
    write_video(Path(args.output), output, fps, args.crf)
    windows = "one causal pass" if args.window == 0 else f"window {args.window}, context {args.context}"
    print(
        f"reconstructed {_describe(video, fps)}{read.note()} with {network.config.name} ({windows}) "
        f"in {seconds:.1f} s, PSNR {_psnr(video, output):.2f} dB -> {args.output}"
        + (f" (latents: {args.save_latents})" if args.save_latents else "")
    )
    return 0


def _encode(args: argparse.Namespace) -> int:
    source = _existing(args.input, "input video")
    network, options = _setup(args, encoding=True)
    read = read_video(source, args.allow_partial)
    video, fps = read.frames, read.fps
    with progress("encode", len(video), "frames") as shown:
        encoded = inference.encode(network, torch.from_numpy(video), options, on_window=shown.update)
    save_latents(Path(args.output), encoded, network.config.full_name, fps, source)
    key = "indices" if network.config.is_discrete else "latent"
    print(
        f"encoded {_describe(video, fps)}{read.note()} with {network.config.name}: {key} "
        f"{tuple(encoded[key].shape)} {str(encoded[key].dtype).removeprefix('torch.')} -> {args.output}"
    )
    return 0


def _frame_count(encoded: dict[str, torch.Tensor]) -> int | None:
    """The frames a latents file decodes to, for the progress; None where the file does not say (``decode``
    itself then says what is wrong)."""
    try:
        return int(encoded["frames"])
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None


def _decode(args: argparse.Namespace) -> int:
    encoded, meta = load_latents(_existing(args.input, "latents file"))
    network, options = _setup(args, encoding=True)
    if meta.get("model") and resolve_name(meta["model"]) != network.config.name:
        raise CommandError(
            f"{args.input} holds {meta['model']} latents, but the checkpoint is {network.config.full_name}"
        )
    with progress("decode", _frame_count(encoded), "frames") as shown:
        output = inference.decode(network, encoded, **_decode_options(options), on_window=shown.update).numpy()
    fps = args.fps or Fraction(meta.get("fps") or DEFAULT_FPS)
    write_video(Path(args.output), output, fps, args.crf)
    print(f"decoded {_describe(output, fps)} with {network.config.name} -> {args.output}")
    return 0


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``command`` with the failure handling every command shares (:func:`.guard.run_guarded`)."""

    def run(args: argparse.Namespace) -> int:
        return run_guarded(lambda: command(args), oom_hint=OOM_HINT)

    return run


def _fps(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a frame rate (e.g. 30 or 30000/1001)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive frame rate")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _common(parser: argparse.ArgumentParser, output_help: str, video_out: bool) -> None:
    parser.add_argument("--checkpoint", required=True, help="model folder, .jit, .safetensors or training .ckpt")
    parser.add_argument("--output", required=True, help=output_help)
    parser.add_argument("--model", help="model name (e.g. CV8x8x8) when it cannot be inferred from the checkpoint")
    parser.add_argument("--tile", type=_count, help="process frames in tiles of this many pixels (memory)")
    parser.add_argument("--tile-overlap", type=_count, default=32, help="overlap of the tiles (default 32)")
    parser.add_argument(
        "--time-chunk",
        type=_count,
        help="Wan VAEs: latent frames per chunk of the causal pass (same result, memory; default "
        f"{inference.INFERENCE_TIME_CHUNK}; 0 = the whole window at once)",
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="compute dtype (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    if video_out:
        parser.add_argument("--crf", type=_count, default=18, help="h264 quality, lower is better (default 18)")


def _windowing(parser: argparse.ArgumentParser, context_help: str) -> None:
    parser.add_argument(
        "--window",
        type=_count,
        help="frames per window, 1+tc*k; 0 = the whole video in one causal pass (default: 17, the whole video for "
        "the Wan VAEs, as their own code runs)",
    )
    parser.add_argument("--context", type=_count, help=context_help)


def _partial(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help="when the input is cut short or damaged, use the frames before the damage (with a warning) instead "
        "of failing",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``reconstruct``, ``encode`` and ``decode`` subcommands."""
    p = subparsers.add_parser(
        "reconstruct",
        help="video -> tokenizer -> video (any length and size)",
        description="Reconstruct a video through the tokenizer, window by window, and write it as h264 "
        "(same frame count, size and frame rate as the input). Prints the PSNR. A display matrix (phone "
        "videos) is applied: the output is upright, at the size the input is shown at. An input cut short or "
        "damaged fails, naming how many of its frames are readable, unless --allow-partial.",
    )
    p.add_argument("--input", required=True, help="input video (mp4, mov, mkv, webm, ...)")
    _common(p, "output video (.mp4)", video_out=True)
    _windowing(
        p,
        "frames re-read before each later window as causal warm-up: 0 or 1+8m "
        "(default about half the window: 9 for 17, 17 for 33; 0 = independent windows)",
    )
    p.add_argument("--save-latents", help="also write the latents (as `encode` does, with this --context)")
    _partial(p)
    p.set_defaults(func=_guarded(_reconstruct))

    p = subparsers.add_parser(
        "encode",
        help="video -> latents (CV) or token indices (DV) in a safetensors file",
        description="Encode a video window by window into a safetensors file: 'latent' [windows, C, t, h, w] (CV) "
        "or 'indices' int32 [windows, t, h, w] (DV), plus frames/height/width/window/context; the model name "
        "and fps are in the file's metadata.",
    )
    p.add_argument("--input", required=True, help="input video")
    _common(p, "latents file (.safetensors)", video_out=False)
    _windowing(p, "frames shared with the previous window: 0 (default: disjoint windows) or 1+8m")
    _partial(p)
    p.set_defaults(func=_guarded(_encode))

    p = subparsers.add_parser(
        "decode",
        help="latents file written by `encode` -> video",
        description="Decode a latents file written by `encode` back to an h264 video of the original size.",
    )
    p.add_argument("--input", required=True, help="latents file (.safetensors) written by `encode`")
    _common(p, "output video (.mp4)", video_out=True)
    p.add_argument("--fps", type=_fps, help="frame rate of the output (default: the encoded video's)")
    p.set_defaults(func=_guarded(_decode))
