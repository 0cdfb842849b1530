"""The Wan2.1 VAE behind the family seam: its encoding, the shape checks, the head split the adaptive GAN weight
uses, LoRA, the training's speed switches and tracing."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.family import VideoTokenizer
from tokenizer_posttrain.network.lora import apply_lora, merge_lora
from tokenizer_posttrain.training.acceleration import configure_network

from .conftest import TINY


def video(frames: int = 9, size: int = 16, batch: int = 1) -> torch.Tensor:
    return torch.rand(batch, 3, frames, size, size) * 2 - 1


def test_the_encoding_is_the_raw_posterior(tiny_wan: VideoTokenizer) -> None:
    x = video(batch=2)
    with torch.no_grad():
        encoding = tiny_wan.encoding(x)
        stacked = tiny_wan.encoder_output(x)
    assert stacked.shape == (2, 8, 3, 2, 2)  # mean and log-variance on the channels
    assert encoding.posterior is not None and encoding.indices is None
    mean, logvar = encoding.posterior
    assert torch.equal(encoding.latent, mean) and torch.equal(encoding.tokens, mean)
    assert torch.equal(mean, stacked[:, :4]) and torch.equal(logvar, stacked[:, 4:])
    assert not tiny_wan.is_discrete and tiny_wan.config.latent_frames(9) == 3
    with torch.no_grad():
        assert torch.equal(tiny_wan(x), tiny_wan.decode(mean))  # reconstruction from the mean, unclamped


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 8, 16, 16), r"T=8 is not 1\+4k frames \(use 5 or 9\)"),
        ((1, 3, 9, 20, 16), "H=20 is not a multiple of 8"),
        ((1, 3, 9, 16, 12), "W=12 is not a multiple of 8"),
        ((1, 4, 9, 16, 16), r"expected a video \[B, 3, T, H, W\]"),
    ],
)
def test_clips_that_break_the_rule_are_refused(tiny_wan: VideoTokenizer, shape: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_wan.encoding(torch.zeros(shape))
    with pytest.raises(ValueError, match=r"decode expects \[B, 4, t, h, w\]"):
        tiny_wan.decode(torch.zeros(1, 16, 2, 2, 2))


def test_apply_head_of_the_head_input_is_the_decoding(tiny_wan: VideoTokenizer) -> None:
    z = torch.randn(1, 4, 3, 2, 2)
    with torch.no_grad():
        decoded, head_input = tiny_wan.decode_with_head_input(z)
        assert torch.equal(decoded, tiny_wan.decode(z))
        assert torch.equal(tiny_wan.apply_head(head_input), decoded)
    head = tiny_wan.get_submodule(tiny_wan.head)
    assert isinstance(head, torch.nn.Conv3d) and head.out_channels == 3
    assert tiny_wan.get_parameter(tiny_wan.last_layer + ".weight") is head.weight
    for side, prefixes in tiny_wan.sides.items():
        assert any(k.startswith(prefixes) for k in tiny_wan.state_dict()), side
    assert all(k.startswith(tiny_wan.sides["encoder"] + tiny_wan.sides["decoder"]) for k in tiny_wan.state_dict())


def test_lora_keeps_the_outputs_at_init_and_trains_only_adapters(tiny_wan: VideoTokenizer) -> None:
    x = video(frames=5)
    with torch.no_grad():
        before = tiny_wan(x)
    adapted = apply_lora(tiny_wan, 2, 4.0, allowed=tiny_wan.lora_modules)
    conv3d = [n for n, m in tiny_wan.named_modules() if isinstance(m, torch.nn.Conv3d) and "lora_" not in n]
    assert sorted(adapted) == sorted(conv3d)  # every 3D convolution, the temporal resamplers' too
    with torch.no_grad():
        assert torch.equal(tiny_wan(x), before)
    trained = {n for n, p in tiny_wan.named_parameters() if p.requires_grad}
    assert trained and all(".lora_down." in n or ".lora_up." in n for n in trained)
    tiny_wan.train()
    tiny_wan(x).square().mean().backward()
    assert all(p.grad is None for p in tiny_wan.parameters() if not p.requires_grad)
    ups = [p for n, p in tiny_wan.named_parameters() if ".lora_up." in n]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ups)
    with torch.no_grad():  # a step on the adapters changes the output, and merging folds it into the weights
        for p in ups:
            p.add_(torch.randn_like(p) * 0.01)
        tiny_wan.eval()
        adapted_out = tiny_wan(x)
        assert not torch.equal(adapted_out, before)
        merged = merge_lora(tiny_wan)
        plain = build_tokenizer("Wan2.1-VAE", **TINY).eval()
        plain.load_state_dict(merged.state_dict(), strict=True)
        assert torch.allclose(plain(x), adapted_out, atol=1e-5)


def test_the_speed_switches_keep_outputs_and_gradients(tiny_wan: VideoTokenizer) -> None:
    x = video(frames=5)
    tiny_wan(x).square().mean().backward()
    reference = {n: p.grad.clone() for n, p in tiny_wan.named_parameters() if p.grad is not None}
    with torch.no_grad():
        out = tiny_wan(x)
    tiny_wan.zero_grad()
    configure_network(tiny_wan, activation_checkpointing=True, channels_last=True)
    assert tiny_wan.encoder.memory_format == torch.channels_last_3d  # type: ignore[union-attr]
    switched = tiny_wan(x)
    assert torch.allclose(switched, out, atol=1e-5)
    switched.square().mean().backward()
    for name, grad in reference.items():
        got = tiny_wan.get_parameter(name).grad
        assert got is not None and torch.allclose(got, grad, rtol=1e-4, atol=1e-6), name


def test_the_forward_traces_whole_with_dynamo(tiny_wan: VideoTokenizer) -> None:
    torch._dynamo.reset()
    x = video(frames=5)
    compiled = torch.compile(tiny_wan, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x), tiny_wan(x), atol=1e-6)
    torch._dynamo.reset()
