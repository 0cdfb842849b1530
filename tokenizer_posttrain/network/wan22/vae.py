"""The Wan2.2 VAE: the video patched 2x2, a causal 3D encoder (patches -> posterior mean and log-variance), the
decoder, and the network class the rest of the package reaches through :class:`~..family.VideoTokenizer`.

The state dict is the official one key for key (``Wan2.2_VAE.pth`` loads strictly). Each clip goes through in one
causal pass (see :mod:`.blocks` for why that is the official chunked encode and decode); no output is clamped, so
training keeps its gradients at the edges of [-1, 1].
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from ..wan21.blocks import AttentionBlock, CausalConv3d, ResidualBlock, RMSNorm
from ..wan21.vae import DecoderBase, Segmented, Wan21VAE
from .blocks import DownLevel, UpLevel, patchify, unpatchify
from .registry import Wan22Config


class Encoder3d(Segmented):
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
        out = self._segment(self._stem, x, self.activation_checkpointing, self.conv1)
        assert isinstance(out, Tensor)
        for level in self.downsamples:
            assert isinstance(level, DownLevel)
            # The shortcut has no parameters and keeps nothing for the backward pass but the level's input,
            # which the first piece keeps anyway.
            out = self._run_all(level.downsamples, out) + level.shortcut(out)
        out = self._run_all(self.middle, out)
        return self._run(self.head, out)


class Decoder3d(DecoderBase):
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

    def _upsample(self, h: Tensor) -> Tensor:
        for level in self.upsamples:
            assert isinstance(level, UpLevel)
            main = self._run_all(level.upsamples, h)
            h = main if level.shortcut is None else main + level.shortcut(h)
        return h


class Wan22VAE(Wan21VAE):
    """The Wan2.2 video VAE (16x16 spatial, 4x temporal compression; clips of ``1 + 4k`` frames, sides multiples
    of 16; 48 latent channels), built from its config, with the official parameter names: Wan2.1's network around
    Wan2.2's encoder and decoder, which work on 2x2 patches of the video.

    Its :class:`~..family.Encoding` holds the raw posterior mean (no per-channel normalisation: the world models'
    constants are :data:`.registry.WAN22_LATENT_MEAN` and ``_STD``) and log-variance; :meth:`forward`
    reconstructs from the mean.
    """

    family: ClassVar[str] = "wan22"
    encoder_class: ClassVar[type[nn.Module]] = Encoder3d
    decoder_class: ClassVar[type[DecoderBase]] = Decoder3d
    config: Wan22Config  # type: ignore[assignment]

    def _video(self, decoded: Tensor) -> Tensor:
        return unpatchify(decoded, self.config.patch_size)
