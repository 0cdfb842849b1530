"""The Wan2.1 VAE: a causal 3D encoder (video -> posterior mean and log-variance), the decoder, and the network
class the rest of the package reaches through :class:`~..family.VideoTokenizer`.

The state dict is the official one key for key (``Wan2.1_VAE.pth`` loads strictly). Each clip goes through in one
causal pass (see :mod:`.blocks` for why that is the official chunked encode and decode); no output is clamped, so
training keeps its gradients at the edges of [-1, 1] (the official ``WanVAE.decode`` wrapper clamps afterwards,
for display).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from ..family import Encoding, VideoTokenizer
from ..segments import Segment, run_segment
from .blocks import AttentionBlock, CausalConv3d, Resample, ResidualBlock, RMSNorm
from .chunks import Rerun, Streaming, chunk_sizes, run_in_chunks, streaming_modules
from .registry import Wan21Config


class Segmented(Streaming):
    """Runs its pieces through :func:`~..segments.run_segment`, steered by the training's speed switches (the
    encoders and decoders of both Wan VAEs). In a chunk of a clip (:mod:`.chunks`), a recomputed piece runs with
    the chunk's state again."""

    def __init__(self) -> None:
        super().__init__()
        # Speed and memory switches (see ..segments); not part of the state.
        self.activation_checkpointing = False
        self.segment_wrapper = None
        self.memory_format = torch.contiguous_format

    def _run(self, piece: nn.Module, x: Tensor) -> Tensor:
        # Attention runs at the lowest resolution, where recomputing saves little (and Cosmos saw Inductor
        # compute wrong values for checkpointed channels-last attention).
        recompute = self.activation_checkpointing and not isinstance(piece, AttentionBlock)
        out = self._segment(piece, x, recompute, piece)
        assert isinstance(out, Tensor)
        return out

    def _segment(self, fn: Segment, x: Tensor, recompute: bool, owner: nn.Module) -> Tensor | tuple[Tensor, ...]:
        """``fn(x)`` through :func:`~..segments.run_segment`; ``owner`` holds the modules ``fn`` runs."""
        stream = self.stream
        context = None if stream is None else Rerun(stream, streaming_modules(owner))
        return run_segment(fn, x, recompute, self.segment_wrapper, context)

    def _run_all(self, pieces: nn.Sequential, x: Tensor) -> Tensor:
        for piece in pieces:
            x = self._run(piece, x)
        return x

    def _formatted(self, x: Tensor) -> Tensor:
        # The default layout adds no operation at all.
        fmt = self.memory_format
        return x if fmt == torch.contiguous_format else x.contiguous(memory_format=fmt)


class DecoderBase(Segmented):
    """What both Wan decoders share: the stem (``conv1``), the middle blocks, the head (``head``: norm, SiLU and the
    last convolution, ``head.2``) and the forward pass around their levels (:meth:`_upsample`)."""

    conv1: nn.Module
    middle: nn.Sequential
    head: nn.Sequential

    def _stem(self, z: Tensor) -> Tensor:
        return self.conv1(self._formatted(z))

    def _upsample(self, h: Tensor) -> Tensor:
        raise NotImplementedError

    def head_input(self, h: Tensor) -> Tensor:
        """What the last convolution (``head.2``) takes: the head's norm and activation of ``h``."""
        return self.head[1](self.head[0](h))

    def _head_and_input(self, h: Tensor) -> tuple[Tensor, Tensor]:
        head_input = self.head_input(h)
        return self.head[2](head_input), head_input

    def forward(self, z: Tensor, with_head_input: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """The output decoded from ``z``; with ``with_head_input``, also the input of the last convolution."""
        h = self._segment(self._stem, z, self.activation_checkpointing, self.conv1)
        assert isinstance(h, Tensor)
        h = self._upsample(self._run_all(self.middle, h))
        if with_head_input:
            # The full-resolution activations: the widest of the decoder, worth recomputing.
            out = self._segment(self._head_and_input, h, self.activation_checkpointing, self.head)
            assert isinstance(out, tuple)
            return out[0], out[1]
        return self._run(self.head, h)


class Encoder3d(Segmented):
    """Video ``[B, 3, 1 + 4k, 8h, 8w]`` -> ``[B, 2 z_dim, 1 + k, h, w]`` (before the posterior's ``conv1``)."""

    def __init__(self, cfg: Wan21Config) -> None:
        super().__init__()
        dims = [cfg.channels * m for m in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        scale = 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=False)):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, cfg.dropout))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i < len(cfg.dim_mult) - 1:
                blocks.append(Resample(out_dim, up=False, temporal=cfg.temporal_downsample[i]))
                scale /= 2.0
        self.downsamples = nn.Sequential(*blocks)
        width = dims[-1]
        self.middle = nn.Sequential(
            ResidualBlock(width, width, cfg.dropout), AttentionBlock(width), ResidualBlock(width, width, cfg.dropout)
        )
        self.head = nn.Sequential(RMSNorm(width), nn.SiLU(), CausalConv3d(width, 2 * cfg.z_dim, 3, padding=1))

    def _stem(self, x: Tensor) -> Tensor:
        return self.conv1(self._formatted(x))

    def forward(self, x: Tensor) -> Tensor:
        out = self._segment(self._stem, x, self.activation_checkpointing, self.conv1)
        assert isinstance(out, Tensor)
        out = self._run_all(self.downsamples, out)
        out = self._run_all(self.middle, out)
        return self._run(self.head, out)


class Decoder3d(DecoderBase):
    """``[B, z_dim, 1 + k, h, w]`` (after ``conv2``) -> video ``[B, 3, 1 + 4k, 8h, 8w]``, unclamped."""

    def __init__(self, cfg: Wan21Config) -> None:
        super().__init__()
        levels = len(cfg.dim_mult)
        dims = [cfg.channels * m for m in (cfg.dim_mult[-1], *reversed(cfg.dim_mult))]
        temporal_upsample = tuple(reversed(cfg.temporal_downsample))
        scale = 1.0 / 2 ** (levels - 2)
        width = dims[0]
        self.conv1 = CausalConv3d(cfg.z_dim, width, 3, padding=1)
        self.middle = nn.Sequential(
            ResidualBlock(width, width, cfg.dropout), AttentionBlock(width), ResidualBlock(width, width, cfg.dropout)
        )
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=False)):
            if i > 0:  # the upsampler before this level halved its width
                in_dim //= 2
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResidualBlock(in_dim, out_dim, cfg.dropout))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i < levels - 1:
                blocks.append(Resample(out_dim, up=True, temporal=temporal_upsample[i]))
                scale *= 2.0
        self.upsamples = nn.Sequential(*blocks)
        width = dims[-1]
        self.head = nn.Sequential(RMSNorm(width), nn.SiLU(), CausalConv3d(width, cfg.in_channels, 3, padding=1))

    def _upsample(self, h: Tensor) -> Tensor:
        return self._run_all(self.upsamples, h)


class Wan21VAE(VideoTokenizer):
    """The Wan2.1 video VAE (8x8 spatial, 4x temporal compression; clips of ``1 + 4k`` frames, sizes multiples
    of 8), built from its config, with the official parameter names.

    Its :class:`~..family.Encoding` holds the raw posterior mean (no per-channel normalisation: the world models'
    constants are :data:`.registry.WAN21_LATENT_MEAN` and ``_STD``) and log-variance; :meth:`forward`
    reconstructs from the mean.
    """

    family: ClassVar[str] = "wan21"
    sides: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "encoder": ("encoder.", "conv1."),
        "decoder": ("decoder.", "conv2."),
    }
    last_layer: ClassVar[str] = "decoder.head.2"
    head: ClassVar[str] = "decoder.head.2"
    # Every 3D convolution may be adapted (all are plain convolutions, causal padding aside, so adapters fold
    # into their weights). The spatial resamplers' and the attention's convolutions are 2D: LoRA never adapts them.
    lora_modules: ClassVar[tuple[str, ...]] = ("*",)
    encoder_class: ClassVar[type[nn.Module]] = Encoder3d
    decoder_class: ClassVar[type[DecoderBase]] = Decoder3d
    chunks_in_time: ClassVar[bool] = True

    def __init__(self, config: Wan21Config) -> None:
        super().__init__()
        self.config = config
        z = config.z_dim
        # Registration order is the official state-dict order.
        self.encoder = self.encoder_class(config)
        self.conv1 = CausalConv3d(2 * z, 2 * z, 1)
        self.conv2 = CausalConv3d(z, z, 1)
        self.decoder = self.decoder_class(config)
        self.time_chunk = 0  # a speed and memory switch (see VideoTokenizer), not part of the state

    def _in_chunks(self, fn: Callable[[Tensor], Tensor], x: Tensor, module: nn.Module, first: int, rest: int) -> Tensor:
        # Training recomputes each chunk in the backward pass: memory is why a training clip is cut at all.
        sizes = chunk_sizes(x.shape[2], first, rest)
        if len(sizes) == 1:
            return fn(x)
        return run_in_chunks(fn, x, sizes, streaming_modules(module), recompute=True)

    def _video(self, decoded: Tensor) -> Tensor:
        """The decoder's output as video (Wan2.2's decoder gives patches, which it puts back)."""
        return decoded

    def _encoded(self, x: Tensor) -> Tensor:
        return self.conv1(self.encoder(x))

    def encoder_output(self, x: Tensor) -> Tensor:
        """The posterior's mean and log-variance, stacked on the channels (``[B, 2 z_dim, t, h, w]``)."""
        n, tc = self.time_chunk, self.config.temporal_compression
        if not n:
            return self._encoded(x)
        return self._in_chunks(self._encoded, x, self.encoder, 1 + tc * (n - 1), tc * n)

    def _decoded(self, latent: Tensor) -> Tensor:
        out = self.decoder(self.conv2(latent))
        assert isinstance(out, Tensor)
        return out

    def encoding_of(self, z: Tensor) -> Encoding:
        mean, logvar = z.chunk(2, dim=1)
        return Encoding(mean, mean=mean, logvar=logvar)

    def decode_unchecked(self, latent: Tensor) -> Tensor:
        n = self.time_chunk
        out = self._in_chunks(self._decoded, latent, self.decoder, n, n) if n else self._decoded(latent)
        return self._video(out)

    def decode_with_head_input(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        self.check_latent(latent)
        if self.time_chunk:
            # The head input is the decoder's widest activation; in chunks it is kept whole all the same (the
            # adversarial stage's adaptive weight reads it), and the head is run again on it.
            head_input = self._in_chunks(self._head_input, latent, self.decoder, self.time_chunk, self.time_chunk)
            return self.apply_head(head_input), head_input
        out = self.decoder(self.conv2(latent), with_head_input=True)
        assert isinstance(out, tuple)
        return self._video(out[0]), out[1]

    def _head_input(self, latent: Tensor) -> Tensor:
        out = self.decoder(self.conv2(latent), with_head_input=True)
        assert isinstance(out, tuple)
        return out[1]

    def apply_head(self, head_input: Tensor) -> Tensor:
        return self._video(self.decoder.head[2](head_input))
