"""The Wan2.2 VAE: the video patched 2x2, a causal 3D encoder (patches -> posterior mean and log-variance), the
decoder, and the network class the rest of the package reaches through :class:`~..family.VideoTokenizer`.

The state dict is the official one key for key (``Wan2.2_VAE.pth`` loads strictly). Each clip goes through in one
causal pass (see :mod:`.blocks` for why that is the official chunked encode and decode); no output is clamped, so
training keeps its gradients at the edges of [-1, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from ..family import Encoding, VideoTokenizer
from ..segments import run_segment
from ..wan21.blocks import AttentionBlock, CausalConv3d, ResidualBlock, RMSNorm
from .blocks import DownLevel, UpLevel, patchify, unpatchify
from .registry import Wan22Config


class _Segmented(nn.Module):
    """Runs its pieces (each residual block, resampler, stem and head) through
    :func:`~..segments.run_segment`, steered by the training's speed switches."""

    def __init__(self) -> None:
        super().__init__()
        # Speed and memory switches (see ..segments); not part of the state.
        self.activation_checkpointing = False
        self.segment_wrapper = None
        self.memory_format = torch.contiguous_format

    def _run(self, piece: nn.Module, x: Tensor) -> Tensor:
        # Attention runs at the lowest resolution, where recomputing saves little.
        recompute = self.activation_checkpointing and not isinstance(piece, AttentionBlock)
        out = run_segment(piece, x, recompute, self.segment_wrapper)
        assert isinstance(out, Tensor)
        return out

    def _run_all(self, pieces: nn.Sequential, x: Tensor) -> Tensor:
        for piece in pieces:
            x = self._run(piece, x)
        return x

    def _formatted(self, x: Tensor) -> Tensor:
        # The default layout adds no operation at all.
        fmt = self.memory_format
        return x if fmt == torch.contiguous_format else x.contiguous(memory_format=fmt)


class Encoder3d(_Segmented):
    """Video ``[B, 3, 1 + 4k, 16h, 16w]`` -> ``[B, 2 z_dim, 1 + k, h, w]`` (before the posterior's ``conv1``)."""

    def __init__(self, cfg: Wan22Config) -> None:
        super().__init__()
        self.patch_size = cfg.patch_size
        levels = cfg.encoder_levels()
        self.conv1 = CausalConv3d(cfg.patch_channels, levels[0].in_dim, 3, padding=1)
        self.downsamples = nn.Sequential(*(DownLevel(lv, cfg.num_res_blocks, cfg.dropout) for lv in levels))
        width = levels[-1].out_dim
        self.middle = nn.Sequential(
            ResidualBlock(width, width, cfg.dropout), AttentionBlock(width), ResidualBlock(width, width, cfg.dropout)
        )
        self.head = nn.Sequential(RMSNorm(width), nn.SiLU(), CausalConv3d(width, 2 * cfg.z_dim, 3, padding=1))

    def _stem(self, x: Tensor) -> Tensor:
        return self.conv1(self._formatted(patchify(x, self.patch_size)))

    def forward(self, x: Tensor) -> Tensor:
        out = run_segment(self._stem, x, self.activation_checkpointing, self.segment_wrapper)
        assert isinstance(out, Tensor)
        for level in self.downsamples:
            assert isinstance(level, DownLevel)
            # The shortcut has no parameters and keeps nothing for the backward pass but the level's input,
            # which the first piece keeps anyway.
            out = self._run_all(level.downsamples, out) + level.shortcut(out)
        out = self._run_all(self.middle, out)
        return self._run(self.head, out)


class Decoder3d(_Segmented):
    """``[B, z_dim, 1 + k, h, w]`` (after ``conv2``) -> patches ``[B, 12, 1 + 4k, 8h, 8w]``, unclamped (the
    network puts the pixels back)."""

    def __init__(self, cfg: Wan22Config) -> None:
        super().__init__()
        levels = cfg.decoder_levels()
        width = levels[0].in_dim
        self.conv1 = CausalConv3d(cfg.z_dim, width, 3, padding=1)
        self.middle = nn.Sequential(
            ResidualBlock(width, width, cfg.dropout), AttentionBlock(width), ResidualBlock(width, width, cfg.dropout)
        )
        self.upsamples = nn.Sequential(*(UpLevel(lv, cfg.num_res_blocks + 1, cfg.dropout) for lv in levels))
        width = levels[-1].out_dim
        self.head = nn.Sequential(RMSNorm(width), nn.SiLU(), CausalConv3d(width, cfg.patch_channels, 3, padding=1))

    def _stem(self, z: Tensor) -> Tensor:
        return self.conv1(self._formatted(z))

    def head_input(self, h: Tensor) -> Tensor:
        """What the last convolution (``head.2``) takes: the head's norm and activation of ``h``."""
        return self.head[1](self.head[0](h))

    def _head_and_input(self, h: Tensor) -> tuple[Tensor, Tensor]:
        head_input = self.head_input(h)
        return self.head[2](head_input), head_input

    def forward(self, z: Tensor, with_head_input: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The patches decoded from ``z``; with ``with_head_input``, also the input of the last convolution."""
        h = run_segment(self._stem, z, self.activation_checkpointing, self.segment_wrapper)
        assert isinstance(h, Tensor)
        h = self._run_all(self.middle, h)
        for level in self.upsamples:
            assert isinstance(level, UpLevel)
            main = self._run_all(level.upsamples, h)
            h = main if level.shortcut is None else main + level.shortcut(h)
        if with_head_input:
            # The full-resolution activations: the widest of the decoder, worth recomputing.
            out = run_segment(self._head_and_input, h, self.activation_checkpointing, self.segment_wrapper)
            assert isinstance(out, tuple)
            return out[0], out[1]
        return self._run(self.head, h)


class Wan22VAE(VideoTokenizer):
    """The Wan2.2 video VAE (16x16 spatial, 4x temporal compression; clips of ``1 + 4k`` frames, sides multiples
    of 16; 48 latent channels), built from its config, with the official parameter names.

    Its :class:`~..family.Encoding` holds the raw posterior mean (no per-channel normalisation: the world models'
    constants are :data:`.registry.WAN22_LATENT_MEAN` and ``_STD``) and log-variance; :meth:`forward`
    reconstructs from the mean.
    """

    family: ClassVar[str] = "wan22"
    sides: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "encoder": ("encoder.", "conv1."),
        "decoder": ("decoder.", "conv2."),
    }
    last_layer: ClassVar[str] = "decoder.head.2"
    head: ClassVar[str] = "decoder.head.2"
    # Every 3D convolution may be adapted (all are plain convolutions, causal padding aside, so adapters fold
    # into their weights). The spatial resamplers' and the attention's convolutions are 2D: LoRA never adapts them.
    lora_modules: ClassVar[tuple[str, ...]] = ("*",)

    def __init__(self, config: Wan22Config) -> None:
        super().__init__()
        self.config = config
        z = config.z_dim
        # Registration order is the official state-dict order.
        self.encoder = Encoder3d(config)
        self.conv1 = CausalConv3d(2 * z, 2 * z, 1)
        self.conv2 = CausalConv3d(z, z, 1)
        self.decoder = Decoder3d(config)

    def encoder_output(self, x: Tensor) -> Tensor:
        """The posterior's mean and log-variance, stacked on the channels (``[B, 2 z_dim, t, h, w]``)."""
        return self.conv1(self.encoder(x))

    def encoding_of(self, z: Tensor) -> Encoding:
        mean, logvar = z.chunk(2, dim=1)
        return Encoding(mean, mean=mean, logvar=logvar)

    def decode_unchecked(self, latent: Tensor) -> Tensor:
        out = self.decoder(self.conv2(latent))
        assert isinstance(out, Tensor)
        return unpatchify(out, self.config.patch_size)

    def decode_with_head_input(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        self.check_latent(latent)
        out = self.decoder(self.conv2(latent), with_head_input=True)
        assert isinstance(out, tuple)
        return unpatchify(out[0], self.config.patch_size), out[1]

    def apply_head(self, head_input: Tensor) -> Tensor:
        return unpatchify(self.decoder.head[2](head_input), self.config.patch_size)
