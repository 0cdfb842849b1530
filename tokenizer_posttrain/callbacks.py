"""Checkpointing pieces: atomic writes, step checkpoints, a checkpoint on preemption."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .data.batch import KEYS, SKIPPED, VIDEO
from .data.preflight import DataError


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


class SkippedSamples(pl.Callback):
    """Counts and logs the videos the loader skipped (``data/skipped_samples``), naming each;
    stops the run when more than ``max_fraction`` of them fail (after a few dozen samples,
    so one early bad file does not end a run)."""

    MIN_SAMPLES = 20

    def __init__(self, max_fraction: float) -> None:
        self.max_fraction = max_fraction
        self.skipped: list[str] = []
        self.used = 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, dict) or SKIPPED not in batch:
            return
        new = list(batch[SKIPPED])
        for reason in new:
            print(f"[rank {trainer.global_rank}] skipped video {reason}", flush=True)
        self.skipped.extend(new)
        self.used += len(batch[VIDEO])
        pl_module.log("data/skipped_samples", float(len(self.skipped)), reduce_fx="sum", sync_dist=True, batch_size=1)
        total = self.used + len(self.skipped)
        if total >= self.MIN_SAMPLES and len(self.skipped) > self.max_fraction * total:
            listing = "\n  ".join(self.skipped[:20])
            raise DataError(
                f"{len(self.skipped)} of {total} videos read on rank {trainer.global_rank} were unusable, more than "
                f"data.max_skip_fraction={self.max_fraction}:\n  {listing}\n"
                "Run python -m data_tools check on the dataset to list every problem, then fix or remove those files."
            )


class SampleTrace(pl.Callback):
    """Appends which videos each training micro-batch held to ``<dir>/rank<R>.jsonl``: an audit
    trail of what a run trained on, and the proof that a resumed run continues the stream."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, dict) or KEYS not in batch:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {"step": trainer.global_step, "keys": list(batch[KEYS])}
        with open(self.directory / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
