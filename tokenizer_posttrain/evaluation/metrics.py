"""Every metric of a reconstruction, in one place: PSNR and SSIM per clip (on whatever scale the caller
gives, with its data range), temporal flicker, codebook usage, and how far latents or tokens moved."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

from .media import to_unit


def clip_psnr(reconstruction: Tensor, target: Tensor, data_range: float = 1.0) -> Tensor:
    """PSNR in dB of each clip ``[B, C, T, H, W]``, with pixel values spanning ``data_range``: ``[B]``."""
    dims = tuple(range(1, target.dim()))
    return peak_signal_noise_ratio(reconstruction, target, data_range=data_range, reduction="none", dim=dims)


def clip_ssim(reconstruction: Tensor, target: Tensor, data_range: float = 1.0) -> Tensor:
    """SSIM of every frame of each clip ``[B, C, T, H, W]``, averaged over the clip's frames: ``[B]``."""
    b, c, t, h, w = target.shape

    def frames(video: Tensor) -> Tensor:
        return video.transpose(1, 2).reshape(b * t, c, h, w)

    ssim = structural_similarity_index_measure(
        frames(reconstruction), frames(target), data_range=data_range, reduction="none"
    )
    return ssim.view(b, t).mean(dim=1)


def video_psnr(reconstruction: Tensor, target: Tensor) -> Tensor:
    """Mean PSNR in dB of [-1, 1] clips, on the [0, 1] scale (validation's ``val/psnr``)."""
    return clip_psnr(to_unit(reconstruction), to_unit(target)).mean()


def video_ssim(reconstruction: Tensor, target: Tensor) -> Tensor:
    """Mean SSIM of [-1, 1] clips, on the [0, 1] scale (validation's ``val/ssim``)."""
    return clip_ssim(to_unit(reconstruction), to_unit(target)).mean()


def temporal_flicker(reconstruction: Tensor, target: Tensor) -> Tensor:
    """Mean over t of ``|e_t - e_(t-1)|``, ``e = reconstruction - target`` on the [0, 1] scale: ``[B]``.

    An error that stays put (a constant colour shift, a blur of a still scene) scores 0; one that changes from
    frame to frame, which viewers see as flicker, scores high. Single-frame clips score 0.
    """
    error = to_unit(reconstruction) - to_unit(target)
    if error.shape[2] < 2:
        return torch.zeros(error.shape[0], device=error.device)
    return (error[:, :, 1:] - error[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4))


def codebook_stats(histogram: Tensor) -> tuple[float, float]:
    """(fraction of the codebook used, perplexity ``exp(entropy)``) of a code-count histogram."""
    counts = histogram.double()
    probs = counts[counts > 0] / counts.sum()
    entropy = -(probs * probs.log()).sum().item()
    return (counts > 0).sum().item() / counts.numel(), math.exp(entropy)


def latent_drift(latent: Tensor, base: Tensor) -> Tensor:
    """Relative L2 distance ``||z - z_base|| / ||z_base||`` of each clip's CV latent: ``[B]``."""
    diff = (latent.float() - base.float()).flatten(1).norm(dim=1)
    return diff / base.float().flatten(1).norm(dim=1).clamp_min(1e-12)


def token_flip_rate(indices: Tensor, base: Tensor) -> Tensor:
    """Fraction of each clip's DV token positions whose index differs from the baseline's: ``[B]``."""
    return (indices != base).flatten(1).float().mean(dim=1)
