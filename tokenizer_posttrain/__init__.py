"""tokenizer-posttrain: post-train NVIDIA Cosmos video tokenizers on your own videos.

The public Python API; the layers below it, lowest first: ``core`` (errors, atomic files), ``network`` (the
tokenizers and their registry), ``io`` / ``losses`` / ``data``, ``evaluation``, ``training``, ``workflow``,
``commands``. A module imports only from layers below its own (``tests/test_layers.py`` checks).
"""

from .io.checkpoint import load_tokenizer
from .io.export import export_tokenizer
from .network import CausalVideoTokenizer, Encoding, build_tokenizer
from .network.registry import REGISTRY, TokenizerConfig, get_config, known_names, resolve_name

__all__ = [
    "REGISTRY",
    "CausalVideoTokenizer",
    "Encoding",
    "TokenizerConfig",
    "build_tokenizer",
    "export_tokenizer",
    "get_config",
    "known_names",
    "load_tokenizer",
    "resolve_name",
]
