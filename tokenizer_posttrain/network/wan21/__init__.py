"""The Wan2.1 family: the Wan2.1 video VAE (a KL autoencoder with causal 3D convolutions), its config and its
official weights file (``Wan2.1_VAE.pth``, a plain state dict of tensors). Registered as the family ``wan21``;
nothing outside this folder names its classes or submodules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from torch import Tensor

from ...core.errors import CheckpointError
from ...core.untrusted import load_torch_file
from ..family import NetworkConfig, TokenizerFamily, VideoTokenizer, register_family
from .registry import FAMILY, PREFIXES, REGISTRY, WAN21_LATENT_MEAN, WAN21_LATENT_STD, Wan21Config, config_from_dict
from .vae import Wan21VAE

WEIGHTS_SUFFIX = ".pth"
"""The official weights files' suffix (``Wan2.1_VAE.pth``; Cosmos-Predict2.5's ``tokenizer.pth`` too)."""
SIGNATURE_KEYS = (
    "encoder.conv1.weight",
    "conv1.weight",
    "conv2.weight",
    "decoder.conv1.weight",
    "encoder.downsamples.0.residual.0.gamma",  # Wan2.2 nests its levels: its file is the wan22 family's
)
"""Keys every Wan VAE state dict has: a ``.pth`` holding them is read as one."""


def _build(config: NetworkConfig) -> VideoTokenizer:
    assert isinstance(config, Wan21Config)
    return Wan21VAE(config)


def _sizes(state: Mapping[str, Tensor], config: NetworkConfig) -> dict[str, int]:
    # The encoder's first convolution has `dim` outputs (the decoder's last norm dim * dim_mult[0]); conv2 maps
    # the z_dim latent channels to themselves.
    assert isinstance(config, Wan21Config)
    sizes = {}
    if "encoder.conv1.weight" in state:
        sizes["channels"] = int(state["encoder.conv1.weight"].shape[0])
    elif "decoder.head.0.gamma" in state:
        sizes["channels"] = int(state["decoder.head.0.gamma"].shape[0]) // config.dim_mult[0]
    if "conv2.weight" in state:
        sizes["z_dim"] = int(state["conv2.weight"].shape[0])
    return sizes


def pth_reader(signature: tuple[str, ...]) -> Callable[[Path], dict[str, Tensor] | None]:
    """A reader of Wan VAE ``.pth`` state dicts (read weights-only: nothing in them runs) that claims the files
    holding every key of ``signature``: their tensors, else None (not a ``.pth``, or another model's). A ``.pth``
    that is not a plain dict of tensors raises a one-line :class:`CheckpointError` naming it."""

    def read(path: Path) -> dict[str, Tensor] | None:
        if path.suffix.lower() != WEIGHTS_SUFFIX or not path.is_file():
            return None
        content = load_torch_file(path)
        if not isinstance(content, dict) or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in content.items()
        ):
            raise CheckpointError(
                f"{path} is not a state dict of tensors (a Wan VAE .pth holds one dict of parameter name -> "
                "tensor); pass the VAE's weights file itself"
            )
        return content if all(key in content for key in signature) else None

    return read


read_pth = pth_reader(SIGNATURE_KEYS)
"""Wan2.1 VAE ``.pth`` files (Wan's ``Wan2.1_VAE.pth``, NVIDIA's ``tokenizer.pth``)."""


WAN21 = register_family(
    TokenizerFamily(
        name=FAMILY,
        configs=REGISTRY,
        prefixes=PREFIXES,
        aliases={"Wan2.1_VAE": "Wan2.1-VAE"},
        build=_build,
        config_from_dict=config_from_dict,
        sizes_of=_sizes,
        posterior=True,
        latent_stats="per-channel",
        latent_constants=(WAN21_LATENT_MEAN, WAN21_LATENT_STD),
        reader=read_pth,
    )
)

__all__ = [
    "REGISTRY",
    "WAN21",
    "WAN21_LATENT_MEAN",
    "WAN21_LATENT_STD",
    "Wan21Config",
    "Wan21VAE",
    "read_pth",
]
