"""Launch-time checks (parallelism, accumulation, clip shapes) and how train() sets up the Trainer."""

from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import fit, run_script
from tokenizer_posttrain.core.errors import DataError
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


def test_every_launch_problem_is_reported_at_once(tmp_path: Path) -> None:
    from tests.conftest import reference_weights
    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.losses.perceptual import PerceptualConfig
    from tokenizer_posttrain.training.train import LaunchProblems, train

    configs = tiny_run(
        tmp_path,
        model={"jit_ckpt_pth": str(reference_weights("DV8x16x16"))},  # a DV checkpoint for a CV model
        data={"frames": 10, "global_batch_size": 3, "micro_batch_size": 2},
        loss={"perceptual_weight": None, "perceptual": PerceptualConfig(weights_path=str(tmp_path / "missing.pth"))},
    )
    with pytest.raises(LaunchProblems) as err:
        train(**configs)
    message = str(err.value)
    assert message.startswith("4 problems stop this launch:")
    for expected in ("data.frames=10", "data.global_batch_size=3", "missing.pth", "DV8x16x16"):
        assert expected in message, (expected, message)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_stop_for_nan_steps_names_the_checkpoint_from_before_them(tmp_path: Path) -> None:
    from tests.training.test_resume import save_ckpt
    from tokenizer_posttrain.training.step_guard import NonFiniteLossError
    from tokenizer_posttrain.training.train import _stopped_for_bad_steps

    stop = NonFiniteLossError("raw", first=7, last=9)
    assert "No checkpoint was written before step 7" in str(_stopped_for_bad_steps(stop, tmp_path, 3))
    for step in (4, 6, 8):  # step=8 holds the weights that gave the first NaN (at step 7)
        save_ckpt(tmp_path / f"step={step}.ckpt", step)
    save_ckpt(tmp_path / "last.ckpt", 8)
    message = str(_stopped_for_bad_steps(stop, tmp_path, 3))
    assert message.startswith("3 steps in a row (steps 7-9) had a NaN/Inf loss or gradient (trainer.max_bad_steps=3)")
    assert f"The newest checkpoint from before them is {tmp_path / 'step=6.ckpt'} (step 6)" in message
    assert f"resume.resume_from_path={tmp_path / 'step=6.ckpt'}" in message
    assert f"a plain relaunch would resume {tmp_path / 'last.ckpt'}" in message
    assert "\n" not in message


def test_lr_1e10_stops_with_one_line_naming_the_steps(tmp_path: Path) -> None:
    from tests.conftest import run_cli_here

    proc = run_cli_here(
        "--factory", "tiny", "data.frames=9", "data.height=32", "data.width=32", "optim.lr=1e10",
        "trainer.max_bad_steps=2", "trainer.max_steps=20", "log.export_on_end=false", f"log.log_dir={tmp_path}",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 steps in a row (steps "), last
    assert "Traceback" not in proc.stderr and "No checkpoint was written before step" in last
    assert not list(tmp_path.glob("*/export"))


@pytest.mark.usefixtures("one_torch_thread")
def test_a_run_logs_the_gram_and_high_frequency_terms_and_warns_of_an_unreached_schedule(
    tmp_path: Path, vgg_file: Path
) -> None:
    from tests.conftest import read_metrics
    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.losses.gram import GramConfig
    from tokenizer_posttrain.losses.high_freq import HighFreqConfig
    from tokenizer_posttrain.losses.perceptual import PerceptualConfig
    from tokenizer_posttrain.training.train import train

    loss = {
        "perceptual_weight": None,
        # Perceptual off: the Gram term still gets the VGG16 that loss.perceptual sets.
        "perceptual": PerceptualConfig(0.0, weights_path=str(vgg_file)),
        "gram": GramConfig(0.5),
        "high_freq": HighFreqConfig(boundaries=[1, 5], values=[0.0, 0.2, 0.4]),
    }
    configs = tiny_run(tmp_path, steps=2, data={"frames": 1}, loss=loss)
    with pytest.warns(
        UserWarning, match=r"loss\.high_freq\.boundaries=\[1, 5\]: trainer\.max_steps=2 ends before step 5"
    ):
        run_dir = train(**configs)
    rows = {int(row["step"]): row for row in read_metrics(run_dir) if row.get("train/loss")}
    assert sorted(rows) == [0, 1]
    assert float(rows[0]["train/gram"]) > 0 and float(rows[1]["train/gram"]) > 0
    assert rows[0]["train/high_freq"] == "" and float(rows[1]["train/high_freq"]) > 0  # on from step 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "no effect on synthetic clips"),
        ({"path": "some/dataset", "aspect_buckets": True}, "differ by a few pixels at most"),
    ],
)
def test_several_crops_per_decode_warn_where_they_cannot_help(settings: dict, message: str) -> None:
    from tokenizer_posttrain.training.train import build_datamodule

    data = DataConfig(frames=9, height=32, width=32, micro_batch_size=2, crops_per_decode=2, **settings)
    with pytest.warns(UserWarning, match=message):
        build_datamodule(data, ModelConfig(), 0)


def test_the_launch_sizes_the_loaders_batches_in_flight_against_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collections import namedtuple

    from tests.videos import encode_video, write_energon_dataset
    from tokenizer_posttrain.data import preflight
    from tokenizer_posttrain.training.train import check_data

    videos = {f"v{i}": encode_video(12, 48, 64, seed=i) for i in range(4)}
    root = write_energon_dataset(tmp_path / "data", videos)
    data = DataConfig(path=str(root), frames=9, height=32, width=32, num_workers=2, preflight_samples=0)
    batch = 3 * 9 * 32 * 32 * 2  # one bf16 clip a micro-batch
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight, "SHARED_MEMORY", tmp_path)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _: usage(0, 0, 7 * batch))
    with pytest.warns(UserWarning, match=r"data\.prefetch lowered to 3"):  # 2 workers x 3 + 1 = 7 batches
        assert check_data(data, 1, seed=0).prefetch == 3
    with pytest.warns(UserWarning, match=r"lowered to 1"):  # 2 processes here: 2 x (2 x 1) + 2 = 6 batches
        assert check_data(data, 2, seed=0, processes=2).prefetch == 1
    with pytest.raises(DataError, match=r"data\.prefetch=2 x data\.num_workers=2 x 2 process\(es\)"):
        check_data(replace(data, prefetch=2), 2, seed=0, processes=2)
    assert check_data(DataConfig(), 1, seed=0).prefetch is None  # synthetic clips: no loader workers to size


def test_a_failed_launch_removes_only_the_empty_folders_it_made(tmp_path: Path) -> None:
    from tokenizer_posttrain.training.train import _missing_parts, _remove_empty

    run_dir = tmp_path / "logs" / "sweep" / "b"
    made = _missing_parts(run_dir)
    assert made == [run_dir, run_dir.parent, run_dir.parent.parent]
    # Meanwhile another run of the sweep started beside it, and this launch made its own sub-folders.
    (run_dir.parent / "a" / "checkpoints").mkdir(parents=True)
    (run_dir / "csv" / "version_0").mkdir(parents=True)
    _remove_empty(made)
    assert not run_dir.exists()
    assert (run_dir.parent / "a" / "checkpoints").is_dir()  # the other run's empty folders stay
    # With nothing beside it, the whole chain it made goes; a folder holding a file stays.
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
    (run_dir / "empty").mkdir()
    _remove_empty([run_dir])
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and not (run_dir / "empty").exists()


def test_lightnings_note_on_a_non_empty_checkpoint_folder_stays_for_a_new_run() -> None:
    import warnings

    from tokenizer_posttrain.training.console import resumed_fit

    note = "Checkpoint directory /r/checkpoints exists and is not empty."
    for resuming, shown in ((True, 0), (False, 1)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with resumed_fit(resuming):
                warnings.warn(note, stacklevel=1)
        assert len(seen) == shown


def test_each_loss_term_checks_the_clips_and_one_launch_reports_them_all() -> None:
    from tokenizer_posttrain.losses import LossConfig
    from tokenizer_posttrain.losses.consistency import ConsistencyConfig
    from tokenizer_posttrain.losses.flow import FlowConfig
    from tokenizer_posttrain.training.config import DataConfig, ModelConfig
    from tokenizer_posttrain.training.train import check_loss_clips

    model, data = ModelConfig(model="CV8x8x8", channels=16), DataConfig(frames=17, height=64, width=64)
    loss = LossConfig(consistency=ConsistencyConfig(1.0, window=10, step=8), flow=FlowConfig(0.01))
    with pytest.raises(ValueError) as err:
        check_loss_clips(model, data, loss)
    message = str(err.value)
    assert message.startswith("the loss does not fit CV8x8x8 clips of 17x64x64: ")
    # Each term's own problems, in one message (in the terms' summing order).
    assert "(loss.flow.scale=2); use clips of 256+ pixels" in message and "loss.consistency.window=10 is not" in message
    check_loss_clips(model, data, LossConfig(flow=FlowConfig(0.0)))  # a term that is never on is not asked


def test_sampling_a_posterior_needs_a_model_that_has_one() -> None:
    from tokenizer_posttrain.training.config import DataConfig, ModelConfig
    from tokenizer_posttrain.training.train import check_clip_shape

    with pytest.raises(ValueError, match="Cosmos-1.0-Tokenizer-CV8x8x8 has no posterior to sample"):
        check_clip_shape(ModelConfig(model="CV8x8x8", sample_posterior=True), DataConfig(frames=9, height=32, width=32))
