"""Layer 1, the networks: the tokenizer-family seam (:mod:`.family`), each family in its own folder
(:mod:`.cosmos`), LoRA adapters on any family's convolutions and the segment switches the training's speed
settings steer. Nothing here knows about training, files or data."""

from . import (
    cosmos,  # noqa: F401  (registers the Cosmos family)
    wan21,  # noqa: F401  (registers the Wan2.1 family)
    wan22,  # noqa: F401  (registers the Wan2.2 family)
)
from .family import (
    FAMILIES,
    Encoding,
    TokenizerFamily,
    VideoTokenizer,
    build_network,
    build_tokenizer,
    channel_scale,
    config_from_dict,
    family_of,
    get_config,
    known_names,
    register_family,
    resolve,
    resolve_name,
)

__all__ = [
    "FAMILIES",
    "Encoding",
    "TokenizerFamily",
    "VideoTokenizer",
    "build_network",
    "build_tokenizer",
    "channel_scale",
    "config_from_dict",
    "family_of",
    "get_config",
    "known_names",
    "register_family",
    "resolve",
    "resolve_name",
]
