"""The Wan2.2 family: the Wan2.2 video VAE (a KL autoencoder on 2x2-patched video, causal 3D convolutions, 48
latent channels; Wan2.2-TI2V-5B's), its config and its official weights file (``Wan2.2_VAE.pth``, a plain state
dict of tensors). Registered as the family ``wan22``; it reuses Wan2.1's blocks, and nothing outside this folder
names its classes or submodules."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..family import NetworkConfig, TokenizerFamily, VideoTokenizer, register_family
from ..wan21 import pth_reader
from .registry import FAMILY, PREFIXES, REGISTRY, WAN22_LATENT_MEAN, WAN22_LATENT_STD, Wan22Config, config_from_dict
from .vae import Wan22VAE

SIGNATURE_KEYS = (
    "encoder.conv1.weight",
    "conv1.weight",
    "conv2.weight",
    "decoder.conv1.weight",
    "encoder.downsamples.0.downsamples.0.residual.0.gamma",
)
"""Keys every Wan2.2 VAE state dict has: a ``.pth`` holding them is read as one. The last one tells it from a
Wan2.1 VAE, whose levels are not nested (``encoder.downsamples.0.residual.0.gamma``)."""


def _build(config: NetworkConfig) -> VideoTokenizer:
    assert isinstance(config, Wan22Config)
    return Wan22VAE(config)


def _sizes(state: Mapping[str, Tensor], config: NetworkConfig) -> dict[str, int]:
    # The encoder's first convolution has `dim` outputs, the decoder's last norm dec_dim * dim_mult[0] channels;
    # conv2 maps the z_dim latent channels to themselves.
    assert isinstance(config, Wan22Config)
    sizes = {}
    if "encoder.conv1.weight" in state:
        sizes["channels"] = int(state["encoder.conv1.weight"].shape[0])
    if "decoder.head.0.gamma" in state:
        sizes["dec_channels"] = int(state["decoder.head.0.gamma"].shape[0]) // config.dim_mult[0]
    if "conv2.weight" in state:
        sizes["z_dim"] = int(state["conv2.weight"].shape[0])
    return sizes


read_pth = pth_reader(SIGNATURE_KEYS)
"""Wan2.2 VAE ``.pth`` files (``Wan2.2_VAE.pth``); a Wan2.1 VAE's lacks the nested level keys."""


WAN22 = register_family(
    TokenizerFamily(
        name=FAMILY,
        configs=REGISTRY,
        prefixes=PREFIXES,
        aliases={"Wan2.2_VAE": "Wan2.2-VAE"},
        build=_build,
        config_from_dict=config_from_dict,
        sizes_of=_sizes,
        posterior=True,
        latent_stats="per-channel",
        latent_constants=(WAN22_LATENT_MEAN, WAN22_LATENT_STD),
        reader=read_pth,
    )
)

__all__ = [
    "REGISTRY",
    "WAN22",
    "WAN22_LATENT_MEAN",
    "WAN22_LATENT_STD",
    "Wan22Config",
    "Wan22VAE",
    "read_pth",
]
