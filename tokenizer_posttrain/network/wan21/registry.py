"""The typed config of the Wan2.1 VAE, its registry entry and the per-channel latent constants its consumers read.

The network is built from a :class:`Wan21Config` alone; the names resolve through the family table, which accepts
``Wan2.1-VAE`` and an organisation-qualified spelling such as ``Wan-AI/Wan2.1-VAE``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from ..family import clip_rule_problems

FAMILY = "wan21"
"""The family name a checkpoint's config records (``family.FAMILY_KEY``)."""

T = TypeVar("T")


class WanVAEConfig:
    """What the configs of both Wan VAEs answer alike (a mixin of no fields: each dataclass has its own); a config
    sets ``spatial_compression``."""

    name: str
    z_dim: int
    temporal_downsample: tuple[bool, ...]

    @property
    def spatial_compression(self) -> int:
        raise NotImplementedError

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(bool(flag) for flag in self.temporal_downsample)

    @property
    def full_name(self) -> str:
        return self.name

    @property
    def is_discrete(self) -> bool:
        return False

    @property
    def latent_dim(self) -> int:
        return self.z_dim

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` (1 + kT) frames: the first frame is coded alone."""
        return 1 + (frames - 1) // self.temporal_compression

    def clip_problems(
        self, frames: int, height: int, width: int, names: tuple[str, str, str] = ("T", "H", "W")
    ) -> list[str]:
        """Why a clip of this size cannot go through the network (empty when it can)."""
        return clip_rule_problems(self.temporal_compression, self.spatial_compression, frames, height, width, names)

    def check_fields(self, overrides: dict[str, Any], release: str) -> None:
        """A clear error naming the fields of ``overrides`` that this config does not have."""
        known = {f.name for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown {release} config field(s) {unknown}; known: {sorted(known)}")


@dataclass(frozen=True)
class Wan21Config(WanVAEConfig):
    """Hyperparameters of a Wan2.1-style causal video VAE (the official ``WanVAE_`` arguments)."""

    name: str = "Wan2.1-VAE"
    """Short model name (the registry key)."""
    channels: int = 96
    """Base width (``dim``); the tiny test models use 8."""
    z_dim: int = 16
    """Latent channels; the encoder's last convolution gives twice as many (mean and log-variance)."""
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    """Width multiplier of each resolution level."""
    num_res_blocks: int = 2
    """Residual blocks per encoder level (the decoder has one more per level)."""
    attn_scales: tuple[float, ...] = ()
    """Resolution scales (1, 1/2, ...) whose levels get a per-frame attention block after each residual block;
    the released model has none (its middle blocks always attend)."""
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    """Per encoder resampler: whether it also halves time (the decoder mirrors it)."""
    dropout: float = 0.0
    """Dropout inside the residual blocks."""
    in_channels: int = 3

    def __post_init__(self) -> None:
        if self.channels < 1 or self.z_dim < 1:
            raise ValueError(f"{self.name}: channels and z_dim must be positive, got {self.channels}, {self.z_dim}")
        if len(self.dim_mult) < 2:
            raise ValueError(f"{self.name}: dim_mult needs at least two levels, got {self.dim_mult}")
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"{self.name}: temporal_downsample needs one flag per resampler ({len(self.dim_mult) - 1}), "
                f"got {self.temporal_downsample}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{self.name}: dropout must be in [0, 1), got {self.dropout}")

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    def replace(self, **overrides: Any) -> Wan21Config:
        """A copy with some fields changed (e.g. ``channels=8, z_dim=4`` for the tiny test model)."""
        self.check_fields(overrides, "Wan2.1")
        return dataclasses.replace(self, **tupled(overrides))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"family": FAMILY, **dataclasses.asdict(self)}
        for key in ("dim_mult", "attn_scales", "temporal_downsample"):
            out[key] = list(out[key])
        return out


_TUPLE_FIELDS = ("dim_mult", "attn_scales", "temporal_downsample")


def tupled(settings: dict[str, Any], keys: tuple[str, ...] = _TUPLE_FIELDS) -> dict[str, Any]:
    """``settings`` with the lists of ``keys`` (a JSON record, an override) as tuples, so that configs stay
    hashable (layouts are cached by config)."""
    out = dict(settings)
    for key in keys:
        if key in out:
            out[key] = tuple(out[key])
    return out


def from_record(config_class: type[T], data: dict[str, Any], keys: tuple[str, ...] = _TUPLE_FIELDS) -> T:
    """The config of a Wan family that ``data`` (its ``to_dict()``, the ``family`` key taken out or still there)
    records."""
    return config_class(**tupled({k: v for k, v in data.items() if k != "family"}, keys))


def config_from_dict(data: dict[str, Any]) -> Wan21Config:
    """The inverse of :meth:`Wan21Config.to_dict`."""
    return from_record(Wan21Config, data)


REGISTRY: dict[str, Wan21Config] = {c.name: c for c in (Wan21Config(),)}
"""Short name -> config of the released Wan2.1 VAE (``Wan2.1_VAE.pth``)."""

PREFIXES: tuple[str, ...] = ()
"""No long-name prefix: the family table already drops an organisation (``Wan-AI/``) before the lookup."""

WAN21_LATENT_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
"""Per latent channel: the mean the Wan2.1 models subtract from the VAE's posterior mean (``(mu - mean) / std``)."""

WAN21_LATENT_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
"""Per latent channel: the standard deviation the Wan2.1 models divide the centred latent by."""
