"""Re-encode a video to h264 yuv420p mp4 (PyAV), keeping every frame and the frame rate."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av

from tokenizer_posttrain.data.orientation import display_matrix

CRF = 18  # visually lossless for h264: the tokenizer should learn the footage, not our artefacts
GOP = 16
"""Frames between keyframes. Training seeks to a random frame and must decode from the keyframe
before it; x264's default of 250 makes every clip decode ~4x the frames it uses."""
TUNE = "fastdecode"
"""x264 without CABAC, deblocking or weighted prediction: faster to decode per training clip, for a
little PSNR and larger files at the same CRF (docs/benchmarks.md has the figures). Decoding is what
limits the loader's clips per CPU core."""


def output_size(width: int, height: int, max_height: int | None) -> tuple[int, int]:
    """(width, height) after the optional downscale to ``max_height``, both even (yuv420p needs it)."""
    if max_height and height > max_height:
        width, height = width * max_height / height, max_height
    return max(2, 2 * round(width / 2)), max(2, 2 * round(height / 2))


def transcode(src: Path, dst: Path, max_height: int | None = None) -> int:
    """Write ``src``'s first video stream to ``dst`` as h264 mp4 at CRF 18, a keyframe every
    :data:`GOP` frames, tuned for fast decoding (:data:`TUNE`); returns the frame count.

    Frames get consecutive timestamps at the source's average rate, so a variable-frame-rate
    source comes out constant-rate with the same frames; the display matrix (phone videos) is kept.
    Audio is dropped (the tokenizer has no use for it). Raises ``av.FFmpegError``/``OSError`` on a damaged source.
    """
    written = 0
    with av.open(str(src)) as inp:
        if not inp.streams.video:
            raise ValueError("no video stream")
        in_stream = inp.streams.video[0]
        in_stream.thread_type = "AUTO"
        rate = in_stream.average_rate or in_stream.guessed_rate or Fraction(30)
        rate = Fraction(rate).limit_denominator(1001)  # 30000/1001 stays exact, odd rationals shrink
        width, height = output_size(in_stream.codec_context.width, in_stream.codec_context.height, max_height)
        with av.open(str(dst), mode="w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.time_base = 1 / rate
            stream.options = {"crf": str(CRF), "g": str(GOP), "keyint_min": str(GOP), "tune": TUNE}
            for frame in inp.decode(in_stream):
                if written == 0:
                    # The display matrix lives in the container, not in the pixels: carry it over, or a
                    # phone video comes out sideways (training and reconstruct apply it when decoding).
                    matrix = display_matrix(frame)
                    if matrix is not None:
                        stream.set_display_matrix(matrix)
                if (frame.width, frame.height, frame.format.name) != (width, height, "yuv420p"):
                    frame = frame.reformat(width=width, height=height, format="yuv420p", interpolation="AREA")
                frame.pts, frame.time_base = written, 1 / rate
                for packet in stream.encode(frame):
                    out.mux(packet)
                written += 1
            for packet in stream.encode():
                out.mux(packet)
    if written == 0:
        raise ValueError("no frame could be decoded")
    return written
