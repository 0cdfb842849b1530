"""The seam every tokenizer family stands behind: what training, evaluation, inference, export and the commands
may ask of a network, and the table of families that resolves a model name to one.

A family (Cosmos today; the Wan VAEs are planned) is a folder of this package that defines a config type, a
network class derived from :class:`VideoTokenizer`, and one :class:`TokenizerFamily` entry passed to
:func:`register_family`. Nothing outside the folder names its classes or submodules: the layers above reach
the network through :class:`VideoTokenizer`'s methods and the family through this module's functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Optional, Protocol

import torch
from torch import Tensor, nn


class Encoding(NamedTuple):
    """What an encoder gives, by role rather than by position, for any family."""

    latent: Tensor
    """What :meth:`VideoTokenizer.decode` takes: a continuous latent ``[B, C, t, h, w]`` (for a VAE its
    posterior mean), or a discrete tokenizer's codes ``[B, C, t, h, w]``."""
    indices: Optional[Tensor] = None
    """Discrete tokenizers only: token indices ``[B, t, h, w]`` (int32), what autoregressive world models read."""
    quant_loss: Optional[Tensor] = None
    """Discrete tokenizers with a quantizer loss (Cosmos DV: all zero, the official ``encoder.jit`` contract)."""
    mean: Optional[Tensor] = None
    """VAEs only: the posterior's mean (the same tensor as ``latent``)."""
    logvar: Optional[Tensor] = None
    """VAEs only: the posterior's log-variance, which a KL term reads."""
    pre_quant: Optional[Tensor] = None
    """Discrete tokenizers only: the encoder's output before quantizing (``[B, C, t, h, w]``), which has gradients
    where the token indices have none."""

    @property
    def tokens(self) -> Tensor:
        """What downstream world models consume: the continuous latent, or the token indices."""
        return self.latent if self.indices is None else self.indices

    def sample(self) -> Tensor:
        """A sample of the posterior, ``mean + exp(logvar / 2) x noise`` (VAEs); the latent for the others."""
        if self.mean is None or self.logvar is None:
            return self.latent
        return self.mean + torch.exp(0.5 * self.logvar) * torch.randn_like(self.mean)

    @property
    def continuous(self) -> Tensor:
        """The encoder's continuous output: the latent (a VAE's posterior mean), or a discrete tokenizer's codes
        before quantizing."""
        return self.latent if self.pre_quant is None else self.pre_quant

    @property
    def posterior(self) -> Optional[tuple[Tensor, Tensor]]:
        """VAEs: ``(mean, logvar)`` of the Gaussian posterior over the latent; None for the others."""
        return None if self.mean is None or self.logvar is None else (self.mean, self.logvar)


class NetworkConfig(Protocol):
    """What every family's config answers (a frozen dataclass in practice)."""

    name: str
    """Short model name (the family's registry key), e.g. ``CV8x8x8``."""
    temporal_compression: int
    spatial_compression: int
    channels: int
    """Base width; tests use tiny ones, and a file's width is inferred from its shapes."""
    in_channels: int

    @property
    def full_name(self) -> str: ...

    @property
    def is_discrete(self) -> bool: ...

    @property
    def latent_dim(self) -> int: ...

    def latent_frames(self, frames: int) -> int: ...

    def clip_problems(
        self, frames: int, height: int, width: int, names: tuple[str, str, str] = ("T", "H", "W")
    ) -> list[str]: ...

    def replace(self, **overrides: Any) -> NetworkConfig: ...

    def to_dict(self) -> dict[str, Any]: ...


def clip_rule_problems(
    temporal: int, spatial: int, frames: int, height: int, width: int, names: tuple[str, str, str] = ("T", "H", "W")
) -> list[str]:
    """The clip rule of causal video tokenizers: ``1 + k * temporal`` frames (the first frame is coded alone) and
    sizes that are multiples of ``spatial``; why a clip of this size breaks it (empty when it does not)."""
    problems = []
    if frames < 1 or (frames - 1) % temporal:
        lo = 1 + max(frames - 1, 0) // temporal * temporal
        problems.append(f"{names[0]}={frames} is not 1+{temporal}k frames (use {lo} or {lo + temporal})")
    for size, name in ((height, names[1]), (width, names[2])):
        if size < 1 or size % spatial:
            problems.append(f"{name}={size} is not a multiple of {spatial}")
    return problems


class VideoTokenizer(nn.Module):
    """The network of every family: video ``[B, C, T, H, W]`` in [-1, 1] in, :class:`Encoding` and video out.

    A family's class sets the class attributes and implements the four unchecked methods; the public methods
    check shapes (a clear ``ValueError`` naming the sizes that would work) and are the same for all.
    """

    family: ClassVar[str]
    """The :class:`TokenizerFamily` name this network belongs to."""
    sides: ClassVar[Mapping[str, tuple[str, ...]]]
    """``"encoder"`` / ``"decoder"`` -> the parameter-name prefixes of that side (``model.trainable``); training
    the decoder side alone keeps the latent space fixed."""
    last_layer: ClassVar[str]
    """The module holding the decoder's last layer: loss.gan's adaptive weight compares gradients at the last
    trained weight below it."""
    head: ClassVar[str]
    """The module :meth:`apply_head` runs (the decoder's last convolution), from the input
    :meth:`decode_with_head_input` returns."""
    lora_modules: ClassVar[tuple[str, ...]] = ("*",)
    """fnmatch patterns of the convolutions LoRA may adapt (``model.lora.targets`` choose among them): a family
    leaves out a convolution whose weight an adapter could not be folded into, or that must stay as released."""
    chunks_in_time: ClassVar[bool] = False
    """Whether the network can run a clip's causal pass in chunks of time with its state carried across (the
    same result in a fraction of the activation memory); such a network reads :attr:`time_chunk`."""
    time_chunk: int = 0
    """Latent frames per chunk of the causal pass (0: the whole clip at once); a speed and memory switch of
    networks with :attr:`chunks_in_time`, never part of the state."""
    config: NetworkConfig

    @property
    def is_discrete(self) -> bool:
        return self.config.is_discrete

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: what a batch is cast to before the forward pass."""
        return next(self.parameters()).dtype

    # -- what a family implements (unchecked: the layouts trace them without Python checks) ------------
    def encoder_output(self, x: Tensor) -> Tensor:
        """What the encoder gives before quantizing or picking the posterior's mean; spatial tiles blend it."""
        raise NotImplementedError

    def encoding_of(self, z: Tensor) -> Encoding:
        """The :class:`Encoding` of :meth:`encoder_output`'s ``z``."""
        raise NotImplementedError

    def decode_unchecked(self, latent: Tensor) -> Tensor:
        """:meth:`decode` without the shape check."""
        raise NotImplementedError

    def decode_with_head_input(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`decode`, and the input of the decoder's last layer, from which :meth:`apply_head` gives the
        video again (gradients at that layer's weights then cost one small convolution)."""
        raise NotImplementedError

    def apply_head(self, head_input: Tensor) -> Tensor:
        """The decoder's last layer (:attr:`head`) and what follows it, on :meth:`decode_with_head_input`'s
        second output."""
        raise NotImplementedError

    def indices_to_latent(self, indices: Tensor) -> Tensor:
        """Discrete tokenizers: token indices ``[B, t, h, w]`` -> what :meth:`decode` takes."""
        raise TypeError(f"{self.config.name} is continuous: it has no token indices; use decode()")

    # -- the public API, the same for every family --------------------------------------------------------
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

    def encoding(self, x: Tensor) -> Encoding:
        """The :class:`Encoding` of video ``x``: ``.latent`` for the decoder, ``.tokens`` for world models."""
        self.check_video(x)
        return self.encoding_of(self.encoder_output(x))

    def latent(self, x: Tensor) -> Tensor:
        """The continuous latent of video ``x`` (a VAE's posterior mean, a discrete tokenizer's codes): what latent
        statistics and latent drift are measured on."""
        return self.encoding(x).latent

    def decode(self, latent: Tensor) -> Tensor:
        """``latent`` ``[B, C, t, h, w]`` (continuous latent or codes) -> video ``[B, 3, 1 + T_c (t - 1), ...]``."""
        self.check_latent(latent)
        return self.decode_unchecked(latent)

    def decode_indices(self, indices: Tensor) -> Tensor:
        """Discrete tokenizers: token indices ``[B, t, h, w]`` -> video."""
        if not self.is_discrete:
            raise TypeError(f"{self.config.name} is continuous: it has no token indices; use decode()")
        if indices.dim() != 4 or indices.is_floating_point():
            raise ValueError(f"decode_indices expects integer [B, t, h, w], got {indices.dtype} {tuple(indices.shape)}")
        return self.decode_unchecked(self.indices_to_latent(indices))

    def forward(self, x: Tensor) -> Tensor:
        """Reconstruction of ``x`` (discrete tokenizers through the quantizer, with straight-through gradients)."""
        self.check_video(x)
        return self.decode_unchecked(self.encoding_of(self.encoder_output(x)).latent)


@dataclass(frozen=True)
class TokenizerFamily:
    """One family in the table: how its names resolve, how its networks are built, recognised and exported."""

    name: str
    """Short family name (``cosmos``); a checkpoint's config records it."""
    configs: Mapping[str, NetworkConfig]
    """Short model name -> config of every released model of the family."""
    prefixes: tuple[str, ...]
    """Long-name prefixes stripped before the registry lookup (``Cosmos-1.0-Tokenizer-``)."""
    build: Callable[[NetworkConfig], VideoTokenizer]
    """The network of a config, randomly initialised (build under ``torch.device("meta")`` for shapes only)."""
    config_from_dict: Callable[[dict[str, Any]], NetworkConfig]
    """The inverse of ``config.to_dict()`` (a checkpoint's record of its network)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other spellings of its model names (``Wan2.1_VAE``, as Wan names the file) -> registry key."""
    sizes_of: Callable[[Mapping[str, Tensor], NetworkConfig], Mapping[str, Any]] = field(default=lambda state, cfg: {})
    """The config fields a state dict's shapes give for a model of this family (its width ``channels``, and any
    other size that differs between files, such as a VAE's latent channels): a file's model is built at those
    sizes; empty when the shapes say nothing."""
    posterior: bool = False
    """Whether its encoder gives a Gaussian posterior (a KL-VAE): ``loss.kl`` and ``model.sample_posterior`` need
    one."""
    latent_stats: str = "per-frame"
    """The statistics its world models normalise continuous latents with: ``"per-frame"`` (Cosmos' ``mean_std.pt``:
    a mean and std per channel and latent frame of a 121-frame chunk); a family whose consumers read others (per
    channel, as the Wan VAEs' constants) names them, and the statistics commands refuse it until they compute them."""
    latent_constants: Optional[tuple[tuple[float, ...], tuple[float, ...]]] = None
    """The base model's per-channel latent ``(mean, std)`` that its consumers hard-code (Wan's ``(mu - mean) / std``),
    which no file changes: the reference a retrained encoder's statistics are compared with, and what a decoder-only
    run keeps; None where the consumers read only files."""
    official_modules: Optional[Callable[[VideoTokenizer], Mapping[str, nn.Module]]] = None
    """The modules of the family's official traced files, by role (``encoder`` takes video, ``decoder`` the
    tokens, ``autoencoder`` video), sharing the network's weights; None where it has no such files."""
    reader: Optional[Callable[[Path], Optional[dict[str, Tensor]]]] = None
    """Reads a weights file in the family's own format (tensors only, nothing in it runs): its tensors in the
    network's keys, or None when the file is not of that format. None: the family's files are the shared formats
    (TorchScript folders, safetensors, training checkpoints)."""

    def short_name(self, name: str) -> Optional[str]:
        """The registry key ``name`` spells for this family, or None."""
        short = name.strip().rstrip("/").split("/")[-1]
        for prefix in self.prefixes:
            if short.startswith(prefix):
                short = short[len(prefix) :]
        short = self.aliases.get(short, short)
        return short if short in self.configs else None


FAMILIES: dict[str, TokenizerFamily] = {}
"""Family name -> entry, in registration order (the order names are listed and files are recognised in)."""


def register_family(family: TokenizerFamily) -> TokenizerFamily:
    """Add ``family`` to the table (a second family of the same name, or a model name another family has, is
    refused); returns it."""
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise ValueError(f"a tokenizer family named {family.name!r} is registered already")
    taken = {short for other in FAMILIES.values() if other is not family for short in other.configs}
    clash = sorted(taken.intersection(family.configs))
    if clash:
        raise ValueError(f"tokenizer family {family.name!r}: model names {clash} belong to another family")
    FAMILIES[family.name] = family
    return family


def known_names() -> list[str]:
    """Every accepted long model name, of every family (each family's short names are accepted too)."""
    return [cfg.full_name for family in FAMILIES.values() for cfg in family.configs.values()]


def resolve(name: str) -> tuple[TokenizerFamily, str]:
    """The family and registry key of any accepted spelling of a model name."""
    for family in FAMILIES.values():
        short = family.short_name(name)
        if short is not None:
            return family, short
    raise ValueError(
        f"unknown tokenizer model {name!r}. Known models: {', '.join(known_names())} "
        "(the Cosmos-0.1- prefix and the short names such as CV8x8x8 work too)"
    )


def resolve_name(name: str) -> str:
    """Map any accepted spelling of a model name to its short registry key."""
    return resolve(name)[1]


def get_config(name: str, **overrides: Any) -> NetworkConfig:
    """The registered config for ``name`` (any family), with ``overrides`` applied."""
    family, short = resolve(name)
    cfg = family.configs[short]
    return cfg.replace(**overrides) if overrides else cfg


def family_of(config: NetworkConfig) -> TokenizerFamily:
    """The family a config belongs to (the one whose registry holds its name)."""
    for family in FAMILIES.values():
        if config.name in family.configs and isinstance(config, type(family.configs[config.name])):
            return family
    raise ValueError(f"model {config.name!r} belongs to no registered tokenizer family")


def channel_scale(config: NetworkConfig, latent: Tensor) -> Tensor:
    """The spread of each latent channel that a world model sees, ``[1, C, 1, 1, 1]``: the std its family's
    consumers normalise with (:attr:`TokenizerFamily.latent_constants`: the Wan VAEs), else each channel's std
    over ``latent`` itself (computed without gradients, at least a tenth of the channels' mean and 1e-3; Cosmos'
    per-frame statistics are of the same order).
    Latent noise and the latent anchor are measured in it, so a number means the same in every family."""
    constants = family_of(config).latent_constants
    if constants is not None:
        return torch.tensor(constants[1], device=latent.device, dtype=torch.float32).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        std = latent.float().transpose(0, 1).flatten(1).std(dim=1)
        # A flat batch (black frames, a fade) has channels of almost no spread: a floor keeps what is divided by
        # it, or scaled with it, in proportion to the other channels.
        floor = (0.1 * std.mean()).clamp_min(1e-3)
        return torch.maximum(std, floor).view(1, -1, 1, 1, 1)


def build_network(config: NetworkConfig) -> VideoTokenizer:
    """The randomly initialised network of ``config``, by its family."""
    return family_of(config).build(config)


def build_tokenizer(name: str, **config_overrides: Any) -> VideoTokenizer:
    """Build a randomly initialised tokenizer by model name, e.g. ``build_tokenizer("CV8x8x8")``.

    ``config_overrides`` change fields of the family's config (``channels=16`` gives the tiny test models).
    Build under ``torch.device("meta")`` to inspect shapes without allocating weights.
    """
    return build_network(get_config(name, **config_overrides))


FAMILY_KEY = "family"
"""The key of a config's dict (a checkpoint's record) that names its family; absent means Cosmos, the first."""


def config_from_dict(data: Mapping[str, Any]) -> NetworkConfig:
    """The config a checkpoint recorded with ``config.to_dict()`` (its family from :data:`FAMILY_KEY`, the
    first registered family when absent, as in files written before there were families)."""
    settings = dict(data)
    name = settings.pop(FAMILY_KEY, None) or next(iter(FAMILIES))
    if name not in FAMILIES:
        raise ValueError(f"{FAMILY_KEY}={name!r} is not a known tokenizer family ({', '.join(FAMILIES)})")
    return FAMILIES[name].config_from_dict(settings)
