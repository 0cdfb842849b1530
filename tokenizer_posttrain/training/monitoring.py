"""What a run reports while it trains: loggers, learning rates, throughput and memory, the progress bar,
validation videos, which videos each step read (and which were skipped), and the summary at the end."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, ProcessingSpeedColumn
from rich.progress import ProgressColumn, Task
from rich.style import Style
from rich.text import Text
from torch import Tensor

from ..core.errors import DataError
from ..data.batch import DAMAGED_SHARD, IN_DAMAGED_SHARD, KEYS, SKIPPED, VIDEO
from ..evaluation.media import side_by_side_frames, write_mp4
from .step_guard import is_log_step

THROUGHPUT_WINDOW = 10
"""Batches over which ``train/clips_per_sec`` and ``train/step_time`` are averaged."""


def loggers(run_dir: Path, name: str) -> list:
    """CSV always (curves without any account); wandb too when WANDB_API_KEY is set."""
    found: list = [pl.loggers.CSVLogger(save_dir=str(run_dir), name="csv")]
    if os.environ.get("WANDB_API_KEY"):
        found.append(
            pl.loggers.WandbLogger(
                project=os.environ.get("WANDB_PROJECT_NAME", "tokenizer-posttrain"),
                name=name,
                id=os.environ.get("WANDB_RUN_ID"),
                resume="allow",
                save_dir=str(run_dir),
            )
        )
    return found


class ThroughputMonitor(pl.Callback):
    """Logs ``train/clips_per_sec`` and ``train/step_time`` over the wall time of the last few batches,
    ``train/data_wait`` (the mean seconds per batch between the end of one batch and the start of the next:
    where the loop waits for the loader; gaps with a validation or a checkpoint save in them left out), and
    ``train/gpu_mem_gib`` (peak allocated) on a GPU.

    The time includes data loading, and on a GPU the queue of asynchronous kernels keeps the host no more
    than a step ahead, so a ``data_wait`` near 0 means the loader kept up. Values are logged as CPU tensors: a
    Python number would become a CUDA tensor, a copy that waits for the GPU.
    """

    def __init__(self, window: int = THROUGHPUT_WINDOW) -> None:
        self._batch_ends: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._waits: deque[float] = deque(maxlen=window)
        self._interrupted = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch_ends.clear()
        self._waits.clear()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_ends and not self._interrupted:
            self._waits.append(time.perf_counter() - self._batch_ends[-1][0])
        self._interrupted = False

    # Validation and checkpoint saves run between batches too: the wait after them is not the loader's.
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._interrupted = True

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        self._interrupted = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_ends.append((time.perf_counter(), batch[VIDEO].shape[0] * trainer.world_size))
        if len(self._batch_ends) > 1:
            elapsed = self._batch_ends[-1][0] - self._batch_ends[0][0]
            clips = sum(n for _, n in list(self._batch_ends)[1:])
            pl_module.log("train/clips_per_sec", torch.tensor(clips / max(elapsed, 1e-9)), batch_size=1, prog_bar=True)
            pl_module.log("train/step_time", torch.tensor(elapsed / (len(self._batch_ends) - 1)), batch_size=1)
        if self._waits:
            pl_module.log("train/data_wait", torch.tensor(sum(self._waits) / len(self._waits)), batch_size=1)
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
            pl_module.log("train/gpu_mem_gib", torch.tensor(peak), batch_size=1)


def save_validation_video(trainer: pl.Trainer, video: Tensor, reconstruction: Tensor) -> Path:
    """Input | reconstruction of one validation clip as ``<run>/val_videos/stepNNNNNNN.mp4``, also sent to
    wandb when it logs."""
    frames = side_by_side_frames(video, reconstruction)
    step = trainer.global_step
    path = write_mp4(Path(trainer.default_root_dir) / "val_videos" / f"step{step:07d}.mp4", frames)
    for logger in trainer.loggers:
        if isinstance(logger, pl.loggers.WandbLogger):
            import wandb

            logger.experiment.log({"val/video": wandb.Video(str(path), format="mp4")}, step=step)
    return path


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


class _CountColumn(ProgressColumn):
    """``done/total`` of a bar, with the unit and the micro-batches the training bar carries in its fields."""

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__()

    def render(self, task: Task) -> Text:
        total = "--" if task.total is None or task.total == float("inf") else int(task.total)
        text = f"{int(task.completed)}/{total}"
        if "unit" in task.fields:
            text += f" {task.fields['unit']}"
        if task.fields.get("micro"):
            text += f" ({task.fields['micro']} micro-batches)"
        return Text(text, style=self.style)


class _SpeedColumn(ProgressColumn):
    """Speed in the bar's own unit (optimizer steps for the training bar, batches elsewhere)."""

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__()

    def render(self, task: Task) -> Text:
        speed = f"{task.speed:.2f}" if task.speed is not None else "0.00"
        return Text(f"{speed} {task.fields.get('unit', 'it')}/s", style=self.style)


class StepProgressBar(RichProgressBar):
    """Rich progress bar that counts optimizer steps, as ``trainer.max_steps`` does, e.g. ``3/3 steps
    (24/24 micro-batches)`` under gradient accumulation; its total is ``max_steps``, so its ETA is real: the
    data streams are endless and Lightning's own total is not. Lightning's bar counts the micro-batches of
    the current epoch instead; without ``max_steps`` this one does the same."""

    def _counts_steps(self) -> bool:
        return bool(self.trainer.max_steps and self.trainer.max_steps > 0)

    @property
    def total_train_batches(self) -> int | float:
        if self._counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

    def configure_columns(self, trainer: pl.Trainer) -> list:
        replaced = {BatchesProcessedColumn: _CountColumn, ProcessingSpeedColumn: _SpeedColumn}
        return [
            replaced[type(column)](column.style) if type(column) in replaced else column
            for column in super().configure_columns(trainer)
        ]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._counts_steps():
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # as Lightning's: a run resumed mid-epoch has none yet
        if self.progress is not None and self.is_enabled and self.train_progress_bar_id is not None:
            fields: dict[str, str] = {"unit": "steps"}
            accumulate = trainer.accumulate_grad_batches
            if accumulate > 1:
                # The optimizer has stepped (global_step counts it) when the last micro-batch of a step ends.
                micro = trainer.global_step * accumulate + (batch_idx + 1) % accumulate
                fields["micro"] = f"{micro}/{trainer.max_steps * accumulate}"
            self.progress.update(self.train_progress_bar_id, completed=trainer.global_step, **fields)
        self._update_metrics(trainer, pl_module)
        self.refresh()


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
        notes: Sequence[str] = (),
    ) -> None:
        """Print the summary (and write the loss curve of ``(step, loss)`` ``losses``) of a finished run;
        ``notes`` are more lines (e.g. the compile time)."""
        lines = [f"Run finished: {steps} steps in {seconds / 60:.1f} min", *notes]
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
    so one early bad file does not end a run).

    A damaged tar shard is named once, when it is found (``data/damaged_shards`` counts them); the
    samples skipped in its damaged part count in ``data/skipped_samples`` but are not listed one by
    one, and do not count towards ``max_fraction``: they are skipped as they are read, ahead of the
    shuffle buffer (so ahead of the batches this callback sees), and the launch check has already
    refused shards that lose more than that fraction. The end of the run prints how many were
    skipped, and where.
    """

    MIN_SAMPLES = 20

    def __init__(self, max_fraction: float, clips_per_video: int = 1) -> None:
        """``clips_per_video``: clips a batch holds per video read (data.crops_per_decode), so that the
        fraction counts videos."""
        self.max_fraction = max_fraction
        self.clips_per_video = clips_per_video
        self.skipped: list[str] = []
        self.used = 0
        self.damaged: dict[str, int] = {}  # shard -> samples skipped in its damaged part
        self._damage_reports: list[str] = []
        self._unusable = 0  # skipped videos, not counting samples of damaged shards

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not isinstance(batch, dict) or SKIPPED not in batch:
            return
        new = list(batch[SKIPPED])
        for reason in new:
            shard = _damaged_shard(reason)
            if shard is None:
                print(f"[rank {trainer.global_rank}] skipped video {reason}", flush=True)
                self._unusable += 1
                continue
            if shard not in self.damaged:
                self.damaged[shard] = 0
                self._damage_reports.append(reason)
                print(
                    f"[rank {trainer.global_rank}] warning: {reason} (each skipped sample counts in "
                    "data/skipped_samples)",
                    flush=True,
                )
            self.damaged[shard] += 1
        self.skipped.extend(new)
        self.used += len(batch[VIDEO]) // self.clips_per_video
        pl_module.log("data/skipped_samples", float(len(self.skipped)), reduce_fx="sum", sync_dist=True, batch_size=1)
        if self.damaged:
            # This rank's count, no collective: ranks find damaged shards at different steps.
            pl_module.log("data/damaged_shards", float(len(self.damaged)), batch_size=1)
        total = self.used + self._unusable
        if total >= self.MIN_SAMPLES and self._unusable > self.max_fraction * total:
            videos = [r for r in self.skipped if _damaged_shard(r) is None]
            listing = "\n  ".join(videos[:20])
            damage = f"\n  (besides, {self._where().strip(' ()')})" if self.damaged else ""
            raise DataError(
                f"{self._unusable} of {total} videos read on rank {trainer.global_rank} were unusable, more than "
                f"data.max_skip_fraction={self.max_fraction}:\n  {listing}{damage}\n"
                "Run python -m data_tools check on the dataset to list every problem, then fix or remove those files."
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.skipped:
            print(f"[rank {trainer.global_rank}] skipped {len(self.skipped)} samples{self._where()}", flush=True)

    def _where(self) -> str:
        if not self.damaged:
            return ""
        in_shards = sum(self.damaged.values())
        shards = ", ".join(f"{name}: {count}" for name, count in sorted(self.damaged.items()))
        return (
            f" ({in_shards} of them in {len(self.damaged)} damaged tar shard(s): {shards}; "
            f"{self._unusable} unusable videos)"
        )


def _damaged_shard(entry: str) -> str | None:
    """The shard of a skip caused by a damaged tar shard; None for a skipped video (see
    :data:`~..data.batch.DAMAGED_SHARD`)."""
    where, _, reason = entry.partition(": ")
    if reason.startswith(DAMAGED_SHARD):
        return where
    if reason.startswith(IN_DAMAGED_SHARD):
        return where.split("#", 1)[0]
    return None


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
