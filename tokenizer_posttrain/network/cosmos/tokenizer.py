"""The tokenizer module users train, and the three official checkpoint layouts.

:class:`CausalVideoTokenizer` is our public network: ``encode``, ``decode``,
``decode_indices`` (DV) and ``forward(x) -> reconstruction``. Its state_dict is the
official *autoencoder* layout. :class:`EncoderLayout`, :class:`DecoderLayout` and
:class:`AutoencoderLayout` share its submodules and reproduce the keys and call
contracts of ``encoder.jit``, ``decoder.jit`` and ``autoencoder.jit`` (doc section 8).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from ..family import Encoding, VideoTokenizer
from .blocks import pointwise_conv
from .encoder_decoder import Decoder, Encoder
from .fsq import FSQuantizer
from .registry import TokenizerConfig


class CausalVideoTokenizer(VideoTokenizer):
    """A Cosmos causal video tokenizer, continuous (CV) or discrete (DV), built from its config.

    Input video is ``[B, 3, T, H, W]`` in [-1, 1] with ``T = 1 + k*temporal_compression``
    and H, W multiples of ``spatial_compression``; anything else raises a ``ValueError``
    that says which sizes would work.
    """

    family: ClassVar[str] = "cosmos"
    sides: ClassVar[dict[str, tuple[str, ...]]] = {
        "encoder": ("encoder.", "quant_conv."),
        "decoder": ("decoder.", "post_quant_conv."),
    }
    # conv_out is a spatial then a temporal convolution; the temporal one is the last layer, and the unpatching
    # that follows it has no weights.
    last_layer: ClassVar[str] = "decoder.conv_out"
    head: ClassVar[str] = "decoder.conv_out.1"

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

    # -- the family's part of the seam (unchecked: the layouts trace them without Python checks) -------
    def encoder_output(self, x: Tensor) -> Tensor:
        return self.quant_conv(self.encoder(x))

    def encoding_of(self, z: Tensor) -> Encoding:
        if self.is_discrete:
            indices, codes, quant_loss = self.quantizer(z)
            return Encoding(codes, indices, quant_loss, pre_quant=z)
        return Encoding(z)

    def decode_unchecked(self, latent: Tensor) -> Tensor:
        return self.decoder(self.post_quant_conv(latent))

    def indices_to_latent(self, indices: Tensor) -> Tensor:
        if not self.is_discrete:
            return super().indices_to_latent(indices)
        return self.quantizer.indices_to_codes(indices).type_as(self.post_quant_conv.conv3d.weight)

    def decode_with_head_input(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        self.check_latent(latent)
        return self.decoder(self.post_quant_conv(latent), with_head_input=True)

    def apply_head(self, head_input: Tensor) -> Tensor:
        return self.decoder.tail(head_input)

    # -- the official tokenizers' call --------------------------------------------------------------------
    def encode(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """CV: latent ``[B, 16, t, h, w]``. DV: ``(indices [B, t, h, w] int32, codes [B, 6, t, h, w])``
        (the official tokenizers' call; :meth:`encoding` names the parts)."""
        out = self.encoding(x)
        return (out.indices, out.latent) if self.is_discrete else out.latent


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
        tok = self._tokenizer[0]
        out = tok.encoding_of(tok.encoder_output(x))
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
            z = tok.indices_to_latent(z)
        return tok.decode_unchecked(z)


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
        out = tok.encoding_of(tok.encoder_output(x))
        if out.indices is not None:
            return tok.decode_unchecked(out.latent), out.quant_loss, out.indices
        return tok.decode_unchecked(out.latent), (torch.zeros(1), torch.zeros(1)), out.latent
