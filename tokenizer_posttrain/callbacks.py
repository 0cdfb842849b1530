"""Checkpointing pieces: atomic writes, step checkpoints, a checkpoint on preemption."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .data.batch import KEYS, SKIPPED, VIDEO
from .data.preflight import DataError
from .step_scalars import is_log_step


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


class RunSummary(pl.Callback):
    """Keeps the validation history of this run; at the end prints a summary and draws ``loss_curve.png``
    from the training losses the module logged."""

    def __init__(self) -> None:
        self.val_psnr: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        psnr = trainer.callback_metrics.get("val/psnr")
        if psnr is not None and not trainer.sanity_checking:
            self.val_psnr.append((trainer.global_step, float(psnr)))

    def report(
        self,
        run_dir: Path,
        steps: int,
        seconds: float,
        losses: list[tuple[int, float]],
        ckpt_dir: Path,
        export_dir: Path | None,
    ) -> None:
        """Print the summary (and write the loss curve of ``(step, loss)`` ``losses``) of a finished run."""
        lines = [f"Run finished: {steps} steps in {seconds / 60:.1f} min"]
        if len(losses) >= 2:
            n = min(5, len(losses) // 2)
            first, last = (sum(v for _, v in part) / n for part in (losses[:n], losses[-n:]))
            lines.append(
                f"train/loss over this run: {first:.4f} (mean of first {n} steps) -> {last:.4f} (mean of last {n})"
            )
            lines.append(f"loss curve: {self._plot(run_dir / 'loss_curve.png', losses)}")
        if self.val_psnr:
            step, best = max(self.val_psnr, key=lambda item: item[1])
            lines.append(f"best val/psnr: {best:.2f} dB at step {step}")
        lines.append(f"checkpoints: {ckpt_dir}")
        if export_dir is not None:
            lines.append(f"export (encoder.jit, decoder.jit, autoencoder.jit): {export_dir}")
        print("\n".join(lines), flush=True)

    def _plot(self, path: Path, values: list[tuple[int, float]]) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([s for s, _ in values], [v for _, v in values], lw=1, label="train/loss")
        if self.val_psnr:
            twin = ax.twinx()
            twin.plot(*zip(*self.val_psnr, strict=True), "o-", color="tab:orange", label="val/psnr")
            twin.set_ylabel("val PSNR (dB)")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_yscale("log")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


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


class StepProgressBar(RichProgressBar):
    """Rich progress bar whose total is the run's micro-batches (``max_steps`` x accumulation), so
    its ETA is real: the data streams are endless and Lightning's own total is not."""

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps * trainer.accumulate_grad_batches
        return super().total_train_batches


class LearningRateLogger(pl.Callback):
    """Logs each parameter group's learning rate as ``lr-<Optimizer>/<group name>`` at the steps the
    losses are logged. Lightning's LearningRateMonitor does the same but also copies every rate to the
    GPU at every step (for ``callback_metrics``), a copy that makes the host wait for the GPU."""

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        step = trainer.global_step
        first_micro_batch = batch_idx % trainer.accumulate_grad_batches == 0
        if not (trainer.is_global_zero and first_micro_batch and is_log_step(step, trainer.log_every_n_steps)):
            return
        rates = {}
        for optimizer in trainer.optimizers:
            for i, group in enumerate(optimizer.param_groups):
                rates[f"lr-{type(optimizer).__name__}/{group.get('name', f'pg{i + 1}')}"] = float(group["lr"])
        for logger in trainer.loggers:
            logger.log_metrics(rates, step=step)


class RngState(pl.Callback):
    """Saves and restores the Python, NumPy and torch random states with every checkpoint, so a
    resumed run draws the same random numbers (LoRA dropout, augmentation) as an uninterrupted one."""

    KEY = "rng_states"

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import random

        import numpy as np
        import torch

        checkpoint[self.KEY] = {
            "python": pickle.dumps(random.getstate()),
            "numpy": pickle.dumps(np.random.get_state()),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        import random

        import numpy as np
        import torch

        states = checkpoint.get(self.KEY)
        if not states:
            return
        random.setstate(pickle.loads(states["python"]))
        np.random.set_state(pickle.loads(states["numpy"]))
        torch.set_rng_state(states["torch"])
        if states["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])
