"""probe_video on small real files of each container/codec, and clip_problems' verdicts."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from tests.videos import bigbuckbunny, encode_video, faststart, write_video
from tokenizer_posttrain.data.orientation import Orientation
from tokenizer_posttrain.data.probe import Problem, VideoInfo, VideoProbeError, clip_problems, probe_video


def audio_only_mp4() -> bytes:
    """An mp4 with one AAC stream and no video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        for i in range(4):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("codec", "container", "name"),
    [
        ("libx264", "mp4", "h264"),
        ("libx264", "matroska", "h264"),  # mkv stores no frame count: packets are counted
        ("libvpx-vp9", "webm", "vp9"),
        ("mpeg4", "avi", "mpeg4"),
        ("libx264", "mov", "h264"),
    ],
)
@pytest.mark.parametrize(("fps", "height", "width"), [(10, 64, 96), (24, 144, 256), (30, 96, 64)])
def test_probe_values(codec: str, container: str, name: str, fps: int, height: int, width: int) -> None:
    data = encode_video(17, height, width, fps=fps, codec=codec, container=container)
    info = probe_video(data)
    promised = 0 if container in ("matroska", "webm") else 17  # mkv and webm state no frame count
    assert info == VideoInfo(
        frames=17, fps=pytest.approx(fps), width=width, height=height, duration=pytest.approx(17 / fps, abs=0.05),
        codec=name, variable_fps=False, promised=promised, keyframes=info.keyframes,
    )  # fmt: skip
    assert info.keyframes >= 1
    assert probe_video(data, deep=True) == info


def test_probe_path_bytes_and_file_agree(tmp_path: Path) -> None:
    path = write_video(tmp_path / "clip.mkv", 12, 64, 96, fps=24)
    with open(path, "rb") as f:
        from_file = probe_video(f)
    assert probe_video(path) == probe_video(str(path)) == probe_video(path.read_bytes()) == from_file


def test_probe_ntsc_rate() -> None:
    info = probe_video(encode_video(12, 64, 96, fps=30000 / 1001))
    assert info.fps == pytest.approx(29.97, abs=1e-3)
    assert not info.variable_fps


def test_probe_real_footage() -> None:
    info = probe_video(bigbuckbunny())
    assert (info.frames, info.fps, info.width, info.height, info.codec) == (132, 25.0, 1280, 720, "h264")
    assert info.duration == pytest.approx(5.28)
    assert not info.variable_fps


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_probe_variable_fps(container: str) -> None:
    info = probe_video(encode_video(20, 64, 96, fps=30, container=container, pts_steps=[33, 33, 100, 17]))
    assert info.variable_fps
    assert info.frames == 20
    assert info.fps == pytest.approx(20 / info.duration, rel=0.1)  # the average, not the nominal 30


def test_probe_millisecond_rounding_is_not_vfr() -> None:
    # mkv stores 1/120 s steps as 8 or 9 ms: that jitter must not read as variable frame rate
    assert not probe_video(encode_video(30, 64, 96, fps=120, container="matroska")).variable_fps


@pytest.mark.parametrize(
    "data",
    [b"", b"this is not a video" * 50, encode_video(20, 64, 96)[:2000], encode_video(20, 64, 96)[:-100]],
    ids=["empty", "text", "truncated_head", "truncated_index"],
)
def test_probe_unreadable(data: bytes) -> None:
    with pytest.raises(VideoProbeError, match=r"^unreadable \(") as err:
        probe_video(data)
    assert err.value.code == "unreadable"
    problem = err.value.problem()
    assert (problem.severity, problem.code) == ("error", "unreadable")


def test_probe_truncated_mkv_counts_what_is_left() -> None:
    data = encode_video(30, 64, 96, container="matroska")
    info = probe_video(data[: len(data) // 2])
    assert 0 < info.frames < 30


@pytest.mark.parametrize("fraction", [0.25, 0.4, 0.5])
def test_probe_finds_a_faststart_mp4_cut_short(fraction: float, tmp_path: Path) -> None:
    # The index at the front still promises all 72 frames; the frames after the cut are gone.
    data = faststart(encode_video(72, 64, 96, fps=24), tmp_path / "whole.mp4")
    info = probe_video(data[: int(len(data) * fraction)])
    assert info.promised == 72
    assert 0.5 * fraction * 72 < info.frames < fraction * 72 + 3
    # A cut inside a frame's packet, or (when the cut falls on a packet boundary) right after a whole one.
    assert info.damage.startswith(("the file ends inside frame", "the file ends after frame")), info.damage
    # even a clip short enough to fit in the readable part is refused: the file is damaged
    problems = {p.code: p for p in clip_problems(info, frames=9, crop=64)}
    assert problems["partial_video"].severity == "error"
    assert f"{info.frames} of 72 frames readable" in problems["partial_video"].message
    whole = probe_video(data)
    assert whole.keyframes >= 1
    assert whole == VideoInfo(
        frames=72, fps=24.0, width=96, height=64, duration=pytest.approx(3.0), codec="h264", variable_fps=False,
        promised=72, keyframes=whole.keyframes,
    )  # fmt: skip


def test_deep_probe_finds_damage_the_tail_check_cannot_see() -> None:
    # Garbage inside the first third: every packet is whole, the last keyframe's frames decode.
    damaged = bytearray(encode_video(72, 96, 160, gop=8))
    at = len(damaged) // 3
    damaged[at : at + 2000] = np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    fast, deep = probe_video(bytes(damaged)), probe_video(bytes(damaged), deep=True)
    assert (fast.frames, fast.damage) == (72, "")
    assert 0 < deep.frames < 72 and deep.promised == 72
    assert f"frame {deep.frames + 1} does not decode" in deep.damage
    assert "partial_video" in {p.code for p in clip_problems(deep, 9, 64)}


def test_probe_reads_the_display_matrix() -> None:
    # A phone-style portrait video: stored 96x64 landscape, shown turned 90 degrees clockwise.
    info = probe_video(encode_video(12, 64, 96, rotation=-90))
    assert (info.width, info.height) == (96, 64)
    assert info.orientation == Orientation(quarter_turns=3) and info.display_size() == (64, 96)
    assert probe_video(encode_video(12, 64, 96)).display_matrix is None
    (small,) = [p for p in clip_problems(info, 9, 80) if p.code == "too_small"]
    assert "frame 64x96 is smaller" in small.message  # the size as shown, and as training decodes it


def test_clip_problems_unsupported_rotation() -> None:
    tilted = (46341, 46341, 0, -46341, 46341, 0, 0, 0, 1 << 30)  # 45 degrees
    problems = {p.code: p for p in clip_problems(_info(display_matrix=tilted), 33, 256)}
    assert problems["unsupported_rotation"].severity == "error"
    assert "45 degrees" in problems["unsupported_rotation"].message


def test_probe_no_video_stream() -> None:
    with pytest.raises(VideoProbeError, match="no video stream") as err:
        probe_video(audio_only_mp4())
    assert err.value.code == "no_video_stream"


def test_probe_missing_file(tmp_path: Path) -> None:
    with pytest.raises(VideoProbeError, match="unreadable"):
        probe_video(tmp_path / "missing.mp4")


def _info(**kw: object) -> VideoInfo:
    base = dict(frames=100, fps=24.0, width=1280, height=720, duration=100 / 24, codec="h264", variable_fps=False)
    return VideoInfo(**{**base, **kw})


def _codes(problems: list[Problem]) -> dict[str, str]:
    return {p.code: p.severity for p in problems}


def test_clip_problems_clean() -> None:
    assert clip_problems(_info(), frames=33, crop=256) == []
    assert clip_problems(_info(fps=29.97), 33, 256) == []
    assert clip_problems(_info(fps=30000 / 1001, width=1080, height=1920), 33, 256) == []


def test_clip_problems_too_few_frames() -> None:
    problems = clip_problems(_info(frames=20), frames=33, crop=256)
    assert _codes(problems) == {"too_few_frames": "error"}
    assert "20" in problems[0].message and "33" in problems[0].message
    assert clip_problems(_info(frames=33), frames=33, crop=256) == []


def test_clip_problems_too_small_and_resize() -> None:
    small = _info(width=480, height=270)
    assert _codes(clip_problems(small, 33, 256)) == {"low_resolution": "warning"}
    problems = clip_problems(small, 33, 300)
    assert _codes(problems) == {"too_small": "error", "low_resolution": "warning"}
    assert "480x270" in problems[0].message and "300x300" in problems[0].message
    # resizing the short side to 320 makes the frame 569x320: big enough for a 300 crop
    assert _codes(clip_problems(small, 33, 300, resize_short_side=320)) == {"low_resolution": "warning"}
    # resizing a 720p frame down to 128 makes it too small for 256
    problems = clip_problems(_info(), 33, 256, resize_short_side=128)
    assert _codes(problems) == {"too_small": "error"}
    assert "228x128" in problems[0].message


def test_clip_problems_warnings() -> None:
    assert _codes(clip_problems(_info(width=960, height=540), 33, 256)) == {"low_resolution": "warning"}
    problems = clip_problems(_info(width=640, height=360), 33, 256)
    assert "720p is the recommended minimum" in problems[0].message
    assert _codes(clip_problems(_info(variable_fps=True), 33, 256)) == {"variable_fps": "warning"}
    for fps in (5.0, 15.0, 27.0, 240.0):
        assert _codes(clip_problems(_info(fps=fps), 33, 256)) == {"odd_fps": "warning"}, fps
    for fps in (23.976, 24.0, 25.0, 50.0, 59.94, 60.0, 100.0, 120.0):
        assert clip_problems(_info(fps=fps), 33, 256) == [], fps


def test_clip_problems_several_at_once() -> None:
    info = _info(frames=5, width=96, height=64, fps=10.0, variable_fps=True)
    assert _codes(clip_problems(info, 33, 256)) == {
        "too_few_frames": "error",
        "too_small": "error",
        "low_resolution": "warning",
        "variable_fps": "warning",
        "odd_fps": "warning",
    }


def test_probe_counts_keyframes() -> None:
    assert probe_video(bigbuckbunny()).keyframes == 1  # the sample as shipped: one keyframe in 132 frames
    assert probe_video(encode_video(40, 32, 48, gop=8)).keyframes >= 5


def test_clip_problems_long_gop_warns_with_the_decoding_it_costs() -> None:
    # 1000 frames, 4 keyframes: GOP 250, a 33-frame clip decodes 33 + 124.5 frames against 33 + 7.5 transcoded.
    problems = clip_problems(_info(frames=1000, keyframes=4), 33, 256)
    assert _codes(problems) == {"long_gop": "warning"}
    message = problems[0].message
    assert "every 250 frames" in message and "about 158 frames, 3.9x the pixels" in message
    assert "make-shards --transcode (a keyframe" in message and "data.start=keyframe" in message
    assert "docs/data.md, Real footage" in message
    # One keyframe in 132 frames: only 100 starts, 49.5 frames wasted on average; keyframe starts not offered.
    (single,) = clip_problems(_info(frames=132, keyframes=1), 33, 256)
    assert "about 82 frames, 2.0x" in single.message and "data.start" not in single.message
    # Frames that training shrinks while decoding: transcoding them smaller saves that work too.
    (shrunk,) = clip_problems(_info(frames=132, keyframes=1, width=1920, height=1080), 33, 256, 256)
    assert "about 82 frames of 1920x1080" in shrunk.message and "--max-height 256 (a keyframe" in shrunk.message
    assert "36.3x the pixels" in shrunk.message  # 82.5 / 40.5 frames x (1080 / 256)^2 pixels
    # Portrait: the short side is the width, so the height stays at 256 x 1920 / 1080, rounded up to even.
    (tall,) = clip_problems(_info(frames=132, keyframes=1, width=1080, height=1920), 33, 256, 256)
    assert "--max-height 456 (a keyframe" in tall.message
    (kept,) = clip_problems(_info(frames=132, keyframes=1, width=1920, height=1080), 33, 256, 1080)
    assert "--max-height" not in kept.message and "of 1920x1080" not in kept.message
    # A keyframe every 16 or 48 frames (shipped by many cameras at 1-2 s): less than 1.5x, no warning.
    assert clip_problems(_info(frames=480, keyframes=30), 33, 256) == []
    assert clip_problems(_info(frames=480, keyframes=10), 33, 256) == []
    assert clip_problems(_info(frames=480, keyframes=0), 33, 256) == []  # not counted: nothing said
