"""The step guard: scalars read back a step late, NaN/Inf steps skipped and counted, the stop after too many."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import fit
from tests.training.conftest import no_vgg, snapshot, tiny
from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.training.config import OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.optim import build_optimizer
from tokenizer_posttrain.training.step_guard import (
    DeviceScalars,
    NonFiniteLossError,
    NonFiniteSteps,
    grad_norm,
    skip_flag,
)


def test_scalars_come_back_in_order_keeping_the_newest_back() -> None:
    queue = DeviceScalars()
    queue.push(0, {"a": torch.tensor(1.5), "b": torch.tensor([2.0], dtype=torch.bfloat16)})
    queue.push(1, {"a": torch.tensor(float("nan")), "b": torch.tensor(3)})
    assert queue.pop(keep_last=1) == [(0, {"a": 1.5, "b": 2.0})]
    assert queue.pop(keep_last=1) == []
    ((step, values),) = queue.pop()
    assert step == 1 and math.isnan(values["a"]) and values["b"] == 3.0
    assert queue.pop() == []


def test_skip_flag_is_fused_adamws_found_inf() -> None:
    flags = [float(skip_flag(torch.tensor(v))) for v in (1.0, float("nan"), float("inf"), 0.0)]
    assert flags == [0.0, 1.0, 1.0, 0.0]


def test_non_finite_steps_count_in_a_row_and_stop() -> None:
    steps = NonFiniteSteps(max_in_a_row=2)
    with pytest.warns(UserWarning, match="step 3: gradient norm is nan; step skipped \\(1 in a row\\)"):
        assert steps.check(3, float("nan"))
    assert not steps.check(4, 0.5) and steps.in_a_row == 0
    with pytest.warns(UserWarning):
        assert steps.check(5, float("inf"))
    with (
        pytest.raises(NonFiniteLossError, match="2 steps in a row .*trainer.max_bad_steps=2"),
        pytest.warns(UserWarning),
    ):
        steps.check(6, float("nan"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scalars_cross_from_a_gpu_through_pinned_copies() -> None:
    queue = DeviceScalars()
    x = torch.randn(4096, 4096, device="cuda")
    for step in range(3):
        queue.push(step, {"sum": (x @ x).sum() * 0 + step, "nan": torch.tensor(float("nan"), device="cuda")})
    # A pinned copy behind an event per step, read back in order with the right values.
    popped = queue.pop(keep_last=1) + queue.pop()
    assert [step for step, _ in popped] == [0, 1, 2]
    assert [values["sum"] for _, values in popped] == [0.0, 1.0, 2.0]
    assert all(math.isnan(values["nan"]) for _, values in popped)


def test_grad_norm_is_fp32_whatever_the_gradient_dtype() -> None:
    grads = [torch.full((300,), 0.01, dtype=torch.bfloat16), torch.full((7, 3), -2.0)]
    norm = grad_norm(grads)
    expected = (300 * float(torch.tensor(0.01, dtype=torch.bfloat16)) ** 2 + 21 * 4.0) ** 0.5
    assert norm.dtype == torch.float32 and norm.shape == ()
    assert float(norm) == pytest.approx(expected, rel=1e-6)


class _NaNEvery(SyntheticVideoDataModule):
    """Synthetic clips, with NaN pixels in the clips of chosen batches."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__(frames=9, height=32, width=32, num_workers=0, num_train_samples=8)
        self.bad, self.seen = bad, 0

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        if self.trainer.training:
            if self.seen in self.bad:
                batch[VIDEO] = torch.full_like(batch[VIDEO], float("nan"))
            self.seen += 1
        assert LOSS_MASK in batch
        return batch


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_non_finite_steps_are_skipped_then_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    # CUDA runs use fused AdamW, which skips a step on the device (found_inf) and is read back a step
    # later; the CPU's AdamW skips by dropping the gradients at once. Both must leave weights finite.
    monkeypatch.setattr(
        TokenizerModel,
        "configure_optimizers",
        lambda self: build_optimizer(self.network, self.optim_config, self.trainer.max_steps, fused=fused),
    )
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), no_vgg(), max_bad_steps=3)
    before = snapshot(module)
    with pytest.warns(UserWarning, match="step skipped"):
        trainer = fit(module, tmp_path, steps=3, datamodule=_NaNEvery({0, 1}))  # two bad steps, then a good one
    assert module.guard.nonfinite.in_a_row == 0 and all(
        torch.isfinite(v).all() for v in module.network.state_dict().values() if v.is_floating_point()
    )
    assert any(not torch.equal(before[k], v) for k, v in module.network.state_dict().items())
    optimizer = trainer.optimizers[0]
    assert optimizer.defaults["fused"] is fused
    # One update happened: AdamW's step count (its bias correction) saw none of the skipped steps.
    assert {float(optimizer.state[p]["step"]) for p in module.network.parameters()} == {1.0}
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), no_vgg(), max_bad_steps=3)
    with pytest.raises(NonFiniteLossError, match="3 steps in a row"), pytest.warns(UserWarning):
        fit(module, tmp_path, steps=5, datamodule=_NaNEvery({0, 1, 2, 3}))
    assert all(torch.isfinite(v).all() for v in module.network.state_dict().values() if v.is_floating_point())


class Recorder(pl.loggers.Logger):
    """Keeps what reaches a logger: ``(step, {name: value})`` per call."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: object, *args: object, **kwargs: object) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((int(step or 0), dict(metrics)))


def fit_logged(module: TokenizerModel, tmp_path: Path, callback: pl.Callback) -> tuple[pl.Trainer, Recorder]:
    """4 optimizer steps of 2 micro-batches each, logged every 2 steps into a recorder."""
    recorder = Recorder()
    trainer = fit(
        module, tmp_path, steps=4, callbacks=[callback], logger=recorder, accumulate_grad_batches=2, log_every_n_steps=2
    )
    return trainer, recorder


def test_step_scalars_reach_the_loggers_as_the_mean_over_micro_batches(tmp_path: Path) -> None:
    # The losses and gradient norm travel to the host a step late (no GPU wait); they must still be
    # logged at Lightning's cadence, under the step they belong to, as the optimizer step's mean.
    micro: list[float] = []

    class MicroLosses(pl.Callback):
        def on_train_batch_end(
            self, trainer: pl.Trainer, module: pl.LightningModule, outputs: dict, *_: object
        ) -> None:
            micro.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)  # Lightning divides it

    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), no_vgg())
    trainer, recorder = fit_logged(module, tmp_path, MicroLosses())
    logged = {step: row for step, row in recorder.rows if "train/loss" in row}
    assert sorted(logged) == [1, 3]  # where Lightning logs its own metrics with log_every_n_steps=2
    for step, row in logged.items():
        mean = (micro[2 * step] + micro[2 * step + 1]) / 2
        assert row["train/loss"] == pytest.approx(mean, rel=1e-5)
        assert row["train/l1"] == pytest.approx(mean, rel=1e-5)  # no perceptual term
        assert row["train/grad_norm"] > 0
    assert module.guard.loss_history == [(step, logged[step]["train/loss"]) for step in (1, 3)]
    # The progress bar shows a value already on the host (on a CPU, read back at once: the last one).
    assert trainer.progress_bar_metrics["train/loss"] == pytest.approx(logged[3]["train/loss"], rel=1e-5)


def test_with_the_fused_optimizer_steps_read_late_are_all_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CUDA runs (fused AdamW) read each step's scalars one step late; a checkpoint and the end of the
    # run must flush what is still pending, so no step goes missing from the logs.
    monkeypatch.setattr(
        TokenizerModel,
        "configure_optimizers",
        lambda self: build_optimizer(self.network, self.optim_config, self.trainer.max_steps, fused=True),
    )
    recorder = Recorder()
    at_save: list[list[int]] = []

    class SaveAtStep1(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *_: object) -> None:
            if trainer.global_step == 2:  # after optimizer step 1
                logged_before = [step for step, row in recorder.rows if "train/loss" in row]
                module.on_save_checkpoint({})
                at_save.append(logged_before + [-1] + [s for s, r in recorder.rows if "train/loss" in r])

    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), no_vgg())
    fit(module, tmp_path, steps=4, callbacks=[SaveAtStep1()], logger=recorder, log_every_n_steps=1)
    assert at_save == [[0, -1, 0, 1]]  # step 1 was pending, and the checkpoint flushed it
    assert [step for step, row in recorder.rows if "train/loss" in row] == [0, 1, 2, 3]  # step 3 at the end


def test_a_nan_stop_found_while_saving_a_checkpoint_waits_for_the_next_step() -> None:
    # Raised inside on_save_checkpoint, the stop would break the save and, on preemption, Lightning's
    # own SIGTERM handling; it is raised at the next step (or the end of the run) instead.
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), no_vgg(), max_bad_steps=1)
    module.guard.to_host.push(4, {"train/grad_norm": torch.tensor(float("nan"))})
    checkpoint: dict = {}
    with pytest.warns(UserWarning, match="step 4: gradient norm is nan"):
        module.on_save_checkpoint(checkpoint)
    assert checkpoint  # the save went through
    with pytest.raises(NonFiniteLossError, match="1 steps in a row"):
        module.on_train_end()
