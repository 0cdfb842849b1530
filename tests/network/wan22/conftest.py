"""The tiny Wan2.2 VAE of the reference vectors (dim 8, dec_dim 12, z_dim 8), with their weights, in eval mode."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REFERENCE
from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.family import VideoTokenizer

WAN = REFERENCE / "wan"
TINY = {"channels": 8, "dec_channels": 12, "z_dim": 8}
"""The tiny reference model's config overrides (tests/data/reference/wan/tiny_vectors.json)."""


@pytest.fixture(scope="session")
def wan22_state() -> dict[str, torch.Tensor]:
    return load_file(str(WAN / "wan22_tiny_weights.safetensors"))


@pytest.fixture(scope="session")
def wan22_io() -> dict[str, torch.Tensor]:
    return load_file(str(WAN / "wan22_tiny_io.safetensors"))


@pytest.fixture
def tiny_wan22(wan22_state: dict[str, torch.Tensor]) -> VideoTokenizer:
    network = build_tokenizer("Wan2.2-VAE", **TINY)
    network.load_state_dict(wan22_state, strict=True)
    return network.eval()
