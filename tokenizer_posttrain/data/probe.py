"""Fast video probing without decoding pixels, and the problems a video has for a requested clip.

Used by ``python -m data_tools`` (make-shards, check) and by the trainer's preflight. Probing
demuxes every packet of the video stream (reads the bytes, decodes nothing): that gives an exact
frame count for containers that store none (mkv, webm), catches truncated files whose header
still claims the full count, and yields the timestamps the variable-frame-rate test needs.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import BinaryIO

import av

COMMON_FPS = (23.976, 24.0, 25.0, 29.97, 30.0, 48.0, 50.0, 59.94, 60.0, 100.0, 120.0)
MIN_SHORT_SIDE = 720  # below this the tokenizer sees little detail: warn, do not reject
_FPS_TOLERANCE = 0.01  # relative; 23.976 vs 24 differ by 0.1 %, so this keeps them apart from 23 or 26
_VFR_TOLERANCE = 0.10


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_video` learns about the first video stream of a file."""

    frames: int
    fps: float
    width: int
    height: int
    duration: float
    codec: str
    variable_fps: bool


class VideoProbeError(Exception):
    """The bytes are not a usable video; ``code`` is ``"unreadable"`` or ``"no_video_stream"``."""

    def __init__(self, message: str, code: str = "unreadable") -> None:
        super().__init__(message)
        self.code = code

    def problem(self) -> Problem:
        """This failure as an error-severity :class:`Problem`."""
        return Problem("error", self.code, f"{self}; re-encode or remove the file")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a sample: ``severity`` is ``"error"`` (unusable) or ``"warning"``."""

    severity: str
    code: str
    message: str


def _open(source: bytes | str | os.PathLike | BinaryIO) -> av.container.InputContainer:
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    elif isinstance(source, os.PathLike):
        source = os.fspath(source)
    try:
        return av.open(source, mode="r")
    except (av.FFmpegError, OSError, ValueError, EOFError) as err:
        raise VideoProbeError(f"unreadable ({_describe(err)})") from err


def _describe(err: BaseException) -> str:
    text = str(err).split(": '", 1)[0]  # PyAV appends the (often '<none>') file name
    text = re.sub(r"^\[Errno -?\d+\] ", "", text)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _is_variable(steps: list[int]) -> bool:
    """True when the middle 90 % of timestamp steps spread by more than ~10 % of the median.

    Percentiles instead of min/max so one dropped frame in a long clip does not count; one tick of
    slack because millisecond time bases round 1/24 s to 41 or 42 ms.
    """
    if len(steps) < 2:
        return False
    steps = sorted(steps)
    lo, hi = steps[int(0.05 * (len(steps) - 1))], steps[int(round(0.95 * (len(steps) - 1)))]
    median = steps[len(steps) // 2]
    return median > 0 and hi - lo > _VFR_TOLERANCE * median + 1


def probe_video(source: bytes | str | os.PathLike | BinaryIO) -> VideoInfo:
    """Probe a video file, its bytes, or a seekable binary file object.

    Describes the first video stream (the one energon's ``AVDecoder`` reads). Raises
    :class:`VideoProbeError` when it cannot be opened, holds no video stream, or no frame of it can
    be read. The container is always closed.
    """
    container = _open(source)
    try:
        if not container.streams.video:
            raise VideoProbeError("no video stream", code="no_video_stream")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        packets, pts, durations = 0, [], []
        try:
            for packet in container.demux(stream):
                if packet.size == 0:  # the flush packet at the end
                    continue
                packets += 1
                if packet.pts is not None:
                    pts.append(packet.pts)
                if packet.duration:
                    durations.append(packet.duration)
        except (av.FFmpegError, OSError, EOFError) as err:
            # A damaged tail: what was demuxed so far still decodes; report those frames only.
            if packets == 0:
                raise VideoProbeError(f"unreadable ({_describe(err)})") from err
        # The container's count is exact when present, but a truncated file still claims it.
        frames = min(stream.frames, packets) if stream.frames > 0 else packets
        if frames == 0:
            raise VideoProbeError("unreadable (no video packets: empty or truncated file)")

        fps = float(stream.average_rate or stream.guessed_rate or stream.base_rate or 0)
        duration = 0.0
        if stream.duration and stream.time_base:
            duration = float(stream.duration * stream.time_base)
        elif container.duration:
            duration = container.duration / av.time_base
        if fps <= 0 and duration > 0:
            fps = frames / duration
        if duration <= 0 and fps > 0:
            duration = frames / fps

        if len(pts) >= max(2, frames // 2):
            pts.sort()
            steps = [b - a for a, b in zip(pts, pts[1:], strict=False)]
        else:  # some avi files carry no pts; their packet durations are all we have
            steps = durations[:-1]
        variable = _is_variable(steps)
        if variable and duration > 0:
            fps = frames / duration  # mkv headers give a nominal rate that means nothing for VFR
        return VideoInfo(
            frames=frames,
            fps=fps,
            width=int(ctx.width),
            height=int(ctx.height),
            duration=duration,
            codec=ctx.name,
            variable_fps=variable,
        )
    finally:
        container.close()


def _near_common_fps(fps: float) -> bool:
    return any(abs(fps - rate) <= _FPS_TOLERANCE * rate for rate in COMMON_FPS)


def clip_problems(info: VideoInfo, frames: int, crop: int, resize_short_side: int | None = None) -> list[Problem]:
    """What keeps ``info``'s video from giving a ``frames`` x ``crop`` x ``crop`` clip (errors), plus
    properties that hurt training quality (warnings). An empty list means the video is fine."""
    problems: list[Problem] = []
    if info.frames < frames:
        problems.append(
            Problem(
                "error",
                "too_few_frames",
                f"{info.frames} frames, fewer than the {frames} a clip needs; use fewer frames per clip "
                "or drop this video",
            )
        )
    width, height = info.width, info.height
    short = min(width, height)
    if resize_short_side:
        scale = resize_short_side / short if short else 0.0
        width, height = round(info.width * scale), round(info.height * scale)
    if min(width, height) < crop:
        resized = (
            f" (after resizing the short side to {resize_short_side}: {width}x{height})" if resize_short_side else ""
        )
        fix = (
            f"resize the short side to at least {crop}"
            if not resize_short_side
            else f"use a resize short side of at least {crop}"
        )
        problems.append(
            Problem(
                "error",
                "too_small",
                f"frame {info.width}x{info.height}{resized} is smaller than the {crop}x{crop} crop; use a crop of "
                f"at most {min(width, height)}, {fix}, or drop this video",
            )
        )
    if short < MIN_SHORT_SIDE:
        problems.append(
            Problem(
                "warning",
                "low_resolution",
                f"short side {short} px (frame {info.width}x{info.height}); {MIN_SHORT_SIDE}p is the recommended "
                "minimum, low-resolution footage teaches the tokenizer little detail",
            )
        )
    if info.variable_fps:
        problems.append(
            Problem(
                "warning",
                "variable_fps",
                f"variable frame rate (average {info.fps:.3f} fps): clips sampled by frame index will have uneven "
                "motion; re-encode at a constant rate (make-shards --transcode does)",
            )
        )
    if not 10 <= info.fps <= 120 or not _near_common_fps(info.fps):
        problems.append(
            Problem(
                "warning",
                "odd_fps",
                f"{info.fps:.3f} fps is not a common frame rate (23.976/24/25/29.97/30/50/59.94/60...); check the "
                "file's timing or re-encode at a standard rate",
            )
        )
    return problems
