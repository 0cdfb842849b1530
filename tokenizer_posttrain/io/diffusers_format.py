"""The diffusers format of continuous Cosmos tokenizers, both ways: ``AutoencoderKLCosmos`` folders.

Such a folder holds diffusers' ``config.json`` (``_class_name`` ``AutoencoderKLCosmos``, the architecture, and the
latent statistics ``latents_mean`` / ``latents_std`` that diffusers' Cosmos pipelines normalize latents with) and
``diffusion_pytorch_model.safetensors``. :func:`write_diffusers` writes one that
``AutoencoderKLCosmos.from_pretrained`` loads with no missing or unexpected key, so a diffusers Cosmos pipeline
takes it as its ``vae``; :func:`read_diffusers` reads one back (strictly) as a starting point. Neither needs
diffusers installed: the format is JSON, safetensors and the renaming of keys below. diffusers has no class for
the discrete tokenizers, so they have no diffusers format.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..core.errors import CheckpointError, ExportError
from ..network import VideoTokenizer
from ..network.cosmos import REGISTRY, TokenizerConfig
from ..network.cosmos.haar import Patcher3D, UnPatcher3D
from .config_json import (
    INTEGERS,
    MAX_LEVELS,
    MAX_WIDTH,
    POWERS_OF_TWO,
    integer,
    integers,
    read_config_json,
    shown,
)
from .export import CHUNK_FRAMES, _atomic_write, prepared_copy
from .layout import CONFIG_JSON, Weights, describe_config, diff_layout, expected_shapes, load_safetensors

DIFFUSERS_CLASS = "AutoencoderKLCosmos"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_VERSION = "0.34.0"
"""The first diffusers release with ``AutoencoderKLCosmos`` (its config fields are unchanged up to 0.42.1)."""
PIPELINE_SUBFOLDER = "vae"
"""Where a diffusers pipeline folder (and NVIDIA's tokenizer repositories on the Hub) keep the diffusers VAE."""

_RESOLUTION = 1024
"""diffusers' nominal input size; like ``attention_resolutions`` it only decides where attention blocks go."""
_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "encoder_block_out_channels": [128, 256, 512, 512],
    "decode_block_out_channels": [256, 512, 512, 512],
    "attention_resolutions": [32],
    "resolution": _RESOLUTION,
    "num_layers": 2,
    "patch_size": 4,
    "patch_type": "haar",
    "spatial_compression_ratio": 8,
    "temporal_compression_ratio": 8,
}
"""``AutoencoderKLCosmos.__init__``'s defaults: what diffusers builds for a field that a config.json leaves out."""
_MAX_RESOLUTION = 65536
_OURS = {
    "in_channels": "in_channels",
    "out_channels": "out_channels",
    "latent_channels": "latent_channels",
    "num_layers": "num_res_blocks",
    "patch_size": "patch_size",
    "spatial_compression_ratio": "spatial_compression",
    "temporal_compression_ratio": "temporal_compression",
}
"""The field of our config each integer field of diffusers' becomes: it is held to that field's range."""
_FIX = "copy, download or export the folder again"


class LatentMoments(Protocol):
    """The latent statistics written into the config (``LatentStats`` of the evaluation layer is one)."""

    mean: Tensor
    """``[C, T]``: per latent channel and latent-frame position."""
    std: Tensor
    """``[C, T]``, positive."""


def normalizes(mean: Tensor, std: Tensor) -> bool:
    """Whether latent statistics can normalize a latent: finite, and every std above 0 (a NaN, an infinity or a
    std of 0 turns every latent the world model reads into NaN or infinity)."""
    return bool(mean.isfinite().all() and std.isfinite().all() and (std > 0).all())


# -- key names ------------------------------------------------------------------------------------------------
# A key of ours is read left to right: module containers (each renamed on its own), then one leaf (a conv or a
# norm and its parameter). Every key of a representable network matches; any other key is an error naming it.

_Rename = Callable[[re.Match, int], str]
_CONTAINERS: tuple[tuple[re.Pattern, _Rename], ...] = tuple(
    (re.compile(f"(?:{pattern})\\."), rename)
    for pattern, rename in (
        (r"(encoder|decoder)", lambda m, n: m[1]),
        (r"mid", lambda m, n: "mid_block"),
        (r"block_([12])", lambda m, n: f"resnets.{int(m[1]) - 1}"),
        (r"attn_1\.([01])", lambda m, n: ("attentions.0", "temp_attentions.0")[int(m[1])]),  # spatial, temporal
        (r"down\.(\d+)", lambda m, n: f"down_blocks.{m[1]}"),
        # We number the decoder's levels by resolution (as the official layout does), diffusers in the order they run.
        (r"up\.(\d+)", lambda m, n: f"up_blocks.{n - 1 - int(m[1])}"),
        (r"block\.(\d+)", lambda m, n: f"resnets.{m[1]}"),
        (r"downsample", lambda m, n: "downsamplers.0"),
        (r"upsample", lambda m, n: "upsamplers.0"),
    )
)
# Our causal convs hold their nn.Conv3d as ``.conv3d``; diffusers' causal conv is the nn.Conv3d itself.
_PAIR = {"0": "s", "1": "t"}
"""A factorized pair's convs: ours by index, diffusers' by kind (spatial 1x3x3, then temporal 3x1x1)."""
_LEAVES: tuple[tuple[re.Pattern, Callable[[re.Match], str] | None], ...] = tuple(
    (re.compile(pattern), rename)
    for pattern, rename in (
        (r"(conv_in|conv_out|conv[12])\.([01])\.conv3d\.(weight|bias)", lambda m: f"{m[1]}.conv_{_PAIR[m[2]]}.{m[3]}"),
        (r"(conv[123]|quant_conv|post_quant_conv)\.conv3d\.(weight|bias)", lambda m: f"{m[1]}.{m[2]}"),
        (r"nin_shortcut\.conv3d\.(weight|bias)", lambda m: f"conv_shortcut.{m[1]}"),
        (r"([qkv])\.conv3d\.(weight|bias)", lambda m: f"to_{m[1]}.{m[2]}"),
        (r"proj_out\.conv3d\.(weight|bias)", lambda m: f"to_out.0.{m[1]}"),
        (r"(norm|norm1|norm2|norm_out)\.norm\.(weight|bias)", lambda m: m[0]),
        (r"(patcher3d|unpatcher3d)\.\w+", None),  # Haar constants: diffusers' buffers are not saved
    )
)  # fmt: skip


def diffusers_key(key: str, levels: int) -> str | None:
    """diffusers' name for the key ``key`` of our state_dict, of a network with ``levels`` resolution levels
    (``len(channels_mult)``); None for the constants diffusers does not save. :class:`ExportError` naming the key
    for a key that has no diffusers name."""
    parts, rest = [], key
    while True:
        for pattern, rename in _LEAVES:
            leaf = pattern.fullmatch(rest)
            if leaf:
                return None if rename is None else ".".join([*parts, rename(leaf)])
        for pattern, container in _CONTAINERS:
            found = pattern.match(rest)
            if found:
                parts.append(container(found, levels))
                rest = rest[found.end() :]
                break
        else:
            raise ExportError(f"the weight {key} has no name in diffusers' {DIFFUSERS_CLASS} (nothing maps {rest!r})")


def diffusers_names(keys: Iterable[str], config: TokenizerConfig) -> dict[str, str | None]:
    """Our key -> diffusers' key (None: not saved) for ``keys`` of the state_dict of a network of ``config``."""
    names = {key: diffusers_key(key, len(config.channels_mult)) for key in keys}
    saved = [name for name in names.values() if name is not None]
    if len(set(saved)) != len(saved):  # a rule that merges two keys would silently drop weights
        raise ExportError(f"{config.name}: two weights map to one diffusers key")
    return names


# -- config ---------------------------------------------------------------------------------------------------


def _nominal_resolutions(patch_size: int, levels: int, resolution: int = _RESOLUTION) -> set[int]:
    # Encoder and decoder levels alike see resolution/p, halved once per level (architecture doc, 1.4).
    return {resolution // patch_size // 2**i for i in range(levels)}


def _unrepresentable(cfg: TokenizerConfig) -> str | None:
    if cfg.is_discrete:
        return "a discrete (FSQ) tokenizer; diffusers has a class for the continuous Cosmos tokenizers only"
    if cfg.z_factor != 1 or cfg.z_channels != cfg.latent_channels:
        return (
            f"its encoder ends in z_channels x z_factor = {cfg.z_channels} x {cfg.z_factor} channels, not "
            f"latent_channels={cfg.latent_channels}, and diffusers' encoder ends in latent_channels"
        )
    if cfg.legacy_mode and cfg.num_temporal_down:
        return "legacy_mode=True puts the decoder's temporal upsampling at another level than diffusers' decoder"
    return None


def diffusers_config(config: TokenizerConfig) -> dict[str, Any]:
    """diffusers' ``AutoencoderKLCosmos`` config fields (every one, without the latent statistics) of a tokenizer
    built from ``config``; :class:`ExportError` in one line for a tokenizer that diffusers cannot build (DV,
    ``legacy_mode`` with temporal upsampling, an encoder that does not end in ``latent_channels``)."""
    problem = _unrepresentable(config)
    if problem:
        raise ExportError(
            f"no diffusers format for {describe_config(config)}: {problem}; export it with --format cosmos"
        )
    widths = [config.channels * m for m in config.channels_mult]
    levels = len(widths)
    return {
        "_class_name": DIFFUSERS_CLASS,
        "_diffusers_version": DIFFUSERS_VERSION,
        "in_channels": config.in_channels,
        "out_channels": config.out_channels,
        "latent_channels": config.latent_channels,
        "encoder_block_out_channels": [config.channels, *widths],
        "decode_block_out_channels": [*widths, widths[-1]],
        # The official (32,) never reaches a level (no attention inside levels): keep it unless it would.
        "attention_resolutions": [] if 32 in _nominal_resolutions(config.patch_size, levels) else [32],
        "resolution": _RESOLUTION,
        "num_layers": config.num_res_blocks,
        "patch_size": config.patch_size,
        "patch_type": "haar",
        "scaling_factor": 1.0,
        "spatial_compression_ratio": config.spatial_compression,
        "temporal_compression_ratio": config.temporal_compression,
    }


def _bounded(fields: dict[str, Any], key: str, where: Path) -> int:
    if key == "resolution":
        return integer(fields[key], key, 1, _MAX_RESOLUTION, where)
    ours = _OURS[key]
    if ours in POWERS_OF_TWO:
        return integer(fields[key], key, 1, POWERS_OF_TWO[ours], where, power_of_two=True)
    return integer(fields[key], key, *INTEGERS[ours], where)


def tokenizer_config(data: dict[str, Any], where: Path) -> TokenizerConfig:
    """The :class:`TokenizerConfig` of the network that diffusers' ``AutoencoderKLCosmos`` config ``data`` (read
    from ``where``) describes; :class:`CheckpointError` in one line, naming the field, for one we cannot build.
    Every field read is checked for type and range first, so nothing is built from a value out of range."""
    fields = {**_DEFAULTS, **{k: data[k] for k in _DEFAULTS if k in data}}
    if fields["patch_type"] != "haar":
        raise CheckpointError(
            f"{where}: patch_type={shown(fields['patch_type'])}; the Cosmos tokenizers patch with 'haar', the only "
            "patcher tokenizer-posttrain builds"
        )
    one = {k: _bounded(fields, k, where) for k, default in _DEFAULTS.items() if isinstance(default, int)}
    # A width list holds the base width and one per level; the decoder's repeats the last.
    enc, dec = (
        integers(fields[k], k, 1, MAX_WIDTH, where, (2, MAX_LEVELS + 1))
        for k in ("encoder_block_out_channels", "decode_block_out_channels")
    )
    attention = integers(fields["attention_resolutions"], "attention_resolutions", 1, _MAX_RESOLUTION, where, (0, 64))
    base = enc[0]
    if any(width % base for width in enc[1:]):
        raise CheckpointError(
            f"{where}: encoder_block_out_channels={enc} is not a base width followed by its multiples, one per level"
        )
    mult = tuple(width // base for width in enc[1:])
    mirrored = [base * m for m in mult] + [base * mult[-1]]
    if dec != mirrored:
        raise CheckpointError(
            f"{where}: decode_block_out_channels={dec} does not mirror encoder_block_out_channels={enc} (expected "
            f"{mirrored}), as the decoder of every Cosmos tokenizer does"
        )
    inside = sorted(_nominal_resolutions(one["patch_size"], len(mult), one["resolution"]) & set(attention))
    if inside:
        raise CheckpointError(
            f"{where}: attention_resolutions={attention} with resolution={one['resolution']} puts attention inside "
            f"the levels at resolution {inside}, which no Cosmos tokenizer has"
        )
    t, s, p = one["temporal_compression_ratio"], one["spatial_compression_ratio"], one["patch_size"]
    known = [c for c in REGISTRY.values() if not c.is_discrete]
    matches = [c for c in known if (c.temporal_compression, c.spatial_compression, c.patch_size) == (t, s, p)]
    if not matches:
        names = ", ".join(f"{c.name} (patch_size {c.patch_size})" for c in known)
        raise CheckpointError(
            f"{where}: no Cosmos tokenizer compresses {t}x{s}x{s} with patch_size {p}; the continuous ones: {names}"
        )
    registered = next((c for c in matches if c.channels_mult == mult), matches[0])
    try:
        return registered.replace(
            channels=base,
            channels_mult=mult,
            num_res_blocks=one["num_layers"],
            in_channels=one["in_channels"],
            out_channels=one["out_channels"],
            z_channels=one["latent_channels"],
            latent_channels=one["latent_channels"],
        )
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from err


# -- writing --------------------------------------------------------------------------------------------------


def _latents(stats: LatentMoments | None, config: TokenizerConfig, out: Path) -> dict[str, list[float] | None]:
    if stats is None:
        warnings.warn(
            f"{out / CONFIG_JSON}: no latent statistics, so latents_mean and latents_std are null and diffusers' "
            "Cosmos pipelines feed the world model unnormalized latents; pass the statistics (export --latent-stats "
            "DATA) for a vae a pipeline can use",
            UserWarning,
            stacklevel=3,
        )
        return {"latents_mean": None, "latents_std": None}
    mean, std = stats.mean.detach().float().cpu(), stats.std.detach().float().cpu()
    channels = config.latent_channels
    if mean.dim() != 2 or mean.shape[0] != channels or std.shape != mean.shape:
        raise ExportError(
            f"latent statistics of shapes {tuple(mean.shape)} and {tuple(std.shape)} for {out}: expected "
            f"[{channels}, T] each (per latent channel and latent-frame position)"
        )
    if not normalizes(mean, std):
        raise ExportError(f"latent statistics for {out} hold NaN, Inf or a std <= 0: compute them again")
    frames = 1 + (mean.shape[1] - 1) * config.temporal_compression
    if frames < CHUNK_FRAMES:
        warnings.warn(
            f"{out / CONFIG_JSON}: the latent statistics cover {mean.shape[1]} latent frames (videos of up to {frames} "
            f"frames); diffusers' Cosmos pipelines generate {CHUNK_FRAMES} frames by default and fail on longer "
            f"videos than the statistics cover: compute them over {CHUNK_FRAMES}-frame clips",
            UserWarning,
            stacklevel=3,
        )
    # diffusers' pipelines read them with view(1, C, -1, 1, 1)[:, :, :t]: channel-major, as [C, T] flattens.
    return {"latents_mean": mean.flatten().tolist(), "latents_std": std.flatten().tolist()}


def write_diffusers(
    network: VideoTokenizer,
    out_dir: str | Path,
    stats: LatentMoments | None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``network`` as a diffusers ``AutoencoderKLCosmos`` folder into ``out_dir``: ``config.json`` (with
    ``latents_mean`` / ``latents_std`` from ``stats``, a ``LatentStats``) and ``diffusion_pytorch_model.safetensors``
    (``dtype``; LoRA merged); returns ``out_dir``. Load it with ``AutoencoderKLCosmos.from_pretrained(out_dir)``.

    ``stats=None`` writes ``latents_mean`` / ``latents_std`` as null, with a warning: diffusers' Cosmos pipelines
    then skip the normalization their world models were trained with. A tokenizer that diffusers cannot build
    (DV, see :func:`diffusers_config`) or non-finite weights are refused (:class:`ExportError`) before anything
    is written. Each file is written atomically, the config last.
    """
    out = Path(out_dir)
    config = diffusers_config(network.config)
    latents = _latents(stats, network.config, out)
    net = prepared_copy(network, out, dtype)
    state = net.state_dict()
    names = diffusers_names(state, net.config)
    saved = {names[k]: v.detach().contiguous() for k, v in state.items() if names[k] is not None}
    metadata = {"format": "pt", "model": net.config.full_name}
    _atomic_write(out / DIFFUSERS_WEIGHTS, lambda p: save_file(saved, p, metadata=metadata))
    text = json.dumps({**config, **latents}, indent=2) + "\n"
    _atomic_write(out / CONFIG_JSON, lambda p: Path(p).write_text(text))
    return out


# -- reading --------------------------------------------------------------------------------------------------


def diffusers_class(folder: Path) -> str | None:
    """The ``_class_name`` of the diffusers ``config.json`` in ``folder``; None when there is none (our own
    exports' config.json has no ``_class_name``)."""
    meta = folder / CONFIG_JSON
    if not (meta.exists() or meta.is_symlink()):
        return None
    try:
        data = read_config_json(meta, _FIX)
    except CheckpointError:
        if (folder / DIFFUSERS_WEIGHTS).is_file():  # a diffusers folder whose config is damaged
            raise
        return None  # another folder's config.json (ours is read, and refused, with our weights)
    name = data.get("_class_name")
    return str(name) if name is not None else None


def _haar_constants(config: TokenizerConfig) -> dict[str, Tensor]:
    patcher, unpatcher = Patcher3D(config.patch_size), UnPatcher3D(config.patch_size)
    return {
        **{f"encoder.patcher3d.{k}": v for k, v in patcher.state_dict().items()},
        **{f"decoder.unpatcher3d.{k}": v for k, v in unpatcher.state_dict().items()},
    }


def diffusers_weights(folder: Path, class_name: str) -> dict[str, Tensor]:
    """The tensors of a diffusers folder's one safetensors weights file (the folder's ``config.json`` names
    ``class_name``); a folder with only sharded or pickled weights is refused, saying how to re-save it."""
    weights = folder / DIFFUSERS_WEIGHTS
    if not weights.is_file():
        others = sorted(p.name for p in folder.glob("diffusion_pytorch_model*"))
        hint = (
            f" ({', '.join(others)} is not read: only one safetensors file, never a pickle; re-save it with "
            "save_pretrained(folder, safe_serialization=True, max_shard_size='20GB'))"
            if others
            else ""
        )
        raise CheckpointError(
            f"{folder} has diffusers' {CONFIG_JSON} ({class_name}) but no {DIFFUSERS_WEIGHTS}{hint}: copy the "
            "weights file into the folder, or download or export it again"
        )
    return load_safetensors(weights)


def read_diffusers(folder: str | Path) -> Weights:
    """Read a diffusers ``AutoencoderKLCosmos`` folder (``config.json`` + ``diffusion_pytorch_model.safetensors``)
    as our weights and config. Strict: a key missing from the file, one it has over, or a shape that differs
    from what its config.json describes is a :class:`CheckpointError` naming them (in diffusers' names, as the
    file has them), as is a missing or unreadable file."""
    folder = Path(folder)
    meta = folder / CONFIG_JSON
    data = read_config_json(meta, _FIX)
    found = data.get("_class_name")
    if found != DIFFUSERS_CLASS:
        name = found if isinstance(found, str) and len(found) < 60 else shown(found)
        raise CheckpointError(
            f"{meta} describes a diffusers {name}, not an {DIFFUSERS_CLASS}: only Cosmos tokenizers load here"
        )
    config = tokenizer_config(data, meta)
    state = diffusers_weights(folder, DIFFUSERS_CLASS)
    weights = folder / DIFFUSERS_WEIGHTS
    shapes = expected_shapes(config)
    names = diffusers_names(shapes, config)
    expected = {names[k]: shape for k, shape in shapes.items() if names[k] is not None}
    diff = diff_layout(state, expected)
    if diff.size:
        raise CheckpointError(
            f"{weights}: the weights do not fit the {DIFFUSERS_CLASS} that {meta.name} describes "
            f"({describe_config(config)}), so it was altered or belongs to another folder (export or download the "
            f"folder again): {diff.describe()}"
        )
    ours = {key: state[name] for key, name in names.items() if name is not None}
    constants = _haar_constants(config)
    if set(constants) != {key for key, name in names.items() if name is None}:
        raise RuntimeError(f"{config.name}: the Haar constants of the network changed their names")  # a bug of ours
    return Weights({**ours, **constants}, str(weights), config)
