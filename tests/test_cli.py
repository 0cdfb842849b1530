"""The real command line, in fresh processes: smoke run, resume, overrides and failures."""

import csv
from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_cli, run_torchrun


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    workdir = tmp_path_factory.mktemp("cli")
    result = run_cli(
        "--factory",
        "tiny",
        "trainer.max_steps=30",
        "trainer.val_check_interval=10",
        "trainer.checkpoint_every_n_steps=10",
        "optim.lr=3e-4",
        f"log.log_dir={workdir}",
        "log.name=smoke",
        cwd=workdir,
    )
    return workdir / "smoke", result


def test_smoke_run_trains_checkpoints_and_exports(first_run: tuple[Path, object]) -> None:
    run_dir, result = first_run
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir)
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses  # the loss falls
    assert any(r.get("val/psnr") for r in rows)
    ckpts = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"last.ckpt", "step=10.ckpt", "step=20.ckpt", "step=30.ckpt"} <= ckpts
    assert {"encoder.jit", "decoder.jit", "autoencoder.jit"} <= {p.name for p in (run_dir / "export").iterdir()}
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 30
    assert ckpt["hyper_parameters"]["optim"]["lr"] == 3e-4  # the override reached the config
    assert ckpt["hyper_parameters"]["model"]["channels"] == 16
    assert all(v.dtype == torch.float32 for k, v in ckpt["state_dict"].items() if "conv3d" in k)


def test_second_run_in_the_same_folder_resumes(first_run: tuple[Path, object]) -> None:
    run_dir, first = first_run
    assert first.returncode == 0
    result = run_cli(
        "--factory",
        "tiny",
        "trainer.max_steps=34",
        f"log.log_dir={run_dir.parent}",
        "log.name=smoke",
        "log.export_on_end=false",
        cwd=run_dir.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in result.stdout
    latest = sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    with open(latest / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert min(steps) == 30 and max(steps) == 33  # continued at step 30, did not restart at 0
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 34


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_stepz=3", "cannot apply override trainer.max_stepz=3: no such setting"),
        ("trainer.max_steps=abc", "invalid override trainer.max_steps=abc: 'abc' is not a valid int"),
        ("data.global_batch_size=3", "data.global_batch_size=3 is not a multiple of"),
    ],
)
def test_bad_input_exits_non_zero_with_a_message(override: str, message: str, tmp_path: Path) -> None:
    result = run_cli(
        "--factory", "tiny", "trainer.max_steps=2", f"log.log_dir={tmp_path}", override, cwd=tmp_path, timeout=120
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr  # a clear message, not a stack dump
    assert not (tmp_path / "tiny_cv8x8x8" / "checkpoints").exists()  # failed before any work


def test_torchrun_two_processes_on_cpu(tmp_path: Path) -> None:
    result = run_torchrun(
        "--factory",
        "tiny",
        "trainer.max_steps=2",
        "data.global_batch_size=4",
        "data.micro_batch_size=1",
        "log.export_on_end=false",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = torch.load(tmp_path / "tiny_cv8x8x8" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2
    # 4 clips per step over 2 processes at micro batch 1: 2 micro-batches accumulated per step
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 4
