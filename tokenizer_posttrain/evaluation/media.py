"""Video tensors for people to look at: [-1, 1] clips as [0, 1] or uint8 pixels and frames, and mp4 files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor


def to_unit(video: Tensor) -> Tensor:
    """[-1, 1] -> [0, 1] (the NeMo module's x + 0.5 washes videos out), fp32, clamped."""
    return ((video.float() + 1) / 2).clamp(0, 1)


def to_uint8(video: Tensor) -> Tensor:
    """[-1, 1] video -> uint8 (0..255, rounded, clamped), the pixels a viewer of the decoded video gets."""
    return (to_unit(video) * 255).round().to(torch.uint8)


def to_frames(video: Tensor) -> Tensor:
    """One clip ``[3, T, H, W]`` (or a batch of one) in [-1, 1] -> uint8 frames ``[T, H, W, 3]`` on the CPU."""
    if video.dim() == 5:
        video = video[0]
    return to_uint8(video).permute(1, 2, 3, 0).cpu()


def side_by_side_frames(target: Tensor, reconstruction: Tensor) -> Tensor:
    """One clip ``[3, T, H, W]`` each in [-1, 1] -> uint8 frames ``[T, H, 2W, 3]``: input | reconstruction."""
    return to_frames(torch.cat([target, reconstruction], dim=-1))


PANEL_MIN_WIDTH = 192
"""Panels of labelled videos are scaled up (by a whole factor, pixels kept sharp) to at least this width, so a
64-pixel clip is big enough to look at and its label fits."""
LABEL_HEIGHT = 20
"""Height of the strip above labelled panels that holds their names."""


def labelled_panels(panels: list[Tensor], labels: list[str]) -> Tensor:
    """uint8 frames ``[T, H, W, 3]`` of each panel side by side under a strip naming them (e.g. ``input |
    baseline | post-trained``): ``[T, LABEL_HEIGHT + s*H, s*len(panels)*W, 3]``, each panel scaled by the whole
    factor ``s`` that makes it at least :data:`PANEL_MIN_WIDTH` wide."""
    from PIL import Image, ImageDraw, ImageFont

    if len(panels) != len(labels) or not panels:
        raise ValueError(f"{len(panels)} panels and {len(labels)} labels: one label per panel")
    frames, height, width, _ = panels[0].shape
    scale = max(1, -(-PANEL_MIN_WIDTH // width))
    row = torch.cat(panels, dim=2)
    if scale > 1:
        row = row.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
    strip = Image.new("RGB", (row.shape[2], LABEL_HEIGHT))
    draw = ImageDraw.Draw(strip)
    font = ImageFont.load_default(size=LABEL_HEIGHT - 6)
    for i, label in enumerate(labels):
        centre = (i + 0.5) * width * scale
        draw.text((centre, LABEL_HEIGHT / 2), label, fill=(255, 255, 255), font=font, anchor="mm")
    header = torch.from_numpy(np.asarray(strip).copy()).expand(frames, -1, -1, -1)
    return torch.cat([header, row], dim=1)


def write_mp4(path: Path, frames: Tensor, fps: float = 8) -> Path:
    """Write uint8 ``[T, H, W, 3]`` frames as h264 mp4 (bundled FFmpeg via PyAV) at ``fps`` frames a second
    (fractional rates such as 29.97 are kept)."""
    import imageio.v3 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, frames.numpy(), plugin="pyav", codec="libx264", fps=float(fps))
    return path
