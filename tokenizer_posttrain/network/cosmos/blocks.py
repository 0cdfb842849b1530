"""Building blocks of the Cosmos causal video tokenizers (architecture doc, section 2).

Every module keeps the child names of the official checkpoints (``conv3d``, ``norm``,
``nin_shortcut``, ...), so ``load_state_dict(strict=True)`` works on the released files.
Tensors are ``[B, C, T, H, W]``. Nothing here branches on tensor values, and only on
config constants, so the blocks trace, script-free export and ``torch.compile`` alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu(x: torch.Tensor) -> torch.Tensor:
    # Written out rather than F.silu: that kernel differs from the reference in the last bits.
    return x * torch.sigmoid(x)


def is_channels_last(x: torch.Tensor) -> bool:
    """True for a 5D tensor laid out ``[B, T, H, W, C]`` in memory (and not also plainly contiguous)."""
    return x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()


def replicate_first_frame(x: torch.Tensor, n: int) -> torch.Tensor:
    """Prepend ``n`` copies of frame 0 (causal padding along T)."""
    if n == 0:
        return x
    pad = x[:, :, :1].expand(-1, -1, n, -1, -1)
    if is_channels_last(x):
        # cat keeps the inputs' layout only when all of them have it; the expanded view has none.
        pad = pad.contiguous(memory_format=torch.channels_last_3d)
    return torch.cat([pad, x], dim=2)


class CausalConv3d(nn.Module):
    """3D convolution that pads time causally (copies of frame 0) and space with zeros."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, int, int] = (1, 1, 1),
        stride: int = 1,
        time_stride: int = 1,
        padding: int = 0,
    ) -> None:
        super().__init__()
        k_t = kernel_size[0]
        self.time_pad = k_t - 1 + (1 - time_stride)
        # Zero padding of H and W inside the convolution equals padding the input first.
        self.conv3d = nn.Conv3d(
            in_channels,
            out_channels,
            kernel_size,
            stride=(time_stride, stride, stride),
            padding=(0, padding, padding),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3d(replicate_first_frame(x, self.time_pad))


def factorized_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    """A (1,3,3) spatial conv followed by a (3,1,1) causal temporal conv."""
    return nn.Sequential(
        CausalConv3d(in_channels, out_channels, (1, 3, 3), padding=1),
        CausalConv3d(out_channels, out_channels, (3, 1, 1)),
    )


def pointwise_conv(in_channels: int, out_channels: int) -> CausalConv3d:
    return CausalConv3d(in_channels, out_channels, (1, 1, 1))


class FrameGroupNorm(nn.Module):
    """GroupNorm(1, C) applied to every frame on its own (never across the clip: causality)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(num_groups=1, num_channels=channels, eps=1e-6, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_channels_last(x):
            return self._forward_channels_last(x)
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        return self.norm(frames).reshape(b, t, c, h, w).transpose(1, 2)

    def _forward_channels_last(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, W, C] is contiguous here, so each frame is one block of memory: a layer norm over
        # (H, W, C) is the same normalisation, and the per-channel affine broadcasts over the last axis.
        # GroupNorm on CUDA would copy the input to NCHW and return NCHW, undoing the layout.
        frames = x.permute(0, 2, 3, 4, 1)
        out = F.layer_norm(frames, frames.shape[2:], eps=self.norm.eps)
        out = out * self.norm.weight + self.norm.bias
        return out.permute(0, 4, 1, 2, 3)


class ResnetBlock(nn.Module):
    """Factorized ResNet block: norm-SiLU-conv twice, plus a (projected) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(in_channels)
        self.conv1 = factorized_conv(in_channels, out_channels)
        self.norm2 = FrameGroupNorm(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = factorized_conv(out_channels, out_channels)
        self.nin_shortcut = pointwise_conv(in_channels, out_channels) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(silu(self.norm1(x)))
        h = self.conv2(self.dropout(silu(self.norm2(h))))
        return self.nin_shortcut(x) + h


class HybridDownsample(nn.Module):
    """x2 spatial and/or temporal downsampling: strided conv plus average pool, then a 1x1x1 conv.

    With neither flag it is a parameter-free identity, as in the official layout.
    """

    def __init__(self, channels: int, spatial: bool, temporal: bool) -> None:
        super().__init__()
        self.spatial = spatial
        self.temporal = temporal
        if spatial:
            self.conv1 = CausalConv3d(channels, channels, (1, 3, 3), stride=2)
        if temporal:
            self.conv2 = CausalConv3d(channels, channels, (3, 1, 1), time_stride=2)
        if spatial or temporal:
            self.conv3 = pointwise_conv(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.spatial or self.temporal):
            return x
        if self.spatial:
            b, c, t, h, w = x.shape
            # Average of 2x2 cells; the right/bottom zero pad the conv needs is never pooled.
            pooled = x.reshape(b, c, t, h // 2, 2, w // 2, 2).mean(dim=(4, 6))
            x = self.conv1(F.pad(x, (0, 1, 0, 1, 0, 0))) + pooled
        if self.temporal:
            x = replicate_first_frame(x, 1)
            b, c, t, h, w = x.shape
            pooled = x.reshape(b, c, t // 2, 2, h, w).mean(dim=3)
            x = self.conv2(x) + pooled
        return self.conv3(x)


class HybridUpsample(nn.Module):
    """x2 temporal and/or spatial upsampling by repetition, each followed by a residual conv.

    Naming follows the checkpoints: here ``conv1`` is temporal and ``conv2`` spatial.
    """

    def __init__(self, channels: int, spatial: bool, temporal: bool) -> None:
        super().__init__()
        self.spatial = spatial
        self.temporal = temporal
        if temporal:
            self.conv1 = CausalConv3d(channels, channels, (3, 1, 1))
        if spatial:
            self.conv2 = CausalConv3d(channels, channels, (1, 3, 3), padding=1)
        if spatial or temporal:
            self.conv3 = pointwise_conv(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.spatial or self.temporal):
            return x
        if self.temporal:
            x = _repeat_frames(x)
            x = self.conv1(x) + x
        if self.spatial:
            x = _repeat_pixels(x)
            x = self.conv2(x) + x
        return self.conv3(x)


def _repeat_frames(x: torch.Tensor) -> torch.Tensor:
    """Repeat each frame twice and drop the first: T -> 2T-1 (and 1 -> 1, as the reference)."""
    if not is_channels_last(x):
        return x.repeat_interleave(2, dim=2)[:, :, 1:]
    # Gathering frames 0,1,1,2,2,... of the [B, T, H, W, C] view keeps the channels-last layout
    # (repeat_interleave returns NCDHW, and a slice of it is not dense).
    index = torch.arange(1, 2 * x.shape[2], device=x.device) // 2
    return x.permute(0, 2, 3, 4, 1).index_select(1, index).permute(0, 4, 1, 2, 3)


def _repeat_pixels(x: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour x2 upsampling of H and W."""
    if not is_channels_last(x):
        return x.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
    # Broadcast in the [B, T, H, W, C] view, which keeps the channels-last layout.
    b, c, t, h, w = x.shape
    frames = x.permute(0, 2, 3, 4, 1)[:, :, :, None, :, None, :].expand(b, t, h, 2, w, 2, c)
    return frames.reshape(b, t, 2 * h, 2 * w, c).permute(0, 4, 1, 2, 3)


MATMUL_ATTENTION_MAX_SCORES = 2**28
"""Attention with at most this many scores (sequences x length^2) is computed with two matrix products."""


def single_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """``softmax(q k^T / sqrt(C)) v`` of token sequences ``[N, L, C]``; ``causal``: key j <= query i only.

    The heads are one channel-wide head (C = 512 in the real models). PyTorch's fused attention kernels
    handle at most 256 channels per head, so SDPA takes its generic kernel, whose backward pass cost more
    than all convolutions' backward together (docs/benchmarks.md). Two batched matrix products are fast here,
    and their score matrix is small at training sizes; past :data:`MATMUL_ATTENTION_MAX_SCORES` (720p frames:
    14,400 tokens) SDPA's memory-efficient kernel keeps the scores out of memory.
    """
    n, length, channels = q.shape
    if n * length * length > MATMUL_ATTENTION_MAX_SCORES:
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=causal)[:, 0]
    scores = torch.bmm(q, k.transpose(1, 2)) * channels**-0.5
    if causal:
        future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    # Under autocast softmax runs in fp32 and the product casts back to bf16, as the fused kernels do.
    # type_as, not .to(v.dtype): a trace would freeze the dtype of the export, and a cast export must follow v.
    return torch.bmm(torch.softmax(scores, dim=-1).type_as(v), v)


class _Attention(nn.Module):
    """Single-head self-attention with 1x1x1 projections and a residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = FrameGroupNorm(channels)
        self.q = pointwise_conv(channels, channels)
        self.k = pointwise_conv(channels, channels)
        self.v = pointwise_conv(channels, channels)
        self.proj_out = pointwise_conv(channels, channels)


class SpatialAttention(_Attention):
    """Attention among the H*W positions of each frame."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, t, hh, ww = x.shape

        def tokens(y: torch.Tensor) -> torch.Tensor:  # [B*T, H*W, C]
            return y.permute(0, 2, 3, 4, 1).reshape(b * t, hh * ww, c)

        out = single_head_attention(tokens(self.q(h)), tokens(self.k(h)), tokens(self.v(h)), causal=False)
        out = out.reshape(b, t, hh, ww, c).permute(0, 4, 1, 2, 3)
        return x + self.proj_out(out)


class CausalTemporalAttention(_Attention):
    """Attention along T at each pixel, each frame seeing itself and the past only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, t, hh, ww = x.shape

        def tokens(y: torch.Tensor) -> torch.Tensor:  # [B*H*W, T, C]
            return y.permute(0, 3, 4, 2, 1).reshape(b * hh * ww, t, c)

        out = single_head_attention(tokens(self.q(h)), tokens(self.k(h)), tokens(self.v(h)), causal=True)
        out = out.reshape(b, hh, ww, t, c).permute(0, 4, 3, 1, 2)
        if is_channels_last(x):  # [B, H, W, T, C] in memory: back to the network's layout
            out = out.contiguous(memory_format=torch.channels_last_3d)
        return x + self.proj_out(out)


def attention_pair(channels: int) -> nn.Sequential:
    """Spatial then causal temporal attention (``attn_1.0`` and ``attn_1.1`` in checkpoints)."""
    return nn.Sequential(SpatialAttention(channels), CausalTemporalAttention(channels))
