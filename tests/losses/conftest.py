"""Fixtures of the loss tests: a VGG16 weights file in torchvision's layout, with random weights; an empty torch
hub cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.losses.test_perceptual import random_vgg16_state
from tokenizer_posttrain.losses.perceptual import VGG16_FILE


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``vgg16-397923af.pth`` holding seeded random weights (read only)."""
    path = tmp_path_factory.mktemp("vgg") / VGG16_FILE
    torch.save(random_vgg16_state(), path)
    return path


@pytest.fixture
def empty_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache dir in tmp_path, so the real cache in ~/.cache/torch is never consulted."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # undo any earlier torch.hub.set_dir
    return Path(torch.hub.get_dir())
