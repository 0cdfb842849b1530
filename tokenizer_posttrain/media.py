"""Writing videos for people to look at (validation side-by-sides)."""

from __future__ import annotations

from pathlib import Path

import torch

from .metrics import to_unit


def side_by_side_frames(target: torch.Tensor, reconstruction: torch.Tensor) -> torch.Tensor:
    """One clip ``[3, T, H, W]`` each in [-1, 1] -> uint8 frames ``[T, H, 2W, 3]``: input | reconstruction."""
    both = torch.cat([to_unit(target), to_unit(reconstruction)], dim=-1)
    return (both * 255 + 0.5).to(torch.uint8).permute(1, 2, 3, 0).cpu()


def write_mp4(path: Path, frames: torch.Tensor, fps: int = 8) -> Path:
    """Write uint8 ``[T, H, W, 3]`` frames as h264 mp4 (bundled FFmpeg via PyAV)."""
    import imageio.v3 as iio

    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, frames.numpy(), plugin="pyav", codec="libx264", fps=fps)
    return path
