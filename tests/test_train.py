"""Launch-time checks (parallelism, accumulation, clip shapes) and how train() sets up the Trainer."""

import warnings
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.conftest import fit, run_script
from tokenizer_posttrain.config import DataConfig, LossConfig, ModelConfig, TrainerConfig
from tokenizer_posttrain.model import TokenizerModel
from tokenizer_posttrain.optim import build_optimizer
from tokenizer_posttrain.train import (
    WHOLE_STEP_BUCKET_MB,
    check_clip_shape,
    ddp_kwargs,
    ddp_strategy,
    resolve_compile,
    resolve_parallelism,
)


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


def test_compile_is_left_off_on_the_cpu() -> None:
    # The GPU recipes turn it on; a run that lands on a CPU must not spend minutes in Inductor.
    fast = ModelConfig(model="CV8x8x8", compile=True, cuda_graphs=True, channels_last=True)
    with pytest.warns(UserWarning, match="model.compile is for GPUs"):
        on_cpu = resolve_compile(fast, "cpu")
    assert not on_cpu.compile and not on_cpu.cuda_graphs and on_cpu.channels_last
    assert resolve_compile(fast, "gpu") is fast
    # The GPU recipes' CUDA graphs need the step compiled whole: other choices train without them.
    for other in ({"compile": False}, {"compile_scope": "blocks"}):
        chosen = replace(fast, **other)
        with pytest.warns(UserWarning, match="model.cuda_graphs=true needs model.compile=true and model.compile_sc"):
            resolved = resolve_compile(chosen, "gpu")
        assert resolved == replace(chosen, cuda_graphs=False) and not resolved.replays_cuda_graphs


def test_synthetic_runs_need_no_video_stack() -> None:
    # benchmarks/ddp_scaling.py runs train() on GPU machines that have neither PyAV, energon nor NeMo-Run.
    blocked = ("av", "megatron", "braceexpand", "webdataset", "nemo_run")
    code = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}: raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from tokenizer_posttrain.train import build_datamodule\n"
        "from tokenizer_posttrain.config import DataConfig, ModelConfig\n"
        "dm = build_datamodule(DataConfig(frames=9, height=32, width=32), ModelConfig(), 0)\n"
        "print(type(dm).__name__)\n"
    )
    result = run_script("-c", code, cwd=Path.cwd(), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "SyntheticVideoDataModule"


@pytest.mark.parametrize(
    ("model", "bucket_mb"),
    [
        (ModelConfig(compile=True), WHOLE_STEP_BUCKET_MB),  # one compiled backward: nothing to overlap
        (ModelConfig(compile=True, compile_scope="blocks"), None),  # PyTorch's 25 MB buckets
        (ModelConfig(compile=False), None),
    ],
)
def test_ddp_keeps_the_host_work_per_step_small(model: ModelConfig, bucket_mb: int | None) -> None:
    strategy = ddp_strategy(TrainerConfig(), model)
    assert isinstance(strategy, DDPStrategy)
    kwargs = ddp_kwargs(model)
    assert strategy._ddp_kwargs == kwargs
    # no buffer broadcast in each forward, under the name this torch knows (the old one warns on 2.13)
    assert kwargs.get("forward_sync_buffers", kwargs.get("broadcast_buffers")) is False
    assert kwargs["gradient_as_bucket_view"] is True and kwargs["bucket_cap_mb"] == bucket_mb
    assert ddp_strategy(TrainerConfig(strategy="fsdp"), model) == "fsdp"  # other strategies as named


def test_ddp_accepts_its_settings_without_deprecation_warnings(tmp_path: Path) -> None:
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch 2.13's FutureWarning for broadcast_buffers
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), **ddp_kwargs(ModelConfig(compile=True)))
    finally:
        dist.destroy_process_group()
