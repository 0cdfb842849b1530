"""What trains and how: full loss, decoder/encoder-only, LoRA, lr groups, EMA, NaN handling, logging."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import fit, reference_weights
from tests.test_losses import random_vgg16_state
from tokenizer_posttrain.callbacks import LearningRateLogger
from tokenizer_posttrain.config import LoRAConfig, LossConfig, ModelConfig, OptimConfig, PerceptualConfig
from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.export import export_tokenizer
from tokenizer_posttrain.model import TokenizerModel
from tokenizer_posttrain.optim import build_optimizer, lr_factor, param_groups
from tokenizer_posttrain.step_scalars import NonFiniteLossError


def tiny(name: str = "DV8x16x16", **model_kw) -> ModelConfig:  # noqa: ANN003
    return ModelConfig(model=name, jit_ckpt_pth=str(reference_weights(name)), channels=16, **model_kw)


def no_vgg() -> LossConfig:
    return LossConfig(perceptual_weight=0.0)


def snapshot(module: TokenizerModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.network.state_dict().items()}


@pytest.fixture(scope="module")
def vgg_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vgg") / "vgg16-397923af.pth"
    torch.save(random_vgg16_state(), path)
    return path


def test_full_loss_is_l1_plus_weighted_perceptual(vgg_file: Path) -> None:
    loss = LossConfig(perceptual_weight=0.1, perceptual=PerceptualConfig(weights_path=str(vgg_file)))
    module = TokenizerModel(tiny(), loss=loss)
    assert not any(k.startswith("_perceptual") or "vgg" in k for k in module.state_dict())  # not checkpointed
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        terms = module.losses(module.network(video), video, torch.ones(1, 1, 9, 32, 32))
    assert terms["perceptual"] > 0 and terms["l1"] > 0
    torch.testing.assert_close(terms["loss"], terms["l1"] + 0.1 * terms["perceptual"])


def test_missing_vgg_file_is_explained(tmp_path: Path) -> None:
    loss = LossConfig(perceptual=PerceptualConfig(weights_path=str(tmp_path / "nope.pth")))
    with pytest.raises(FileNotFoundError, match="loss.perceptual_weight=0"):
        TokenizerModel(tiny(), loss=loss)


@pytest.mark.parametrize(
    "trainable, frozen, moving", [("decoder", "encoder.", "decoder."), ("encoder", "decoder.", "encoder.")]
)
def test_one_side_training_leaves_the_other_bit_identical(
    tmp_path: Path, trainable: str, frozen: str, moving: str
) -> None:
    module = TokenizerModel(tiny(trainable=trainable), OptimConfig(lr=1e-3), no_vgg())
    before = snapshot(module)
    fit(module, tmp_path)
    after = module.network.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(frozen))
    assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(moving))
    if trainable == "decoder":  # the latent space is untouched: the same clip gives the same tokens
        video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
        fresh = TokenizerModel(tiny(), loss=no_vgg()).network.eval()
        with torch.no_grad():
            assert torch.equal(module.network.eval().encode(video)[0], fresh.encode(video)[0])


def test_lora_trains_adapters_only_and_exports_merged(tmp_path: Path) -> None:
    module = TokenizerModel(
        tiny("CV8x8x8", lora=LoRAConfig(rank=4, targets=["decoder.*"])), OptimConfig(lr=1e-2), no_vgg()
    )
    assert module.trainable_names and all(".lora_" in n and n.startswith("decoder.") for n in module.trainable_names)
    base = {k: v for k, v in snapshot(module).items() if ".lora_" not in k}
    fit(module, tmp_path)
    state = module.network.state_dict()
    assert all(torch.equal(base[k], state[k]) for k in base)  # base weights untouched
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        adapted = module.network.eval()(video)
    folder = export_tokenizer(module.network, tmp_path / "export")
    exported = torch.jit.load(str(folder / "autoencoder.jit"))
    assert not any(".lora_" in k for k in exported.state_dict())  # official keys: nothing extra needed
    with torch.no_grad():
        torch.testing.assert_close(
            exported(video)[0], adapted, rtol=1e-3, atol=1e-4
        )  # merged weights round differently


def test_lora_checkpoint_loads_merged(tmp_path: Path) -> None:
    from tokenizer_posttrain.checkpoint import load_tokenizer

    module = TokenizerModel(tiny("CV8x8x8", lora=LoRAConfig(rank=2, alpha=4.0)), OptimConfig(lr=1e-2), no_vgg())
    trainer = fit(module, tmp_path, steps=2)
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    loaded = load_tokenizer(tmp_path / "lora.ckpt").eval()
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(video), module.network.eval()(video), rtol=1e-3, atol=1e-4
        )  # merged weights round differently


def test_lr_groups_and_schedules() -> None:
    net = TokenizerModel(tiny(), loss=no_vgg()).network
    groups = {g["name"]: g for g in param_groups(net, 1e-4, {"decoder.": 2e-4, "decoder.up.0.": 3e-4})}
    assert groups["decoder.up.0."]["lr"] == 3e-4 and groups["decoder."]["lr"] == 2e-4
    assert groups["default"]["lr"] == 1e-4
    assert sum(len(g["params"]) for g in groups.values()) == len(list(net.parameters()))
    assert all(
        n.startswith("decoder.up.0.")
        for n, p in net.named_parameters()
        if any(p is q for q in groups["decoder.up.0."]["params"])
    )
    with pytest.raises(ValueError, match="match no trainable parameter"):
        param_groups(net, 1e-4, {"decodr.": 1e-3})
    assert [lr_factor(s, 4, "constant", 20, 0.0) for s in (0, 3, 10)] == [0.25, 1.0, 1.0]
    assert lr_factor(4, 4, "cosine", 20, 0.0) == pytest.approx(1.0)
    assert lr_factor(12, 4, "cosine", 20, 0.0) == pytest.approx(0.5)
    assert lr_factor(20, 4, "cosine", 20, 0.1) == pytest.approx(0.1)
    assert lr_factor(12, 4, "linear", 20, 0.0) == pytest.approx(0.5)


def test_ema_weights_are_the_exponential_average(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), no_vgg())
    history: list[dict[str, torch.Tensor]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            history.append({k: v.detach().clone() for k, v in pl_module.network.named_parameters()})

    fit(module, tmp_path, steps=3, callbacks=[Record(), EMAWeightAveraging(decay=0.5, use_buffers=False)])
    expected = dict(history[0])
    for weights in history[1:]:
        expected = {k: 0.5 * expected[k] + 0.5 * weights[k] for k in expected}
    final = dict(module.network.named_parameters())
    name = "decoder.conv_out.0.conv3d.weight"
    torch.testing.assert_close(final[name].detach(), expected[name])
    assert not torch.equal(final[name].detach(), history[-1][name])


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
    assert module.bad_steps == 0 and all(
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


def test_cosine_schedule_reaches_the_optimizer(tmp_path: Path) -> None:
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=1), no_vgg())
    trainer = fit(module, tmp_path, steps=3)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 2)), abs=1e-12)


def test_rng_states_travel_with_checkpoints() -> None:
    import random

    import numpy as np

    from tokenizer_posttrain.callbacks import RngState

    callback, checkpoint = RngState(), {}
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    callback.on_save_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    callback.on_load_checkpoint(None, None, checkpoint)  # type: ignore[arg-type]
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


class _Recorder(pl.loggers.Logger):
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


def fit_logged(module: TokenizerModel, tmp_path: Path, callback: pl.Callback) -> tuple[pl.Trainer, _Recorder]:
    """4 optimizer steps of 2 micro-batches each, logged every 2 steps into a recorder."""
    recorder = _Recorder()
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
    assert module.loss_history == [(step, logged[step]["train/loss"]) for step in (1, 3)]
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
    recorder = _Recorder()
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
    module._to_host.push(4, {"train/grad_norm": torch.tensor(float("nan"))})
    checkpoint: dict = {}
    with pytest.warns(UserWarning, match="step 4: gradient norm is nan"):
        module.on_save_checkpoint(checkpoint)
    assert checkpoint  # the save went through
    with pytest.raises(NonFiniteLossError, match="1 steps in a row"):
        module.on_train_end()


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
