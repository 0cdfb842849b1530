"""tokenizer-posttrain: post-train NVIDIA Cosmos video tokenizers on your own videos.

The public Python API; the layers below it, lowest first: ``core`` (errors, atomic files), ``network`` (the
tokenizer-family seam and each family's folder), ``io`` / ``losses`` / ``data``, ``evaluation``, ``training``,
``workflow``, ``commands``. A module imports only from layers below its own (``tests/test_layers.py`` checks).
"""

from .io.checkpoint import load_tokenizer
from .io.export import export_tokenizer
from .network import (
    FAMILIES,
    Encoding,
    TokenizerFamily,
    VideoTokenizer,
    build_tokenizer,
    get_config,
    known_names,
    register_family,
    resolve_name,
)
from .network.cosmos import REGISTRY, CausalVideoTokenizer, TokenizerConfig

__all__ = [
    "FAMILIES",
    "REGISTRY",
    "CausalVideoTokenizer",
    "Encoding",
    "TokenizerConfig",
    "TokenizerFamily",
    "VideoTokenizer",
    "build_tokenizer",
    "export_tokenizer",
    "get_config",
    "known_names",
    "load_tokenizer",
    "register_family",
    "resolve_name",
]
