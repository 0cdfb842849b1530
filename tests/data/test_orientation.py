"""Display matrices: the 8 upright turns match what ffmpeg (and so every player) shows; crop boxes map back."""

from __future__ import annotations

import io
import re
import subprocess
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from tests.videos import encode_video
from tokenizer_posttrain.data.orientation import (
    Orientation,
    UnsupportedOrientation,
    display_matrix,
    frame_orientation,
    orientation_of,
)

CORNERS = np.zeros((1, 32, 64, 3), np.uint8)
CORNERS[0, :8, :8] = (255, 0, 0)  # red top left, green top right, blue bottom left: any turn is visible
CORNERS[0, :8, -8:] = (0, 255, 0)
CORNERS[0, -8:, :8] = (0, 0, 255)


def ffmpeg_shows(path: Path) -> np.ndarray:
    """The first frame as the ffmpeg command line shows it (it applies the display matrix)."""
    import imageio_ffmpeg

    exe = imageio_ffmpeg.get_ffmpeg_exe()
    result = subprocess.run(
        [exe, "-i", str(path), "-frames:v", "1", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
        capture_output=True,
        check=True,
    )
    # the output stream's size, as ffmpeg logs it: "Video: rawvideo (...), rgb24(...), 32x64, ..."
    width, height = map(int, re.search(r"Video: rawvideo.*?, (\d+)x(\d+)", result.stderr.decode()).groups())
    return np.frombuffer(result.stdout, np.uint8).reshape(height, width, 3)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
def test_turns_match_ffmpeg_autorotate(rotation: int, mirror: bool, tmp_path: Path) -> None:
    data = encode_video(1, 32, 64, codec="libx264", pix_fmt="yuv444p", rotation=rotation, mirror=mirror, images=CORNERS)
    path = tmp_path / "turned.mp4"
    path.write_bytes(data)
    with av.open(io.BytesIO(data)) as container:
        frame = next(container.decode(video=0))
        orientation = frame_orientation(frame)
        stored = frame.to_ndarray(format="rgb24")
    shown = ffmpeg_shows(path)
    ours = orientation.apply_numpy(stored)
    assert ours.shape == shown.shape
    assert np.abs(ours.astype(int) - shown.astype(int)).max() < 40
    assert orientation.display_size(64, 32) == (shown.shape[1], shown.shape[0])
    assert orientation.is_identity == (display_matrix(frame) is None or (rotation, mirror) == (0, False))
    as_torch = orientation.apply_torch(torch.from_numpy(np.ascontiguousarray(stored)).permute(2, 0, 1))
    assert np.array_equal(as_torch.permute(1, 2, 0).numpy(), ours)


@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_stored_box_is_the_crop_before_turning(turns: int, mirror: bool) -> None:
    stored = np.arange(5 * 7).reshape(5, 7)
    orientation = Orientation(turns, mirror)
    shown = orientation.apply_numpy(stored)
    width, height = orientation.display_size(7, 5)
    assert shown.shape == (height, width)
    for top, left, h, w in [(0, 0, 1, 1), (1, 2, 2, 3), (0, 0, height, width), (height - 2, width - 3, 2, 3)]:
        s_top, s_left, s_h, s_w = orientation.stored_box(top, left, h, w, 7, 5)
        crop = stored[s_top : s_top + s_h, s_left : s_left + s_w]
        assert np.array_equal(orientation.apply_numpy(crop), shown[top : top + h, left : left + w])


def test_other_angles_are_refused_with_the_angle() -> None:
    assert orientation_of(None) == Orientation()
    with pytest.raises(UnsupportedOrientation, match="by 45 degrees; only multiples of 90"):
        orientation_of((46341, 46341, 0, -46341, 46341, 0, 0, 0, 1 << 30))


def test_descriptions() -> None:
    assert Orientation(3).describe() == "rotated 90 degrees clockwise"
    assert Orientation(1, True).describe() == "rotated 90 degrees counter-clockwise, then mirrored left-right"
    assert Orientation().describe() == "as stored"
