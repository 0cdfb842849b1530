"""Temporal consistency term of NVIDIA's Cosmos tokenizer trainer: overlapping windows of a clip, each reconstructed
on its own, must agree on the frames they share (and, for continuous tokenizers, on the latent frames they share).

A clip ``[B, 3, T, H, W]`` is cut into the windows of ``window`` frames that start every ``step`` frames
(0, step, 2 step, ... while the window fits: ``M = (T - window) // step + 1`` of them), all stacked into the batch
dimension (``[B*M, 3, window, H, W]``, clip-major) so that the network runs once on them. Window ``i + 1`` starts
``step`` frames after window ``i``: its frames ``0 .. window-step-1`` are window ``i``'s frames
``step .. window-1``. The term is the mask-weighted L1 between those two reconstructions of the shared frames, over
every pair of neighbouring windows; for CV tokenizers plus the L1 between the shared latent frames (window ``i``'s
latent frames from ``step / temporal_compression`` on against window ``i + 1``'s), scaled as NVIDIA's trainer by
``3 * temporal_compression * spatial_compression**2 / latent channels`` (pixels per latent value), each latent value
weighted by the share of its pixels that the loss mask counts (all of them: NVIDIA's plain mean).

The term asks the step for one more network pass, on the windows (:meth:`ConsistencyTerm.extra_inputs`); the
step runs it (it owns the network) and hands the outputs over in the step's context. The math is here, pure tensor
code.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .context import NetworkOutput, StepContext
from .terms import Clips, LossTerm, TermConfig

WINDOWS = "consistency_windows"
"""The name of the extra pass on the windows, in the step's context."""
ConsistencyWindows = NetworkOutput
"""The network's outputs on the windows of :func:`cut_windows`, clip-major: reconstruction
``[B*M, 3, window, H, W]``, and for CV the latents ``[B*M, C, t, h, w]`` (None for DV: pixels only)."""


@dataclass
class ConsistencyConfig(TermConfig):
    """Windows of a clip reconstructed on their own must agree on their shared frames (and CV latents).

    NVIDIA's tokenizer trainers ship it off (``enabled=False``; when enabled, weight 1.0 from step 0, windows of 32
    frames every 8); weight 0 (default) here: off, and no extra network pass. It costs one more network pass per
    step, on ``(T - window) // step + 1`` windows of each clip.
    """

    window: int = 25
    """Frames per window, ``1 + k * temporal_compression`` (the trainers' 32 is no such length; 25 is, for 4x and
    8x models, and two windows 8 apart fit the default 33-frame clips), at most ``data.frames - step`` so that a clip
    holds two windows."""
    step: int = 8
    """Frames from one window's start to the next (the trainers' 8), below ``window`` so that windows overlap; for
    CV models a multiple of the temporal compression, so that the windows' latent frames line up."""

    def problems(self, key: str) -> list[str]:
        problems = super().problems(key)
        if self.window < 2:
            problems.append(f"{key}.window={self.window} must be >= 2 frames (1 + k * temporal compression)")
        if self.step < 1:
            problems.append(f"{key}.step={self.step} must be >= 1 frame")
        elif self.step >= self.window:
            problems.append(
                f"{key}.step={self.step} must be < {key}.window={self.window} for windows to overlap; "
                f"use a step of at most {self.window - 1}"
            )
        return problems

    def build(self) -> "ConsistencyTerm":
        return ConsistencyTerm(self)

    def clip_problems(self, key: str, clips: Clips) -> list[str]:
        """The windows must code whole latent frames, line up with the latents (CV) and overlap within a clip."""
        frames, continuous = clips.frames, clips.continuous
        tc, problems = clips.temporal_compression, []
        if self.window < 1 or (self.window - 1) % tc:
            lo = 1 + max(self.window - 1, 0) // tc * tc
            problems.append(f"{key}.window={self.window} is not 1+{tc}k frames (use {lo} or {lo + tc})")
        if continuous and self.step % tc:
            lo = self.step // tc * tc
            use = f"{lo} or {lo + tc}" if lo else f"{tc}"
            problems.append(
                f"{key}.step={self.step} is not a multiple of the temporal compression {tc}, so the windows' latent "
                f"frames do not line up (use {use})"
            )
        if self.window + self.step > frames:
            fit = 1 + (frames - self.step - 1) // tc * tc if frames - self.step >= 1 + tc else None
            hint = f"set {key}.window={fit}" if fit else f"lower {key}.step"
            problems.append(
                f"{key}.window={self.window} + {key}.step={self.step} > data.frames={frames}: a clip holds no two "
                f"overlapping windows; {hint} or raise data.frames to >= {self.window + self.step}"
            )
        return problems


def window_count(frames: int, window: int, step: int) -> int:
    """How many windows of ``window`` frames, starting every ``step`` frames, fit in ``frames`` frames."""
    return (frames - window) // step + 1 if frames >= window else 0


def cut_windows(video: Tensor, window: int, step: int) -> Tensor:
    """``[B, C, T, H, W]`` -> its windows ``[B*M, C, window, H, W]`` (window ``m`` of clip ``b`` at ``b*M + m``;
    frames ``m*step .. m*step + window - 1``), one copy, no loop."""
    b, c, t, h, w = video.shape
    if window_count(t, window, step) < 2:
        raise ValueError(
            f"loss.consistency: a clip of {t} frames holds no two windows of {window} frames {step} apart; "
            f"set loss.consistency.window + loss.consistency.step <= {t}"
        )
    # [B, C, M, H, W, window] -> [B, M, C, window, H, W]
    windows = video.unfold(2, window, step).permute(0, 2, 1, 5, 3, 4)
    return windows.reshape(-1, c, window, h, w)


def _neighbours(x: Tensor, clips: int, shift: int) -> tuple[Tensor, Tensor]:
    """Of windows ``x`` ``[B*M, C, N, ...]``: window ``i``'s frames from ``shift`` on and window ``i + 1``'s frames up
    to ``N - shift``, for every ``i < M - 1`` (the frames the two share), as ``[B, M-1, C, N-shift, ...]``."""
    x = x.reshape(clips, -1, *x.shape[1:])
    return x[:, :-1, :, shift:], x[:, 1:, :, : x.shape[3] - shift]


def latent_weights(mask: Tensor, temporal_compression: int, height: int, width: int) -> Tensor:
    """A causal window's pixel mask ``[N, 1, 1 + k tc, H, W]`` -> ``[N, 1, 1 + k, height, width]``: the share of each
    latent value's pixels that count (latent frame 0 stands for frame 0 alone, latent frame ``j`` for frames
    ``tc (j - 1) + 1 .. tc j``; each for its ``H / height x W / width`` block of pixels)."""
    block = (mask.shape[-2] // height, mask.shape[-1] // width)
    first = F.avg_pool3d(mask[:, :, :1], (1, *block))
    rest = F.avg_pool3d(mask[:, :, 1:], (temporal_compression, *block))
    return torch.cat([first, rest], dim=2)


def consistency_loss(windows: ConsistencyWindows, mask: Tensor, window: int, step: int) -> Tensor:
    """The consistency term (fp32 scalar) of the outputs ``windows`` on :func:`cut_windows` of clips whose loss mask is
    ``mask`` ``[B, 1, T, H, W]``: the mean absolute difference of neighbouring windows' reconstructions of their
    shared frames over the pixels where ``mask`` is 1, plus, with latents, the scaled absolute difference of their
    shared latent frames, averaged with each latent value weighted by :func:`latent_weights`."""
    clips = mask.shape[0]
    earlier, later = _neighbours(windows.reconstruction.float(), clips, step)
    frames, (height, width) = mask.shape[2], windows.reconstruction.shape[-2:]
    window_mask = cut_windows(mask.float().expand(clips, 1, frames, height, width), window, step)
    # The shared frames are the same frames of the clip in both windows: one mask for the pair.
    _, counted = _neighbours(window_mask, clips, step)
    counted = counted.expand_as(earlier)
    value = ((earlier - later).abs() * counted).sum() / counted.sum().clamp_min(1)
    if windows.latent is None:
        return value
    latent = windows.latent.float()
    # A causal window of 1 + k*tc frames has 1 + k latent frames.
    channels, frames_z, height_z, width_z = latent.shape[1:]
    temporal_compression = (window - 1) // max(frames_z - 1, 1)
    shift = step // temporal_compression
    earlier_z, later_z = _neighbours(latent, clips, shift)
    weights = latent_weights(window_mask, temporal_compression, height_z, width_z)
    # The later window's weights: the frames both latents of a pair stand for (the first shared pair's later latent,
    # its window's frame 0, stands for that frame alone, the earlier one for it and the tc - 1 frames before).
    _, counted_z = _neighbours(weights, clips, shift)
    counted_z = counted_z.expand_as(earlier_z)
    # Fractional weights: no clamp to 1 (a lone half-counted value is still a mean of itself); 0 when none count.
    latent_value = ((earlier_z - later_z).abs() * counted_z).sum() / counted_z.sum().clamp_min(1e-12)
    pixels_per_value = (
        windows.reconstruction.shape[1] * temporal_compression * (height // height_z) * (width // width_z)
    )
    return value + latent_value * (pixels_per_value / channels)


class ConsistencyTerm(LossTerm):
    """:func:`consistency_loss` as a loss term. It reads the network's outputs on the clip's windows, an extra pass
    the step runs on what :meth:`extra_inputs` cuts."""

    reconstruction_only = False  # its windows run through the network (and the decoder's last layer) again

    def __init__(self, config: ConsistencyConfig) -> None:
        super().__init__()
        self.config = config

    def extra_inputs(self, target: Tensor) -> dict[str, Tensor]:
        """The windows of ``target`` to run the network on."""
        return {WINDOWS: cut_windows(target, self.config.window, self.config.step)}

    def forward(self, context: StepContext) -> Tensor:
        return consistency_loss(context.extra(WINDOWS), context.mask, self.config.window, self.config.step)
