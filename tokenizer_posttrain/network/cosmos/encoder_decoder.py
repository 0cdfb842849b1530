"""The factorized causal encoder and decoder (architecture doc, sections 1.3-1.4, 4 and 5)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..segments import run_segment
from .blocks import (
    FrameGroupNorm,
    HybridDownsample,
    HybridUpsample,
    ResnetBlock,
    attention_pair,
    factorized_conv,
    silu,
)
from .haar import Patcher3D, UnPatcher3D
from .registry import TokenizerConfig


class _Level(nn.Module):
    """One resolution level: ResNet blocks, an (always empty) ``attn`` list, then a resampler.

    The official configs never reach their per-level attention resolution, so ``attn``
    stays empty; it exists so module paths match the checkpoints.
    """

    def __init__(self, blocks: list[nn.Module], resample: nn.Module | None, resample_name: str) -> None:
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList()
        if resample is not None:
            self.add_module(resample_name, resample)
        self._resample_name = resample_name if resample is not None else None
        self.activation_checkpointing = False
        self.segment_wrapper = None

    def forward(self, x: Tensor) -> Tensor:
        for block in self.block:
            x = run_segment(block, x, self.activation_checkpointing, self.segment_wrapper)
        if self._resample_name is not None:
            resample = getattr(self, self._resample_name)
            x = run_segment(resample, x, self.activation_checkpointing, self.segment_wrapper)
        return x


class _Mid(nn.Module):
    def __init__(self, channels: int, dropout: float) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout)
        self.attn_1 = attention_pair(channels)
        self.block_2 = ResnetBlock(channels, channels, dropout)
        self.activation_checkpointing = False
        self.segment_wrapper = None

    def forward(self, x: Tensor) -> Tensor:
        x = run_segment(self.block_1, x, self.activation_checkpointing, self.segment_wrapper)
        # Attention runs at the lowest resolution, where recomputing saves little memory. Checkpointed, with
        # channels-last activations, Inductor's forward computed wrong values (torch 2.13 on CPU).
        x = run_segment(self.attn_1, x, False, self.segment_wrapper)
        return run_segment(self.block_2, x, self.activation_checkpointing, self.segment_wrapper)


class Encoder(nn.Module):
    """Video ``[B, 3, T, H, W]`` -> ``[B, z_factor*z_channels, t, h, w]``."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        super().__init__()
        n_levels = len(cfg.channels_mult)
        widths = [cfg.channels * m for m in cfg.channels_mult]
        self.patcher3d = Patcher3D(cfg.patch_size)
        self.conv_in = factorized_conv(cfg.in_channels * cfg.patch_size**3, cfg.channels)
        levels = []
        block_in = cfg.channels
        for i, width in enumerate(widths):
            blocks = []
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResnetBlock(block_in, width, cfg.dropout))
                block_in = width
            down = None
            if i < n_levels - 1:
                down = HybridDownsample(width, spatial=i < cfg.num_spatial_down, temporal=i < cfg.num_temporal_down)
            levels.append(_Level(blocks, down, "downsample"))
        self.down = nn.ModuleList(levels)
        self.mid = _Mid(block_in, cfg.dropout)
        self.norm_out = FrameGroupNorm(block_in)
        self.conv_out = factorized_conv(block_in, cfg.z_factor * cfg.z_channels)
        # Speed and memory switches (see .segments); not part of the state.
        self.activation_checkpointing = False
        self.segment_wrapper = None
        self.memory_format = torch.contiguous_format

    def _stem(self, x: Tensor) -> Tensor:
        # The Haar coefficients come out contiguous whatever the input layout: convert here, once.
        return self.conv_in(_to_memory_format(self.patcher3d(x), self.memory_format))

    def _head(self, h: Tensor) -> Tensor:
        return self.conv_out(silu(self.norm_out(h)))

    def forward(self, x: Tensor) -> Tensor:
        h = run_segment(self._stem, x, self.activation_checkpointing, self.segment_wrapper)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        return run_segment(self._head, h, self.activation_checkpointing, self.segment_wrapper)


def _to_memory_format(x: Tensor, memory_format: torch.memory_format) -> Tensor:
    # The default layout adds no operation at all, so traced and exported graphs stay as they were.
    return x if memory_format == torch.contiguous_format else x.contiguous(memory_format=memory_format)


def _decoder_upsample_flags(cfg: TokenizerConfig, level: int) -> tuple[bool, bool]:
    """(spatial, temporal) flags of the upsampler after decoder ``level`` (doc 1.3)."""
    n_s, n_t = cfg.num_spatial_down, cfg.num_temporal_down
    r = len(cfg.channels_mult) - 1 - level  # position in run order
    temporal = r < n_t if cfg.legacy_mode else 0 < r < n_t + 1
    spatial = temporal or (r < n_s and n_s > n_t)
    return spatial, temporal


class Decoder(nn.Module):
    """``[B, z_channels, t, h, w]`` -> video ``[B, 3, 1 + T_c*(t-1), H_c*h, W_c*w]``."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        super().__init__()
        n_levels = len(cfg.channels_mult)
        widths = [cfg.channels * m for m in cfg.channels_mult]
        self.unpatcher3d = UnPatcher3D(cfg.patch_size)
        self.conv_in = factorized_conv(cfg.z_channels, widths[-1])
        self.mid = _Mid(widths[-1], cfg.dropout)
        levels = []
        for i, width in enumerate(widths):  # stored in level order 0..N-1, run in reverse
            block_in = widths[i + 1] if i < n_levels - 1 else widths[-1]
            blocks = []
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResnetBlock(block_in, width, cfg.dropout))
                block_in = width
            up = None
            if i > 0:
                spatial, temporal = _decoder_upsample_flags(cfg, i)
                up = HybridUpsample(width, spatial=spatial, temporal=temporal)
            levels.append(_Level(blocks, up, "upsample"))
        self.up = nn.ModuleList(levels)
        self.norm_out = FrameGroupNorm(widths[0])
        self.conv_out = factorized_conv(widths[0], cfg.out_channels * cfg.patch_size**3)
        self.activation_checkpointing = False
        self.segment_wrapper = None
        self.memory_format = torch.contiguous_format

    def _stem(self, z: Tensor) -> Tensor:
        return self.conv_in(_to_memory_format(z, self.memory_format))

    def _head(self, h: Tensor) -> Tensor:
        # The widest activations of the decoder (full resolution, fp32 under autocast): worth recomputing.
        return self.tail(self._head_input(h))

    def _head_input(self, h: Tensor) -> Tensor:
        return self.conv_out[0](silu(self.norm_out(h)))

    def _head_and_input(self, h: Tensor) -> tuple[Tensor, Tensor]:
        head_input = self._head_input(h)
        return self.tail(head_input), head_input

    def tail(self, head_input: Tensor) -> Tensor:
        """The decoder's last layer (``conv_out``'s temporal convolution) and the unpatching, from that layer's
        input: the video."""
        return self.unpatcher3d(self.conv_out[1](head_input))

    def forward(self, z: Tensor, with_head_input: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The video decoded from ``z``; with ``with_head_input``, also the input of the last layer
        (:meth:`tail`), from which gradients at that layer's weights cost one small convolution."""
        h = run_segment(self._stem, z, self.activation_checkpointing, self.segment_wrapper)
        h = self.mid(h)
        for level in reversed(self.up):
            h = level(h)
        head = self._head_and_input if with_head_input else self._head
        return run_segment(head, h, self.activation_checkpointing, self.segment_wrapper)
