"""The tokenizer module users train, and the three official checkpoint layouts.

:class:`CausalVideoTokenizer` is our public network: ``encode``, ``decode``,
``decode_indices`` (DV) and ``forward(x) -> reconstruction``. Its state_dict is the
official *autoencoder* layout. :class:`EncoderLayout`, :class:`DecoderLayout` and
:class:`AutoencoderLayout` share its submodules and reproduce the keys and call
contracts of ``encoder.jit``, ``decoder.jit`` and ``autoencoder.jit`` (doc section 8).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from .blocks import pointwise_conv
from .encoder_decoder import Decoder, Encoder
from .fsq import FSQuantizer
from .registry import TokenizerConfig, get_config


class Encoding(NamedTuple):
    """What the encoder gives, by role rather than by position, for either kind of tokenizer."""

    latent: Tensor
    """What :meth:`CausalVideoTokenizer.decode` takes: the CV latent ``[B, 16, t, h, w]``, or the DV codes
    ``[B, 6, t, h, w]`` (FSQ levels scaled to [-1, 1])."""
    indices: Optional[Tensor] = None
    """DV only: token indices ``[B, t, h, w]`` (int32), what autoregressive world models read."""
    quant_loss: Optional[Tensor] = None
    """DV only: the all-zero quantizer loss of the official ``encoder.jit`` contract."""

    @property
    def tokens(self) -> Tensor:
        """What downstream world models consume: the CV latent, or the DV indices."""
        return self.latent if self.indices is None else self.indices


class CausalVideoTokenizer(nn.Module):
    """A Cosmos causal video tokenizer, continuous (CV) or discrete (DV), built from its config.

    Input video is ``[B, 3, T, H, W]`` in [-1, 1] with ``T = 1 + k*temporal_compression``
    and H, W multiples of ``spatial_compression``; anything else raises a ``ValueError``
    that says which sizes would work.
    """

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        z = config.z_factor * config.z_channels
        self.quant_conv = pointwise_conv(z, config.z_factor * config.latent_dim)
        self.post_quant_conv = pointwise_conv(config.latent_dim, config.z_channels)
        if config.is_discrete:
            self.quantizer = FSQuantizer(config.levels)

    @property
    def is_discrete(self) -> bool:
        return self.config.is_discrete

    # -- shape contract -------------------------------------------------------------------
    def check_video(self, x: Tensor) -> None:
        """Raise a clear ``ValueError`` unless ``x`` is a video this model accepts."""
        cfg = self.config
        if x.dim() != 5 or x.shape[1] != cfg.in_channels:
            raise ValueError(
                f"{cfg.name}: expected a video [B, {cfg.in_channels}, T, H, W], got shape {tuple(x.shape)}"
            )
        problems = cfg.clip_problems(*x.shape[2:])
        if problems:
            raise ValueError(
                f"{cfg.name}: unsupported input size: {'; '.join(problems)}. "
                "Crop or pad the clip (tokenizer_posttrain pads nothing silently)."
            )

    def check_latent(self, z: Tensor) -> None:
        channels = self.config.latent_dim
        if z.dim() != 5 or z.shape[1] != channels:
            raise ValueError(f"{self.config.name}: decode expects [B, {channels}, t, h, w], got shape {tuple(z.shape)}")

    # -- unchecked paths (used by the layouts, which must trace without Python checks) ----
    def _encoding(self, x: Tensor) -> Encoding:
        z = self.quant_conv(self.encoder(x))
        if self.is_discrete:
            indices, codes, quant_loss = self.quantizer(z)
            return Encoding(codes, indices, quant_loss)
        return Encoding(z)

    def _decode(self, latent: Tensor) -> Tensor:
        return self.decoder(self.post_quant_conv(latent))

    def _indices_to_codes(self, indices: Tensor) -> Tensor:
        return self.quantizer.indices_to_codes(indices).type_as(self.post_quant_conv.conv3d.weight)

    # -- public API -----------------------------------------------------------------------
    def encoding(self, x: Tensor) -> Encoding:
        """The :class:`Encoding` of video ``x``: ``.latent`` for the decoder, ``.tokens`` for world models."""
        self.check_video(x)
        return self._encoding(x)

    def encode(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """CV: latent ``[B, 16, t, h, w]``. DV: ``(indices [B, t, h, w] int32, codes [B, 6, t, h, w])``
        (the official tokenizers' call; :meth:`encoding` names the parts)."""
        out = self.encoding(x)
        return (out.indices, out.latent) if self.is_discrete else out.latent

    def decode(self, latent_or_codes: Tensor) -> Tensor:
        """Latent (CV) or codes (DV) ``[B, C, t, h, w]`` -> video ``[B, 3, 1+T_c(t-1), ...]``."""
        self.check_latent(latent_or_codes)
        return self._decode(latent_or_codes)

    def decode_indices(self, indices: Tensor) -> Tensor:
        """DV only: token indices ``[B, t, h, w]`` -> video."""
        if not self.is_discrete:
            raise TypeError(f"{self.config.name} is continuous: it has no token indices; use decode()")
        if indices.dim() != 4 or indices.is_floating_point():
            raise ValueError(f"decode_indices expects integer [B, t, h, w], got {indices.dtype} {tuple(indices.shape)}")
        return self._decode(self._indices_to_codes(indices))

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruction of ``x`` (DV through the quantizer, with straight-through gradients)."""
        self.check_video(x)
        return self._decode(self._encoding(x).latent)

    def decode_with_head_input(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`decode`, and the input of the decoder's last layer (``decoder.tail`` maps it to the video)."""
        self.check_latent(latent)
        return self.decoder(self.post_quant_conv(latent), with_head_input=True)


class _InverseQuantizer(nn.Module):
    """Holds the shared quantizer under ``inv_quant.quantizer`` in the decoder layout."""

    def __init__(self, quantizer: FSQuantizer) -> None:
        super().__init__()
        self.quantizer = quantizer


class EncoderLayout(nn.Module):
    """``encoder.jit`` layout: keys ``encoder.*``, ``quant_conv.*`` (+ ``quantizer.*`` for DV).

    CV returns ``(latent, (zeros(1), zeros(1)))``; DV returns ``(indices, codes, dummy_loss)``.
    """

    def __init__(self, tokenizer: CausalVideoTokenizer) -> None:
        super().__init__()
        self.encoder = tokenizer.encoder
        self.quant_conv = tokenizer.quant_conv
        if tokenizer.is_discrete:
            self.quantizer = tokenizer.quantizer
        self._tokenizer = [tokenizer]  # a list, so it is not registered as a child

    def forward(self, x: Tensor):  # noqa: ANN201 - tuple shape differs CV/DV
        out = self._tokenizer[0]._encoding(x)
        if out.indices is not None:
            return out.indices, out.latent, out.quant_loss
        return out.latent, (torch.zeros(1), torch.zeros(1))


class DecoderLayout(nn.Module):
    """``decoder.jit`` layout: CV takes a latent, DV takes token **indices**."""

    def __init__(self, tokenizer: CausalVideoTokenizer) -> None:
        super().__init__()
        if tokenizer.is_discrete:
            self.inv_quant = _InverseQuantizer(tokenizer.quantizer)
        self.post_quant_conv = tokenizer.post_quant_conv
        self.decoder = tokenizer.decoder
        self._tokenizer = [tokenizer]

    def forward(self, z: Tensor) -> Tensor:
        tok = self._tokenizer[0]
        if tok.is_discrete:
            z = tok._indices_to_codes(z)
        return tok._decode(z)


class AutoencoderLayout(nn.Module):
    """``autoencoder.jit`` layout (same keys as the tokenizer).

    CV returns ``(reconstructions, posteriors, latent)``; DV ``(reconstructions, quant_loss, indices)``.
    """

    def __init__(self, tokenizer: CausalVideoTokenizer) -> None:
        super().__init__()
        for name, child in tokenizer.named_children():
            self.add_module(name, child)
        self._tokenizer = [tokenizer]

    def forward(self, x: Tensor):  # noqa: ANN201
        tok = self._tokenizer[0]
        out = tok._encoding(x)
        if out.indices is not None:
            return tok._decode(out.latent), out.quant_loss, out.indices
        return tok._decode(out.latent), (torch.zeros(1), torch.zeros(1)), out.latent


def build_tokenizer(name: str, **config_overrides) -> CausalVideoTokenizer:  # noqa: ANN003
    """Build a randomly initialised tokenizer by model name, e.g. ``build_tokenizer("CV8x8x8")``.

    ``config_overrides`` change fields of :class:`~tokenizer_posttrain.network.registry.TokenizerConfig`
    (``channels=16`` gives the tiny test models). Build under ``torch.device("meta")`` to
    inspect shapes without allocating weights.
    """
    return CausalVideoTokenizer(get_config(name, **config_overrides))
