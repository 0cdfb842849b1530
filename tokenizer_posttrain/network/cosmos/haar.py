"""3D Haar wavelet patcher and unpatcher (architecture doc, section 3).

Each level maps every 2x2x2 cube to 8 sub-bands ``(1/8) * sum(+-x)``, band index
``4*b_t + 2*b_h + b_w`` as the outer channel index. We compute the closed form with
reshapes instead of grouped convolutions; the two agree to ~1e-6 in fp32. Sizes are
even at every level for the shapes the tokenizer accepts (validated upstream), so the
reference's end-reflection padding is never read and is not needed here.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .blocks import replicate_first_frame

_TAP = 1.0 / math.sqrt(2.0)


def _sum_diff(x: torch.Tensor, dim: int, out_dim: int) -> torch.Tensor:
    """Split ``dim`` (size 2) into its low (sum) and high (difference) band at ``out_dim``."""
    a, b = x.select(dim, 0), x.select(dim, 1)
    return torch.stack([a + b, a - b], dim=out_dim)


def haar_analysis(x: torch.Tensor) -> torch.Tensor:
    """One level: ``[B, G, T, H, W]`` (even sizes) -> ``[B, 8G, T/2, H/2, W/2]``."""
    b, g, t, h, w = x.shape
    y = x.reshape(b, g, t // 2, 2, h // 2, 2, w // 2, 2)
    y = _sum_diff(y, 3, 1)  # [B, bt, G, T2, H2, 2, W2, 2]
    y = _sum_diff(y, 5, 2)  # [B, bt, bh, G, T2, H2, W2, 2]
    y = _sum_diff(y, 7, 3)  # [B, bt, bh, bw, G, T2, H2, W2]
    return y.reshape(b, 8 * g, t // 2, h // 2, w // 2) * 0.125


def haar_synthesis(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`haar_analysis`: ``[B, 8G, T, H, W]`` -> ``[B, G, 2T, 2H, 2W]``."""
    b, c, t, h, w = x.shape
    g = c // 8
    y = x.reshape(b, 2, 2, 2, g, t, h, w)
    y = _sum_diff(y, 3, 7)  # merge W: [B, bt, bh, G, T, H, W, 2]
    y = _sum_diff(y, 2, 5)  # merge H: [B, bt, G, T, H, 2, W, 2]
    y = _sum_diff(y, 1, 3)  # merge T: [B, G, T, 2, H, 2, W, 2]
    return y.reshape(b, g, 2 * t, 2 * h, 2 * w)


class _HaarLevels(nn.Module):
    """What :class:`Patcher3D` and :class:`UnPatcher3D` share: ``log2(patch_size)`` Haar levels, and the
    official checkpoints' buffers."""

    def __init__(self, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.levels = int(math.log2(patch_size))
        # Kept only so the state_dict matches the official checkpoints key for key.
        self.register_buffer("wavelets", torch.full((2,), _TAP, dtype=torch.float32))
        self.register_buffer("_arange", torch.arange(2, dtype=torch.int64))


class Patcher3D(_HaarLevels):
    """Video ``[B, C, T, H, W]`` -> ``[B, C*p^3, (T+p-1)/p, H/p, W/p]`` Haar coefficients."""

    def __init__(self, patch_size: int) -> None:
        super().__init__(patch_size)
        self.register_buffer("patch_size_buffer", torch.tensor([patch_size], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = replicate_first_frame(x, self.patch_size - 1)
        for _ in range(self.levels):
            x = haar_analysis(x)
        return x


class UnPatcher3D(_HaarLevels):
    """Inverse of :class:`Patcher3D`, dropping the ``p-1`` replicated leading frames."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.levels):
            x = haar_synthesis(x)
        return x[:, :, self.patch_size - 1 :]
