"""The diffusers format of the Wan VAEs (Wan2.1 and Wan2.2), both ways: ``AutoencoderKLWan`` folders.

Such a folder holds diffusers' ``config.json`` (``_class_name`` ``AutoencoderKLWan``, the architecture, and the
per-channel latent statistics ``latents_mean`` / ``latents_std`` that diffusers' Wan pipelines normalize latents
with) and ``diffusion_pytorch_model.safetensors``, whose keys are diffusers' names for the official ``WanVAE_``
keys (``Wan2.1_VAE.pth``, Cosmos-Predict2.5's ``tokenizer.pth``, ``Wan2.2_VAE.pth``). :func:`write_wan_diffusers`
writes one from a state_dict in the official layout; :func:`read_wan_diffusers` reads one back (strictly) into that
layout and says which VAE it holds (:class:`WanVAE`). Neither needs diffusers, nor our Wan networks: the layout is
walked below from the architecture, names and shapes alike.

diffusers' one class holds both VAEs: Wan2.1's (``is_residual`` false) at any width ``dim`` and latent size
``z_dim``, and Wan2.2's (``is_residual`` true: residual shortcuts around each level, the video patchified 2x2 into
12 channels, a decoder of its own width ``dec_dim``) at any ``dim``, ``dec_dim`` and ``z_dim``. Any other
architecture the class can take is refused, naming the config field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..core.errors import CheckpointError, ExportError
from ..network.wan21 import WAN21_LATENT_MEAN, WAN21_LATENT_STD
from ..network.wan22 import WAN22_LATENT_MEAN, WAN22_LATENT_STD
from .config_json import MAX_LATENT, MAX_WIDTH, read_config_json, shown
from .diffusers_format import DIFFUSERS_WEIGHTS, diffusers_class, diffusers_weights
from .export import _atomic_write
from .layout import CONFIG_JSON, Weights, diff_layout

WAN_DIFFUSERS_CLASS = "AutoencoderKLWan"
WAN21, WAN22 = "Wan2.1", "Wan2.2"
VARIANTS = (WAN21, WAN22)
"""The Wan VAEs read and written here, by the name their release gives them."""
WAN_DIFFUSERS_VERSION = "0.33.0"
"""The first diffusers release with ``AutoencoderKLWan``, written in a Wan2.1 folder. Later releases (0.35) added
Wan2.2's fields (``decoder_base_dim``, ``is_residual``, ``in_channels``, ``out_channels``, ``patch_size``,
``scale_factor_*``; unchanged up to 0.42.1); they are written too, with Wan2.1's values (their defaults), so that
no release's defaults decide what the folder holds: 0.33 and 0.34 ignore them (an INFO line), later releases read
every field."""
WAN22_DIFFUSERS_VERSION = "0.35.0"
"""The first diffusers release that builds Wan2.2's VAE, written in a Wan2.2 folder (older ones would build a
Wan2.1 VAE from it and find every weight misplaced)."""

DIM_MULT = (1, 2, 4, 4)
"""The width per level of both VAEs, in units of ``dim`` (of ``dec_dim`` in Wan2.2's decoder)."""
RES_BLOCKS = 2
"""Residual blocks per encoder level (the decoder has one more)."""
TEMPORAL_DOWN = (False, True, True)
"""Which encoder levels also halve time (the decoder doubles it in the reverse order)."""
PATCH = 2
"""Wan2.2's VAE folds each 2x2 pixel patch into channels before its encoder (3 -> 12) and back after its decoder."""
_ARCHITECTURE: dict[str, Any] = {
    "dim_mult": list(DIM_MULT),
    "num_res_blocks": RES_BLOCKS,
    "attn_scales": [],
    "temperal_downsample": list(TEMPORAL_DOWN),  # sic: diffusers' (and Wan's) spelling
}
"""The config fields that fix both VAEs' architecture, beside the sizes."""
_VARIANT_FIELDS: dict[str, dict[str, Any]] = {
    WAN21: {
        "is_residual": False,
        "in_channels": 3,
        "out_channels": 3,
        "patch_size": None,
        "scale_factor_temporal": 4,
        "scale_factor_spatial": 8,
    },
    WAN22: {
        "is_residual": True,
        "in_channels": 3 * PATCH**2,
        "out_channels": 3 * PATCH**2,
        "patch_size": PATCH,
        "scale_factor_temporal": 4,
        "scale_factor_spatial": 8 * PATCH,
    },
}
"""The fields (added by diffusers 0.35) that tell the two VAEs apart, at each one's values; Wan2.1's are diffusers'
defaults, as are ``decoder_base_dim`` null (the encoder's width) and the :data:`_ARCHITECTURE` values."""
_DEFAULTS: dict[str, Any] = {**_ARCHITECTURE, **_VARIANT_FIELDS[WAN21], "base_dim": 96, "z_dim": 16}
"""What diffusers builds for a field a config.json leaves out."""
WAN21_LATENTS_MEAN, WAN21_LATENTS_STD = WAN21_LATENT_MEAN, WAN21_LATENT_STD
"""The official Wan2.1 VAE's per-channel latent statistics: diffusers' default ``latents_mean``/``latents_std``."""
WAN22_LATENTS_MEAN, WAN22_LATENTS_STD = WAN22_LATENT_MEAN, WAN22_LATENT_STD
"""The official Wan2.2 VAE's 48 per-channel latent statistics, as Wan2.2's ``Wan2_2_VAE`` wrapper
(``wan/modules/vae2_2.py``) normalizes with. diffusers has no default for them (its defaults are Wan2.1's 16): a
Wan2.2 folder must write them."""
_FIX = "copy, download or export the folder again"
_HIGH = {"dim": MAX_WIDTH // max(DIM_MULT), "dec_dim": MAX_WIDTH // max(DIM_MULT), "z_dim": MAX_LATENT}
"""The largest size of each kind taken (the widest level must stay within the config reader's width bound)."""

Shape = tuple[int, ...]


@dataclass(frozen=True)
class WanVAE:
    """Which Wan VAE, at which size: what an ``AutoencoderKLWan`` config.json describes."""

    variant: str
    """:data:`WAN21` or :data:`WAN22`."""
    dim: int
    """The encoder's width (``base_dim`` in diffusers): 96 in Wan2.1's release, 160 in Wan2.2's."""
    z_dim: int
    """Latent channels: 16 in Wan2.1's release, 48 in Wan2.2's."""
    dec_dim: int
    """The decoder's width (``decoder_base_dim``): Wan2.1's is ``dim``; 256 in Wan2.2's release."""

    def official_sizes(self) -> str:
        """The sizes as ``WanVAE_`` names them."""
        dec = f"dec_dim={self.dec_dim}, " if self.variant == WAN22 else ""
        return f"dim={self.dim}, {dec}z_dim={self.z_dim}"

    def diffusers_sizes(self) -> str:
        """The sizes as diffusers' config.json names them."""
        dec = f"decoder_base_dim={self.dec_dim}, " if self.variant == WAN22 else ""
        return f"base_dim={self.dim}, {dec}z_dim={self.z_dim}"


def wan_vae(variant: str, dim: int, z_dim: int, dec_dim: int | None = None) -> WanVAE:
    """The :class:`WanVAE` ``variant`` of these sizes (``dec_dim`` None: ``dim``, Wan2.1's only choice);
    :class:`ExportError` in one line for a variant or a size that no Wan VAE has."""
    if variant not in VARIANTS:
        raise ExportError(f"no Wan VAE {shown(variant)}: the variants are {', '.join(VARIANTS)}")
    sizes = {"dim": dim, "z_dim": z_dim, "dec_dim": dim if dec_dim is None else dec_dim}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _HIGH[name]:
            raise ExportError(
                f"no {variant} {WAN_DIFFUSERS_CLASS} for {name}={shown(value)}: not an integer from 1 to {_HIGH[name]}"
            )
    if variant == WAN21 and sizes["dec_dim"] != dim:
        raise ExportError(f"no {WAN21} VAE with dec_dim={dec_dim} and dim={dim}: its decoder has its encoder's width")
    return WanVAE(variant, dim, z_dim, sizes["dec_dim"])


# -- the layout ------------------------------------------------------------------------------------------------
# One walk through a Wan VAE's modules, in the order WanVAE_ builds them, yields each weight's official key, its
# diffusers key and its shape. Wan2.1's encoder numbers its blocks in one flat list (``downsamples.N``, diffusers
# keeps the number: ``down_blocks.N``); its decoder's flat ``upsamples.N`` are grouped by level in diffusers
# (``up_blocks.L.resnets.J`` and ``up_blocks.L.upsamplers.0``). Wan2.2 groups both by level
# (``downsamples.L.downsamples.J``: diffusers' ``down_blocks.L.resnets.J`` and ``down_blocks.L.downsampler``; the
# same with ``up`` and ``upsampler``); its level shortcuts hold no weights. Both maps and every shape come from here.

_Entry = tuple[str, str, Shape]


def _conv(official: str, theirs: str, c_in: int, c_out: int, kernel: Shape) -> Iterator[_Entry]:
    yield f"{official}.weight", f"{theirs}.weight", (c_out, c_in, *kernel)
    yield f"{official}.bias", f"{theirs}.bias", (c_out,)


def _residual(official: str, theirs: str, c_in: int, c_out: int) -> Iterator[_Entry]:
    yield f"{official}.residual.0.gamma", f"{theirs}.norm1.gamma", (c_in, 1, 1, 1)
    yield from _conv(f"{official}.residual.2", f"{theirs}.conv1", c_in, c_out, (3, 3, 3))
    yield f"{official}.residual.3.gamma", f"{theirs}.norm2.gamma", (c_out, 1, 1, 1)
    yield from _conv(f"{official}.residual.6", f"{theirs}.conv2", c_out, c_out, (3, 3, 3))
    if c_in != c_out:
        yield from _conv(f"{official}.shortcut", f"{theirs}.conv_shortcut", c_in, c_out, (1, 1, 1))


def _resample(official: str, theirs: str, c: int, c_out: int, up: bool, temporal: bool) -> Iterator[_Entry]:
    # The spatial conv gives c_out channels (Wan2.1's upsampling halves the width there); an upsampling temporal
    # conv makes two frames' channels of one.
    yield from _conv(f"{official}.resample.1", f"{theirs}.resample.1", c, c_out, (3, 3))
    if temporal:
        yield from _conv(f"{official}.time_conv", f"{theirs}.time_conv", c, 2 * c if up else c, (3, 1, 1))


def _middle(side: str, c: int) -> Iterator[_Entry]:
    yield from _residual(f"{side}.middle.0", f"{side}.mid_block.resnets.0", c, c)
    yield f"{side}.middle.1.norm.gamma", f"{side}.mid_block.attentions.0.norm.gamma", (c, 1, 1)
    yield from _conv(f"{side}.middle.1.to_qkv", f"{side}.mid_block.attentions.0.to_qkv", c, 3 * c, (1, 1))
    yield from _conv(f"{side}.middle.1.proj", f"{side}.mid_block.attentions.0.proj", c, c, (1, 1))
    yield from _residual(f"{side}.middle.2", f"{side}.mid_block.resnets.1", c, c)


def _head(side: str, c_in: int, c_out: int) -> Iterator[_Entry]:
    yield f"{side}.head.0.gamma", f"{side}.norm_out.gamma", (c_in, 1, 1, 1)
    yield from _conv(f"{side}.head.2", f"{side}.conv_out", c_in, c_out, (3, 3, 3))


def _block(variant: str, side: str, level: int, index: int, flat: int) -> tuple[str, str]:
    """Official and diffusers names of block ``index`` of ``level`` on ``side`` (``flat``: its number counted over
    all levels); the block after a level's residual blocks is its resampling."""
    down = side == "encoder"
    resample = index == (RES_BLOCKS if down else RES_BLOCKS + 1)
    ours = "downsamples" if down else "upsamples"
    if variant == WAN22:
        sampler = "downsampler" if down else "upsampler"
        theirs = f"{side}.{'down' if down else 'up'}_blocks.{level}." + (sampler if resample else f"resnets.{index}")
        return f"{side}.{ours}.{level}.{ours}.{index}", theirs
    if down:
        return f"encoder.downsamples.{flat}", f"encoder.down_blocks.{flat}"
    theirs = f"decoder.up_blocks.{level}." + ("upsamplers.0" if resample else f"resnets.{index}")
    return f"decoder.upsamples.{flat}", theirs


def _walk(vae: WanVAE) -> Iterator[_Entry]:
    wan22 = vae.variant == WAN22
    pixels = 3 * PATCH**2 if wan22 else 3  # what the encoder takes and the decoder gives, per position
    last = len(DIM_MULT) - 1
    widths = [vae.dim * m for m in (1, *DIM_MULT)]
    yield from _conv("encoder.conv1", "encoder.conv_in", pixels, widths[0], (3, 3, 3))
    flat = 0
    for level, (c_in, c_out) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        for index in range(RES_BLOCKS):
            yield from _residual(*_block(vae.variant, "encoder", level, index, flat), c_in, c_out)
            c_in, flat = c_out, flat + 1
        if level != last:
            names = _block(vae.variant, "encoder", level, RES_BLOCKS, flat)
            yield from _resample(*names, c_out, c_out, False, TEMPORAL_DOWN[level])
            flat += 1
    yield from _middle("encoder", widths[-1])
    yield from _head("encoder", widths[-1], 2 * vae.z_dim)  # the posterior's mean and log-variance
    yield from _conv("conv1", "quant_conv", 2 * vae.z_dim, 2 * vae.z_dim, (1, 1, 1))
    yield from _conv("conv2", "post_quant_conv", vae.z_dim, vae.z_dim, (1, 1, 1))

    widths = [vae.dec_dim * m for m in (DIM_MULT[-1], *DIM_MULT[::-1])]
    temporal_up = TEMPORAL_DOWN[::-1]
    yield from _conv("decoder.conv1", "decoder.conv_in", vae.z_dim, widths[0], (3, 3, 3))
    yield from _middle("decoder", widths[0])
    flat = 0
    for level, (c_in, c_out) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        if level > 0 and not wan22:
            c_in //= 2  # Wan2.1's level above ended in an upsampling that halved the width (Wan2.2's keeps it)
        for index in range(RES_BLOCKS + 1):
            yield from _residual(*_block(vae.variant, "decoder", level, index, flat), c_in, c_out)
            c_in, flat = c_out, flat + 1
        if level != last:
            names = _block(vae.variant, "decoder", level, RES_BLOCKS + 1, flat)
            yield from _resample(*names, c_out, c_out if wan22 else c_out // 2, True, temporal_up[level])
            flat += 1
    yield from _head("decoder", widths[-1], pixels)


def official_shapes(dim: int, z_dim: int, *, variant: str = WAN21, dec_dim: int | None = None) -> dict[str, Shape]:
    """Official ``WanVAE_`` key -> shape of the ``variant`` VAE of width ``dim`` (decoder: ``dec_dim``, Wan2.2
    only) and ``z_dim`` latent channels: what ``Wan2.1_VAE.pth`` holds at ``dim=96, z_dim=16``, and
    ``Wan2.2_VAE.pth`` at ``variant=WAN22, dim=160, dec_dim=256, z_dim=48``."""
    return {official: shape for official, _, shape in _walk(wan_vae(variant, dim, z_dim, dec_dim))}


def diffusers_shapes(dim: int, z_dim: int, *, variant: str = WAN21, dec_dim: int | None = None) -> dict[str, Shape]:
    """diffusers' key -> shape of the same VAE, as ``AutoencoderKLWan(**diffusers_config(...))`` holds it."""
    return {theirs: shape for _, theirs, shape in _walk(wan_vae(variant, dim, z_dim, dec_dim))}


@cache
def _names(variant: str) -> tuple[dict[str, str], dict[str, str]]:
    # Names do not depend on the sizes: one walk gives both maps for every VAE of the variant.
    pairs = [(official, theirs) for official, theirs, _ in _walk(WanVAE(variant, 1, 1, 1))]
    ours, theirs = dict(pairs), {t: o for o, t in pairs}
    if not len(ours) == len(theirs) == len(pairs):  # a walk that names two weights alike would drop one
        raise RuntimeError(f"the {variant} key walk names two weights alike")  # a bug of ours
    return ours, theirs


def diffusers_key(official_key: str, variant: str = WAN21) -> str:
    """diffusers' name for the official key ``official_key`` of the ``variant`` VAE; :class:`ExportError` naming
    it for a key that no such VAE has."""
    found = _names(wan_vae(variant, 1, 1).variant)[0].get(official_key)
    if found is None:
        raise ExportError(
            f"the weight {official_key} is not a weight of the {variant} VAE (WanVAE_), so it has no name in "
            f"diffusers' {WAN_DIFFUSERS_CLASS}: pass the state_dict of a {variant} VAE"
        )
    return found


def official_key(diffusers_key: str, variant: str = WAN21) -> str:
    """The official key of diffusers' key ``diffusers_key`` of the ``variant`` VAE (the inverse of
    :func:`diffusers_key`); :class:`CheckpointError` naming it for a key that no such ``AutoencoderKLWan`` has."""
    found = _names(wan_vae(variant, 1, 1).variant)[1].get(diffusers_key)
    if found is None:
        raise CheckpointError(
            f"the weight {diffusers_key} is not a weight of diffusers' {WAN_DIFFUSERS_CLASS} for {variant}, so it "
            "has no official WanVAE_ name"
        )
    return found


# -- config ---------------------------------------------------------------------------------------------------


def _statistics(mean: Sequence[float], std: Sequence[float], z_dim: int) -> str | None:
    """What is wrong with ``latents_mean`` / ``latents_std`` for ``z_dim`` latent channels; None when nothing."""
    for name, values in (("latents_mean", mean), ("latents_std", std)):
        if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != z_dim:
            return f"{name}={shown(values)} is not a list of {z_dim} numbers, one per latent channel (z_dim)"
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return f"{name}={shown(values)} holds a value that is not a finite number"
    if not all(v > 0 for v in std):
        return f"latents_std={shown(std)} holds a value <= 0, which no latent can be divided by"
    return None


def diffusers_config(
    dim: int,
    z_dim: int,
    latents_mean: Sequence[float],
    latents_std: Sequence[float],
    *,
    variant: str = WAN21,
    dec_dim: int | None = None,
) -> dict:
    """diffusers' ``AutoencoderKLWan`` config.json of the ``variant`` VAE of width ``dim`` (decoder ``dec_dim``,
    Wan2.2 only) and ``z_dim`` latent channels, with the per-channel statistics ``latents_mean`` / ``latents_std``
    (``z_dim`` numbers each) that diffusers' Wan pipelines normalize latents with; :class:`ExportError` in one
    line for values no such VAE can have."""
    vae = wan_vae(variant, dim, z_dim, dec_dim)
    problem = _statistics(latents_mean, latents_std, z_dim)
    if problem:
        raise ExportError(f"no {WAN_DIFFUSERS_CLASS} config with these latent statistics: {problem}")
    wan22 = variant == WAN22
    return {
        "_class_name": WAN_DIFFUSERS_CLASS,
        "_diffusers_version": WAN22_DIFFUSERS_VERSION if wan22 else WAN_DIFFUSERS_VERSION,
        "base_dim": vae.dim,
        "decoder_base_dim": vae.dec_dim if wan22 else None,
        "z_dim": vae.z_dim,
        **_ARCHITECTURE,
        "dropout": 0.0,
        "latents_mean": [float(v) for v in latents_mean],
        "latents_std": [float(v) for v in latents_std],
        **_VARIANT_FIELDS[variant],
    }


# -- writing --------------------------------------------------------------------------------------------------


def write_wan_diffusers(
    state_dict_official: dict[str, Tensor],
    dim: int,
    z_dim: int,
    folder: str | Path,
    latents_mean: Sequence[float],
    latents_std: Sequence[float],
    dtype: torch.dtype = torch.float32,
    *,
    variant: str = WAN21,
    dec_dim: int | None = None,
) -> list[str]:
    """Write the ``variant`` VAE weights ``state_dict_official`` (official ``WanVAE_`` keys, width ``dim``, decoder
    width ``dec_dim`` for Wan2.2, ``z_dim`` latent channels) as a diffusers ``AutoencoderKLWan`` folder into
    ``folder``, the weights cast to ``dtype``; returns the names of the files written. Load it with
    ``AutoencoderKLWan.from_pretrained(folder)``.

    Weights that are not exactly that VAE's (a key missing or over, a shape), non-finite weights, or statistics
    that are not ``z_dim`` finite numbers (std > 0) are refused (:class:`ExportError`, in one line naming the
    keys) before anything is written. Each file is written atomically, the config last.
    """
    out = Path(folder)
    config = diffusers_config(dim, z_dim, latents_mean, latents_std, variant=variant, dec_dim=dec_dim)
    vae = wan_vae(variant, dim, z_dim, dec_dim)
    diff = diff_layout(state_dict_official, {official: shape for official, _, shape in _walk(vae)})
    if diff.size:
        raise ExportError(
            f"not writing {out}: the weights are not those of the {variant} VAE with {vae.official_sizes()} "
            f"(official WanVAE_ keys): {diff.describe()}"
        )
    broken = [k for k, v in state_dict_official.items() if v.is_floating_point() and not v.isfinite().all()]
    if broken:
        raise ExportError(
            f"not writing {out}: {len(broken)} weight tensors hold NaN or Inf (first: {broken[0]}); the training "
            "diverged: export an earlier checkpoint"
        )
    names = _names(variant)[0]
    saved = {names[k]: v.detach().to("cpu", dtype).contiguous() for k, v in state_dict_official.items()}
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / DIFFUSERS_WEIGHTS, lambda p: save_file(saved, p, metadata={"format": "pt"}))
    text = json.dumps(config, indent=2) + "\n"
    _atomic_write(out / CONFIG_JSON, lambda p: Path(p).write_text(text))
    return [DIFFUSERS_WEIGHTS, CONFIG_JSON]


# -- reading --------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class WanWeights(Weights):
    """Weights read from an ``AutoencoderKLWan`` folder, in the official ``WanVAE_`` keys, and which VAE they are
    (``config`` is None: the caller builds the network from :attr:`vae`)."""

    vae: WanVAE


def is_wan_diffusers(folder: str | Path) -> bool:
    """Whether ``folder`` holds a diffusers ``AutoencoderKLWan`` (its config.json's ``_class_name``, read with
    the bounded reader; a damaged config.json beside diffusers' weights file is a :class:`CheckpointError`)."""
    return diffusers_class(Path(folder)) == WAN_DIFFUSERS_CLASS


def _size(data: dict, name: str, high: int, meta: Path) -> int:
    value = data.get(name, _DEFAULTS.get(name))
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        raise CheckpointError(f"{meta}: {name}={shown(value)} is not an integer from 1 to {high}; {_FIX}")
    return value


def _read_config(folder: Path) -> tuple[WanVAE, dict[str, Any]]:
    """The :class:`WanVAE` the ``AutoencoderKLWan`` config.json in ``folder`` describes, and its fields, every field
    read checked; :class:`CheckpointError` in one line naming the file and the field for any other VAE."""
    meta = folder / CONFIG_JSON
    data = read_config_json(meta, _FIX)
    found = data.get("_class_name")
    if found != WAN_DIFFUSERS_CLASS:
        raise CheckpointError(f"{meta} describes a diffusers {shown(found)}, not an {WAN_DIFFUSERS_CLASS}; {_FIX}")
    # is_residual picks diffusers' blocks, hence the variant; every other field must then be that variant's.
    variant = WAN22 if data.get("is_residual") is True else WAN21
    dim = _size(data, "base_dim", _HIGH["dim"], meta)
    z_dim = _size(data, "z_dim", _HIGH["z_dim"], meta)
    dec_dim = data.get("decoder_base_dim")
    if dec_dim is None:  # diffusers builds the decoder at the encoder's width
        dec_dim = dim
    elif variant == WAN22:
        dec_dim = _size(data, "decoder_base_dim", _HIGH["dec_dim"], meta)
    elif not isinstance(dec_dim, int) or isinstance(dec_dim, bool) or dec_dim != dim:
        raise CheckpointError(
            f"{meta}: decoder_base_dim={shown(dec_dim)}, but the {WAN21} VAE has its encoder's width (base_dim={dim}) "
            f"or null (is_residual is false or left out): no Wan VAE that tokenizer-posttrain reads "
            f"({' or '.join(VARIANTS)}); {_FIX}"
        )
    for name, wanted in {**_ARCHITECTURE, **_VARIANT_FIELDS[variant]}.items():
        value = data.get(name, _DEFAULTS[name])
        if json.dumps(value) != json.dumps(wanted):  # types too: 12.0 or true are no channel counts
            why = "is_residual is true" if variant == WAN22 else "is_residual is false or left out"
            raise CheckpointError(
                f"{meta}: {name}={shown(value)}, but the {variant} VAE has {json.dumps(wanted)} ({why}): no Wan "
                f"VAE that tokenizer-posttrain reads ({' or '.join(VARIANTS)}); {_FIX}"
            )
    return WanVAE(variant, dim, z_dim, dec_dim), data


def wan_diffusers_variant(folder: str | Path) -> WanVAE:
    """Which Wan VAE the ``AutoencoderKLWan`` folder ``folder`` holds, from its config.json alone (checked as
    :func:`read_wan_diffusers` checks it)."""
    return _read_config(Path(folder))[0]


def wan_diffusers_latents(folder: str | Path) -> tuple[list[float], list[float]]:
    """The per-channel ``(latents_mean, latents_std)`` of the ``AutoencoderKLWan`` folder ``folder`` (diffusers'
    defaults, the official Wan2.1 constants, where its config.json leaves them out, as diffusers does: 16 numbers,
    which a Wan2.2 folder cannot do without); :class:`CheckpointError` naming the file when they are not ``z_dim``
    finite numbers each (std > 0)."""
    folder = Path(folder)
    vae, data = _read_config(folder)
    mean, std = data.get("latents_mean", WAN21_LATENTS_MEAN), data.get("latents_std", WAN21_LATENTS_STD)
    problem = _statistics(mean, std, vae.z_dim)
    if problem:
        raise CheckpointError(f"{folder / CONFIG_JSON}: {problem}; {_FIX}")
    return [float(v) for v in mean], [float(v) for v in std]


def read_wan_diffusers(folder: str | Path) -> WanWeights:
    """Read a diffusers ``AutoencoderKLWan`` folder of a Wan2.1 or Wan2.2 VAE (``config.json`` +
    ``diffusion_pytorch_model.safetensors``) as weights in the official ``WanVAE_`` key layout of that VAE, with
    which VAE it is (``vae``: variant and sizes). Strict: a key missing from the file, one it has over, or a shape
    that differs from what its config.json describes is a :class:`CheckpointError` naming them (in diffusers'
    names, as the file has them), as is a config of any other VAE or a missing or unreadable file."""
    folder = Path(folder)
    vae, _ = _read_config(folder)
    state = diffusers_weights(folder, WAN_DIFFUSERS_CLASS)
    weights = folder / DIFFUSERS_WEIGHTS
    diff = diff_layout(state, {theirs: shape for _, theirs, shape in _walk(vae)})
    if diff.size:
        raise CheckpointError(
            f"{weights}: the weights do not fit the {vae.variant} {WAN_DIFFUSERS_CLASS} ({vae.diffusers_sizes()}) "
            f"that {CONFIG_JSON} describes, so it was altered or belongs to another folder ({_FIX}): "
            f"{diff.describe()}"
        )
    names = _names(vae.variant)[1]
    return WanWeights({names[k]: v for k, v in state.items()}, str(weights), None, vae=vae)
