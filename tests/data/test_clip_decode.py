"""Clip decoding: the right frames, and a crop equal to cropping FFmpeg's full-frame RGB."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from tests.videos import encode_video, faststart
from tokenizer_posttrain.data.clip_decode import Box, ClipReader
from tokenizer_posttrain.data.orientation import Orientation


def full_rgb(data: bytes, size: tuple[int, int] | None = None) -> np.ndarray:
    """Every frame through FFmpeg's own conversion: ``[T, H, W, 3]`` uint8."""
    with av.open(io.BytesIO(data)) as container:
        frames = []
        for frame in container.decode(video=0):
            if size is not None:
                frame = frame.reformat(width=size[0], height=size[1], interpolation="BILINEAR")
            frames.append(frame.to_ndarray(format="rgb24"))
    return np.stack(frames)


def as_uint8_levels(clip: torch.Tensor) -> np.ndarray:
    """``[3, T, H, W]`` in [-1, 1] -> ``[T, H, W, 3]`` in 0..255 (float)."""
    return ((clip.permute(1, 2, 3, 0) + 1.0) * 127.5).numpy()


def assert_matches(clip: torch.Tensor, reference: np.ndarray, exact_chroma: bool = True) -> None:
    """Within FFmpeg's fixed-point rounding, which differs from exact arithmetic by up to 3 levels.

    For limited-range 4:2:0 of even size FFmpeg repeats each chroma sample over its 2x2 pixels, as
    we do; for full-range (JPEG) video and odd sizes it interpolates chroma, which differs at sharp
    colour edges only: there the median still tells a right matrix and range (about 1 level) from a
    wrong one (about 11).
    """
    diff = np.abs(as_uint8_levels(clip) - reference.astype(np.float32))
    assert np.median(diff) <= 1.5, np.median(diff)
    if exact_chroma:
        assert diff.max() <= 3.5, diff.max()
        assert diff.mean() < 1.5, diff.mean()


CASES = {
    # name: (encode_video arguments, frame height, frame width)
    "h264 mp4, untagged (BT.601)": ({}, 50, 66),
    "h264 mp4, tagged BT.709": ({"colorspace": 1}, 50, 66),
    "h264 mkv (no frame index: read by timestamp)": ({"codec": "libx264", "container": "matroska"}, 50, 66),
    "mjpeg avi, full-range yuvj420p, odd size": ({"codec": "mjpeg", "container": "avi", "pix_fmt": "yuvj420p"}, 49, 67),
    "mpeg4 mp4, odd size": ({"codec": "mpeg4"}, 49, 67),
    "h264 yuv444p (FFmpeg converts)": ({"pix_fmt": "yuv444p"}, 50, 66),
}


@pytest.mark.parametrize("name", list(CASES))
def test_frames_and_crops_equal_ffmpeg_full_frames(name: str) -> None:
    kwargs, height, width = CASES[name]
    data = encode_video(30, height, width, **kwargs)
    reference = full_rgb(data)
    assert reference.shape == (30, height, width, 3)
    rng = np.random.default_rng(0)
    boxes = [Box(0, 0, 32, 32), Box(1, 3, 31, 33), Box(height - 17, width - 19, 17, 19)]  # even, odd, edges
    for box in boxes:
        start = int(rng.integers(0, 30 - 9 + 1))
        with ClipReader(io.BytesIO(data)) as reader:
            assert (reader.frames, reader.width, reader.height) == (30, width, height)
            clip = reader.read(start, 9, box)
        assert clip.shape == (3, 9, box.height, box.width) and clip.dtype == torch.float32
        assert -1.0 <= clip.min() and clip.max() <= 1.0
        window = reference[start : start + 9, box.top : box.top + box.height, box.left : box.left + box.width]
        assert_matches(clip, window, exact_chroma=height % 2 == 0 and "yuvj420p" not in name)


def test_the_clip_holds_exactly_the_requested_frames() -> None:
    # Consecutive frames of the synthetic video differ a lot: a one-frame shift would show.
    data = encode_video(40, 64, 64, fps=25)
    reference = full_rgb(data)
    box = Box(0, 0, 64, 64)
    for start in (0, 7, 15, 16, 31):
        with ClipReader(io.BytesIO(data)) as reader:
            clip = reader.read(start, 9, box)
        errors = [np.abs(as_uint8_levels(clip) - reference[s : s + 9]).mean() for s in range(0, 32)]
        assert int(np.argmin(errors)) == start


def test_crops_of_one_decode_equal_separate_reads() -> None:
    data = encode_video(12, 64, 96)
    boxes = [Box(0, 0, 24, 40), Box(3, 5, 24, 40), Box(24, 24, 24, 40)]
    with ClipReader(io.BytesIO(data)) as reader:
        crops = reader.read_crops(2, 5, boxes, size=(64, 48))
        for crop, box in zip(crops, boxes, strict=True):
            assert crop.shape == (3, 5, 24, 40)
            torch.testing.assert_close(crop, reader.read(2, 5, box, size=(64, 48)), rtol=0, atol=0)
        with pytest.raises(ValueError, match="at least one box"):
            reader.read_crops(0, 1, [])


def test_resize_then_crop() -> None:
    data = encode_video(12, 64, 96)
    size = (48, 32)
    reference = full_rgb(data, size)
    box = Box(3, 5, 24, 40)
    with ClipReader(io.BytesIO(data)) as reader:
        clip = reader.read(2, 5, box, size=size)
    window = reference[2:7, 3:27, 5:45]
    # FFmpeg resizes chroma before converting, we convert after: equal up to edge rounding.
    diff = np.abs(as_uint8_levels(clip) - window.astype(np.float32))
    assert diff.mean() < 2.0, diff.mean()


@pytest.mark.parametrize(
    ("rotation", "mirror", "turn"),
    [
        (-90, False, Orientation(3)),
        (90, False, Orientation(1)),
        (180, False, Orientation(2)),
        (90, True, Orientation(1, True)),
    ],
)
def test_turned_videos_come_out_upright(rotation: int, mirror: bool, turn: Orientation) -> None:
    # Stored 80x48 with a display matrix, as phones write portrait video; the clip is the picture as shown.
    data = encode_video(12, 48, 80, rotation=rotation, mirror=mirror)
    shown = np.stack([turn.apply_numpy(frame) for frame in full_rgb(data)])
    height, width = shown.shape[1:3]
    with ClipReader(io.BytesIO(data)) as reader:
        assert reader.orientation == turn
        assert (reader.frames, reader.width, reader.height) == (12, width, height)
        for box in (Box(0, 0, 32, 32), Box(3, 5, 21, 27), Box(height - 17, width - 19, 17, 19)):
            clip = reader.read(2, 5, box)
            assert clip.shape == (3, 5, box.height, box.width)
            assert_matches(clip, shown[2:7, box.top : box.top + box.height, box.left : box.left + box.width])
        # Several crops of one decode are the crops one read each gives.
        boxes = [Box(0, 0, 16, 16), Box(3, 5, 16, 16), Box(height - 16, width - 16, 16, 16)]
        for one, box in zip(reader.read_crops(2, 5, boxes), boxes, strict=True):
            torch.testing.assert_close(one, reader.read(2, 5, box), rtol=0, atol=0)
        # a resize is given as displayed too: (width, height) of the upright picture
        size = (width // 2, height // 2)
        clip = reader.read(0, 3, Box(0, 0, size[1], size[0]), size=size)
    stored_size = (size[1], size[0]) if turn.swaps_sides else size
    resized = np.stack([turn.apply_numpy(frame) for frame in full_rgb(data, stored_size)])[:3]
    assert np.abs(as_uint8_levels(clip) - resized.astype(np.float32)).mean() < 2.0


def test_a_truncated_file_gives_fewer_frames_and_broken_ones_raise(tmp_path: Path) -> None:
    # The index at the front still claims every frame after the tail is cut off.
    data = faststart(encode_video(30, 64, 64), tmp_path / "faststart.mp4")
    with av.open(io.BytesIO(data)) as container:
        ends = sorted(p.pos + p.size for p in container.demux(video=0) if p.size)
    with ClipReader(io.BytesIO(data[: ends[24]])) as reader:  # the first 25 packets are whole
        assert reader.frames == 30
        clip = reader.read(20, 9, Box(0, 0, 32, 32))
        assert clip.shape[1] < 9
        with pytest.raises(ValueError, match="frames 25 to 34 of a 30-frame video"):
            reader.read(25, 10, Box(0, 0, 32, 32))
    with pytest.raises((av.FFmpegError, OSError)):  # index at the end, cut off
        ClipReader(io.BytesIO(encode_video(30, 64, 64)[:-2000]))
    with pytest.raises((av.FFmpegError, OSError)):
        ClipReader(io.BytesIO(b"not a video at all"))


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_keyframes_are_the_frame_numbers_ffmpeg_marks_as_keyframes(container: str) -> None:
    # mp4 numbers frames by its index, matroska (no index) by demuxed timestamps: both must agree with decoding.
    data = encode_video(40, 32, 48, container=container, gop=8)
    with av.open(io.BytesIO(data)) as decoded:
        truth = [i for i, frame in enumerate(decoded.decode(video=0)) if frame.key_frame]
    with ClipReader(io.BytesIO(data)) as reader:
        assert reader.keyframes == truth
        # At most 8 frames apart (x264 adds some at scene cuts): several, not just the first frame.
        assert reader.frames == 40 and reader.keyframes[0] == 0 and len(reader.keyframes) >= 5


def test_nv12_frames_as_the_gpu_decoder_gives_them_crop_like_yuv420p() -> None:
    # NVDEC's frames come back to the host as NV12 (U and V interleaved in one plane).
    from tokenizer_posttrain.data.clip_decode import _crop_planes

    data = encode_video(3, 50, 66)
    with av.open(io.BytesIO(data)) as container:
        frame = next(container.decode(video=0))
    nv12 = frame.reformat(format="nv12")
    for box in (Box(0, 0, 50, 66), Box(3, 5, 21, 33), Box(10, 12, 16, 16)):
        for ours, theirs in zip(_crop_planes(nv12, box, interleaved=True), _crop_planes(frame, box), strict=True):
            assert np.array_equal(ours, theirs), box
