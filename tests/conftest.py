"""Shared fixtures: the reference vectors shipped in tests/data, tiny networks, CLI runs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file

from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.io.checkpoint import load_tokenizer
from tokenizer_posttrain.network import CausalVideoTokenizer

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
TINY = {"CV8x8x8": 16, "DV8x16x16": 16}


def reference_weights(name: str) -> Path:
    return REFERENCE / f"{name}_tiny_weights.safetensors"


def reference_io(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(REFERENCE / f"{name}_tiny_io.safetensors"))


@pytest.fixture(params=["CV8x8x8", "DV8x16x16"])
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def tiny_network(model_name: str) -> CausalVideoTokenizer:
    """The reference tiny model (width 16) with the reference weights, in eval mode."""
    return load_tokenizer(reference_weights(model_name), channels=TINY[model_name]).eval()


def run_cli(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``train_tokenizer.py`` in a fresh process, as a user would."""
    return run_script(str(ROOT / "train_tokenizer.py"), *args, cwd=cwd, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """All rows of every CSV log version of a run, oldest first."""
    rows: list[dict[str, str]] = []
    for version in sorted((run_dir / "csv").glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        with open(version / "metrics.csv") as f:
            rows.extend(csv.DictReader(f))
    return rows


@pytest.fixture(scope="session")
def exported_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny reference model exported once, in bf16 like the official release files."""
    from tokenizer_posttrain.io.export import export_tokenizer

    out = {}
    for name, width in TINY.items():
        net = load_tokenizer(reference_weights(name), channels=width)
        out[name] = export_tokenizer(net, tmp_path_factory.mktemp(f"export_{name}"), dtype=torch.bfloat16)
    return out


def fit(
    module: pl.LightningModule,
    tmp_path: Path,
    steps: int = 3,
    callbacks: list | None = None,
    datamodule: pl.LightningDataModule | None = None,
    **trainer_kw: Any,
) -> pl.Trainer:
    """A few bf16-mixed CPU training steps of ``module`` on small synthetic clips (no logs, no
    checkpoints, unless ``trainer_kw`` asks: any ``pl.Trainer`` argument, and ``ckpt_path_for_fit``
    to resume from a checkpoint)."""
    options: dict[str, Any] = dict(
        accelerator="cpu",
        max_steps=steps,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=str(tmp_path),
        callbacks=callbacks or [],
        use_distributed_sampler=False,
    )
    ckpt_path = trainer_kw.pop("ckpt_path_for_fit", None)
    trainer = pl.Trainer(**{**options, **trainer_kw})
    trainer.fit(
        module,
        datamodule=datamodule
        or SyntheticVideoDataModule(frames=9, height=32, width=32, num_workers=0, num_train_samples=8),
        ckpt_path=ckpt_path,
    )
    return trainer


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """For modules of tiny convolutions: on a busy 2-core machine a second torch thread only spins
    (measured 30-50x slower), so these run on one thread and restore the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_script(
    *args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python ARGS...`` in a fresh process with the repository importable (torchrun, -m modules)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def run_torchrun(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 train_tokenizer.py --yes ARGS...`` on the CPU, in fresh processes."""
    return run_script(
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(ROOT / "train_tokenizer.py"),
        "--yes",
        *args,
        cwd=cwd,
        timeout=timeout,
    )
