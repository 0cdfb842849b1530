"""Launch-time checks (parallelism, accumulation, clip shapes) and how train() sets up the Trainer."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import fit, run_script
from tokenizer_posttrain.training.config import DataConfig, LossConfig, ModelConfig, TrainerConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.optim import build_optimizer
from tokenizer_posttrain.training.train import check_clip_shape, resolve_parallelism


def test_accumulation_follows_from_the_global_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    cpu = TrainerConfig(accelerator="cpu")
    assert resolve_parallelism(cpu, DataConfig()).accumulate_grad_batches == 8
    par = resolve_parallelism(
        TrainerConfig(accelerator="cpu", devices="2"), DataConfig(global_batch_size=8, micro_batch_size=2)
    )
    assert (par.devices, par.world_size, par.accumulate_grad_batches) == (2, 2, 2)
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert resolve_parallelism(TrainerConfig(accelerator="cpu", devices="2"), DataConfig()).world_size == 4


def test_indivisible_global_batch_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"global_batch_size=6 is not a multiple .* = 4; use a global batch of 4"):
        resolve_parallelism(
            TrainerConfig(accelerator="cpu", devices="2"), DataConfig(global_batch_size=6, micro_batch_size=2)
        )


def test_torchrun_process_count_must_match_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_parallelism(TrainerConfig(accelerator="cpu"), DataConfig()).devices == 2
    with pytest.raises(ValueError, match="torchrun started 2 processes"):
        resolve_parallelism(TrainerConfig(accelerator="cpu", devices="4"), DataConfig())


def test_gpu_falls_back_to_cpu_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.warns(UserWarning, match="no CUDA GPU"):
        assert resolve_parallelism(TrainerConfig(), DataConfig()).accelerator == "cpu"


@pytest.mark.parametrize(
    "data, message",
    [
        (DataConfig(frames=32), r"does not fit DV8x16x16: data.frames=32 is not 1\+8k frames \(use 25 or 33\)"),
        (DataConfig(height=200), "data.height=200 is not a multiple of 16"),
    ],
)
def test_clip_shape_is_checked_before_launch(data: DataConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_clip_shape(ModelConfig(model="DV8x16x16"), data)


def test_clipping_works_with_the_fused_optimizer_cuda_runs_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning's own clipping raises for fused AdamW under mixed precision (seen on an H200 with
    # the defaults), so the module clips; force the fused optimizer here, on the CPU.
    monkeypatch.setattr(
        TokenizerModel,
        "configure_optimizers",
        lambda self: build_optimizer(self.network, self.optim_config, self.trainer.max_steps, fused=True),
    )
    seen: list[float] = []

    class ClippedNorm(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
            grads = [p.grad.float() for p in module.network.parameters() if p.grad is not None]
            seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    module = TokenizerModel(
        ModelConfig(model="CV8x8x8", channels=16), loss=LossConfig(perceptual_weight=0.0), gradient_clip_val=1e-3
    )
    fit(module, tmp_path, steps=2, callbacks=[ClippedNorm()])
    assert module.global_step == 2
    # After the optimizer step (Lightning zeroes gradients at the next step): the ones it used.
    assert len(seen) == 2 and all(0 < norm <= 1e-3 * 1.001 for norm in seen), seen


def test_synthetic_runs_need_no_video_stack() -> None:
    # benchmarks/ddp_scaling.py runs train() on GPU machines that have neither PyAV, energon nor NeMo-Run.
    blocked = ("av", "megatron", "braceexpand", "webdataset", "nemo_run")
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}: raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from tokenizer_posttrain.training.train import build_datamodule\n"
        "from tokenizer_posttrain.training.config import DataConfig, ModelConfig\n"
        "dm = build_datamodule(DataConfig(frames=9, height=32, width=32), ModelConfig(), 0)\n"
        "print(type(dm).__name__)\n"
    )
    result = run_script("-c", code, cwd=Path.cwd(), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "SyntheticVideoDataModule"
