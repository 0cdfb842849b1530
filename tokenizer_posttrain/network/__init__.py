"""Clean-room networks of the Cosmos causal video tokenizers."""

from .tokenizer import (
    AutoencoderLayout,
    CausalVideoTokenizer,
    DecoderLayout,
    EncoderLayout,
    build_tokenizer,
)

__all__ = ["AutoencoderLayout", "CausalVideoTokenizer", "DecoderLayout", "EncoderLayout", "build_tokenizer"]
