"""TokenizerModel: strict loading, fp32 master weights under bf16 autocast, the loss it trains on, EMA."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from tests.conftest import fit, reference_weights
from tests.training.conftest import no_vgg, tiny
from tests.training.test_step_guard import Recorder
from tokenizer_posttrain.losses.perceptual import PerceptualConfig
from tokenizer_posttrain.training.config import LossConfig, ModelConfig, OptimConfig
from tokenizer_posttrain.training.module import TokenizerModel


def test_loads_checkpoint_strictly_and_keeps_fp32() -> None:
    model = TokenizerModel(
        ModelConfig(model="CV8x8x8", jit_ckpt_pth=str(reference_weights("CV8x8x8")), channels=16), loss=no_vgg()
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="this is a CV8x8x8"):
        TokenizerModel(
            ModelConfig(model="DV8x16x16", jit_ckpt_pth=str(reference_weights("CV8x8x8")), channels=16), loss=no_vgg()
        )


def test_a_checkpoint_of_another_width_names_the_override_that_fixes_it() -> None:
    with pytest.raises(
        ValueError, match=r"CV8x8x8 \(channels=16\) checkpoint, you asked for CV8x8x8: set model.channels=16\."
    ):
        TokenizerModel(ModelConfig(model="CV8x8x8", jit_ckpt_pth=str(reference_weights("CV8x8x8"))), loss=no_vgg())


def test_random_init_warns() -> None:
    with pytest.warns(UserWarning, match="RANDOM weights"):
        TokenizerModel(ModelConfig(model="CV8x8x8", channels=16), loss=no_vgg())


def test_small_lr_steps_under_bf16_mixed_change_the_fp32_weights(tmp_path) -> None:
    model = TokenizerModel(
        ModelConfig(model="DV8x16x16", jit_ckpt_pth=str(reference_weights("DV8x16x16")), channels=16),
        OptimConfig(lr=1e-5),
        no_vgg(),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32)
    with torch.no_grad():
        loss_before = model.losses(model.network(video), video, mask)["loss"]
    fit(model, tmp_path, steps=3)
    after = model.state_dict()
    assert all(v.dtype == torch.float32 for k, v in after.items() if k.endswith("conv3d.weight"))
    changed = [k for k in before if before[k].is_floating_point() and not torch.equal(before[k], after[k])]
    # 1e-5 updates survive in fp32 masters (they round away in bf16 weights)
    assert len(changed) > 0.9 * sum(1 for k, v in before.items() if k.endswith(".weight"))
    with torch.no_grad():
        assert model.losses(model.network(video), video, mask)["loss"] != loss_before


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
    with pytest.raises(FileNotFoundError, match="loss.perceptual.weight=0"):
        TokenizerModel(tiny(), loss=loss)


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


def test_a_scheduled_term_joins_the_loss_at_its_boundary(tmp_path: Path, vgg_file: Path) -> None:
    # Weight 0 before optimizer step 2, then 0.1: steps 0 and 1 train on L1 alone (no VGG built), 2 and 3 on both.
    perceptual = PerceptualConfig(boundaries=[2], values=[0.0, 0.1], weights_path=str(vgg_file))
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), LossConfig(perceptual=perceptual))
    assert module.loss.vgg is not None and module.loss.vgg.network is None
    recorder = Recorder()
    fit(module, tmp_path, steps=4, logger=recorder, log_every_n_steps=1)
    terms = {step: set(row) for step, row in recorder.rows if "train/loss" in row}
    assert [("train/perceptual" in terms[step]) for step in range(4)] == [False, False, True, True]
    assert module.loss.vgg.network is not None


def test_with_gradient_accumulation_a_schedule_counts_optimizer_steps_not_batches(tmp_path: Path) -> None:
    from tokenizer_posttrain.losses.high_freq import HighFreqConfig

    # On from optimizer step 2; 2 batches per step: batches 0-3 (steps 0, 1) without the term, 4-7 with it. A
    # schedule read on the batch index (NeMo's) would switch at batch 2.
    loss = LossConfig(perceptual_weight=0.0, high_freq=HighFreqConfig(boundaries=[2], values=[0.0, 0.5]))
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), loss)
    seen: list[tuple[int, dict[str, float]]] = []
    prepare = module.loss.prepare

    def recorded(step: int, device: torch.device) -> dict[str, float]:
        weights = prepare(step, device)
        seen.append((step, dict(weights)))
        return weights

    module.loss.prepare = recorded  # type: ignore[method-assign]
    fit(module, tmp_path, steps=4, accumulate_grad_batches=2)
    assert [step for step, _ in seen] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [weights.get("high_freq", 0.0) for _, weights in seen] == [0.0] * 4 + [0.5] * 4


def assert_frozen_and_left_out(frozen: nn.Module, module: TokenizerModel, trainer: pl.Trainer, ckpt: Path) -> None:
    """``frozen`` (a loss network, once built) gets no gradient and is in none of what DDP registers and broadcasts
    (``module.parameters()``, ``module.buffers()``), the optimizer, the state dict or a saved checkpoint."""
    params = list(frozen.parameters())
    assert params and all(not p.requires_grad and p.grad is None for p in params)
    assert not {id(p) for p in module.parameters()} & {id(p) for p in params}
    assert not {id(b) for b in module.buffers()} & {id(b) for b in frozen.buffers()}
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in params}
    assert all(key.startswith("network.") for key in module.state_dict())
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert saved and all(key.startswith("network.") for key in saved)


def test_the_flow_term_trains_the_tokenizer_and_raft_stays_out_of_checkpoints_and_optimizer(tmp_path: Path) -> None:
    from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
    from tokenizer_posttrain.losses.flow import RAFT_FILES, FlowConfig, build_raft

    raft_file = tmp_path / RAFT_FILES["small"]
    torch.manual_seed(0)
    torch.save(build_raft("small").state_dict(), raft_file)
    flow = FlowConfig(0.5, raft="small", weights_path=str(raft_file), scale=1, flow_updates=2)
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), LossConfig(perceptual_weight=0.0, flow=flow))
    recorder = Recorder()
    clips = SyntheticVideoDataModule(frames=9, height=128, width=128, num_workers=0, num_train_samples=4)
    trainer = fit(module, tmp_path, steps=2, logger=recorder, log_every_n_steps=1, datamodule=clips)
    logged = [row for _, row in recorder.rows if "train/loss" in row]
    assert len(logged) == 2 and all(row["train/flow"] > 0 for row in logged)
    raft = module.loss.terms["flow"].network
    assert {p.dtype for p in raft.parameters()} == {torch.bfloat16} and not raft.training
    assert_frozen_and_left_out(raft, module, trainer, tmp_path / "flow.ckpt")


def test_the_vgg16_once_built_stays_out_of_ddp_the_optimizer_and_checkpoints(tmp_path: Path, vgg_file: Path) -> None:
    # The check of test_full_loss_is_l1_plus_weighted_perceptual runs before the VGG16 exists; this one after a
    # training step built it, when a network held by the module would have joined its parameters and state dict.
    perceptual = PerceptualConfig(0.1, weights_path=str(vgg_file))
    module = TokenizerModel(tiny("CV8x8x8"), OptimConfig(lr=1e-3), LossConfig(perceptual=perceptual))
    recorder = Recorder()
    trainer = fit(module, tmp_path, steps=1, logger=recorder, log_every_n_steps=1)
    assert [row["train/perceptual"] > 0 for _, row in recorder.rows if "train/loss" in row] == [True]
    assert module.loss.vgg is not None and module.loss.vgg.network is not None
    vgg = module.loss.vgg.network
    assert len(list(vgg.parameters())) == 26
    assert_frozen_and_left_out(vgg, module, trainer, tmp_path / "vgg.ckpt")


def test_validation_logs_each_active_term_as_val_name(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
    from tokenizer_posttrain.data.fake import SyntheticVideoDataset
    from tokenizer_posttrain.losses.high_freq import HighFreqConfig, masked_laplacian_l1

    # The Laplacian L1: the cheapest term beside L1 (no network, no file).
    loss = LossConfig(perceptual_weight=0.0, high_freq=HighFreqConfig(0.5))
    module = TokenizerModel(tiny("CV8x8x8"), loss=loss)
    clips = DataLoader(SyntheticVideoDataset(1, frames=9, height=32, width=32), batch_size=1)
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", precision="32-true", logger=recorder, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.validate(module, clips, verbose=False)
    logged = {name: value for _, row in recorder.rows for name, value in row.items()}
    assert {"val/l1", "val/high_freq", "val/loss"} <= logged.keys()
    batch = next(iter(clips))
    video, mask = batch[VIDEO].float(), batch[LOSS_MASK]
    with torch.no_grad():
        expected = masked_laplacian_l1(module.network(video), video, mask)
    assert expected > 0  # the reconstruction differs from the input: a zeroed or constant value cannot match
    assert logged["val/high_freq"] == pytest.approx(expected.item(), rel=1e-5)
    assert logged["val/loss"] == pytest.approx(logged["val/l1"] + 0.5 * logged["val/high_freq"], rel=1e-5)


def test_latent_noise_is_off_at_weight_0_and_scaled_by_each_channel_s_spread() -> None:
    from tokenizer_posttrain.network import Encoding
    from tokenizer_posttrain.network.wan21.registry import WAN21_LATENT_STD
    from tokenizer_posttrain.training.config import DataConfig, LatentNoiseConfig
    from tokenizer_posttrain.training.train import check_clip_shape

    latent = torch.zeros(4, 16, 8, 32, 32)
    plain = TokenizerModel(ModelConfig(model="Wan2.1-VAE", channels=8), loss=no_vgg()).train()
    assert plain._decoded(Encoding(latent)) is latent
    noisy = ModelConfig(model="Wan2.1-VAE", channels=8, latent_noise=LatentNoiseConfig(weight=0.2))
    module = TokenizerModel(noisy, loss=no_vgg()).train()
    torch.manual_seed(0)
    seen = module._decoded(Encoding(latent))
    # 32768 values a channel: the measured std is within 2% of 0.2 x the channel's constant.
    measured = seen.transpose(0, 1).flatten(1).std(dim=1)
    torch.testing.assert_close(measured, 0.2 * torch.tensor(WAN21_LATENT_STD), rtol=0.02, atol=0)
    assert module.eval()._decoded(Encoding(latent)) is latent  # validation and inference decode the latent
    with pytest.raises(ValueError, match="model.latent_noise: Cosmos-1.0-Tokenizer-DV8x16x16 decodes discrete"):
        check_clip_shape(ModelConfig(model="DV8x16x16", latent_noise=LatentNoiseConfig(weight=0.1)), DataConfig())
    with pytest.raises(ValueError, match=r"model.latent_noise.weight=-1.0 must be finite and >= 0"):
        ModelConfig(latent_noise=LatentNoiseConfig(weight=-1.0))
