"""What a run reports: learning rates per group, CSV curves, validation videos, wandb offline runs."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from tests.conftest import fit, read_metrics, run_cli_here
from tests.training.conftest import no_vgg, tiny
from tests.training.test_checkpointing import ARGS
from tests.training.test_step_guard import Recorder, fit_logged
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.training.config import OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.monitoring import LearningRateLogger, StepProgressBar, ThroughputMonitor


def test_learning_rates_are_logged_per_group_at_the_loss_steps(tmp_path: Path) -> None:
    # Logged from the host's copy of the schedule (Lightning's monitor copies each rate to the GPU),
    # once per optimizer step, under the step whose update used that rate.
    optim = OptimConfig(lr=1e-3, warmup_steps=4, lr_groups={"decoder.": 2e-3})
    module = TokenizerModel(tiny("CV8x8x8"), optim, no_vgg())
    _, recorder = fit_logged(module, tmp_path, LearningRateLogger())
    rates = [(step, row) for step, row in recorder.rows if any(k.startswith("lr-") for k in row)]
    assert [step for step, _ in rates] == [1, 3]
    for step, row in rates:
        warmup = (step + 1) / 4
        assert row == pytest.approx({"lr-AdamW/default": 1e-3 * warmup, "lr-AdamW/decoder.": 2e-3 * warmup})


def test_the_progress_bar_counts_optimizer_steps_with_the_micro_batches_beside(tmp_path: Path) -> None:
    # 3 optimizer steps of 4 accumulated micro-batches: Lightning's bar said 12/12, a count max_steps never gives.
    screen = io.StringIO()
    bar = StepProgressBar(console_kwargs={"file": screen, "force_terminal": True, "width": 200})
    module = TokenizerModel(tiny("CV8x8x8"), loss=no_vgg())
    fit(module, tmp_path, steps=3, callbacks=[bar], enable_progress_bar=True, accumulate_grad_batches=4)
    task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
    assert (task.total, task.completed) == (3, 3)
    assert task.fields == {"unit": "steps", "micro": "12/12"}
    shown = screen.getvalue()
    assert "3/3 steps (12/12 micro-batches)" in shown, shown[-2000:]
    assert "2/3 steps (8/12 micro-batches)" in shown and "12/12 steps" not in shown
    assert "steps/s" in shown


def test_logs_curves_videos_and_wandb_offline(tmp_path: Path) -> None:
    env = {"WANDB_API_KEY": "x" * 40, "WANDB_MODE": "offline", "WANDB_PROJECT_NAME": "tp-test", "WANDB_RUN_ID": "r1"}
    result = run_cli_here(
        *ARGS,
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "optim.warmup_steps=2",
        f"log.log_dir={tmp_path}",
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "tiny_cv8x8x8"
    rows = read_metrics(run_dir)
    logged = {k for r in rows for k, v in r.items() if v}
    for key in ("train/loss", "train/l1", "train/grad_norm", "train/clips_per_sec", "val/psnr", "val/ssim", "val/loss"):
        assert key in logged, key
    assert any(k.startswith("lr-AdamW") for k in logged)
    assert sorted(p.name for p in (run_dir / "val_videos").iterdir()) == ["step0000002.mp4", "step0000004.mp4"]
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert "best val/psnr" in result.stdout and "checkpoints:" in result.stdout
    assert list((run_dir / "wandb").glob("offline-run-*"))


class _Module:
    """What SkippedSamples uses of a LightningModule: ``log``."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, name: str, value: float, **_: object) -> None:
        self.logged[name] = value


def _skip_batch(skipped: list[str], clips: int = 1) -> dict:
    import torch

    from tokenizer_posttrain.data.batch import SKIPPED, VIDEO

    return {VIDEO: torch.zeros(clips, 3, 1, 2, 2), SKIPPED: skipped}


def test_a_damaged_shard_is_named_once_and_its_samples_counted(capsys: pytest.CaptureFixture) -> None:
    from types import SimpleNamespace

    from tokenizer_posttrain.core.errors import DataError
    from tokenizer_posttrain.training.monitoring import SkippedSamples

    report = "train.tar: damaged tar shard (ReadError: unexpected end of data): sample 5 of 10 cannot be read, ..."
    later = [f"train.tar#{n}: in the damaged part of its tar shard (from sample 5 on)" for n in range(6, 11)]
    callback, module, trainer = SkippedSamples(max_fraction=0.5), _Module(), SimpleNamespace(global_rank=0)
    callback.on_train_batch_start(trainer, module, _skip_batch([report, *later, "a.tar:short: 4 frames"], 8), 0)
    out = capsys.readouterr().out
    assert f"[rank 0] warning: {report}" in out and "data/skipped_samples" in out
    assert "[rank 0] skipped video a.tar:short: 4 frames" in out
    assert "#6" not in out  # the lost samples are counted, not listed one by one
    assert callback.damaged == {"train.tar": 6}
    assert module.logged == {"data/skipped_samples": 7.0, "data/damaged_shards": 1.0}
    callback.on_train_batch_start(trainer, module, _skip_batch(later[:2], 8), 1)
    assert capsys.readouterr().out == ""
    callback.on_train_end(trainer, module)
    summary = capsys.readouterr().out
    assert "skipped 9 samples (8 of them in 1 damaged tar shard(s): train.tar: 8; 1 unusable videos)" in summary
    # the lost samples of damaged shards do not count towards the fraction of unusable videos
    callback.on_train_batch_start(trainer, module, _skip_batch(later * 10, 0), 2)
    capsys.readouterr()
    bad = [f"a.tar:bad{i}: unreadable" for i in range(20)]
    with pytest.raises(DataError, match="21 of 37 videos read on rank 0 were unusable, more than") as err:
        callback.on_train_batch_start(trainer, module, _skip_batch(bad, 0), 3)
    assert "a.tar:bad18: unreadable" in str(err.value) and "#7" not in str(err.value)
    assert "(besides, 58 of them in 1 damaged tar shard(s): train.tar: 58; 21 unusable videos)" in str(err.value)


def test_the_skip_limit_counts_videos_when_a_decode_gives_several_clips() -> None:
    from types import SimpleNamespace

    from tokenizer_posttrain.core.errors import DataError
    from tokenizer_posttrain.training.monitoring import SkippedSamples

    # 4 crops per decode: 20 batches of 8 clips are 40 videos read, not 160; with 10 unusable, 10 of 50 > 0.1.
    callback, module, trainer = SkippedSamples(0.1, clips_per_video=4), _Module(), SimpleNamespace(global_rank=0)
    for step in range(20):
        callback.on_train_batch_start(trainer, module, _skip_batch([], 8), step)
    bad = [f"a.tar:bad{i}: unreadable" for i in range(10)]
    with pytest.raises(DataError, match="10 of 50 videos read on rank 0 were unusable"):
        callback.on_train_batch_start(trainer, module, _skip_batch(bad, 0), 20)


class SlowLoader(SyntheticVideoDataModule):
    """The synthetic clips, each batch handed over ``delay`` seconds late (a loader that cannot keep up)."""

    def __init__(self, delay: float) -> None:
        super().__init__(frames=9, height=32, width=32, num_workers=0, num_train_samples=8)
        self.delay = delay

    def train_dataloader(self):  # noqa: ANN201 - any iterable of batches
        loader = super().train_dataloader()

        class Late:
            def __iter__(inner):  # noqa: ANN204, N805
                for batch in loader:
                    time.sleep(self.delay)
                    yield batch

        return Late()


def test_the_loop_s_wait_for_the_loader_is_logged(tmp_path: Path) -> None:
    waits = {}
    for delay in (0.0, 0.25):
        recorder = Recorder()
        module = TokenizerModel(tiny("CV8x8x8"), loss=no_vgg())
        fit(module, tmp_path / str(delay), steps=5, callbacks=[ThroughputMonitor()], logger=recorder,
            log_every_n_steps=1, datamodule=SlowLoader(delay))  # fmt: skip
        logged = [row["train/data_wait"] for _, row in recorder.rows if "train/data_wait" in row]
        assert len(logged) >= 3
        waits[delay] = logged[-1]
    assert waits[0.0] < 0.1
    assert 0.2 < waits[0.25] - waits[0.0] < 0.4


def test_a_gap_with_validation_or_a_checkpoint_save_is_not_counted_as_loader_wait() -> None:
    monitor = ThroughputMonitor()
    monitor._batch_ends.append((time.perf_counter() - 5.0, 1))  # a batch that ended 5 s ago
    for interruption in (monitor.on_validation_end, lambda *_: monitor.on_save_checkpoint(None, None, {})):
        interruption(None, None)
        monitor.on_train_batch_start(None, None, None, 0)  # type: ignore[arg-type]
        assert not monitor._waits
    monitor.on_train_batch_start(None, None, None, 1)  # type: ignore[arg-type]
    assert len(monitor._waits) == 1 and monitor._waits[0] >= 5.0
