"""The typed configs of every released Cosmos-1.0 tokenizer.

The network is built from a :class:`TokenizerConfig` alone; names resolve through the family table
(:func:`tokenizer_posttrain.network.family.resolve_name`), which accepts ``Cosmos-1.0-Tokenizer-CV8x8x8``,
``Cosmos-0.1-Tokenizer-CV8x8x8`` and the short ``CV8x8x8``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..family import clip_rule_problems


@dataclass(frozen=True)
class TokenizerConfig:
    """Hyperparameters of a causal video tokenizer (continuous "CV" or discrete "DV")."""

    name: str
    """Short model name, e.g. ``CV8x8x8``."""
    kind: str
    """``"CV"`` (continuous latents, AE) or ``"DV"`` (FSQ tokens)."""
    temporal_compression: int
    spatial_compression: int
    channels: int = 128
    """Base width; the tiny test models use 16."""
    channels_mult: tuple[int, ...] = (2, 4, 4)
    num_res_blocks: int = 2
    patch_size: int = 4
    in_channels: int = 3
    out_channels: int = 3
    z_channels: int = 16
    z_factor: int = 1
    latent_channels: int = 16
    """CV only: width of the latent (output of ``quant_conv``)."""
    levels: tuple[int, ...] = (8, 8, 8, 5, 5, 5)
    """DV only: FSQ levels per code dimension."""
    legacy_mode: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("CV", "DV"):
            raise ValueError(f"kind must be 'CV' or 'DV', got {self.kind!r}")
        for value, what in (
            (self.patch_size, "patch_size"),
            (self.temporal_compression, "temporal_compression"),
            (self.spatial_compression, "spatial_compression"),
        ):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{what} must be a power of two, got {value}")
        if self.channels < 1:
            raise ValueError(f"channels must be positive, got {self.channels}")
        n_levels = len(self.channels_mult)
        if self.num_spatial_down > n_levels or self.num_temporal_down > n_levels:
            raise ValueError(
                f"{self.name}: compression needs more resampling stages than the "
                f"{n_levels} levels of channels_mult={self.channels_mult}"
            )
        if self.num_spatial_down < 0 or self.num_temporal_down < 0:
            raise ValueError(f"{self.name}: patch_size {self.patch_size} exceeds the compression")

    @property
    def is_discrete(self) -> bool:
        return self.kind == "DV"

    @property
    def num_spatial_down(self) -> int:
        return int(math.log2(self.spatial_compression)) - int(math.log2(self.patch_size))

    @property
    def num_temporal_down(self) -> int:
        return int(math.log2(self.temporal_compression)) - int(math.log2(self.patch_size))

    @property
    def embedding_dim(self) -> int:
        """DV: width of the code vectors (one per FSQ level)."""
        return len(self.levels)

    @property
    def codebook_size(self) -> int:
        return math.prod(self.levels)

    @property
    def latent_dim(self) -> int:
        """Channels of what ``encode`` hands to downstream models (CV latent or DV codes)."""
        return self.embedding_dim if self.is_discrete else self.latent_channels

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` (1 + kT) frames: the first frame is coded alone."""
        return 1 + (frames - 1) // self.temporal_compression

    @property
    def full_name(self) -> str:
        return f"Cosmos-1.0-Tokenizer-{self.name}"

    def clip_problems(
        self, frames: int, height: int, width: int, names: tuple[str, str, str] = ("T", "H", "W")
    ) -> list[str]:
        """Why a clip of this size cannot go through the network (empty when it can)."""
        return clip_rule_problems(self.temporal_compression, self.spatial_compression, frames, height, width, names)

    def replace(self, **overrides: Any) -> TokenizerConfig:
        """A copy with some fields changed (e.g. ``channels=16`` for tiny test models)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown tokenizer config field(s) {unknown}; known: {sorted(known)}")
        for key in ("channels_mult", "levels"):
            if key in overrides:
                overrides[key] = tuple(overrides[key])
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["channels_mult"] = list(self.channels_mult)
        out["levels"] = list(self.levels)
        return out


def _cv(name: str, t: int, s: int, **kw: Any) -> TokenizerConfig:
    return TokenizerConfig(name=name, kind="CV", temporal_compression=t, spatial_compression=s, **kw)


def _dv(name: str, t: int, s: int, **kw: Any) -> TokenizerConfig:
    return TokenizerConfig(name=name, kind="DV", temporal_compression=t, spatial_compression=s, **kw)


REGISTRY: dict[str, TokenizerConfig] = {
    c.name: c
    for c in (
        _cv("CV8x8x8", 8, 8),
        _cv("CV8x16x16", 8, 16),
        _cv("CV4x8x8", 4, 8, channels_mult=(2, 4)),
        _cv("CV4x8x8-LowRes", 4, 8, patch_size=2),
        _dv("DV8x16x16", 8, 16),
        _dv("DV8x8x8", 8, 8),
        _dv("DV4x8x8", 4, 8),
        _dv("DV4x8x8-LowRes", 4, 8, patch_size=2, z_channels=256),
    )
}
"""Short name -> config of every released Cosmos-1.0 tokenizer."""

PREFIXES = ("Cosmos-1.0-Tokenizer-", "Cosmos-0.1-Tokenizer-")
"""Long-name prefixes of the released models (the short names work too)."""


def config_from_dict(data: dict[str, Any]) -> TokenizerConfig:
    """The inverse of :meth:`TokenizerConfig.to_dict`."""
    return TokenizerConfig(**data)
