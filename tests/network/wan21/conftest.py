"""The tiny Wan2.1 VAE of the reference vectors (dim 8, z_dim 4), with their weights, in eval mode."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REFERENCE
from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.family import VideoTokenizer

WAN = REFERENCE / "wan"
TINY = {"channels": 8, "z_dim": 4}
"""The tiny reference model's config overrides (tests/data/reference/wan/tiny_vectors.json)."""


@pytest.fixture(scope="session")
def reference_state() -> dict[str, torch.Tensor]:
    return load_file(str(WAN / "wan21_tiny_weights.safetensors"))


@pytest.fixture(scope="session")
def reference_io() -> dict[str, torch.Tensor]:
    return load_file(str(WAN / "wan21_tiny_io.safetensors"))


@pytest.fixture
def tiny_wan(reference_state: dict[str, torch.Tensor]) -> VideoTokenizer:
    network = build_tokenizer("Wan2.1-VAE", **TINY)
    network.load_state_dict(reference_state, strict=True)
    return network.eval()
