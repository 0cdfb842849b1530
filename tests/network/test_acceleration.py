"""Speed and memory switches change neither results nor checkpoint keys: checkpointing, channels-last, compile."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.network import CausalVideoTokenizer, blocks, build_tokenizer
from tokenizer_posttrain.network.acceleration import compile_module_call, configure_network
from tokenizer_posttrain.network.blocks import (
    FrameGroupNorm,
    _repeat_frames,
    _repeat_pixels,
    attention_pair,
    is_channels_last,
    replicate_first_frame,
    single_head_attention,
)

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
