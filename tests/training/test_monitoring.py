"""What a run reports: learning rates per group, CSV curves, validation videos, wandb offline runs, progress in a
terminal and in a log file, the summary and loss curve over every launch of a run."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest

from tests.conftest import fit, read_metrics, run_cli_here
from tests.training.conftest import no_vgg, tiny
from tests.training.test_checkpointing import ARGS
from tests.training.test_step_guard import Recorder, fit_logged
from tokenizer_posttrain.core.progress import INTERVAL_ENV
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.training.config import OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.monitoring import (
    LearningRateLogger,
    StepProgressBar,
    ThroughputMonitor,
    psnr_axis_limits,
    read_history,
)


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


def _screen_lines(screen: str) -> list[str]:
    """What a terminal shows line by line of a Rich bar's output: escape sequences out, split at CR and LF."""
    return [line for line in re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)) if line.strip()]


def test_the_progress_bar_counts_optimizer_steps_and_fits_80_columns(tmp_path: Path) -> None:
    # 3 optimizer steps of 4 accumulated micro-batches: Lightning's bar said 12/12, a count max_steps never gives.
    # At 80 columns it wrapped each redraw into a block of 6 lines (v_num: 0.000, train/loss: over two lines).
    screen = io.StringIO()
    bar = StepProgressBar(console_kwargs={"file": screen, "force_terminal": True, "width": 80})
    module = TokenizerModel(tiny("CV8x8x8"), loss=no_vgg())
    fit(module, tmp_path, steps=3, callbacks=[bar, ThroughputMonitor()], enable_progress_bar=True,
        accumulate_grad_batches=4, log_every_n_steps=1, logger=Recorder())  # fmt: skip
    task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
    assert (task.total, task.completed) == (3, 3)
    assert task.fields == {"unit": "steps", "micro": "4/4"}
    shown = screen.getvalue()
    lines = _screen_lines(shown)
    assert "\x1b[1A" not in shown, lines[-6:]  # one row: Rich never moved the cursor up to redraw a block
    assert max(len(line) for line in lines) <= 80, lines[-6:]
    assert "v_num" not in shown and "Epoch" not in shown
    assert any(line.startswith("train ") and "2/3 steps (micro 2/4) " in line for line in lines), lines
    assert re.search(r"3/3 steps \(micro 4/4\) \d+:\d\d loss \d\.\d+  [\d.]+ clips/s", lines[-1]), lines[-1]


def test_a_run_piped_to_a_log_prints_progress_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # Piped to a file (Slurm, torchrun), the Rich bar printed nothing until the run ended.
    from tests.training.conftest import tiny_run
    from tokenizer_posttrain.training.train import train

    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every step; the default is every 30 s
    validate = {"val_check_interval": 2, "limit_val_batches": 1}
    train(**tiny_run(tmp_path, steps=3, trainer=validate))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert "\r" not in out and "\x1b" not in out
    assert lines[0] == "[train] 0/3 steps | elapsed 0:00"
    assert re.fullmatch(r"\[train\] 1/3 steps \| loss [\d.]+ \| elapsed \d:\d\d", lines[1]), lines
    progress = r"\| loss [\d.]+ \| clips/s [\d.]+ \| data wait [\d.]+ s \| elapsed \d:\d\d"
    assert re.fullmatch(rf"\[train\] 2/3 steps {progress} \| ETA \d:\d\d", lines[2]), lines
    assert re.fullmatch(r"\[val\] step 2 \| .*\| psnr [\d.]+ \| .*took \d:\d\d", lines[3]), lines
    assert re.fullmatch(rf"\[train\] 3/3 steps {progress}", lines[4]), lines
    assert "Run finished at step 3 (3 steps in " in out

    # A resumed launch at the default interval: its first line at once, then none for 30 s (the run is shorter).
    monkeypatch.delenv(INTERVAL_ENV)
    train(**tiny_run(tmp_path, steps=6, trainer=validate))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[train]")]
    assert lines[0] == "[train] 3/6 steps | elapsed 0:00" and lines[1].startswith("[train] 4/6 steps | loss ")
    assert len(lines) == 2, lines
    assert "Run finished at step 6 (this launch: steps 3-6 in " in out
    # The loss curve and the summary cover the whole run, from every launch's metrics.csv.
    history = read_history(tmp_path / "run")
    # Steps counted as the checkpoints and the [val] lines count them (metrics.csv's step is 0-based).
    assert [step for step, _ in history.losses] == [1, 2, 3, 4, 5, 6] and history.launches == [0, 3]
    logged = read_metrics(tmp_path / "run")
    assert history.losses == [(int(r["step"]) + 1, float(r["train/loss"])) for r in logged if r["train/loss"]]
    assert [step for step, _ in history.val_psnr] == [2, 4, 6]
    assert "[val] step 6 |" in out and "dB at step 6\n" in out
    assert f"loss curve: {tmp_path / 'run' / 'loss_curve.png'} (steps 1-6)" in out
    assert "train/loss over the run: " in out and "(mean of the first 3 logged steps)" in out


def _write_metrics(path: Path, rows: list[dict[str, object]]) -> None:
    path.mkdir(parents=True)
    keys = ["epoch", "step", "train/loss", "val/psnr"]
    text = ",".join(keys) + "\n" + "".join(",".join(str(row.get(k, "")) for k in keys) + "\n" for row in rows)
    (path / "metrics.csv").write_text(text)


def test_the_history_keeps_what_the_resumed_launch_logged_again(tmp_path: Path) -> None:
    # Launch 0 logged steps 0-5 but saved its checkpoint at step 3 before it was stopped; launch 1 did 3-7 again.
    _write_metrics(tmp_path / "csv" / "version_0", [{"step": s, "train/loss": 10 + s} for s in range(6)])
    _write_metrics(
        tmp_path / "csv" / "version_1",
        [{"step": s, "train/loss": 20 + s} for s in range(3, 8)] + [{"step": 7, "val/psnr": 30.5}],
    )
    (tmp_path / "csv" / "version_2").mkdir()  # a launch that stopped before it logged anything
    history = read_history(tmp_path)
    assert history.losses == [(1, 10.0), (2, 11.0), (3, 12.0), (4, 23.0), (5, 24.0), (6, 25.0), (7, 26.0), (8, 27.0)]
    assert history.val_psnr == [(8, 30.5)] and history.launches == [0, 3]


def test_the_psnr_axis_spans_at_least_a_decibel() -> None:
    # It zoomed into 0.005 dB, so noise looked like a cliff.
    assert psnr_axis_limits([30.001, 30.006]) == pytest.approx((29.5035, 30.5035))
    assert psnr_axis_limits([28.0, 31.0]) is None


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
