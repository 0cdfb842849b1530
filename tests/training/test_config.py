"""The run configs reject bad values before any work starts, naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenizer_posttrain.training.config import (
    DataConfig,
    LogConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    TrainerConfig,
)


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


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda v: OptimConfig(lr=v), "optim.lr"),
        (lambda v: OptimConfig(lr_groups={"decoder.": v}), "optim.lr_groups['decoder.']"),
        (lambda v: OptimConfig(weight_decay=v), "optim.weight_decay"),
        (lambda v: OptimConfig(adam_eps=v), "optim.adam_eps"),
        (lambda v: OptimConfig(adam_beta1=v), "optim.adam_beta1"),
        (lambda v: OptimConfig(min_lr_ratio=v), "optim.min_lr_ratio"),
        (lambda v: TrainerConfig(gradient_clip_val=v), "trainer.gradient_clip_val"),
        (lambda v: LoRAConfig(alpha=v), "model.lora.alpha"),
        (lambda v: LoRAConfig(dropout=v), "model.lora.dropout"),
        (lambda v: ModelConfig(ema_decay=v), "model.ema_decay"),
        (lambda v: DataConfig(max_skip_fraction=v), "data.max_skip_fraction"),
    ],
)
def test_non_finite_numbers_are_refused_with_their_key(make, key: str, value: float) -> None:  # noqa: ANN001
    # inf passes a one-sided check such as lr > 0: optim.lr=inf trained a run into NaN weights and exported them.
    with pytest.raises(ValueError, match=f"invalid {re.escape(key)}="):
        make(value)


def test_non_positive_rates_are_refused() -> None:
    for make, key in ((lambda: OptimConfig(lr=0.0), "optim.lr"), (lambda: OptimConfig(adam_eps=0.0), "optim.adam_eps")):
        with pytest.raises(ValueError, match=f"invalid {key}=0.0"):
            make()


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: DataConfig(start="first"), "data.start"),
        (lambda: DataConfig(start="keyframe", keyframe_window=-1), "data.keyframe_window"),
        (lambda: DataConfig(keyframe_window=2.5), "data.keyframe_window"),
        (lambda: DataConfig(decode="nvdec"), "data.decode"),
        (lambda: DataConfig(prefetch=0), "data.prefetch"),
        (lambda: DataConfig(crops_per_decode=0), "data.crops_per_decode"),
        (lambda: DataConfig(crops_per_decode=2, micro_batch_size=3), "data.crops_per_decode"),
        (lambda: DataConfig(prefetch=1.5), "data.prefetch"),
        (lambda: DataConfig(prefetch=10**9), "data.prefetch"),  # before: torch queued 1e9 batches at start
    ],
)
def test_clip_start_settings_are_checked_with_their_key(make, key: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=f"invalid {re.escape(key)}="):
        make()
    assert DataConfig(start="keyframe", keyframe_window=0).start == "keyframe"


@pytest.mark.parametrize("name", ["../../elsewhere", "runs/../../elsewhere", "/tmp/elsewhere", "", "."])
def test_a_run_name_that_leaves_the_log_dir_is_refused_before_any_folder_is_made(tmp_path: Path, name: str) -> None:
    from tests.conftest import run_cli_here

    logs = tmp_path / "a" / "b" / "logs"
    result = run_cli_here("--factory", "tiny", f"log.log_dir={logs}", f"log.name={name!r}", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: invalid log.name={name!r}: the run folder is <log.log_dir>/<log.name>, so the name must stay inside "
        "log.log_dir: not empty, not absolute, no '..' (e.g. log.name=my_run, or a sub-folder such as "
        "log.name=team/my_run)"
    ]
    assert list(tmp_path.iterdir()) == []
    assert LogConfig(log_dir=str(logs), name="team/week1").name == "team/week1"  # a sub-folder stays inside
