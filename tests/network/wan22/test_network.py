"""The Wan2.2 VAE behind the family seam: the patching, the level shortcuts, its encoding, the shape checks, the
head split the adaptive GAN weight uses, LoRA, the training's speed switches and tracing."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.family import VideoTokenizer
from tokenizer_posttrain.network.lora import apply_lora, merge_lora
from tokenizer_posttrain.network.wan22.blocks import AverageDown, DuplicateUp, patchify, unpatchify
from tokenizer_posttrain.network.wan22.registry import Level
from tokenizer_posttrain.training.acceleration import configure_network

from .conftest import TINY


def video(frames: int = 9, size: int = 32, batch: int = 1) -> torch.Tensor:
    return torch.rand(batch, 3, frames, size, size) * 2 - 1


def test_patches_stack_the_column_offset_first() -> None:
    x = torch.randn(2, 3, 5, 8, 6)
    patches = patchify(x, 2)
    assert patches.shape == (2, 12, 5, 4, 3)
    for c, dy, dx in ((0, 1, 0), (2, 0, 1), (1, 1, 1)):
        assert torch.equal(patches[:, 4 * c + 2 * dx + dy], x[:, c, :, dy::2, dx::2])
    assert torch.equal(unpatchify(patches, 2), x)


def test_the_shortcuts_average_down_and_copy_up() -> None:
    x = torch.randn(1, 2, 3, 4, 4)
    down = AverageDown(Level(2, 4, temporal=True, spatial=True, up=False))(x)
    assert down.shape == (1, 4, 2, 2, 2)
    # Output channel 2c + j averages input channel c's 2x2 block at time offset j of the zero-padded pairs
    # (zero, frame 0), (frame 1, frame 2).
    padded = torch.cat([torch.zeros_like(x[:, :, :1]), x], dim=2)
    for c, j, pair, y, w in ((0, 0, 0, 0, 0), (0, 1, 0, 1, 0), (1, 0, 1, 0, 1), (1, 1, 1, 1, 1)):
        block = padded[0, c, 2 * pair + j, 2 * y : 2 * y + 2, 2 * w : 2 * w + 2]
        assert torch.allclose(down[0, 2 * c + j, pair, y, w], block.mean())
    assert torch.equal(down[0, 0, 0], torch.zeros(2, 2))
    up = DuplicateUp(Level(4, 2, temporal=True, spatial=True, up=True))(down)
    assert up.shape == (1, 2, 3, 4, 4)  # 2 latent frames -> 1 + 2, the copy before frame 0 dropped
    # Output channel o at time offset j copies input channel 2o + j; output frame f is copy f + 1 of the doubled
    # clip, i.e. latent frame (f + 1) // 2 at offset (f + 1) % 2.
    for o in range(2):
        for f in range(3):
            latent, j = divmod(f + 1, 2)
            expected = down[0, 2 * o + j, latent].repeat_interleave(2, 0).repeat_interleave(2, 1)
            assert torch.equal(up[0, o, f], expected)
    same = AverageDown(Level(4, 4, temporal=False, spatial=False, up=False))
    assert same(down) is down


def test_the_encoding_is_the_raw_posterior(tiny_wan22: VideoTokenizer) -> None:
    x = video(batch=2)
    with torch.no_grad():
        encoding = tiny_wan22.encoding(x)
        stacked = tiny_wan22.encoder_output(x)
    assert stacked.shape == (2, 16, 3, 2, 2)  # mean and log-variance on the channels
    assert encoding.posterior is not None and encoding.indices is None
    mean, logvar = encoding.posterior
    assert torch.equal(encoding.latent, mean) and torch.equal(encoding.tokens, mean)
    assert torch.equal(mean, stacked[:, :8]) and torch.equal(logvar, stacked[:, 8:])
    assert not tiny_wan22.is_discrete and tiny_wan22.config.latent_frames(9) == 3
    with torch.no_grad():
        assert torch.equal(tiny_wan22(x), tiny_wan22.decode(mean))  # reconstruction from the mean, unclamped


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((1, 3, 8, 32, 32), r"T=8 is not 1\+4k frames \(use 5 or 9\)"),
        ((1, 3, 9, 24, 32), "H=24 is not a multiple of 16"),
        ((1, 3, 9, 32, 8), "W=8 is not a multiple of 16"),
        ((1, 12, 9, 32, 32), r"expected a video \[B, 3, T, H, W\]"),
    ],
)
def test_clips_that_break_the_rule_are_refused(tiny_wan22: VideoTokenizer, shape: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_wan22.encoding(torch.zeros(shape))
    with pytest.raises(ValueError, match=r"decode expects \[B, 8, t, h, w\]"):
        tiny_wan22.decode(torch.zeros(1, 48, 2, 2, 2))


def test_apply_head_of_the_head_input_is_the_decoding(tiny_wan22: VideoTokenizer) -> None:
    z = torch.randn(1, 8, 3, 2, 2)
    with torch.no_grad():
        decoded, head_input = tiny_wan22.decode_with_head_input(z)
        assert decoded.shape == (1, 3, 9, 32, 32) and head_input.shape == (1, 12, 9, 16, 16)
        assert torch.equal(decoded, tiny_wan22.decode(z))
        assert torch.equal(tiny_wan22.apply_head(head_input), decoded)
    head = tiny_wan22.get_submodule(tiny_wan22.head)
    assert isinstance(head, torch.nn.Conv3d) and head.out_channels == 12  # 2x2 patches of 3 channels
    assert tiny_wan22.get_parameter(tiny_wan22.last_layer + ".weight") is head.weight
    for side, prefixes in tiny_wan22.sides.items():
        assert any(k.startswith(prefixes) for k in tiny_wan22.state_dict()), side
    everything = tiny_wan22.sides["encoder"] + tiny_wan22.sides["decoder"]
    assert all(k.startswith(everything) for k in tiny_wan22.state_dict())


def test_lora_keeps_the_outputs_at_init_and_trains_only_adapters(tiny_wan22: VideoTokenizer) -> None:
    x = video(frames=5)
    with torch.no_grad():
        before = tiny_wan22(x)
    adapted = apply_lora(tiny_wan22, 2, 4.0, allowed=tiny_wan22.lora_modules)
    conv3d = [n for n, m in tiny_wan22.named_modules() if isinstance(m, torch.nn.Conv3d) and "lora_" not in n]
    assert sorted(adapted) == sorted(conv3d)  # every 3D convolution, the temporal resamplers' too
    with torch.no_grad():
        assert torch.equal(tiny_wan22(x), before)
    trained = {n for n, p in tiny_wan22.named_parameters() if p.requires_grad}
    assert trained and all(".lora_down." in n or ".lora_up." in n for n in trained)
    tiny_wan22.train()
    tiny_wan22(x).square().mean().backward()
    assert all(p.grad is None for p in tiny_wan22.parameters() if not p.requires_grad)
    ups = [p for n, p in tiny_wan22.named_parameters() if ".lora_up." in n]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in ups)
    with torch.no_grad():  # a step on the adapters changes the output, and merging folds it into the weights
        for p in ups:
            p.add_(torch.randn_like(p) * 0.01)
        tiny_wan22.eval()
        adapted_out = tiny_wan22(x)
        assert not torch.equal(adapted_out, before)
        merged = merge_lora(tiny_wan22)
        plain = build_tokenizer("Wan2.2-VAE", **TINY).eval()
        plain.load_state_dict(merged.state_dict(), strict=True)
        assert torch.allclose(plain(x), adapted_out, atol=1e-5)


def test_the_speed_switches_keep_outputs_and_gradients(tiny_wan22: VideoTokenizer) -> None:
    x = video(frames=5)
    tiny_wan22(x).square().mean().backward()
    reference = {n: p.grad.clone() for n, p in tiny_wan22.named_parameters() if p.grad is not None}
    with torch.no_grad():
        out = tiny_wan22(x)
    tiny_wan22.zero_grad()
    configure_network(tiny_wan22, activation_checkpointing=True, channels_last=True)
    assert tiny_wan22.encoder.activation_checkpointing and tiny_wan22.decoder.activation_checkpointing  # type: ignore[union-attr]
    assert tiny_wan22.encoder.memory_format == torch.channels_last_3d  # type: ignore[union-attr]
    switched = tiny_wan22(x)
    assert torch.allclose(switched, out, atol=1e-5)
    switched.square().mean().backward()
    for name, grad in reference.items():
        got = tiny_wan22.get_parameter(name).grad
        assert got is not None and torch.allclose(got, grad, rtol=1e-4, atol=1e-6), name


def test_the_forward_traces_whole_with_dynamo(tiny_wan22: VideoTokenizer) -> None:
    torch._dynamo.reset()
    x = video(frames=5)
    compiled = torch.compile(tiny_wan22, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x), tiny_wan22(x), atol=1e-6)
    torch._dynamo.reset()
