"""tokenizer-posttrain: post-train NVIDIA Cosmos video tokenizers on your own videos."""

from .network import CausalVideoTokenizer, build_tokenizer
from .registry import REGISTRY, TokenizerConfig, get_config, known_names, resolve_name

__all__ = [
    "REGISTRY",
    "CausalVideoTokenizer",
    "TokenizerConfig",
    "build_tokenizer",
    "get_config",
    "known_names",
    "resolve_name",
]
