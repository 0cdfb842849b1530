"""Small training setups shared by the training tests: tiny reference networks, no-VGG losses, weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import reference_weights
from tests.losses.test_perceptual import random_vgg16_state
from tokenizer_posttrain.training.config import LossConfig, ModelConfig
from tokenizer_posttrain.training.module import TokenizerModel


def tiny(name: str = "DV8x16x16", **model_kw) -> ModelConfig:  # noqa: ANN003
    return ModelConfig(model=name, jit_ckpt_pth=str(reference_weights(name)), channels=16, **model_kw)


def no_vgg() -> LossConfig:
    return LossConfig(perceptual_weight=0.0)


def snapshot(module: TokenizerModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.network.state_dict().items()}


@pytest.fixture(scope="module")
def vgg_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vgg") / "vgg16-397923af.pth"
    torch.save(random_vgg16_state(), path)
    return path
