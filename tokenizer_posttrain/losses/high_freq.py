"""High-frequency (edge) loss of NVIDIA's Cosmos tokenizer trainer: L1 between the Laplacians of every frame of
input and reconstruction, per RGB channel.

The Laplacian is the 5-point stencil ``[[0, 1, 0], [1, -4, 1], [0, 1, 0]]``: at each pixel, the sum of the
differences to its four neighbours. It is linear, so the Laplacian of the difference of the videos is taken,
once, as shifted differences that Inductor fuses with the rest of the term (no frames folded into the batch,
no depthwise convolution). Only neighbours that count enter a pixel's sum: outside the frame and masked-out
pixels are treated as copies of the pixel itself (replicate padding at the border), so a masked-out pixel
changes nothing, and a constant frame has a Laplacian of 0 everywhere, its border included.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from .context import StepContext
from .l1 import masked_mean
from .terms import LossTerm, TermConfig


@dataclass
class HighFreqConfig(TermConfig):
    """L1 between the Laplacians (3x3, per frame and RGB channel) of input and reconstruction, over the counted
    pixels: sharpens edges and fine detail."""

    def build(self) -> "HighFreqLoss":
        return HighFreqLoss(self)


def masked_laplacian(video: Tensor, mask: Tensor) -> Tensor:
    """The Laplacian of every frame and channel of ``video`` ``[B, C, T, H, W]`` (fp32), each pixel's sum taken over
    its neighbours where ``mask`` ``[B, 1, T, H, W]`` is 1 (and inside the frame)."""
    video, mask = video.float(), mask.float()
    # Each difference to a neighbour, kept where both pixels count: across columns, then across rows.
    across_w = (video[..., 1:] - video[..., :-1]) * (mask[..., 1:] * mask[..., :-1])
    across_h = (video[..., 1:, :] - video[..., :-1, :]) * (mask[..., 1:, :] * mask[..., :-1, :])
    # Pixel j: (x[j+1] - x[j]) - (x[j] - x[j-1]) along each axis; a missing neighbour adds 0.
    along_w = F.pad(across_w, (0, 1)) - F.pad(across_w, (1, 0))
    along_h = F.pad(across_h, (0, 0, 0, 1)) - F.pad(across_h, (0, 0, 1, 0))
    return along_w + along_h


def masked_laplacian_l1(reconstruction: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean absolute difference of the :func:`masked_laplacian` of ``[B, C, T, H, W]`` videos over the pixels and
    channels where ``mask`` ``[B, 1, T, H, W]`` is 1 (fp32)."""
    # One Laplacian, of the difference: the filter is linear.
    return masked_mean(masked_laplacian(reconstruction.float() - target.float(), mask).abs(), mask)


class HighFreqLoss(LossTerm):
    """:func:`masked_laplacian_l1` as a loss term."""

    def __init__(self, config: HighFreqConfig) -> None:
        super().__init__()
        self.config = config

    def forward(self, context: StepContext) -> Tensor:
        return masked_laplacian_l1(context.reconstruction, context.target, context.mask)
