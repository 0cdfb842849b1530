"""Speed and memory switches change neither results nor checkpoint keys: checkpointing, channels-last, compile,
CUDA-graph gradients, DDP settings."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.conftest import fit, reference_weights
from tests.training.conftest import no_vgg
from tokenizer_posttrain.data.batch import LOSS_MASK, VIDEO
from tokenizer_posttrain.data.fake import SyntheticVideoDataModule
from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.cosmos import CausalVideoTokenizer, blocks
from tokenizer_posttrain.network.cosmos.blocks import (
    FrameGroupNorm,
    ResnetBlock,
    _repeat_frames,
    _repeat_pixels,
    attention_pair,
    is_channels_last,
    replicate_first_frame,
    single_head_attention,
)
from tokenizer_posttrain.training import acceleration
from tokenizer_posttrain.training.acceleration import (
    WHOLE_STEP_BUCKET_MB,
    compile_module_call,
    configure_network,
    ddp_kwargs,
    ddp_strategy,
    resolve_compile,
)
from tokenizer_posttrain.training.config import DataConfig, ModelConfig, TrainerConfig
from tokenizer_posttrain.training.module import TokenizerModel
from tokenizer_posttrain.training.train import check_clip_shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def loss_and_grads(net: CausalVideoTokenizer, video: torch.Tensor, fn=None) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """fp32 L1 reconstruction loss and every parameter's gradient, flattened."""
    net.zero_grad(set_to_none=True)
    loss = (fn or l1)(net, video)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in net.parameters()])


def l1(net: CausalVideoTokenizer, video: torch.Tensor) -> torch.Tensor:
    return (net(video) - video).abs().mean()


def tiny(name: str) -> CausalVideoTokenizer:
    torch.manual_seed(0)
    return build_tokenizer(name, channels=16)


def clip(b: int = 2, t: int = 9, size: int = 32) -> torch.Tensor:
    return torch.rand(b, 3, t, size, size, generator=torch.Generator().manual_seed(1)) * 2 - 1


@pytest.mark.parametrize("name", ["CV8x8x8", "DV8x16x16"])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(name: str) -> None:
    net, video = tiny(name), clip()
    reference = loss_and_grads(net, video)
    configure_network(net, activation_checkpointing=True)
    checkpointed = loss_and_grads(net, video)
    # The same kernels on the same inputs, recomputed: bit for bit.
    assert torch.equal(checkpointed[0], reference[0]) and torch.equal(checkpointed[1], reference[1])


@pytest.mark.parametrize("name", ["CV8x8x8", "DV8x16x16"])
def test_channels_last_gives_the_same_loss_and_gradients(name: str) -> None:
    net, video = tiny(name), clip()
    reference = loss_and_grads(net, video)
    configure_network(net, channels_last=True)
    loss, grads = loss_and_grads(net, video)
    # Other convolution kernels sum in another order: fp32 rounding only.
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=0)
    assert (grads - reference[1]).norm() / reference[1].norm() < 1e-5


def test_operations_between_convolutions_keep_channels_last() -> None:
    # (Whether a convolution returns channels-last is the backend's choice: cuDNN does for channels-last
    # inputs, the one-thread CPU path of a (3,1,1) kernel does not; the operations here are ours.)
    x = torch.randn(2, 16, 3, 4, 4).contiguous(memory_format=torch.channels_last_3d)
    attention = attention_pair(16)
    outputs = {
        "norm": FrameGroupNorm(16)(x),
        "causal pad": replicate_first_frame(x, 2),
        "frame repeat": _repeat_frames(x),
        "pixel repeat": _repeat_pixels(x),
        "attention": attention(x),
    }
    assert [name for name, out in outputs.items() if not is_channels_last(out)] == []
    torch.testing.assert_close(outputs["frame repeat"], x.repeat_interleave(2, dim=2)[:, :, 1:])
    torch.testing.assert_close(outputs["pixel repeat"], x.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4))
    torch.testing.assert_close(outputs["norm"], FrameGroupNorm(16)(x.contiguous()), rtol=1e-5, atol=1e-5)


def test_switches_leave_keys_and_exported_behaviour_alone() -> None:
    net = tiny("CV8x8x8")
    keys = list(net.state_dict())
    configure_network(net, activation_checkpointing=True, channels_last=True)
    assert list(net.state_dict()) == keys
    configure_network(net)  # back to the plain network
    assert net.encoder.memory_format == torch.contiguous_format and not net.decoder.mid.activation_checkpointing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "switches",
    [
        {"compile": True, "channels_last": True, "cuda_graphs": True},
        {"compile": True, "compile_scope": "blocks", "activation_checkpointing": True, "time_chunk": 1},
    ],
    ids=["step-graphed", "blocks-in-chunks"],
)
@pytest.mark.parametrize("name", ["Wan2.1-VAE", "Wan2.2-VAE"])
def test_the_compiled_wan_step_follows_eager_bf16(name: str, switches: dict) -> None:
    # Inductor on the GPU (the CPU tests capture with the eager backend): the step's loss and gradients under bf16
    # autocast as far from eager bf16's as eager bf16's are from fp32's (bf16's own spread), at most twice.
    video = torch.rand(2, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)).cuda() * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32, device="cuda")
    results = []
    for settings, bf16 in (({}, False), ({}, True), (switches, True)):
        torch.manual_seed(0)
        module = TokenizerModel(ModelConfig(model=name, channels=16, **settings), loss=no_vgg()).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = module.training_step({VIDEO: video, LOSS_MASK: mask}, 0)
        loss.backward()
        results.append((loss.detach().float(), torch.cat([p.grad.flatten() for p in module.network.parameters()])))
    (fp32_loss, fp32_grads), (eager_loss, eager_grads), (loss, grads) = results

    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert apart(loss, eager_loss) <= 2 * apart(eager_loss, fp32_loss) + 1e-4
    assert apart(grads, eager_grads) <= 2 * apart(eager_grads, fp32_grads) + 1e-4


def test_time_chunks_are_refused_where_the_network_cannot_chunk() -> None:
    with pytest.raises(ValueError, match=r"model.time_chunk=2: CausalVideoTokenizer cannot run a clip in chunks"):
        configure_network(tiny("CV8x8x8"), time_chunk=2)
    data = DataConfig(frames=17, height=64, width=64)
    with pytest.raises(ValueError, match=r"model.time_chunk=2: Cosmos-1.0-Tokenizer-CV8x8x8 cannot run a clip"):
        check_clip_shape(ModelConfig(time_chunk=2), data)
    check_clip_shape(ModelConfig(model="Wan2.1-VAE", time_chunk=2), data)
    with pytest.raises(ValueError, match=r"model.time_chunk.*use 0 \(the whole clip\)"):
        ModelConfig(model="Wan2.1-VAE", time_chunk=-1)
    # A step compiled whole cannot carry the chunks' state (it would graph-break and run uncompiled): per block.
    with pytest.raises(ValueError, match=r"model.compile_scope='step'.*with model.time_chunk=2, set .*=blocks"):
        ModelConfig(model="Wan2.1-VAE", time_chunk=2, compile=True)
    ModelConfig(model="Wan2.1-VAE", time_chunk=2, compile=True, compile_scope="blocks")


def test_compiled_function_matches_eager_and_keeps_keys() -> None:
    # backend="eager" runs Dynamo's capture (the checkpoint higher-order op, the channels-last branches,
    # guards) without Inductor's code generation, which takes minutes on a CPU; the GPU benchmark
    # (benchmarks/train_step.py --check) compares Inductor's kernels with eager.
    net, video = tiny("CV8x8x8"), clip(b=1)
    reference = loss_and_grads(net, video)
    keys = list(net.state_dict())
    configure_network(net, activation_checkpointing=True, channels_last=True)
    compiled = compile_module_call(l1, backend="eager")
    loss, grads = loss_and_grads(net, video, compiled)
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=0)
    assert (grads - reference[1]).norm() / reference[1].norm() < 1e-5
    assert list(net.state_dict()) == keys


@pytest.mark.parametrize("causal", [False, True])
def test_matmul_attention_equals_the_fused_kernel(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(6, 5, 32, generator=generator, requires_grad=True) for _ in range(3))
    products = single_head_attention(q, k, v, causal)
    monkeypatch.setattr(blocks, "MATMUL_ATTENTION_MAX_SCORES", 0)  # above it: SDPA
    fused = single_head_attention(q, k, v, causal)
    torch.testing.assert_close(products, fused, rtol=1e-5, atol=1e-6)
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v)) for out in (products, fused)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cuda_graphs_keep_gradients_allocated_and_zero_them_in_place() -> None:
    # A gradient set to None would become a CUDA graph's output, which the next replay overwrites.
    cfg = ModelConfig(model="CV8x8x8", channels=16, compile=True, cuda_graphs=True, trainable="decoder")
    with pytest.warns(UserWarning, match="RANDOM weights"):
        module = TokenizerModel(cfg, loss=no_vgg())
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
        plain = TokenizerModel(ModelConfig(model="CV8x8x8", channels=16), loss=no_vgg())
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
    monkeypatch.setattr(acceleration, "compile_module_call", eager_capture)
    cfg = ModelConfig(
        model="CV8x8x8", jit_ckpt_pth=str(reference_weights("CV8x8x8")), channels=16, compile=True, cuda_graphs=True
    )
    data = SyntheticVideoDataModule(frames=9, height=32, width=32, num_workers=0, num_train_samples=16)
    middle, first, resumed = tmp_path / "middle.ckpt", GradientsAtBackward(), GradientsAtBackward()
    fit(TokenizerModel(cfg, loss=no_vgg()), tmp_path, 1, [first, SaveAt(1, middle)], data, accumulate_grad_batches=4)
    assert first.batches == [0, 1, 2, 3] and not first.missing
    fit(
        TokenizerModel(cfg, loss=no_vgg()),
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
        module = TokenizerModel(cfg, loss=no_vgg()).cuda()
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
    monkeypatch.setattr(acceleration, "compile_module_call", eager_capture)
    monkeypatch.setattr(acceleration, "SEGMENT_BACKEND", "eager")
    compiled_pieces: dict = {}
    monkeypatch.setattr(acceleration, "_compiled_functions", compiled_pieces)
    weights = str(reference_weights("CV8x8x8"))
    plain = TokenizerModel(ModelConfig(model="CV8x8x8", jit_ckpt_pth=weights, channels=16), loss=no_vgg())
    switches = {"compile": True, "compile_scope": scope, "channels_last": True, "activation_checkpointing": True}
    fast = TokenizerModel(ModelConfig(model="CV8x8x8", jit_ckpt_pth=weights, channels=16, **switches), loss=no_vgg())
    assert list(fast.state_dict()) == list(plain.state_dict())  # no "_orig_mod." or wrapper keys
    # Under DDP the compiled code keeps the graphs it has on one GPU (no DDPOptimizer cuts).
    assert torch._dynamo.config.optimize_ddp is False
    copy.deepcopy(fast)  # the EMA callback copies the module
    video = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    mask = torch.ones(1, 1, 9, 32, 32)
    results = []
    for module in (plain, fast):
        loss = module.step_forward(video, mask, module.loss.prepare(0, video.device))["loss"]
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in module.network.parameters()])))
    # The blocks went through their compiled class functions exactly when the scope asks for it.
    assert ((ResnetBlock.forward, "eager", None) in compiled_pieces) == (scope == "blocks")
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=0)
    assert (results[1][1] - results[0][1]).norm() / results[0][1].norm() < 1e-5
    fit(fast, tmp_path, steps=2)  # bf16-mixed through Lightning
    # After fit the network is plain again, so the export traces the official graph.
    assert fast.network.encoder.memory_format == torch.contiguous_format
    assert not fast.network.decoder.activation_checkpointing and fast.network.decoder.segment_wrapper is None


def test_compile_is_left_off_on_the_cpu() -> None:
    # The GPU recipes turn it on; a run that lands on a CPU must not spend minutes in Inductor.
    fast = ModelConfig(model="CV8x8x8", compile=True, cuda_graphs=True, channels_last=True)
    with pytest.warns(UserWarning, match="model.compile is for GPUs"):
        on_cpu = resolve_compile(fast, "cpu")
    assert not on_cpu.compile and not on_cpu.cuda_graphs and on_cpu.channels_last
    assert resolve_compile(fast, "gpu") is fast
    # The GPU recipes' CUDA graphs need the step compiled whole: other choices train without them.
    for other in ({"compile": False}, {"compile_scope": "blocks"}):
        chosen = replace(fast, **other)
        with pytest.warns(UserWarning, match="model.cuda_graphs=true needs model.compile=true and model.compile_sc"):
            resolved = resolve_compile(chosen, "gpu")
        assert resolved == replace(chosen, cuda_graphs=False) and not resolved.replays_cuda_graphs


@pytest.mark.parametrize(
    ("model", "bucket_mb"),
    [
        (ModelConfig(compile=True), WHOLE_STEP_BUCKET_MB),  # one compiled backward: nothing to overlap
        (ModelConfig(compile=True, compile_scope="blocks"), None),  # PyTorch's 25 MB buckets
        (ModelConfig(compile=False), None),
    ],
)
def test_ddp_keeps_the_host_work_per_step_small(model: ModelConfig, bucket_mb: int | None) -> None:
    strategy = ddp_strategy(TrainerConfig(), model)
    assert isinstance(strategy, DDPStrategy)
    kwargs = ddp_kwargs(model)
    assert strategy._ddp_kwargs == kwargs
    # no buffer broadcast in each forward, under the name this torch knows (the old one warns on 2.13)
    assert kwargs.get("forward_sync_buffers", kwargs.get("broadcast_buffers")) is False
    assert kwargs["gradient_as_bucket_view"] is True and kwargs["bucket_cap_mb"] == bucket_mb
    assert ddp_strategy(TrainerConfig(strategy="fsdp"), model) == "fsdp"  # other strategies as named


def test_ddp_accepts_its_settings_without_deprecation_warnings(tmp_path: Path) -> None:
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch 2.13's FutureWarning for broadcast_buffers
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), **ddp_kwargs(ModelConfig(compile=True)))
    finally:
        dist.destroy_process_group()


def test_tf32_matmuls_hold_within_the_block_only() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with acceleration.tensor_core_matmuls(False):
            assert torch.get_float32_matmul_precision() == "highest"
        with acceleration.tensor_core_matmuls(True):
            assert torch.get_float32_matmul_precision() == "high"
        with pytest.raises(RuntimeError), acceleration.tensor_core_matmuls(True):
            raise RuntimeError("a failed fit")
        assert torch.get_float32_matmul_precision() == "highest"  # restored, also after the failure
    finally:
        torch.set_float32_matmul_precision(before)


def test_tf32_holds_the_products_of_bf16_values_exactly() -> None:
    # Why TF32 costs the Gram term nothing: a bf16 value (7 mantissa bits) survives TF32's 10-bit rounding.
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    mantissa = values.view(torch.int32) & 0x7FFFFF
    assert torch.equal(mantissa & ((1 << 13) - 1), torch.zeros_like(mantissa))  # the 13 bits TF32 drops are 0
