"""The run configs reject bad values before any work starts, naming the key."""

from __future__ import annotations

import pytest

from tokenizer_posttrain.training.config import DataConfig, ModelConfig, TrainerConfig


def test_speed_switches_are_validated() -> None:
    for key in ("compile", "cuda_graphs", "channels_last", "activation_checkpointing"):
        with pytest.raises(ValueError, match=f"model.{key}='yes': use true or false"):
            ModelConfig(**{key: "yes"})
    with pytest.raises(ValueError, match="model.compile_scope='graph': use step or blocks"):
        ModelConfig(compile_scope="graph")
    with pytest.raises(ValueError, match="data.synthetic_cache='yes': use true or false"):
        DataConfig(synthetic_cache="yes")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"precision": "fp8"}, "trainer.precision"),
        ({"devices": "two"}, "trainer.devices"),
        ({"max_steps": 0}, "trainer.max_steps"),
    ],
)
def test_trainer_config_rejects_bad_values(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=f"invalid {key}="):
        TrainerConfig(**kwargs)
