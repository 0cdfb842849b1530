"""TokenizerModel: fp32 master weights under bf16 autocast, masked loss, real updates, speed switches."""

import copy
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import fit, reference_weights
from tokenizer_posttrain import model as model_module
from tokenizer_posttrain.config import DataConfig, LossConfig, ModelConfig, OptimConfig
from tokenizer_posttrain.metrics import masked_l1, video_psnr
from tokenizer_posttrain.model import TokenizerModel
from tokenizer_posttrain.network import acceleration
from tokenizer_posttrain.network.acceleration import compile_module_call
from tokenizer_posttrain.network.blocks import ResnetBlock

NO_VGG = LossConfig(perceptual_weight=0.0)


def test_masked_l1_ignores_masked_pixels() -> None:
    target = torch.zeros(1, 3, 2, 4, 4)
    rec = torch.ones_like(target)
    mask = torch.zeros(1, 1, 2, 4, 4)
    mask[:, :, 0] = 1
    rec[:, :, 1] = 100.0  # only in the masked-out frame
    assert masked_l1(rec, target, mask).item() == pytest.approx(1.0)


def test_psnr_of_known_error() -> None:
    target = torch.zeros(2, 3, 1, 8, 8)
    assert video_psnr(target + 0.2, target).item() == pytest.approx(20.0, abs=1e-3)  # error 0.1 on [0, 1]


def test_loads_checkpoint_strictly_and_keeps_fp32() -> None:
    model = TokenizerModel(
        ModelConfig(model="CV8x8x8", jit_ckpt_pth=str(reference_weights("CV8x8x8")), channels=16), loss=NO_VGG
    )
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="this is a CV8x8x8"):
        TokenizerModel(
            ModelConfig(model="DV8x16x16", jit_ckpt_pth=str(reference_weights("CV8x8x8")), channels=16), loss=NO_VGG
        )


def test_random_init_warns() -> None:
    with pytest.warns(UserWarning, match="RANDOM weights"):
        TokenizerModel(ModelConfig(model="CV8x8x8", channels=16), loss=NO_VGG)


def test_small_lr_steps_under_bf16_mixed_change_the_fp32_weights(tmp_path) -> None:
    model = TokenizerModel(
        ModelConfig(model="DV8x16x16", jit_ckpt_pth=str(reference_weights("DV8x16x16")), channels=16),
        OptimConfig(lr=1e-5),
        NO_VGG,
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


def test_speed_switches_are_validated() -> None:
    for key in ("compile", "channels_last", "activation_checkpointing"):
        with pytest.raises(ValueError, match=f"model.{key}='yes': use true or false"):
            ModelConfig(**{key: "yes"})
    with pytest.raises(ValueError, match="model.compile_scope='graph': use step or blocks"):
        ModelConfig(compile_scope="graph")
    with pytest.raises(ValueError, match="data.synthetic_cache='yes': use true or false"):
        DataConfig(synthetic_cache="yes")


@pytest.fixture
def dynamo_config() -> Iterator[None]:
    """Dynamo's global settings as they were before the test, afterwards."""
    with torch._dynamo.config.patch(optimize_ddp=True):
        yield


@pytest.mark.usefixtures("dynamo_config")
@pytest.mark.parametrize("scope", ["step", "blocks"])
def test_speed_switches_keep_keys_and_results_and_train(tmp_path, monkeypatch, scope) -> None:
    # Dynamo's capture with backend="eager": Inductor's code generation would take minutes on a CPU
    # (benchmarks/train_step.py --check compares Inductor's kernels with eager on the GPU).
    monkeypatch.setattr(model_module, "compile_module_call", lambda fn: compile_module_call(fn, backend="eager"))
    monkeypatch.setattr(acceleration, "SEGMENT_BACKEND", "eager")
    compiled_pieces: dict = {}
    monkeypatch.setattr(acceleration, "_compiled_functions", compiled_pieces)
    weights = str(reference_weights("CV8x8x8"))
    plain = TokenizerModel(ModelConfig(model="CV8x8x8", jit_ckpt_pth=weights, channels=16), loss=NO_VGG)
    switches = {"compile": True, "compile_scope": scope, "channels_last": True, "activation_checkpointing": True}
    fast = TokenizerModel(ModelConfig(model="CV8x8x8", jit_ckpt_pth=weights, channels=16, **switches), loss=NO_VGG)
    assert list(fast.state_dict()) == list(plain.state_dict())  # no "_orig_mod." or wrapper keys
    # Under DDP the compiled code keeps the graphs it has on one GPU (no DDPOptimizer cuts).
    assert torch._dynamo.config.optimize_ddp is False
    copy.deepcopy(fast)  # the EMA callback copies the module
    video = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32)
    results = []
    for module in (plain, fast):
        loss = module._step_terms(video, mask, None)["loss"]
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in module.network.parameters()])))
    # The blocks went through their compiled class functions exactly when the scope asks for it.
    assert ((ResnetBlock.forward, "eager") in compiled_pieces) == (scope == "blocks")
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0)
    assert (results[1][1] - results[0][1]).norm() / results[0][1].norm() < 1e-5
    fit(fast, tmp_path, steps=2)  # bf16-mixed through Lightning
    # After fit the network is plain again, so the export traces the official graph.
    assert fast.network.encoder.memory_format == torch.contiguous_format
    assert not fast.network.decoder.activation_checkpointing and not fast.network.decoder.compile_segments
