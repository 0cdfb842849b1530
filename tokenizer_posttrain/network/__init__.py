"""Layer 1, the networks: the clean-room Cosmos causal video tokenizers, built from the registry's typed configs
(:mod:`.registry`), their official checkpoint layouts, and LoRA adapters on their convolutions. Nothing here
knows about training, files or data."""

from .tokenizer import (
    AutoencoderLayout,
    CausalVideoTokenizer,
    DecoderLayout,
    EncoderLayout,
    Encoding,
    build_tokenizer,
)

__all__ = ["AutoencoderLayout", "CausalVideoTokenizer", "DecoderLayout", "EncoderLayout", "Encoding", "build_tokenizer"]
