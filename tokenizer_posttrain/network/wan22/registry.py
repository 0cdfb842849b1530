"""The typed config of the Wan2.2 VAE, its registry entry and the per-channel latent constants its consumers read.

The network is built from a :class:`Wan22Config` alone; the names resolve through the family table, which accepts
``Wan2.2-VAE``, the file's spelling ``Wan2.2_VAE`` and an organisation-qualified one such as ``Wan-AI/Wan2.2-VAE``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..wan21.registry import WanVAEConfig, from_record, tupled

FAMILY = "wan22"
"""The family name a checkpoint's config records (``family.FAMILY_KEY``)."""


@dataclass(frozen=True)
class Level:
    """One resolution level of either side: its widths, whether it resamples time and space (by 2) at its end,
    and which side it is on (``up``: the decoder)."""

    in_dim: int
    out_dim: int
    temporal: bool
    spatial: bool
    up: bool

    @property
    def positions(self) -> int:
        """Positions one low-resolution position stands for: 2 per resampled dimension."""
        return (2 if self.temporal else 1) * (4 if self.spatial else 1)

    @property
    def has_shortcut(self) -> bool:
        """Whether the level adds a parameter-free shortcut: every encoder level does (the last one's is the
        identity), decoder levels only where they upsample."""
        return self.spatial or not self.up

    def shortcut_problem(self) -> str:
        """Why the shortcut cannot map ``in_dim`` to ``out_dim`` (empty when it can): the encoder's averages whole
        groups of (channel, position) pairs, the decoder's copies each input channel to a whole number of them."""
        source, target = (
            (self.in_dim, self.out_dim * self.positions) if self.up else (self.out_dim, self.in_dim * self.positions)
        )
        if self.has_shortcut and target % source:
            return f"widths {self.in_dim} -> {self.out_dim} do not share {self.positions} positions evenly"
        return ""


@dataclass(frozen=True)
class Wan22Config(WanVAEConfig):
    """Hyperparameters of a Wan2.2-style causal video VAE (the official ``WanVAE_`` arguments of ``vae2_2.py``)."""

    name: str = "Wan2.2-VAE"
    """Short model name (the registry key)."""
    channels: int = 160
    """The encoder's base width (``dim``); the tiny test models use 8."""
    dec_channels: int = 256
    """The decoder's base width (``dec_dim``); the tiny test models use 12."""
    z_dim: int = 48
    """Latent channels; the encoder's last convolution gives twice as many (mean and log-variance)."""
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    """Width multiplier of each resolution level (of both sides' base widths)."""
    num_res_blocks: int = 2
    """Residual blocks per encoder level (the decoder has one more per level)."""
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    """Per encoder resampler: whether it also halves time (the decoder mirrors it)."""
    dropout: float = 0.0
    """Dropout inside the residual blocks."""
    patch_size: int = 2
    """The video is cut into ``patch_size`` x ``patch_size`` pixel patches, stacked on the channels, before the
    encoder (and put back after the decoder)."""
    in_channels: int = 3
    """Channels of the video (the encoder's first convolution takes ``in_channels * patch_size**2``)."""

    def __post_init__(self) -> None:
        if min(self.channels, self.dec_channels, self.z_dim, self.patch_size) < 1:
            raise ValueError(
                f"{self.name}: channels, dec_channels, z_dim and patch_size must be positive, got "
                f"{self.channels}, {self.dec_channels}, {self.z_dim}, {self.patch_size}"
            )
        if len(self.dim_mult) < 2:
            raise ValueError(f"{self.name}: dim_mult needs at least two levels, got {self.dim_mult}")
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"{self.name}: temporal_downsample needs one flag per resampler ({len(self.dim_mult) - 1}), "
                f"got {self.temporal_downsample}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{self.name}: dropout must be in [0, 1), got {self.dropout}")
        # The level shortcuts regroup (encoder) or share out (decoder) channels x resampled positions evenly.
        for side, levels in (("channels", self.encoder_levels()), ("dec_channels", self.decoder_levels())):
            for i, level in enumerate(levels):
                if level.shortcut_problem():
                    raise ValueError(
                        f"{self.name}: {side} with dim_mult {self.dim_mult}, level {i}: {level.shortcut_problem()}"
                    )

    def encoder_levels(self) -> list[Level]:
        """The encoder's resolution levels, input first (the last one does not resample)."""
        widths = [self.channels * m for m in (1, *self.dim_mult)]
        last = len(self.dim_mult) - 1
        return [
            Level(widths[i], widths[i + 1], i < last and self.temporal_downsample[i], i < last, up=False)
            for i in range(len(self.dim_mult))
        ]

    def decoder_levels(self) -> list[Level]:
        """The decoder's resolution levels, latent first (the last one does not resample)."""
        widths = [self.dec_channels * m for m in (self.dim_mult[-1], *reversed(self.dim_mult))]
        temporal = tuple(reversed(self.temporal_downsample))
        last = len(self.dim_mult) - 1
        return [
            Level(widths[i], widths[i + 1], i < last and temporal[i], i < last, up=True)
            for i in range(len(self.dim_mult))
        ]

    @property
    def spatial_compression(self) -> int:
        return self.patch_size * 2 ** (len(self.dim_mult) - 1)

    @property
    def patch_channels(self) -> int:
        """Channels of the patchified video (12 for RGB in 2x2 patches)."""
        return self.in_channels * self.patch_size**2

    def replace(self, **overrides: Any) -> Wan22Config:
        """A copy with some fields changed (e.g. ``channels=8, dec_channels=12, z_dim=8`` for the tiny model).

        ``channels`` alone scales the decoder's width with it (``model.channels`` is the one width setting a run
        has): 160 -> 256 in the release, so ``channels=8`` gives a decoder of width 12."""
        self.check_fields(overrides, "Wan2.2")
        if "channels" in overrides and "dec_channels" not in overrides:
            released = REGISTRY[self.name] if self.name in REGISTRY else Wan22Config()
            overrides = {
                **overrides,
                "dec_channels": overrides["channels"] * released.dec_channels // released.channels,
            }
        return dataclasses.replace(self, **tupled(overrides, _TUPLE_FIELDS))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"family": FAMILY, **dataclasses.asdict(self)}
        for key in _TUPLE_FIELDS:
            out[key] = list(out[key])
        return out


_TUPLE_FIELDS = ("dim_mult", "temporal_downsample")


def config_from_dict(data: dict[str, Any]) -> Wan22Config:
    """The inverse of :meth:`Wan22Config.to_dict`."""
    return from_record(Wan22Config, data, _TUPLE_FIELDS)


REGISTRY: dict[str, Wan22Config] = {c.name: c for c in (Wan22Config(),)}
"""Short name -> config of the released Wan2.2 VAE (``Wan2.2_VAE.pth``)."""

PREFIXES: tuple[str, ...] = ()
"""No long-name prefix: the family table already drops an organisation (``Wan-AI/``) before the lookup."""

WAN22_LATENT_MEAN: tuple[float, ...] = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
"""Per latent channel: the mean the Wan2.2 models subtract from the VAE's posterior mean (``(mu - mean) / std``)."""

WAN22_LATENT_STD: tuple[float, ...] = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip
"""Per latent channel: the standard deviation the Wan2.2 models divide the centred latent by."""
