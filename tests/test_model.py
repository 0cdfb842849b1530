"""TokenizerModel: fp32 master weights under bf16 autocast, masked loss, real updates, speed switches."""

import copy
import functools
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tests.conftest import fit, reference_weights
from tokenizer_posttrain import model as model_module
from tokenizer_posttrain.config import DataConfig, LossConfig, ModelConfig, OptimConfig
from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
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
    for key in ("compile", "cuda_graphs", "channels_last", "activation_checkpointing"):
        with pytest.raises(ValueError, match=f"model.{key}='yes': use true or false"):
            ModelConfig(**{key: "yes"})
    with pytest.raises(ValueError, match="model.compile_scope='graph': use step or blocks"):
        ModelConfig(compile_scope="graph")
    with pytest.raises(ValueError, match="data.synthetic_cache='yes': use true or false"):
        DataConfig(synthetic_cache="yes")


def test_cuda_graphs_keep_gradients_allocated_and_zero_them_in_place() -> None:
    # A gradient set to None would become a CUDA graph's output, which the next replay overwrites.
    cfg = ModelConfig(model="CV8x8x8", channels=16, compile=True, cuda_graphs=True, trainable="decoder")
    with pytest.warns(UserWarning, match="RANDOM weights"):
        module = TokenizerModel(cfg, loss=NO_VGG)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1)
    module.optimizer_zero_grad(0, 0, optimizer)
    trainable = [p for p in module.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and not p.grad.any() for p in trainable)
    assert all(p.grad is None for p in module.parameters() if not p.requires_grad)  # the frozen encoder
    first = [p.grad for p in trainable]
    for grad in first:
        grad.fill_(1.0)
    module.optimizer_zero_grad(0, 1, optimizer)
    assert all(p.grad is g and not g.any() for p, g in zip(trainable, first, strict=True))
    module.on_validation_model_zero_grad()  # Lightning's default frees them before validation
    assert all(p.grad is g for p, g in zip(trainable, first, strict=True))
    trainable[0].grad = None
    module.on_before_backward(torch.zeros(()))  # a backward without zero_grad before it
    assert trainable[0].grad is not None
    assert all(p.grad is g for p, g in zip(trainable[1:], first[1:], strict=True))
    # Without CUDA graphs gradients are freed between steps, as Lightning does by default.
    with pytest.warns(UserWarning, match="RANDOM weights"):
        plain = TokenizerModel(ModelConfig(model="CV8x8x8", channels=16), loss=NO_VGG)
    for p in plain.parameters():
        p.grad = torch.ones_like(p)
    plain.optimizer_zero_grad(0, 0, torch.optim.SGD(plain.parameters(), lr=0.1))
    assert all(p.grad is None for p in plain.parameters())


class GradientsAtBackward(pl.Callback):
    """Records the batch indices trained and every trainable parameter whose gradient arrived while
    ``.grad`` was None (under CUDA graphs that gradient would be the graph's own output)."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.missing: list[str] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for name, param in module.named_parameters():
            if param.requires_grad:
                param.register_hook(functools.partial(self._arrived, name, param))

    def _arrived(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> None:
        if param.grad is None:
            self.missing.append(name)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.batches.append(batch_idx)


class SaveAt(pl.Callback):
    def __init__(self, batch_idx: int, path: Path) -> None:
        self.batch_idx, self.path = batch_idx, path

    def on_train_batch_end(self, trainer: pl.Trainer, module, outputs, batch, batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


@pytest.mark.usefixtures("dynamo_config")
def test_cuda_graphs_find_gradients_allocated_at_every_backward_after_a_resume_mid_step(tmp_path, monkeypatch) -> None:
    # A preemption checkpoint can fall between the micro-batches of a step; the run resumed from it
    # starts without Lightning's zero_grad, so the gradients must be allocated before its backward.
    eager_capture = lambda fn, mode=None: compile_module_call(fn, backend="eager")  # noqa: E731
    monkeypatch.setattr(model_module, "compile_module_call", eager_capture)
    cfg = ModelConfig(
        model="CV8x8x8", jit_ckpt_pth=str(reference_weights("CV8x8x8")), channels=16, compile=True, cuda_graphs=True
    )
    data = SyntheticVideoDataModule(frames=9, height=32, width=32, num_workers=0, num_train_samples=16)
    middle, first, resumed = tmp_path / "middle.ckpt", GradientsAtBackward(), GradientsAtBackward()
    fit(TokenizerModel(cfg, loss=NO_VGG), tmp_path, 1, [first, SaveAt(1, middle)], data, accumulate_grad_batches=4)
    assert first.batches == [0, 1, 2, 3] and not first.missing
    fit(
        TokenizerModel(cfg, loss=NO_VGG),
        tmp_path,
        2,
        [resumed],
        data,
        accumulate_grad_batches=4,
        ckpt_path_for_fit=str(middle),
    )
    assert resumed.batches[0] % 4 != 0 and resumed.batches[-1] == 7  # resumed inside the first step
    assert not resumed.missing, sorted(set(resumed.missing))[:5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_accumulate_the_gradients_of_eager() -> None:
    # Two micro-batches per step, new clips every step: stolen or stale CUDA-graph outputs would
    # show as gradients of the wrong clips or the wrong sum (pytorch/pytorch#169545).
    weights = str(reference_weights("CV8x8x8"))
    clips = torch.rand(4, 2, 1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)).cuda() * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32, device="cuda")

    def gradients(**switches: bool) -> tuple[list[torch.Tensor], TokenizerModel]:
        cfg = ModelConfig(model="CV8x8x8", jit_ckpt_pth=weights, channels=16, **switches)
        module = TokenizerModel(cfg, loss=NO_VGG).cuda()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        seen = []
        for step, micro_batches in enumerate(clips):
            module.optimizer_zero_grad(0, step, optimizer)
            for i, video in enumerate(micro_batches):
                (module.training_step({VIDEO: video, LOSS_MASK: mask}, i) / len(micro_batches)).backward()
            seen.append(torch.cat([p.grad.flatten() for p in module.network.parameters()]))
        return seen, module

    eager, _ = gradients()
    skips = acceleration.cuda_graph_skips()
    graphed, module = gradients(compile=True, cuda_graphs=True)  # module kept: its graphs live with it
    assert acceleration.cuda_graph_skips() == skips
    # The step did run as recorded CUDA graphs (forward and backward), not as plain compiled code.
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(0, create_if_none_exists=False)
    assert manager is not None and len(list(manager.get_roots())) > 0
    for step, (want, got) in enumerate(zip(eager, graphed, strict=False)):
        error = ((got - want).norm() / want.norm()).item()
        assert error < 1e-2, f"step {step}: relative gradient error {error:.2e}"


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
    eager_capture = lambda fn, mode=None: compile_module_call(fn, backend="eager")  # noqa: E731
    monkeypatch.setattr(model_module, "compile_module_call", eager_capture)
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
