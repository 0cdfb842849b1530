"""Checkpointing pieces: atomic writes, step checkpoints, a checkpoint on preemption."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary name and renames it, so a kill during a save
    never leaves a truncated file under the name resume will read."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)


def checkpoint_callback(ckpt_dir: Path, every_n_steps: int, keep: int) -> ModelCheckpoint:
    """``step=N.ckpt`` every ``every_n_steps`` keeping the newest ``keep``, plus ``last.ckpt``."""
    return ModelCheckpoint(
        dirpath=str(ckpt_dir),
        filename="{step}",
        every_n_train_steps=every_n_steps,
        # Monitoring the step keeps the newest k (Lightning needs a monitor for top-k > 1).
        monitor="step",
        mode="max",
        save_top_k=keep,
        save_last=True,
        enable_version_counter=False,
        auto_insert_metric_name=True,
    )


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM (Lightning stops after the current batch) write ``last.ckpt`` so the
    next launch of the same command resumes where this one stopped."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(str(self.path))
            if trainer.is_global_zero:
                print(
                    f"Preempted at step {trainer.global_step}: saved {self.path}; "
                    "run the same command again to resume.",
                    flush=True,
                )


class LossSummary(pl.Callback):
    """Prints how the training loss moved over this run (first vs last steps) when it ends."""

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self.losses: list = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            self.losses.append(loss.detach().clone())  # no .item(): no GPU sync per step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or len(self.losses) < 2:
            return
        values = [float(v) for v in self.losses]
        n = min(self.window, len(values) // 2)
        first, last = sum(values[:n]) / n, sum(values[-n:]) / n
        print(
            f"train/loss over this run: {first:.4f} (mean of first {n} steps) -> {last:.4f} "
            f"(mean of last {n}); {trainer.global_step} steps done",
            flush=True,
        )
