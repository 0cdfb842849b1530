"""Display orientation of a video: the display matrix (phone videos store the picture sideways plus a
matrix that says how to turn it) as quarter turns and a mirror, applied to decoded frames.

FFmpeg's decoders do not apply the matrix; its command-line tool does (``autorotate``), and so do
players. The 8 axis-aligned matrices map to the same pictures as ``ffmpeg``'s autorotate (checked in
``tests/data/test_orientation.py`` against the ``ffmpeg`` binary of imageio-ffmpeg); other angles
are refused, since cropping a tilted picture would invent its corners.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import av
import numpy as np
import torch

_DISPLAYMATRIX = "DISPLAYMATRIX"

# Signs of the display matrix's (a, b, c, d) = (m[0], m[1], m[3], m[4]) -> (counter-clockwise quarter
# turns of numpy's rot90, then mirror left-right), matched to ffmpeg's autorotate output.
_BY_SIGNS: dict[tuple[int, int, int, int], tuple[int, bool]] = {
    (1, 0, 0, 1): (0, False),
    (-1, 0, 0, 1): (0, True),
    (1, 0, 0, -1): (2, True),
    (-1, 0, 0, -1): (2, False),
    (0, -1, 1, 0): (1, False),
    (0, -1, -1, 0): (1, True),
    (0, 1, -1, 0): (3, False),
    (0, 1, 1, 0): (3, True),
}


class UnsupportedOrientation(ValueError):
    """A display matrix that is not a multiple of 90 degrees (with or without a mirror)."""


@dataclass(frozen=True)
class Orientation:
    """How to turn a decoded (stored) frame into the displayed one: ``quarter_turns`` counter-clockwise
    turns (numpy's ``rot90``), then a left-right mirror when ``mirror``."""

    quarter_turns: int = 0
    mirror: bool = False

    @property
    def is_identity(self) -> bool:
        return self.quarter_turns == 0 and not self.mirror

    @property
    def swaps_sides(self) -> bool:
        """True when the displayed width is the stored height (a 90 or 270 degree turn)."""
        return self.quarter_turns % 2 == 1

    def display_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) as displayed, for a stored ``width x height`` frame."""
        return (height, width) if self.swaps_sides else (width, height)

    def describe(self) -> str:
        """E.g. ``"rotated 90 degrees clockwise"``, ``"mirrored"``; ``"as stored"`` for none."""
        turns = {1: "rotated 90 degrees counter-clockwise", 2: "rotated 180 degrees", 3: "rotated 90 degrees clockwise"}
        parts = [turns[self.quarter_turns]] if self.quarter_turns else []
        if self.mirror:
            parts.append("mirrored left-right")
        return ", then ".join(parts) or "as stored"

    def apply_numpy(self, image: np.ndarray) -> np.ndarray:
        """A stored ``[H, W, ...]`` image as displayed (a view where possible)."""
        out = np.rot90(image, self.quarter_turns, axes=(0, 1))
        return out[:, ::-1] if self.mirror else out

    def apply_torch(self, images: torch.Tensor) -> torch.Tensor:
        """Stored ``[..., H, W]`` images as displayed."""
        out = torch.rot90(images, self.quarter_turns, dims=(-2, -1)) if self.quarter_turns else images
        return out.flip(-1) if self.mirror else out

    def stored_box(
        self, top: int, left: int, height: int, width: int, stored_width: int, stored_height: int
    ) -> tuple[int, int, int, int]:
        """The rectangle ``(top, left, height, width)`` of a stored ``stored_width x stored_height`` frame
        that becomes the displayed rectangle ``(top, left, height, width)`` after :meth:`apply_numpy`."""
        display_width, _ = self.display_size(stored_width, stored_height)
        corners = [
            self._stored_pixel(row, col, display_width, stored_width, stored_height)
            for row, col in ((top, left), (top + height - 1, left + width - 1))
        ]
        rows, cols = zip(*corners, strict=True)
        return min(rows), min(cols), max(rows) - min(rows) + 1, max(cols) - min(cols) + 1

    def _stored_pixel(self, row: int, col: int, display_width: int, width: int, height: int) -> tuple[int, int]:
        if self.mirror:
            col = display_width - 1 - col
        # numpy's rot90 by k: out[i, j] = in[j, W-1-i] (k=1), in[H-1-i, W-1-j] (k=2), in[H-1-j, i] (k=3)
        return {
            0: (row, col),
            1: (col, width - 1 - row),
            2: (height - 1 - row, width - 1 - col),
            3: (height - 1 - col, row),
        }[self.quarter_turns]


NONE = Orientation()


def display_matrix(frame: av.VideoFrame) -> tuple[int, ...] | None:
    """The 9 integers of the frame's display matrix side data (FFmpeg's layout), or None."""
    for side_data in frame.side_data:
        if _DISPLAYMATRIX in str(side_data.type):
            raw = bytes(side_data)
            if len(raw) >= 36:
                return struct.unpack("<9i", raw[:36])
    return None


def orientation_of(matrix: tuple[int, ...] | None) -> Orientation:
    """The :class:`Orientation` of a display matrix (None: as stored).

    Raises :class:`UnsupportedOrientation` for a matrix that is not a multiple of 90 degrees.
    """
    if matrix is None:
        return NONE
    a, b, _, c, d = matrix[:5]
    signs = tuple(int(np.sign(v)) for v in (a, b, c, d))
    if signs not in _BY_SIGNS:
        degrees = round(math.degrees(math.atan2(b, a)))
        raise UnsupportedOrientation(
            f"the display matrix turns the picture by {degrees} degrees; only multiples of 90 are supported "
            "(re-encode it upright, e.g. with ffmpeg, which applies the matrix)"
        )
    quarter_turns, mirror = _BY_SIGNS[signs]
    return Orientation(quarter_turns, mirror)


def frame_orientation(frame: av.VideoFrame) -> Orientation:
    """The display orientation a decoded frame carries (see :func:`orientation_of`)."""
    return orientation_of(display_matrix(frame))
