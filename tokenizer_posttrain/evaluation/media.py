"""Video tensors for people to look at: [-1, 1] clips as [0, 1] or uint8 pixels and frames, and mp4 files."""

from __future__ import annotations

from pathlib import Path

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


def write_mp4(path: Path, frames: Tensor, fps: int = 8) -> Path:
    """Write uint8 ``[T, H, W, 3]`` frames as h264 mp4 (bundled FFmpeg via PyAV)."""
    import imageio.v3 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, frames.numpy(), plugin="pyav", codec="libx264", fps=fps)
    return path
