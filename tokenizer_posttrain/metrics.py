"""Reconstruction losses and metrics on [-1, 1] videos ``[B, 3, T, H, W]``."""

from __future__ import annotations

from torch import Tensor
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure


def masked_l1(reconstruction: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean absolute error over the pixels where ``mask`` is 1 (computed in fp32)."""
    mask = mask.float().expand_as(target)
    return ((reconstruction.float() - target.float()).abs() * mask).sum() / mask.sum().clamp_min(1)


def to_unit(video: Tensor) -> Tensor:
    """[-1, 1] -> [0, 1] (the NeMo module's x + 0.5 washes videos out), fp32, clamped."""
    return ((video.float() + 1) / 2).clamp(0, 1)


def video_psnr(reconstruction: Tensor, target: Tensor) -> Tensor:
    """PSNR in dB of the [0, 1] videos, per clip, then averaged."""
    ref = to_unit(target)
    return peak_signal_noise_ratio(
        to_unit(reconstruction), ref, data_range=1.0, reduction="elementwise_mean", dim=tuple(range(1, ref.dim()))
    )


def video_ssim(reconstruction: Tensor, target: Tensor) -> Tensor:
    """SSIM of the [0, 1] videos, per frame, averaged."""

    def frames(video: Tensor) -> Tensor:
        b, c, t, h, w = video.shape
        return to_unit(video).transpose(1, 2).reshape(b * t, c, h, w)

    return structural_similarity_index_measure(frames(reconstruction), frames(target), data_range=1.0)
