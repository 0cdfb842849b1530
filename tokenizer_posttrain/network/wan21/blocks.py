"""The building blocks of the Wan2.1 VAE, each run over a whole clip at once.

The official code runs the encoder on frame 0 and then on chunks of 4 frames, and the decoder on one latent frame
at a time, carrying the last frames of every causal convolution's input across calls. That is one causal pass over
the clip (zeros in front in time), with two exceptions at the temporal resamplers, which :class:`Resample` writes
out: frame 0 skips the encoder's temporal downsampling, and in the decoder the first latent frame is not upsampled
in time while the later ones are upsampled as a clip of their own (their causal past starts with zeros, not with
frame 0). Every block here takes and gives ``[B, C, T, H, W]`` and has the official parameter names and shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .chunks import Streaming


class CausalConv3d(nn.Conv3d, Streaming):
    """A 3D convolution that sees only the present and the past: a kernel ``kt`` in time pads ``kt - 1`` zero
    frames in front (none behind; in a later chunk of a clip, the previous chunk's last input frames), and pads
    space symmetrically.

    The time padding is added in :meth:`forward` before ``nn.Conv3d.forward``, so ``_conv_forward`` (where LoRA
    adds its update) sees the padded clip; space is padded by the convolution itself.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
    ) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=padding)
        pad_t, pad_h, pad_w = self.padding  # type: ignore[misc]
        # Official convention: a time padding p (symmetric for nn.Conv3d) becomes 2p frames in front.
        self.time_padding = 2 * int(pad_t)
        self.padding = (0, pad_h, pad_w)

    def forward(self, x: Tensor) -> Tensor:
        if self.time_padding and self.stream is not None:
            x = self.stream.padded(self, x, self.time_padding)
            self.stream.hand(self, x[:, :, -self.time_padding :])
        elif self.time_padding:
            x = F.pad(x, (0, 0, 0, 0, self.time_padding, 0))
        return super().forward(x)


class FrameConv2d(nn.Conv2d):
    """A 2D convolution applied to every frame of a clip, as a 3D convolution of time kernel 1 (no reshaping of
    time into the batch, so a channels-last clip stays channels-last). Parameters keep the 2D shapes."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        stride_h, stride_w = self.stride
        pad_h, pad_w = self.padding  # type: ignore[misc]
        return F.conv3d(x, self.weight.unsqueeze(2), self.bias, (1, stride_h, stride_w), (0, pad_h, pad_w))


class SpatialUpsample(nn.Module):
    """Nearest-neighbour upsampling of every frame by 2 in height and width."""

    def forward(self, x: Tensor) -> Tensor:
        # For an integer factor, "nearest-exact" (the official mode) and "nearest" pick the same pixels.
        return F.interpolate(x, scale_factor=(1.0, 2.0, 2.0), mode="nearest-exact")


class RMSNorm(nn.Module):
    """Normalises each position's channel vector to unit L2 norm, times ``sqrt(dim)`` and a learnt gain.

    ``gamma`` has the official shape ``[dim, 1, 1, 1]`` (``[dim, 1, 1]`` with ``image_shape``); any input
    ``[B, dim, ...]`` is normalised over dim 1 (in fp32 under autocast) and comes out in the input's dtype
    (under bf16 autocast, bf16 as the convolution that follows reads it).
    """

    def __init__(self, dim: int, image_shape: bool = False) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * (2 if image_shape else 3)))

    def forward(self, x: Tensor) -> Tensor:
        # Back in the input's dtype: under bf16 autocast the norm's fp32 result would make the activation and the
        # convolution's input after it twice as large, and the convolution reads it as bf16 anyway.
        gamma = self.gamma.view(-1, *(1,) * (x.dim() - 2))
        return (F.normalize(x, dim=1) * self.scale * gamma).to(x.dtype)


class ResidualBlock(nn.Module):
    """``x -> shortcut(x) + conv(drop(silu(norm(conv(silu(norm(x)))))))``, causal 3x3x3 convolutions; the
    shortcut is a 1x1x1 convolution where the width changes."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        # Indices as in the official checkpoints (residual.0, .2, .3, .6).
        self.residual = nn.Sequential(
            RMSNorm(in_dim),
            nn.SiLU(),
            CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMSNorm(out_dim),
            nn.SiLU(),
            nn.Dropout(dropout),
            CausalConv3d(out_dim, out_dim, 3, padding=1),
        )
        self.shortcut: nn.Module = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.residual(x) + self.shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention among the positions of each frame (frames do not see each other), residual.

    ``to_qkv`` and ``proj`` are the official 1x1 ``nn.Conv2d`` parameters, applied as linear maps on the
    channels-last view of the clip (time goes into the batch, the one reshape of time in the network).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, image_shape=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        nn.init.zeros_(self.proj.weight)  # as the official init: a fresh block starts as the identity

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        tokens = self.norm(x).permute(0, 2, 3, 4, 1).reshape(b * t, 1, h * w, c)
        q, k, v = F.linear(tokens, self.to_qkv.weight.flatten(1), self.to_qkv.bias).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v)
        out = F.linear(out.squeeze(1), self.proj.weight.flatten(1), self.proj.bias)
        return x + out.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)


class Resample(Streaming):
    """Halve (encoder) or double (decoder) height and width, and time too where ``temporal``.

    Downsampling: zero-pad right and bottom by one, a 3x3 convolution of stride 2 on every frame; then, in time,
    frame 0 passes alone and every later pair of frames becomes one through ``time_conv`` (kernel 3, stride 2,
    no padding), each window starting at an even frame: ``1 + 2k`` frames -> ``1 + k``.

    Upsampling: in time first, ``time_conv`` (causal, kernel 3) gives two output frames per input frame from its
    doubled channels, for the frames after frame 0 only (which passes alone, and is not their causal past):
    ``1 + k`` frames -> ``1 + 2k``; then nearest 2x in space and a 3x3 convolution that halves the channels.

    In chunks of a clip (:mod:`.chunks`), frame 0 passes alone in the first chunk only, and the downsampler reads
    the previous chunk's last frame in front of a later one (a later chunk has an even number of frames).
    """

    def __init__(self, dim: int, up: bool, temporal: bool) -> None:
        super().__init__()
        self.up = up
        if up:
            self.resample = nn.Sequential(SpatialUpsample(), FrameConv2d(dim, dim // 2, 3, padding=1))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), FrameConv2d(dim, dim, 3, stride=2))
        self.time_conv: CausalConv3d | None = None
        if temporal and up:
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif temporal:
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        if self.up:
            return self.resample(self._upsample_time(x))
        return self._downsample_time(self.resample(x))

    def _downsample_time(self, x: Tensor) -> Tensor:
        if self.time_conv is None:
            return x
        stream = self.stream
        if stream is not None:
            self.stream.hand(self, x[:, :, -1:])
            if not stream.first:
                assert x.shape[2] % 2 == 0, "a later chunk has an even number of frames"
                return self.time_conv(stream.padded(self, x, 1))
        if x.shape[2] == 1:
            return x
        return torch.cat([x[:, :, :1], self.time_conv(x)], dim=2)

    def _upsample_time(self, x: Tensor) -> Tensor:
        if self.time_conv is None:
            return x
        first = self.first_chunk
        later = x[:, :, 1:] if first else x
        if later.shape[2] == 0:
            return x
        b, c, t, h, w = later.shape
        later = self.time_conv(later)  # [B, 2C, t, h, w]: channel half j is output frame 2i + j
        later = later.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        return torch.cat([x[:, :, :1], later], dim=2) if first else later
