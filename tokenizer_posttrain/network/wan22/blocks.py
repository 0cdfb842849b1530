"""The building blocks Wan2.2's VAE adds to Wan2.1's, each run over a whole clip at once.

Residual blocks, attention, norms and causal convolutions are Wan2.1's (:mod:`..wan21.blocks`). New here: the 2x2
patching of the video, the levels (residual blocks and a resampler, plus a parameter-free shortcut that averages
the level's input down or copies it up to the output's size), and an upsampler that keeps its width.

The official code runs the encoder on frame 0 and then on chunks of 4 frames, and the decoder on one latent frame
at a time, carrying causal state across calls. As for Wan2.1 that is one causal pass over the clip, with the same
two exceptions at the temporal resamplers (see :mod:`..wan21.blocks`), and two more in the shortcuts: the encoder's
averages frame pairs ``(0, frame 0), (1, 2), (3, 4), ...`` (one zero frame in front, the first chunk's padding),
and the decoder's copies every latent frame to two, then drops the copy before frame 0 (the first chunk's
``first_chunk`` trim), so both keep the ``1 + 2k`` frame rule of the main path.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..wan21.blocks import FrameConv2d, ResidualBlock, SpatialUpsample
from ..wan21.blocks import Resample as Wan21Resample
from ..wan21.chunks import Streaming
from .registry import Level


def patchify(x: Tensor, patch: int) -> Tensor:
    """``[B, C, T, pH, pW]`` -> ``[B, C p^2, T, H, W]``: each pixel's ``patch`` x ``patch`` block on the channels,
    channel ``c p^2 + p dx + dy`` holding the pixel at row offset ``dy`` and column offset ``dx`` (the official
    order: the column offset is the slower one)."""
    if patch == 1:
        return x
    b, c, t, hp, wp = x.shape
    h, w = hp // patch, wp // patch
    blocks = x.reshape(b, c, t, h, patch, w, patch)  # b c t h dy w dx
    return blocks.permute(0, 1, 6, 4, 2, 3, 5).reshape(b, c * patch * patch, t, h, w)


def unpatchify(x: Tensor, patch: int) -> Tensor:
    """The inverse of :func:`patchify`."""
    if patch == 1:
        return x
    b, cpp, t, h, w = x.shape
    blocks = x.reshape(b, cpp // (patch * patch), patch, patch, t, h, w)  # b c dx dy t h w
    return blocks.permute(0, 1, 4, 5, 3, 6, 2).reshape(b, cpp // (patch * patch), t, h * patch, w * patch)


class AverageDown(nn.Module):
    """The encoder level's shortcut: every output position averages a group of the input's (channel, position)
    pairs under it, ``in_dim * positions / out_dim`` of them. Time is padded in front with zeros to an even
    length, so frame 0 is paired with a zero frame (later chunks of a clip have even lengths: no padding, no
    state). No parameters."""

    def __init__(self, level: Level) -> None:
        super().__init__()
        self.out_dim = level.out_dim
        self.factor_t = 2 if level.temporal else 1
        self.factor_s = 2 if level.spatial else 1
        self.identity = level.positions == 1 and level.in_dim == level.out_dim

    def forward(self, x: Tensor) -> Tensor:
        if self.identity:
            return x
        ft, fs = self.factor_t, self.factor_s
        x = F.pad(x, (0, 0, 0, 0, (-x.shape[2]) % ft, 0))
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
        # Channel-major, then the offsets in time, rows, columns: the official grouping of the pairs.
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6)
        return x.reshape(b, self.out_dim, -1, t // ft, h // fs, w // fs).mean(dim=2)


class DuplicateUp(Streaming):
    """The decoder level's shortcut, the converse of :class:`AverageDown`: each input channel is copied to
    ``out_dim * positions / in_dim`` of the output's (channel, position) pairs; time doubles (where temporal) and
    the copy before frame 0 is dropped, as the official first chunk does (in chunks of a clip, the first only).
    No parameters."""

    def __init__(self, level: Level) -> None:
        super().__init__()
        self.out_dim = level.out_dim
        self.factor_t = 2 if level.temporal else 1
        self.factor_s = 2 if level.spatial else 1
        self.copies = level.out_dim * level.positions // level.in_dim

    def forward(self, x: Tensor) -> Tensor:
        ft, fs = self.factor_t, self.factor_s
        b, _, t, h, w = x.shape
        x = x.repeat_interleave(self.copies, dim=1).reshape(b, self.out_dim, ft, fs, fs, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.out_dim, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1 :] if self.first_chunk else x


class Resample(Wan21Resample):
    """Wan2.1's resampler, except that upsampling keeps the width (Wan2.1's halves it in the spatial
    convolution)."""

    def __init__(self, dim: int, up: bool, temporal: bool) -> None:
        super().__init__(dim, up, temporal)
        if up:  # the same place in the state dict (resample.1), a full-width convolution
            self.resample = nn.Sequential(SpatialUpsample(), FrameConv2d(dim, dim, 3, padding=1))


def _level_blocks(level: Level, num_res_blocks: int, dropout: float, up: bool) -> nn.Sequential:
    """A level's residual blocks (the first changes the width), then its resampler where it has one."""
    blocks: list[nn.Module] = []
    in_dim = level.in_dim
    for _ in range(num_res_blocks):
        blocks.append(ResidualBlock(in_dim, level.out_dim, dropout))
        in_dim = level.out_dim
    if level.spatial:
        blocks.append(Resample(level.out_dim, up=up, temporal=level.temporal))
    return nn.Sequential(*blocks)


class DownLevel(nn.Module):
    """An encoder level: ``downsamples`` (residual blocks, then the resampler where the level has one; the
    official names) plus :class:`AverageDown` of the level's input."""

    def __init__(self, level: Level, num_res_blocks: int, dropout: float) -> None:
        super().__init__()
        self.downsamples = _level_blocks(level, num_res_blocks, dropout, up=False)
        self.shortcut = AverageDown(level)


class UpLevel(nn.Module):
    """A decoder level: ``upsamples`` (residual blocks, then the resampler where the level has one) plus, where
    it upsamples, :class:`DuplicateUp` of the level's input (None elsewhere, as in the official code)."""

    def __init__(self, level: Level, num_res_blocks: int, dropout: float) -> None:
        super().__init__()
        self.upsamples = _level_blocks(level, num_res_blocks, dropout, up=True)
        self.shortcut = DuplicateUp(level) if level.has_shortcut else None
