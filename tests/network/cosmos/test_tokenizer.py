"""The public network API: shapes, errors for unsupported sizes, causality, gradients."""

import pytest
import torch

from tokenizer_posttrain.network.cosmos import CausalVideoTokenizer


def video(t: int, h: int, w: int, b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, 3, t, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("t", [1, 9, 25])
def test_shapes_round_trip(tiny_network: CausalVideoTokenizer, t: int) -> None:
    cfg = tiny_network.config
    x = video(t, 32, 48)
    with torch.no_grad():
        encoded = tiny_network.encode(x)
        latent = encoded[1] if cfg.is_discrete else encoded
        s = cfg.spatial_compression
        assert latent.shape == (1, cfg.latent_dim, 1 + (t - 1) // 8, 32 // s, 48 // s)
        assert tiny_network.decode(latent).shape == x.shape
        assert tiny_network(x).shape == x.shape
        if cfg.is_discrete:
            indices = encoded[0]
            assert indices.shape == (1, latent.shape[2], 32 // s, 48 // s)
            assert int(indices.min()) >= 0 and int(indices.max()) < cfg.codebook_size
            assert tiny_network.decode_indices(indices).shape == x.shape


@pytest.mark.parametrize(
    "shape, message",
    [
        ((1, 3, 16, 32, 32), r"T=16 is not 1\+8k frames \(use 9 or 17\)"),
        ((1, 3, 17, 36, 32), "H=36 is not a multiple"),
        ((1, 3, 17, 32, 20), "W=20 is not a multiple"),
        ((1, 4, 17, 32, 32), r"expected a video \[B, 3, T, H, W\]"),
        ((3, 17, 32, 32), r"expected a video"),
    ],
)
def test_unsupported_input_gets_a_clear_error(tiny_network: CausalVideoTokenizer, shape: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_network.encode(torch.zeros(shape))
    with pytest.raises(ValueError, match=message):
        tiny_network(torch.zeros(shape))


def test_decode_checks_its_input(tiny_network: CausalVideoTokenizer) -> None:
    with pytest.raises(ValueError, match="decode expects"):
        tiny_network.decode(torch.zeros(1, 5, 2, 4, 4))
    if tiny_network.is_discrete:
        with pytest.raises(ValueError, match="integer"):
            tiny_network.decode_indices(torch.zeros(1, 2, 4, 4))
    else:
        with pytest.raises(TypeError, match="continuous"):
            tiny_network.decode_indices(torch.zeros(1, 2, 4, 4, dtype=torch.long))


def test_encoder_is_causal(tiny_network: CausalVideoTokenizer) -> None:
    # Latent frame j depends on input frames 0..8j only (doc section 10).
    x = video(17, 32, 32)
    y = x.clone()
    y[:, :, 9:] = -y[:, :, 9:]  # change frames 9..16 only
    with torch.no_grad():  # before quantization, where a change cannot round away
        a = tiny_network.quant_conv(tiny_network.encoder(x))
        b = tiny_network.quant_conv(tiny_network.encoder(y))
    assert torch.equal(a[:, :, :2], b[:, :, :2])
    assert not torch.equal(a[:, :, 2], b[:, :, 2])


def test_clips_in_a_batch_are_independent(tiny_network: CausalVideoTokenizer) -> None:
    x = video(9, 32, 32, b=2)
    with torch.no_grad():
        both = tiny_network(x)
        first = tiny_network(x[:1])
    # oneDNN picks its convolution algorithm by batch size: on some CPUs (seen on AMD EPYC) a batch of one
    # and of two differ by ~1e-5 in fp32. A clip leaking into its neighbour would differ by far more.
    torch.testing.assert_close(both[:1], first, rtol=1e-4, atol=5e-5)


def test_gradients_reach_every_parameter(tiny_network: CausalVideoTokenizer) -> None:
    net = tiny_network.train()
    x = video(17, 64, 64)  # enough latent frames and tokens that the DV codes differ over time
    net(x).abs().mean().backward()
    # A key bias shifts every score of a query equally, so softmax makes its gradient exactly zero.
    missing = [
        n
        for n, p in net.named_parameters()
        if not n.endswith(".k.conv3d.bias") and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    assert missing == []  # the DV straight-through estimator lets gradients reach the encoder


def test_bf16_autocast_matches_fp32_roughly(tiny_network: CausalVideoTokenizer) -> None:
    x = video(9, 32, 32)
    with torch.no_grad():
        ref = tiny_network(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = tiny_network(x)
    assert low.shape == ref.shape
    assert ((low.float() - ref).norm() / ref.norm()).item() < 0.15


def test_encoding_names_the_parts_for_either_kind(tiny_network: CausalVideoTokenizer) -> None:
    x = video(9, 32, 32)
    with torch.no_grad():
        encoding, encoded = tiny_network.encoding(x), tiny_network.encode(x)
        if tiny_network.is_discrete:
            indices, codes = encoded  # the official call, unpacked as before
            assert torch.equal(encoding.indices, indices) and torch.equal(encoding.latent, codes)
            assert encoding.tokens is encoding.indices and encoding.quant_loss is not None
        else:
            assert torch.equal(encoding.latent, encoded) and encoding.indices is None
            assert encoding.tokens is encoding.latent
        assert torch.equal(tiny_network.decode(encoding.latent), tiny_network(x))
