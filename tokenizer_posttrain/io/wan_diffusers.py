"""The diffusers format of the Wan2.1 VAE, both ways: ``AutoencoderKLWan`` folders.

Such a folder holds diffusers' ``config.json`` (``_class_name`` ``AutoencoderKLWan``, the architecture, and the
per-channel latent statistics ``latents_mean`` / ``latents_std`` that diffusers' Wan pipelines normalize latents
with) and ``diffusion_pytorch_model.safetensors``, whose keys are diffusers' names for the official ``WanVAE_``
keys (``Wan2.1_VAE.pth``, Cosmos-Predict2.5's ``tokenizer.pth``). :func:`write_wan_diffusers` writes one from a
state_dict in the official layout; :func:`read_wan_diffusers` reads one back (strictly) into that layout. Neither
needs diffusers, nor our Wan network: the layout is walked below from the architecture, names and shapes alike.

Only Wan2.1's architecture is handled (any width ``dim`` and latent size ``z_dim``); diffusers' class also holds
Wan2.2's VAE (``is_residual``, ``patch_size`` 2, ``z_dim`` 48), which is refused by name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..core.errors import CheckpointError, ExportError
from ..network.wan21 import WAN21_LATENT_MEAN, WAN21_LATENT_STD
from .config_json import MAX_LATENT, MAX_WIDTH, read_config_json, shown
from .diffusers_format import DIFFUSERS_WEIGHTS, diffusers_class, diffusers_weights
from .export import _atomic_write
from .layout import CONFIG_JSON, Weights, diff_layout

WAN_DIFFUSERS_CLASS = "AutoencoderKLWan"
WAN_DIFFUSERS_VERSION = "0.33.0"
"""The first diffusers release with ``AutoencoderKLWan``. Later releases (0.35) added Wan2.2's fields
(``decoder_base_dim``, ``is_residual``, ``in_channels``, ``out_channels``, ``patch_size``, ``scale_factor_*``;
unchanged up to 0.42.1); they are written too, with Wan2.1's values (their defaults), so that no release's
defaults decide what the folder holds: 0.33 and 0.34 ignore them (an INFO line), later releases read every field."""

DIM_MULT = (1, 2, 4, 4)
"""Wan2.1's width per level, in units of ``dim``."""
RES_BLOCKS = 2
"""Residual blocks per encoder level (the decoder has one more)."""
TEMPORAL_DOWN = (False, True, True)
"""Which encoder levels also halve time (the decoder doubles it in the reverse order)."""
_ARCHITECTURE: dict[str, Any] = {
    "dim_mult": list(DIM_MULT),
    "num_res_blocks": RES_BLOCKS,
    "attn_scales": [],
    "temperal_downsample": list(TEMPORAL_DOWN),  # sic: diffusers' (and Wan's) spelling
}
"""The config fields that fix Wan2.1's architecture, beside ``base_dim`` and ``z_dim``."""
_WAN21_ONLY: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}
"""Fields later diffusers releases added for Wan2.2 that a Wan2.1 VAE has at these values (their defaults)."""
_WAN22_UNSET: dict[str, Any] = {"decoder_base_dim": None, "is_residual": False, "patch_size": None}
"""Fields that Wan2.2's VAE sets (to 256, true and 2) and a Wan2.1 VAE leaves unset."""
WAN21_LATENTS_MEAN, WAN21_LATENTS_STD = WAN21_LATENT_MEAN, WAN21_LATENT_STD
"""The official Wan2.1 VAE's per-channel latent statistics: diffusers' default ``latents_mean``/``latents_std``."""
_FIX = "copy, download or export the folder again"

Shape = tuple[int, ...]


# -- the layout ------------------------------------------------------------------------------------------------
# One walk through Wan2.1's modules, in the order WanVAE_ builds them, yields each weight's official key, its
# diffusers key and its shape. The encoder numbers its blocks in one flat list (``downsamples.N``, diffusers keeps
# the number: ``down_blocks.N``); the decoder's flat ``upsamples.N`` are grouped by level in diffusers
# (``up_blocks.L.resnets.J`` and ``up_blocks.L.upsamplers.0``). Both maps and every shape come from this walk.

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


def _resample(official: str, theirs: str, c: int, up: bool, temporal: bool) -> Iterator[_Entry]:
    # Upsampling halves the width in its spatial conv; its temporal conv makes two frames' channels of one.
    yield from _conv(f"{official}.resample.1", f"{theirs}.resample.1", c, c // 2 if up else c, (3, 3))
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


def _walk(dim: int, z_dim: int) -> Iterator[_Entry]:
    last = len(DIM_MULT) - 1
    widths = [dim * m for m in (1, *DIM_MULT)]
    yield from _conv("encoder.conv1", "encoder.conv_in", 3, widths[0], (3, 3, 3))
    n = 0
    for level, (c_in, c_out) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        for _ in range(RES_BLOCKS):
            yield from _residual(f"encoder.downsamples.{n}", f"encoder.down_blocks.{n}", c_in, c_out)
            c_in, n = c_out, n + 1
        if level != last:
            yield from _resample(
                f"encoder.downsamples.{n}", f"encoder.down_blocks.{n}", c_out, False, TEMPORAL_DOWN[level]
            )
            n += 1
    yield from _middle("encoder", widths[-1])
    yield from _head("encoder", widths[-1], 2 * z_dim)  # the posterior's mean and log-variance
    yield from _conv("conv1", "quant_conv", 2 * z_dim, 2 * z_dim, (1, 1, 1))
    yield from _conv("conv2", "post_quant_conv", z_dim, z_dim, (1, 1, 1))

    widths = [dim * m for m in (DIM_MULT[-1], *DIM_MULT[::-1])]
    temporal_up = TEMPORAL_DOWN[::-1]
    yield from _conv("decoder.conv1", "decoder.conv_in", z_dim, widths[0], (3, 3, 3))
    yield from _middle("decoder", widths[0])
    n = 0
    for level, (c_in, c_out) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        if level > 0:
            c_in //= 2  # the level above ended in an upsampling that halved the width
        for block in range(RES_BLOCKS + 1):
            yield from _residual(f"decoder.upsamples.{n}", f"decoder.up_blocks.{level}.resnets.{block}", c_in, c_out)
            c_in, n = c_out, n + 1
        if level != last:
            theirs = f"decoder.up_blocks.{level}.upsamplers.0"
            yield from _resample(f"decoder.upsamples.{n}", theirs, c_out, True, temporal_up[level])
            n += 1
    yield from _head("decoder", widths[-1], 3)


def official_shapes(dim: int, z_dim: int) -> dict[str, Shape]:
    """Official ``WanVAE_`` key -> shape of the Wan2.1 VAE of width ``dim`` and ``z_dim`` latent channels: what
    ``Wan2.1_VAE.pth`` holds at ``dim=96, z_dim=16``."""
    return {official: shape for official, _, shape in _walk(dim, z_dim)}


def diffusers_shapes(dim: int, z_dim: int) -> dict[str, Shape]:
    """diffusers' key -> shape of the same VAE, as ``AutoencoderKLWan(base_dim=dim, z_dim=z_dim)`` holds it."""
    return {theirs: shape for _, theirs, shape in _walk(dim, z_dim)}


@cache
def _names() -> tuple[dict[str, str], dict[str, str]]:
    # Names do not depend on the widths: one walk gives both maps for every Wan2.1 VAE.
    pairs = [(official, theirs) for official, theirs, _ in _walk(1, 1)]
    ours, theirs = dict(pairs), {t: o for o, t in pairs}
    if not len(ours) == len(theirs) == len(pairs):  # a walk that names two weights alike would drop one
        raise RuntimeError("the Wan2.1 key walk names two weights alike")  # a bug of ours
    return ours, theirs


def diffusers_key(official_key: str) -> str:
    """diffusers' name for the official Wan2.1 key ``official_key``; :class:`ExportError` naming it for a key
    that no Wan2.1 VAE has."""
    found = _names()[0].get(official_key)
    if found is None:
        raise ExportError(
            f"the weight {official_key} is not a weight of the Wan2.1 VAE (WanVAE_), so it has no name in "
            f"diffusers' {WAN_DIFFUSERS_CLASS}: pass the state_dict of a Wan2.1 VAE"
        )
    return found


def official_key(diffusers_key: str) -> str:
    """The official Wan2.1 key of diffusers' key ``diffusers_key`` (the inverse of :func:`diffusers_key`);
    :class:`CheckpointError` naming it for a key that no Wan2.1 ``AutoencoderKLWan`` has."""
    found = _names()[1].get(diffusers_key)
    if found is None:
        raise CheckpointError(
            f"the weight {diffusers_key} is not a weight of diffusers' {WAN_DIFFUSERS_CLASS} for Wan2.1, so it has "
            "no official WanVAE_ name"
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


def diffusers_config(dim: int, z_dim: int, latents_mean: Sequence[float], latents_std: Sequence[float]) -> dict:
    """diffusers' ``AutoencoderKLWan`` config.json of the Wan2.1 VAE of width ``dim`` and ``z_dim`` latent
    channels, with the per-channel statistics ``latents_mean`` / ``latents_std`` (``z_dim`` numbers each) that
    diffusers' Wan pipelines normalize latents with; :class:`ExportError` in one line for values no Wan2.1 VAE
    can have."""
    for name, value, high in (("dim", dim, MAX_WIDTH // max(DIM_MULT)), ("z_dim", z_dim, MAX_LATENT)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise ExportError(
                f"no {WAN_DIFFUSERS_CLASS} config for {name}={shown(value)}: not an integer from 1 to {high}"
            )
    problem = _statistics(latents_mean, latents_std, z_dim)
    if problem:
        raise ExportError(f"no {WAN_DIFFUSERS_CLASS} config with these latent statistics: {problem}")
    return {
        "_class_name": WAN_DIFFUSERS_CLASS,
        "_diffusers_version": WAN_DIFFUSERS_VERSION,
        "base_dim": dim,
        "z_dim": z_dim,
        **_ARCHITECTURE,
        "dropout": 0.0,
        "latents_mean": [float(v) for v in latents_mean],
        "latents_std": [float(v) for v in latents_std],
        **_WAN21_ONLY,
        **_WAN22_UNSET,
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
) -> list[str]:
    """Write the Wan2.1 VAE weights ``state_dict_official`` (official ``WanVAE_`` keys, width ``dim``, ``z_dim``
    latent channels) as a diffusers ``AutoencoderKLWan`` folder into ``folder``, the weights cast to ``dtype``;
    returns the names of the files written. Load it with ``AutoencoderKLWan.from_pretrained(folder)``.

    Weights that are not exactly that VAE's (a key missing or over, a shape), non-finite weights, or statistics
    that are not ``z_dim`` finite numbers (std > 0) are refused (:class:`ExportError`, in one line naming the
    keys) before anything is written. Each file is written atomically, the config last.
    """
    out = Path(folder)
    config = diffusers_config(dim, z_dim, latents_mean, latents_std)
    diff = diff_layout(state_dict_official, official_shapes(dim, z_dim))
    if diff.size:
        raise ExportError(
            f"not writing {out}: the weights are not those of the Wan2.1 VAE with dim={dim}, z_dim={z_dim} "
            f"(official WanVAE_ keys): {diff.describe()}"
        )
    broken = [k for k, v in state_dict_official.items() if v.is_floating_point() and not v.isfinite().all()]
    if broken:
        raise ExportError(
            f"not writing {out}: {len(broken)} weight tensors hold NaN or Inf (first: {broken[0]}); the training "
            "diverged: export an earlier checkpoint"
        )
    saved = {diffusers_key(k): v.detach().to("cpu", dtype).contiguous() for k, v in state_dict_official.items()}
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / DIFFUSERS_WEIGHTS, lambda p: save_file(saved, p, metadata={"format": "pt"}))
    text = json.dumps(config, indent=2) + "\n"
    _atomic_write(out / CONFIG_JSON, lambda p: Path(p).write_text(text))
    return [DIFFUSERS_WEIGHTS, CONFIG_JSON]


# -- reading --------------------------------------------------------------------------------------------------


def is_wan_diffusers(folder: str | Path) -> bool:
    """Whether ``folder`` holds a diffusers ``AutoencoderKLWan`` (its config.json's ``_class_name``, read with
    the bounded reader; a damaged config.json beside diffusers' weights file is a :class:`CheckpointError`)."""
    return diffusers_class(Path(folder)) == WAN_DIFFUSERS_CLASS


def _wan21_config(folder: Path) -> tuple[int, int, dict[str, Any]]:
    """``(dim, z_dim, fields)`` of the ``AutoencoderKLWan`` config.json in ``folder``, every field read checked;
    :class:`CheckpointError` in one line naming the file and the field for anything but a Wan2.1 VAE."""
    meta = folder / CONFIG_JSON
    data = read_config_json(meta, _FIX)
    found = data.get("_class_name")
    if found != WAN_DIFFUSERS_CLASS:
        raise CheckpointError(f"{meta} describes a diffusers {shown(found)}, not an {WAN_DIFFUSERS_CLASS}; {_FIX}")
    # Wan2.2's VAE sets these (true, 2, 256); a Wan2.1 one leaves them null, false or out (or its own width).
    unset = {"is_residual": (None, False), "patch_size": (None,), "decoder_base_dim": (None, data.get("base_dim", 96))}
    wan22 = [f"{k}={shown(data[k])}" for k, values in unset.items() if data.get(k, None) not in values]
    if data.get("is_residual") is True or data.get("patch_size") == 2:
        raise CheckpointError(
            f"{meta} describes a Wan2.2 VAE ({', '.join(wan22)}, z_dim={shown(data.get('z_dim'))}), which "
            "tokenizer-posttrain does not support yet: only Wan2.1 VAEs (Wan2.1, Wan2.2-A14B, Cosmos-Predict2.5) load"
        )
    dims = []
    for name, high in (("base_dim", MAX_WIDTH // max(DIM_MULT)), ("z_dim", MAX_LATENT)):
        value = data.get(name, {"base_dim": 96, "z_dim": 16}[name])  # diffusers' defaults: Wan2.1's
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
            raise CheckpointError(f"{meta}: {name}={shown(value)} is not an integer from 1 to {high}; {_FIX}")
        dims.append(value)
    if wan22:  # another architecture that only names the class
        only = f"the only {WAN_DIFFUSERS_CLASS} read here"
        raise CheckpointError(f"{meta}: {wan22[0]} is no Wan2.1 VAE's, {only}; {_FIX}")
    for name, wan21 in {**_ARCHITECTURE, **_WAN21_ONLY}.items():
        if name in data and data[name] != wan21:
            raise CheckpointError(
                f"{meta}: {name}={shown(data[name])}, but the Wan2.1 VAE has {json.dumps(wan21)}: not a Wan2.1 "
                f"VAE, which is the only {WAN_DIFFUSERS_CLASS} tokenizer-posttrain reads"
            )
    return dims[0], dims[1], data


def wan_diffusers_latents(folder: str | Path) -> tuple[list[float], list[float]]:
    """The per-channel ``(latents_mean, latents_std)`` of the ``AutoencoderKLWan`` folder ``folder`` (diffusers'
    defaults, the official Wan2.1 constants, where its config.json leaves them out, as diffusers does);
    :class:`CheckpointError` naming the file when they are not ``z_dim`` finite numbers each (std > 0)."""
    folder = Path(folder)
    _, z_dim, data = _wan21_config(folder)
    mean, std = data.get("latents_mean", WAN21_LATENTS_MEAN), data.get("latents_std", WAN21_LATENTS_STD)
    problem = _statistics(mean, std, z_dim)
    if problem:
        raise CheckpointError(f"{folder / CONFIG_JSON}: {problem}; {_FIX}")
    return [float(v) for v in mean], [float(v) for v in std]


def read_wan_diffusers(folder: str | Path) -> Weights:
    """Read a diffusers ``AutoencoderKLWan`` folder of a Wan2.1 VAE (``config.json`` +
    ``diffusion_pytorch_model.safetensors``) as weights in the official ``WanVAE_`` key layout (``config`` None:
    the network is built from ``dim`` / ``z_dim`` by the caller). Strict: a key missing from the file, one it has
    over, or a shape that differs from what its config.json describes is a :class:`CheckpointError` naming them
    (in diffusers' names, as the file has them), as is a Wan2.2 config or a missing or unreadable file."""
    folder = Path(folder)
    dim, z_dim, _ = _wan21_config(folder)
    state = diffusers_weights(folder, WAN_DIFFUSERS_CLASS)
    weights = folder / DIFFUSERS_WEIGHTS
    diff = diff_layout(state, diffusers_shapes(dim, z_dim))
    if diff.size:
        raise CheckpointError(
            f"{weights}: the weights do not fit the Wan2.1 {WAN_DIFFUSERS_CLASS} (base_dim={dim}, z_dim={z_dim}) "
            f"that {CONFIG_JSON} describes, so it was altered or belongs to another folder ({_FIX}): "
            f"{diff.describe()}"
        )
    return Weights({official_key(k): v for k, v in state.items()}, str(weights), None)
