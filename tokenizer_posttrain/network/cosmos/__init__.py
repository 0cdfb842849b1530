"""The Cosmos-1.0 family: continuous (CV) and discrete (DV) causal video tokenizers, their blocks, the Haar
wavelet patcher, the FSQ quantizer, the registry of released models and the three official checkpoint layouts.
Registered as the family ``cosmos``; nothing outside this folder names its classes or submodules."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from ..family import NetworkConfig, TokenizerFamily, VideoTokenizer, register_family
from .registry import PREFIXES, REGISTRY, TokenizerConfig, config_from_dict
from .tokenizer import AutoencoderLayout, CausalVideoTokenizer, DecoderLayout, EncoderLayout


def _build(config: NetworkConfig) -> VideoTokenizer:
    assert isinstance(config, TokenizerConfig)
    return CausalVideoTokenizer(config)


def _sizes(state: Mapping[str, Tensor], config: NetworkConfig) -> dict[str, int]:
    # The encoder's first convolution has `channels` outputs; a decoder alone shows it in its last norm.
    assert isinstance(config, TokenizerConfig)
    if "encoder.conv_in.0.conv3d.weight" in state:
        return {"channels": int(state["encoder.conv_in.0.conv3d.weight"].shape[0])}
    if "decoder.norm_out.norm.weight" in state:
        return {"channels": int(state["decoder.norm_out.norm.weight"].shape[0]) // config.channels_mult[0]}
    return {}


def _official_modules(network: VideoTokenizer) -> dict[str, nn.Module]:
    assert isinstance(network, CausalVideoTokenizer)
    return {
        "encoder": EncoderLayout(network),
        "decoder": DecoderLayout(network),
        "autoencoder": AutoencoderLayout(network),
    }


COSMOS = register_family(
    TokenizerFamily(
        name="cosmos",
        configs=REGISTRY,
        prefixes=PREFIXES,
        build=_build,
        config_from_dict=config_from_dict,
        sizes_of=_sizes,
        official_modules=_official_modules,
    )
)

__all__ = [
    "COSMOS",
    "REGISTRY",
    "AutoencoderLayout",
    "CausalVideoTokenizer",
    "DecoderLayout",
    "EncoderLayout",
    "TokenizerConfig",
]
