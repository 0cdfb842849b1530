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


def tiny_run(tmp_path: Path, steps: int = 2, name: str = "run", **groups: dict) -> dict[str, object]:
    """The configs of a tiny CV8x8x8 run on synthetic 9x32x32 clips on the CPU, for ``train(**configs)``; each
    of ``groups`` (``model={...}``, ``trainer={...}``, ...) overrides fields of that group."""
    from tokenizer_posttrain.training.config import DataConfig, LogConfig, OptimConfig, ResumeConfig, TrainerConfig

    fields = {
        "model": (ModelConfig, {"model": "CV8x8x8", "channels": 16}),
        "data": (DataConfig, {"frames": 9, "height": 32, "width": 32, "global_batch_size": 1, "num_workers": 0}),
        "trainer": (
            TrainerConfig,
            {
                "accelerator": "cpu",
                "max_steps": steps,
                "precision": "32-true",
                "checkpoint_every_n_steps": 100,
                "val_check_interval": 1000,
                "limit_val_batches": 0,
            },
        ),
        "optim": (OptimConfig, {}),
        "resume": (ResumeConfig, {}),
        "log": (LogConfig, {"log_dir": str(tmp_path), "name": name, "export_on_end": False}),
        "loss": (LossConfig, {"perceptual_weight": 0.0}),
    }
    return {group: cls(**{**defaults, **groups.get(group, {})}) for group, (cls, defaults) in fields.items()}
