"""Fast video probing, and the problems a video has for a requested clip.

Used by ``python -m data_tools`` (make-shards, check) and by the trainer's preflight. Probing
demuxes every packet of the video stream (reads the bytes): that gives an exact frame count for
containers that store none (mkv, webm), and the timestamps the variable-frame-rate test needs.
Then it decodes from the last keyframe to the end, which proves the last frame is there and
yields the display matrix (phone videos). A file cut short (an mp4 written with its index at the
front, then truncated) still promises every frame in its header: its packets stop early, or the
last one is cut, and the probe reports the frames readable against the frames promised.
``deep=True`` decodes every frame instead, which also finds damage in the middle of a file whose
packets are all whole.
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass, field
from typing import BinaryIO

import av

from .orientation import Orientation, UnsupportedOrientation, orientation_of
from .orientation import display_matrix as frame_display_matrix

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
    promised: int = 0
    """Frames the container's header or index promises (0: it states none, as mkv and webm)."""
    damage: str = ""
    """Why fewer than ``promised`` frames (or not every frame) can be read; empty for a whole file."""
    display_matrix: tuple[int, ...] | None = None
    """The stream's display matrix (FFmpeg's 9 integers), when it has one: how players turn the picture."""
    keyframes: int = 0
    """Keyframes among the readable packets (0: not counted)."""

    @property
    def orientation(self) -> Orientation:
        """How decoding turns the stored frames upright (raises UnsupportedOrientation for odd angles)."""
        return orientation_of(self.display_matrix)

    def display_size(self) -> tuple[int, int]:
        """(width, height) as displayed (and as training and ``reconstruct`` decode it)."""
        try:
            return self.orientation.display_size(self.width, self.height)
        except UnsupportedOrientation:
            return self.width, self.height


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


def probe_video(source: bytes | str | os.PathLike | BinaryIO, deep: bool = False) -> VideoInfo:
    """Probe a video file, its bytes, or a seekable binary file object.

    Describes the first video stream (the one energon's ``AVDecoder`` reads): ``frames`` counts the
    frames that can be read, ``promised`` the frames the header claims, ``damage`` says why they
    differ. ``deep`` decodes every frame (slower) instead of the tail only. Raises
    :class:`VideoProbeError` when it cannot be opened, holds no video stream, or no frame of it can
    be read. The container is always closed.
    """
    container = _open(source)
    try:
        if not container.streams.video:
            raise VideoProbeError("no video stream", code="no_video_stream")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        scan = _scan_packets(container, stream)
        promised = max(0, stream.frames)
        frames, damage = scan.whole, scan.damage
        if promised and frames > promised:
            frames = promised
        if frames == 0:
            raise VideoProbeError(
                "unreadable (no whole video packet: empty or truncated file)"
                if not scan.damage
                else f"unreadable ({scan.damage})"
            )
        if promised and frames < promised and not damage:
            damage = f"the file ends after frame {frames}"
        decoded, matrix, decode_damage = _decode_check(container, stream, scan, deep)
        if decode_damage:
            frames, damage = min(frames, decoded), decode_damage

        fps = float(stream.average_rate or stream.guessed_rate or stream.base_rate or 0)
        duration = 0.0
        if stream.duration and stream.time_base:
            duration = float(stream.duration * stream.time_base)
        elif container.duration:
            duration = container.duration / av.time_base
        if fps <= 0 and duration > 0:
            fps = scan.whole / duration
        if duration <= 0 and fps > 0:
            duration = scan.whole / fps

        pts = scan.pts
        if len(pts) >= max(2, scan.whole // 2):
            pts.sort()
            steps = [b - a for a, b in zip(pts, pts[1:], strict=False)]
        else:  # some avi files carry no pts; their packet durations are all we have
            steps = scan.durations[:-1]
        variable = _is_variable(steps)
        if variable and duration > 0:
            fps = scan.whole / duration  # mkv headers give a nominal rate that means nothing for VFR
        return VideoInfo(
            frames=frames,
            fps=fps,
            width=int(ctx.width),
            height=int(ctx.height),
            duration=duration,
            codec=ctx.name,
            variable_fps=variable,
            promised=promised,
            damage=damage,
            display_matrix=matrix,
            keyframes=len(scan.keyframes),
        )
    finally:
        container.close()


@dataclass
class _PacketScan:
    """What demuxing the whole stream found: whole packets (one per frame), their timing, keyframes."""

    whole: int = 0
    pts: list[int] = field(default_factory=list)
    durations: list[int] = field(default_factory=list)
    keyframes: list[tuple[int, int]] = field(default_factory=list)  # (packet number, pts)
    positions: dict[int, int] = field(default_factory=dict)  # byte position -> packet number
    damage: str = ""


def index_sizes(stream: av.video.stream.VideoStream) -> list[int] | None:
    """The size of every packet by the container's index, when it has one entry per frame (mp4, mov, avi)."""
    entries = stream.index_entries
    return [e.size for e in entries] if entries is not None and 0 < len(entries) == stream.frames else None


def is_cut_off(packet: av.Packet, number: int, sizes: list[int] | None) -> bool:
    """Whether the ``number``-th (0-based) packet of a stream is cut short: FFmpeg flags it corrupt, or it
    holds fewer bytes than the index (:func:`index_sizes`) says. What follows it cannot be whole."""
    expected = sizes[number] if sizes is not None and number < len(sizes) else 0
    return bool(packet.is_corrupt) or packet.size < expected


def _scan_packets(container: av.container.InputContainer, stream: av.video.stream.VideoStream) -> _PacketScan:
    """Demux every packet, up to the first one that is cut off (flagged corrupt, or shorter than the
    container's index says); later packets cannot belong to a whole file."""
    scan = _PacketScan()
    sizes = index_sizes(stream)
    try:
        for packet in container.demux(stream):
            if packet.size == 0:  # the flush packet at the end
                continue
            if is_cut_off(packet, scan.whole, sizes):
                scan.damage = f"the file ends inside frame {scan.whole + 1}"
                break
            if packet.is_keyframe and packet.pts is not None:
                scan.keyframes.append((scan.whole, packet.pts))
            if packet.pos is not None and packet.pos >= 0:
                scan.positions[packet.pos] = scan.whole
            scan.whole += 1
            if packet.pts is not None:
                scan.pts.append(packet.pts)
            if packet.duration:
                scan.durations.append(packet.duration)
    except (av.FFmpegError, OSError, EOFError) as err:
        # A damaged tail: what was demuxed so far still decodes; report those frames only.
        if scan.whole == 0:
            raise VideoProbeError(f"unreadable ({_describe(err)})") from err
        scan.damage = f"reading stops after frame {scan.whole} ({_describe(err)})"
    return scan


def _decode_check(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, scan: _PacketScan, deep: bool
) -> tuple[int, tuple[int, ...] | None, str]:
    """Decode the whole packets from the last keyframe (every one with ``deep``) to the end.

    Returns (frames known readable, the display matrix of the first decoded frame, damage); damage
    is empty when every decoded packet gave its frame without an error.
    """
    first_packet, start_pts = 0, None
    if not deep and scan.keyframes:
        first_packet, start_pts = scan.keyframes[-1]
    try:
        if start_pts is None:
            container.seek(0)
        else:
            container.seek(start_pts, stream=stream, backward=True, any_frame=False)
    except (av.FFmpegError, OSError):
        return scan.whole, None, ""  # cannot seek (e.g. a stream without index): nothing more to learn
    matrix, decoded, fed, started = None, 0, 0, False
    try:
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            if not started:
                # The seek may land on an earlier keyframe than asked; number from where it landed.
                first_packet = scan.positions.get(packet.pos, first_packet) if packet.pos is not None else first_packet
                started = True
            if first_packet + fed >= scan.whole:
                break  # the cut-off packet and anything after it
            fed += 1
            for frame in stream.decode(packet):
                decoded += 1
                if matrix is None:
                    matrix = frame_display_matrix(frame)
        for frame in stream.decode(None):
            decoded += 1
            if matrix is None:
                matrix = frame_display_matrix(frame)
    except (av.FFmpegError, OSError, EOFError) as err:
        readable = first_packet + decoded
        return readable, matrix, f"frame {readable + 1} does not decode ({_describe(err)})"
    if fed and not decoded:
        return first_packet, matrix, f"no frame decodes from frame {first_packet + 1} on"
    return scan.whole, matrix, ""


TRANSCODED_GOP = 16
"""Frames per keyframe of ``make-shards --transcode``'s shards."""
LONG_GOP_RATIO = 1.5
"""Warn when a random clip decodes this many times the frames it would from transcoded shards."""


def decoded_per_clip(gop: float, frames: int, video_frames: int | None = None) -> float:
    """Frames a clip of ``frames`` from a uniformly random start decodes on average, with a keyframe every
    ``gop`` frames: its own, and those from the keyframe before its start: (gop - 1) / 2 on average, or less
    when the ``video_frames - frames + 1`` possible starts are fewer than a GOP."""
    starts = gop if video_frames is None else min(gop, video_frames - frames + 1)
    return frames + (max(starts, 1.0) - 1.0) / 2.0


def _smaller_transcode(info: VideoInfo, resize_short_side: int | None) -> tuple[str, float]:
    """The ``--max-height`` flag that transcodes ``info``'s video no larger than training resizes it to, and how
    many times fewer pixels its frames then have; ("", 1.0) when decoding does not shrink the frames."""
    short = min(info.width, info.height)
    if not resize_short_side or short <= resize_short_side:
        return "", 1.0
    height = 2 * math.ceil(info.height * resize_short_side / short / 2)  # even, as the transcoder writes it
    if height >= info.height:
        return "", 1.0
    return f" --max-height {height}", (info.height / height) ** 2


def _near_common_fps(fps: float) -> bool:
    return any(abs(fps - rate) <= _FPS_TOLERANCE * rate for rate in COMMON_FPS)


def clip_problems(info: VideoInfo, frames: int, crop: int, resize_short_side: int | None = None) -> list[Problem]:
    """What keeps ``info``'s video from giving a ``frames`` x ``crop`` x ``crop`` clip (errors), plus
    properties that hurt training quality (warnings). An empty list means the video is fine."""
    problems: list[Problem] = []
    if info.damage:
        of = f" of {info.promised}" if info.promised else ""
        problems.append(
            Problem(
                "error",
                "partial_video",
                f"{info.frames}{of} frames readable: {info.damage} (cut short or damaged); re-encode it from its "
                "source or remove it",
            )
        )
    try:
        info.orientation  # noqa: B018 - raises for a matrix that cannot be applied
    except UnsupportedOrientation as err:
        problems.append(Problem("error", "unsupported_rotation", f"{err}; training skips it"))
    if info.frames < frames:
        problems.append(
            Problem(
                "error",
                "too_few_frames",
                f"{info.frames} frames, fewer than the {frames} a clip needs; use fewer frames per clip "
                "or drop this video",
            )
        )
    shown_width, shown_height = info.display_size()  # what training decodes: upright
    width, height = shown_width, shown_height
    short = min(width, height)
    if resize_short_side:
        scale = resize_short_side / short if short else 0.0
        width, height = round(shown_width * scale), round(shown_height * scale)
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
                f"frame {shown_width}x{shown_height}{resized} is smaller than the {crop}x{crop} crop; use a crop of "
                f"at most {min(width, height)}, {fix}, or drop this video",
            )
        )
    if short < MIN_SHORT_SIDE:
        problems.append(
            Problem(
                "warning",
                "low_resolution",
                f"short side {short} px (frame {shown_width}x{shown_height}); {MIN_SHORT_SIDE}p is the recommended "
                "minimum, low-resolution footage teaches the tokenizer little detail",
            )
        )
    if info.keyframes and info.frames >= frames:
        gop = info.frames / info.keyframes
        decoded = decoded_per_clip(gop, frames, info.frames)
        ratio = decoded / decoded_per_clip(TRANSCODED_GOP, frames, info.frames)
        if ratio >= LONG_GOP_RATIO:
            # Keyframe starts need a few keyframes to start from; with one, every clip would open the video.
            other = " (or set data.start=keyframe: docs/data.md, Clip starts)" if info.keyframes >= 4 else ""
            flag, pixels = _smaller_transcode(info, resize_short_side)
            of_size = f" of {shown_width}x{shown_height}" if flag else ""
            problems.append(
                Problem(
                    "warning",
                    "long_gop",
                    f"a keyframe every {gop:.0f} frames: a {frames}-frame clip from a random start decodes about "
                    f"{decoded:.0f} frames{of_size}, {ratio * pixels:.1f}x the pixels it would decode from shards "
                    f"made with make-shards --transcode{flag} (a keyframe every {TRANSCODED_GOP}, encoded for fast "
                    f"decoding); transcode them for a faster loader (docs/data.md, Real footage: measured "
                    f"speed-ups){other}",
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
