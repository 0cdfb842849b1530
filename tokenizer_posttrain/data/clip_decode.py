"""Decode one clip from an encoded video: a single container open, a seek, and RGB for the crop only.

energon's ``AVDecoder.get_video_clips`` converts every decoded frame to full-size RGB and stacks
it before we crop, and its metadata call opens the container a second time and decodes a frame
to learn the size. For a 256x256 crop of 720p frames that is most of the time spent outside the
video decoder itself. Here energon's index-based readers still do the seeking and frame counting
(so frame numbering is theirs), while the crop is cut from the YUV planes and only that region is
converted to RGB, for the whole clip at once.

Frames come out as displayed: a display matrix (phone videos store the picture sideways) is read
from the first frame when the video is opened, ``width``/``height`` are the displayed sides, and the
crop is cut from the stored frame where it lands there, then turned upright (:mod:`.orientation`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import av
import numpy as np
import torch
from av.codec.hwaccel import HWAccel
from megatron.energon.av import AVDecoder
from megatron.energon.av.av_init import av_open, initialize_av_container
from megatron.energon.av.av_reader import AVProbeIndex, AVReaderByFrames, AVReaderByPts

from .orientation import NONE, Orientation, frame_orientation

# Kr, Kb of the YUV -> RGB matrices, by FFmpeg's AVColorSpace number; anything else (unspecified
# included) is BT.601, as FFmpeg's scaler assumes.
_KR_KB: dict[int, tuple[float, float]] = {
    1: (0.2126, 0.0722),  # BT.709
    9: (0.2627, 0.0593),  # BT.2020 non-constant luminance
    10: (0.2627, 0.0593),  # BT.2020 constant luminance (approximated by the NCL matrix)
}
_BT601 = (0.299, 0.114)
_FULL_RANGE = 2  # AVCOL_RANGE_JPEG
_YUV420 = {"yuv420p", "yuvj420p"}


@dataclass(frozen=True)
class Box:
    """A crop rectangle in (possibly resized) frame pixels."""

    top: int
    left: int
    height: int
    width: int


class ClipReader:
    """One open video; ``frames`` comes from its index, ``keyframes`` (sorted frame numbers) from the same
    index, ``width`` and ``height`` are the displayed sides (the stored ones turned by the display matrix, see
    ``orientation``).

    Use as a context manager: the container is closed on exit, also after an error. Opening decodes
    the first frame (to read the display matrix); a matrix other than a multiple of 90 degrees raises
    :class:`~.orientation.UnsupportedOrientation` (a ValueError).
    """

    def __init__(self, video: AVDecoder | BinaryIO, threads: int | None = None, gpu: bool = False) -> None:
        """``threads``: FFmpeg's decoding threads (frame and slice threading) for this video; None keeps
        energon's setting (none: FFmpeg's threads can deadlock a forked loader worker). ``gpu``: decode on the
        GPU's video decoder (NVDEC, through FFmpeg's CUDA device), frames downloaded to the host; no fallback
        to software decoding, so a missing decoder fails here or at the first frame."""
        decoder = video if isinstance(video, AVDecoder) else AVDecoder(video)
        by_frames = decoder._inspect_index_mode().name == "FRAMES"  # mp4/mov/m4v: a full index
        stream = decoder.stream
        stream.seek(0)
        if gpu:
            # This rank's GPU, and its primary CUDA context (shared, not a new context per clip).
            device = os.environ.get("LOCAL_RANK", "0")
            hwaccel = HWAccel("cuda", device=device, allow_software_fallback=False, options={"primary_ctx": "1"})
            self._container = av.open(stream, "r", hwaccel=hwaccel)
            try:
                initialize_av_container(self._container)
            except BaseException:
                self._container.close()
                raise
        else:
            self._container = av_open(stream)
        try:
            if not self._container.streams.video:
                raise ValueError("no video stream")
            self._stream = self._container.streams.video[0]
            if threads is not None:  # before the first decode opens the codec
                self._stream.thread_type = "AUTO"
                self._stream.codec_context.thread_count = threads
            self._pts: list[int] | None = None
            index = self._stream.index_entries if by_frames else None
            if index is not None and len(index) > 0:
                self._reader: AVReaderByFrames | AVReaderByPts = AVReaderByFrames(self._container, 0, index)
                self.frames = len(index)
                # Frame numbers as energon's reader counts them: positions in the index.
                self.keyframes = [i for i, entry in enumerate(index) if entry.is_keyframe]
            else:
                # No usable index (mkv, webm, avi): demux once (no decoding) for exact frame
                # timestamps, and read by timestamp so variable frame rates stay exact too.
                probe = AVProbeIndex(self._container, 0)
                self._pts = sorted(entry.timestamp for entry in probe._entries)
                self._reader = AVReaderByPts(self._container, 0, probe)
                self.frames = len(self._pts)
                keyframe_pts = {entry.timestamp for entry in probe._entries if entry.is_keyframe}
                self.keyframes = [i for i, pts in enumerate(self._pts) if pts in keyframe_pts]
            ctx = self._stream.codec_context
            self._stored = (int(ctx.width), int(ctx.height))
            self.orientation = self._read_orientation()
            self.width, self.height = self.orientation.display_size(*self._stored)
        except BaseException:
            self._container.close()
            raise

    def __enter__(self) -> ClipReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._container.close()

    def _read_orientation(self) -> Orientation:
        # Through the reader itself, so its position stays consistent for the first read.
        if not self.frames:
            return NONE
        first = next(iter(self._decoded(0, 1)), None)
        return NONE if first is None else frame_orientation(first)

    def _decoded(self, start: int, count: int) -> Iterator[av.VideoFrame]:
        last = start + count - 1
        if self._pts is None:
            yield from self._reader.seek_read(start, last)
        else:
            yield from self._reader.seek_read(self._pts[start], self._pts[last])

    def read(
        self,
        start: int,
        count: int,
        box: Box,
        size: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Frames ``start .. start + count - 1``, resized to ``size`` (width, height) when given,
        cropped to ``box`` (both as displayed, like ``width`` and ``height``): RGB in [-1, 1] as
        ``dtype``, ``[3, T, box.height, box.width]`` (the layout the tokenizers take), upright. Fewer
        than ``count`` frames when the file ends early."""
        return self.read_crops(start, count, [box], size, dtype)[0]

    def read_crops(
        self,
        start: int,
        count: int,
        boxes: Sequence[Box],
        size: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> list[torch.Tensor]:
        """:meth:`read` of each of ``boxes`` from one decode of the frames: the decoding, which costs the
        same whatever is cut from a frame, is paid once for all crops."""
        if start < 0 or count < 1 or start + count > self.frames:
            raise ValueError(f"frames {start} to {start + count - 1} of a {self.frames}-frame video")
        if not boxes:
            raise ValueError("read_crops needs at least one box")
        turn = self.orientation
        if turn.is_identity:
            return self._read_stored(start, count, boxes, size, dtype)
        # Resize and crop the stored frame where each displayed box lands on it; turn the crops after.
        if size is not None and turn.swaps_sides:
            size = (size[1], size[0])
        stored_width, stored_height = size or self._stored
        stored = [Box(*turn.stored_box(b.top, b.left, b.height, b.width, stored_width, stored_height)) for b in boxes]
        return [turn.apply_torch(clip).contiguous() for clip in self._read_stored(start, count, stored, size, dtype)]

    def _read_stored(
        self, start: int, count: int, boxes: Sequence[Box], size: tuple[int, int] | None, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        planes: list[list] = [[] for _ in boxes]
        rgb: list[list] = [[] for _ in boxes]
        frame, decoded = None, 0
        for frame in self._decoded(start, count):
            if decoded == count:
                break
            decoded += 1
            if size is not None and (frame.width, frame.height) != size:
                # Resizing stays in YUV; only the crops are converted to RGB below.
                frame = frame.reformat(width=size[0], height=size[1], interpolation="BILINEAR")
            for index, box in enumerate(boxes):
                if frame.height < box.top + box.height or frame.width < box.left + box.width:
                    raise ValueError(f"frame {frame.width}x{frame.height} does not hold the crop {box}")
                if frame.format.name in _YUV420 and not rgb[index]:
                    planes[index].append(_crop_planes(frame, box))
                elif frame.format.name == "nv12" and not rgb[index]:  # what the GPU's decoder hands back
                    planes[index].append(_crop_planes(frame, box, interleaved=True))
                else:
                    rgb[index].append(_crop_rgb(frame, box))
        return [self._assembled(p, r, frame, box, dtype) for p, r, box in zip(planes, rgb, boxes, strict=True)]

    @staticmethod
    def _assembled(planes: list, rgb: list, frame: av.VideoFrame | None, box: Box, dtype: torch.dtype) -> torch.Tensor:
        """One crop's ``[3, T, h, w]`` clip from its frames' YUV planes or RGB pictures."""
        if planes and rgb:
            raise ValueError("the pixel format changes inside the clip")
        if rgb:
            return torch.stack(rgb, dim=1).float().div_(127.5).sub_(1.0).to(dtype)
        if not planes or frame is None:
            return torch.empty(3, 0, box.height, box.width, dtype=dtype)
        y, u, v = (torch.from_numpy(np.stack(p)) for p in zip(*planes, strict=True))
        full_range = int(frame.color_range) == _FULL_RANGE or frame.format.name == "yuvj420p"
        crop = Box(box.top % 2, box.left % 2, box.height, box.width)  # within the even-grown planes
        return yuv420_to_rgb(y, u, v, _KR_KB.get(int(frame.colorspace), _BT601), full_range, dtype, crop)


def _plane(frame: av.VideoFrame, index: int, height: int, width: int) -> np.ndarray:
    plane = frame.planes[index]
    return np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:height, :width]


def _crop_planes(
    frame: av.VideoFrame, box: Box, interleaved: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies of the chroma samples covering the crop (4:2:0: one per 2x2 pixels) and of the luma
    under them: the crop grown to even offsets and sizes. ``interleaved``: NV12, both chroma planes in one
    (U and V alternating)."""
    rows = slice(box.top // 2, (box.top + box.height - 1) // 2 + 1)
    cols = slice(box.left // 2, (box.left + box.width - 1) // 2 + 1)
    ch, cw = (frame.height + 1) // 2, (frame.width + 1) // 2
    if interleaved:
        uv = _plane(frame, 1, ch, 2 * cw)[rows, 2 * cols.start : 2 * cols.stop]
        u, v = uv[:, 0::2], uv[:, 1::2]
    else:
        u = _plane(frame, 1, ch, cw)[rows, cols]
        v = _plane(frame, 2, ch, cw)[rows, cols]
    y = _plane(frame, 0, frame.height, frame.width)[2 * rows.start : 2 * rows.stop, 2 * cols.start : 2 * cols.stop]
    if y.shape != (2 * u.shape[0], 2 * u.shape[1]):  # odd frame size, crop at its edge: repeat the edge
        y = np.pad(y, [(0, 2 * u.shape[0] - y.shape[0]), (0, 2 * u.shape[1] - y.shape[1])], mode="edge")
    return y.copy(), u.copy(), v.copy()


def _crop_rgb(frame: av.VideoFrame, box: Box) -> torch.Tensor:
    """Other pixel formats (4:2:2, 4:4:4, 10-bit, RGB, grey): FFmpeg's full-frame conversion."""
    rgb = frame.to_ndarray(format="rgb24")[box.top : box.top + box.height, box.left : box.left + box.width]
    return torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)


def yuv420_to_rgb(
    y: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    kr_kb: tuple[float, float],
    full_range: bool,
    dtype: torch.dtype = torch.float32,
    crop: Box | None = None,
) -> torch.Tensor:
    """uint8 luma ``[T, 2h, 2w]`` and chroma ``[T, h, w]`` -> RGB ``[3, T, 2h, 2w]`` in [-1, 1],
    or only its ``crop`` (``[3, T, crop.height, crop.width]``).

    Each chroma sample serves its 2x2 pixels (FFmpeg's fast converter does the same), so a crop
    cut from this equals the same crop of FFmpeg's full-frame RGB. Scale and offset to [-1, 1] are
    folded into the matrix: a few passes over the clip instead of a chain of them.
    """
    frames, height, width = y.shape
    scale = 2.0 / 255.0
    if full_range:
        luma_gain, luma_offset, chroma_gain = scale, -1.0, scale
    else:
        luma_gain, chroma_gain = scale * 255.0 / 219.0, scale * 255.0 / 224.0
        luma_offset = -16.0 * luma_gain - 1.0
    kr, kb = kr_kb
    kg = 1.0 - kr - kb
    cb = u.float().sub_(128.0).mul_(chroma_gain)
    cr = v.float().sub_(128.0).mul_(chroma_gain)
    chroma = (
        (2.0 * (1.0 - kr)) * cr,
        -(2.0 * kb * (1.0 - kb) / kg) * cb - (2.0 * kr * (1.0 - kr) / kg) * cr,
        (2.0 * (1.0 - kb)) * cb,
    )
    crop = crop or Box(0, 0, height, width)
    out = torch.empty(3, frames, crop.height, crop.width, dtype=dtype)
    luma = y.float().mul_(luma_gain).view(frames, height // 2, 2, width // 2, 2)
    # One fp32 channel at a time, clamped, then rounded into the output: bf16 arithmetic on the
    # CPU is slow, and a single reused buffer page-faults a third as often as a full fp32 clip.
    channel_buffer = torch.empty_like(luma)
    for channel, term in enumerate(chroma):
        torch.add(luma, term.add_(luma_offset)[:, :, None, :, None], out=channel_buffer)
        full = channel_buffer.clamp_(-1.0, 1.0).view(frames, height, width)
        out[channel].copy_(full[:, crop.top : crop.top + crop.height, crop.left : crop.left + crop.width])
    return out
