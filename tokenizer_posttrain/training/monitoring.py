"""What a run reports while it trains: loggers, learning rates, throughput and memory, the progress (a bar in a
terminal, plain lines in a log file), validation videos, which videos each step read (and which were skipped), and
the summary and loss curve of the whole run at the end."""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import CustomBarColumn
from rich.progress import ProgressColumn, Task, TextColumn
from rich.style import Style
from rich.table import Column
from rich.text import Text
from torch import Tensor

from ..core.errors import DataError
from ..core.progress import LineProgress, format_duration, format_rate, is_terminal, progress_interval
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


def _scalar(value: Any) -> float | None:  # noqa: ANN401 - a tensor, a number, or anything else a module logged
    """A logged value as a float (CPU tensors: no wait for the GPU); None for anything else."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def _train_fields(trainer: pl.Trainer) -> dict[str, str]:
    """The training scalars the progress shows, as text: loss, clips/s, data wait (those logged so far)."""
    bar, every = trainer.progress_bar_metrics, trainer.callback_metrics
    fields = {}
    loss = _scalar(bar.get("train/loss"))
    if loss is not None:
        fields["loss"] = f"{loss:.4g}"
    speed = _scalar(bar.get("train/clips_per_sec", every.get("train/clips_per_sec")))
    if speed is not None:
        fields["clips/s"] = format_rate(speed)
    wait = _scalar(every.get("train/data_wait"))
    if wait is not None:
        fields["data_wait"] = f"{wait:.2f} s"
    return fields


class _CountColumn(ProgressColumn):
    """``done/total`` of a bar, with the unit and the micro-batch the training bar carries in its fields."""

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        total = "--" if task.total is None or task.total == float("inf") else int(task.total)
        text = f"{int(task.completed)}/{total}"
        if "unit" in task.fields:
            text += f" {task.fields['unit']}"
        if task.fields.get("micro"):
            text += f" (micro {task.fields['micro']})"
        return Text(text, style=self.style)


class _TimeColumn(ProgressColumn):
    """``elapsed<remaining`` as tqdm writes it (``1:02<3:40``): half the width of Lightning's column."""

    max_refresh = 0.5  # as Lightning's: a time that changes at every redraw jitters

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        remaining = task.time_remaining
        shown = "-:--" if elapsed is None else format_duration(elapsed)
        if not task.finished:
            shown += "<" + ("-:--" if remaining is None else format_duration(remaining))
        return Text(shown, style=self.style)


class _MetricsColumn(ProgressColumn):
    """The training scalars on the training bar's row (``loss 0.1234  11.0 clips/s  val 31.20 dB``), cut
    at the console's edge rather than wrapped: Lightning's column listed every name in full (``v_num``
    too) and wrapped each bar into a block of 6 lines at 80 columns."""

    def __init__(self, bar: StepProgressBar, style: str | Style) -> None:
        self.bar = bar
        self.style = style
        # The one column Rich may narrow (its text still stays on one line): the others keep their widths.
        super().__init__(table_column=Column(no_wrap=False))

    def render(self, task: Task) -> Text:
        if task.id != self.bar.train_progress_bar_id:
            return Text()
        return Text(self.bar.metrics_text, style=self.style, no_wrap=True, overflow="ellipsis")


class StepProgressBar(RichProgressBar):
    """Rich progress bar that counts optimizer steps, as ``trainer.max_steps`` does, e.g. ``3/3 steps
    (micro 4/4)`` under gradient accumulation, the bar moving at each micro-batch; its total is ``max_steps``,
    so its ETA is real: the data streams are endless and Lightning's own total is not. Lightning's bar counts
    the micro-batches of the current epoch instead; without ``max_steps`` this one does the same.

    One row per bar that fits 80 columns: ``train ━━━━━━━━━━ 12/80 steps 0:07<0:41 loss 0.1234  11.0
    clips/s``, anything longer cut at the edge, never wrapped."""

    BAR_WIDTH = 10

    def __init__(self, **kwargs: Any) -> None:  # noqa: ANN401 - RichProgressBar's arguments
        super().__init__(**kwargs)
        self.metrics_text = ""

    @property
    def sanity_check_description(self) -> str:
        return "sanity check"

    @property
    def validation_description(self) -> str:
        return "val"

    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning's "Epoch 0/-2": the streams are endless, so the epoch says nothing (and -2 is max_epochs-1).
        return "train"

    def _counts_steps(self) -> bool:
        return bool(self.trainer.max_steps and self.trainer.max_steps > 0)

    @property
    def total_train_batches(self) -> int | float:
        if self._counts_steps():
            return self.trainer.max_steps
        return super().total_train_batches

    def configure_columns(self, trainer: pl.Trainer) -> list:
        theme = self.theme
        return [
            TextColumn("[progress.description]{task.description}", table_column=Column(no_wrap=True)),
            CustomBarColumn(
                bar_width=self.BAR_WIDTH,
                complete_style=theme.progress_bar,
                finished_style=theme.progress_bar_finished,
                pulse_style=theme.progress_bar_pulse,
            ),
            _CountColumn(theme.batch_progress),
            _TimeColumn(theme.time),
            _MetricsColumn(self, theme.metrics),
        ]

    def _init_progress(self, trainer: pl.Trainer) -> None:
        super()._init_progress(trainer)
        # Lightning appends its metrics column after ours; ours shows the metrics, and its empty cell would
        # still take two columns of the 80.
        if self.progress is not None and self.progress.columns[-1:] == (self._metric_component,):
            self.progress.columns = self.progress.columns[:-1]

    def _update_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.is_enabled:
            return
        fields = _train_fields(trainer)
        parts = [f"loss {fields['loss']}"] if "loss" in fields else []
        if "clips/s" in fields:
            parts.append(f"{fields['clips/s']} clips/s")
        psnr = _scalar(trainer.progress_bar_metrics.get("val/psnr"))
        if psnr is not None:
            parts.append(f"val {psnr:.2f} dB")
        self.metrics_text = "  ".join(parts)

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
            completed: float = trainer.global_step
            accumulate = trainer.accumulate_grad_batches
            if accumulate > 1:
                # The optimizer has stepped (global_step counts it) when the last micro-batch of a step ends;
                # the bar moves at each micro-batch, so a slow step still shows its progress and the ETA.
                micro = batch_idx % accumulate + 1
                fields["micro"] = f"{micro}/{accumulate}"
                if micro < accumulate:
                    completed += micro / accumulate
            self.progress.update(self.train_progress_bar_id, completed=completed, **fields)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class LineProgressBar(ProgressBar):
    """Training progress as plain lines, for a log file (stdout not a terminal), at most every ``interval``
    seconds (default :func:`~..core.progress.progress_interval`) and at the first step::

        [train] 12/80 steps | loss 0.1234 | clips/s 11.0 | data wait 0.02 s | elapsed 1:02 | ETA 5:40

    and one line after each validation (``[val] step 40 | psnr 31.2 | ... | took 0:12``). Rank 0 only
    (Lightning disables progress bars on the other ranks). A progress bar to Lightning, so Lightning adds
    none of its own."""

    def __init__(self, interval: float | None = None) -> None:
        super().__init__()
        # Read now: a bad setting stops the launch, not the fit after its setup.
        self.interval = progress_interval() if interval is None else interval
        self._enabled = True
        self._line: LineProgress | None = None
        self._val_started = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled:
            return
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._line = LineProgress(
            "train", total, "steps", start=trainer.global_step, interval=self.interval, rate=False
        )
        self._line.start()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._line is None or not self._enabled or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if self._line.due():
            self._line.update(trainer.global_step, **_train_fields(trainer))
        else:
            self._line.update(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._line is not None and self._enabled:
            self._line.close(**_train_fields(trainer))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_started = time.monotonic()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or trainer.sanity_checking:
            return
        parts = [f"[val] step {trainer.global_step}"]
        for name, value in trainer.callback_metrics.items():
            number = _scalar(value) if name.startswith("val/") else None
            if number is not None:
                parts.append(f"{name.removeprefix('val/')} {number:.4g}")
        parts.append(f"took {format_duration(time.monotonic() - self._val_started)}")
        print(" | ".join(parts), flush=True)


def progress_callback() -> ProgressBar:
    """The training progress for where stdout goes: the Rich bar in a terminal, lines in a log file."""
    return StepProgressBar() if is_terminal() else LineProgressBar()


@dataclass
class RunHistory:
    """What a run folder's CSV logs hold over every launch of the run (``csv/version_*/metrics.csv``)."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    """``(step, train/loss)`` of every logged step."""
    val_psnr: list[tuple[int, float]] = field(default_factory=list)
    """``(step, val/psnr)`` of every validation."""
    launches: list[int] = field(default_factory=list)
    """The first step each launch logged, oldest first."""


def read_history(run_dir: Path) -> RunHistory:
    """The run's logged history, every launch of it: a resumed launch writes a new CSV version, starting at
    its checkpoint's step. Steps an earlier launch logged past the checkpoint a later one resumed from (it was
    stopped before its next save) are left out: the later launch did them again, and its values led to the
    weights."""
    history = RunHistory()
    versions = [p for p in (Path(run_dir) / "csv").glob("version_*") if p.name.split("_", 1)[1].isdigit()]
    for version in sorted(versions, key=lambda p: int(p.name.split("_", 1)[1])):
        try:
            with open(version / "metrics.csv", newline="") as f:
                rows = [row for row in csv.DictReader(f) if (row.get("step") or "").isdigit()]
        except OSError:  # a launch that stopped before it logged anything
            continue
        if not rows:
            continue
        # The CSV's step is the 0-based index of the step just taken; counted from 1 it is the step count that
        # the [val] lines, the checkpoints (step=N.ckpt) and a resume ("at step N") name.
        first = min(int(row["step"]) for row in rows)
        history.losses = [(s, v) for s, v in history.losses if s <= first]
        history.val_psnr = [(s, v) for s, v in history.val_psnr if s <= first]
        history.launches = [s for s in history.launches if s < first] + [first]
        for row in rows:
            for key, series in (("train/loss", history.losses), ("val/psnr", history.val_psnr)):
                if row.get(key):
                    series.append((int(row["step"]) + 1, float(row[key])))
    return history


PSNR_MIN_SPAN = 1.0
"""dB: the loss curve's PSNR axis spans at least this much, so it does not magnify 0.005 dB into a cliff."""


class RunSummary(pl.Callback):
    """At the end of a launch prints a summary and draws ``loss_curve.png`` from the whole run's CSV logs
    (:func:`read_history`)."""

    def __init__(self) -> None:
        self.first_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.first_step = trainer.global_step  # a resumed launch starts at its checkpoint's step

    def report(
        self,
        run_dir: Path,
        steps: int,
        seconds: float,
        ckpt_dir: Path,
        export_dir: Path | None,
        notes: Sequence[str] = (),
    ) -> None:
        """Print the summary of a finished launch that ended at step ``steps`` after ``seconds``, and write
        the loss curve of the whole run; ``notes`` are more lines (e.g. the compile time)."""
        took = f"{seconds / 60:.1f} min"
        if self.first_step:
            lines = [f"Run finished at step {steps} (this launch: steps {self.first_step}-{steps} in {took})"]
        else:
            lines = [f"Run finished at step {steps} ({steps} steps in {took})"]
        lines += notes
        history = read_history(run_dir)
        losses = [(s, v) for s, v in history.losses if math.isfinite(v)]
        if len(losses) >= 2:
            n = min(5, len(losses) // 2)
            first, last = (sum(v for _, v in part) / n for part in (losses[:n], losses[-n:]))
            lines.append(
                f"train/loss over the run: {first:.4f} (mean of the first {n} logged steps) -> {last:.4f} "
                f"(mean of the last {n})"
            )
            path = _plot_history(run_dir / "loss_curve.png", history, run_dir.name)
            lines.append(f"loss curve: {path} (steps {history.losses[0][0]}-{history.losses[-1][0]})")
        if history.val_psnr:
            step, best = max(history.val_psnr, key=lambda item: item[1])
            lines.append(f"best val/psnr: {best:.2f} dB at step {step}")
        lines.append(f"checkpoints: {ckpt_dir}")
        if export_dir is not None:
            lines.append(f"export ({', '.join(export_files(export_dir))}): {export_dir}")
        print("\n".join(lines), flush=True)


def export_files(export_dir: Path) -> list[str]:
    """The files of the export format ``export_dir`` holds (the model family's own: Cosmos' ``.jit`` files, Wan's
    ``.pth``), else every file in it."""
    from ..io.formats import FORMATS

    for fmt in FORMATS.values():
        if fmt.found_in(export_dir):
            return list(fmt.files)
    return sorted(p.name for p in export_dir.iterdir() if p.is_file())


def psnr_axis_limits(values: Sequence[float]) -> tuple[float, float] | None:
    """The PSNR axis's range when the values span less than :data:`PSNR_MIN_SPAN` (centred on them); None:
    matplotlib's own range."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or max(finite) - min(finite) >= PSNR_MIN_SPAN:
        return None
    middle = (max(finite) + min(finite)) / 2
    return middle - PSNR_MIN_SPAN / 2, middle + PSNR_MIN_SPAN / 2


def _plot_history(path: Path, history: RunHistory, name: str) -> Path:
    """``loss_curve.png``: train/loss (log scale when positive) and val/psnr over the whole run, a dotted
    line where a launch resumed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [s for s, _ in history.losses]
    ax.plot(steps, [v for _, v in history.losses], lw=1, color="tab:blue", label="train/loss")
    for n, start in enumerate(history.launches[1:]):
        ax.axvline(start, color="grey", ls=":", lw=1, label="resumed" if n == 0 else None)
    handles, labels = ax.get_legend_handles_labels()
    top = ax  # the axes drawn last, which the legend goes on
    if history.val_psnr:
        twin = top = ax.twinx()
        psnr = [v for _, v in history.val_psnr]
        line = twin.plot([s for s, _ in history.val_psnr], psnr, "o-", color="tab:orange", label="val/psnr")
        twin.set_ylabel("val PSNR (dB)")
        limits = psnr_axis_limits(psnr)
        if limits is not None:
            twin.set_ylim(*limits)
        twin.ticklabel_format(axis="y", useOffset=False)
        handles, labels = handles + line, [*labels, "val/psnr"]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss")
    finite = [v for _, v in history.losses if math.isfinite(v)]
    if finite and min(finite) > 0:  # a GAN term can make the total negative: log scale only when it can
        ax.set_yscale("log")
    what = "train/loss and val/psnr" if history.val_psnr else "train/loss"
    ax.set_title(f"{name}: {what}, steps {steps[0]}-{steps[-1]}", pad=22)
    # Above the plot, between it and the title: inside, the curves of either axis would run under it.
    top.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
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
