"""A clip's causal pass in chunks of time (``network.time_chunk``) gives the whole-clip pass's outputs and
gradients, for both Wan families, with blocks recomputed inside the chunks or not. (The official vectors in chunks:
test_reference_vectors.py; the memory they save: tests/training/test_memory.py.)"""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.network import build_tokenizer
from tokenizer_posttrain.network.family import VideoTokenizer
from tokenizer_posttrain.network.wan21.chunks import chunk_sizes
from tokenizer_posttrain.training.acceleration import configure_network

FAMILIES = ["Wan2.1-VAE", "Wan2.2-VAE"]


def tiny(name: str) -> VideoTokenizer:
    torch.manual_seed(0)
    return build_tokenizer(name, channels=8).double()


def outputs_and_gradients(network: VideoTokenizer, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Posterior, reconstruction of its mean, and the gradients of a loss on both (weights and input)."""
    network.zero_grad()
    x = x.clone().requires_grad_()
    posterior = network.encoder_output(x)
    video = network.decode(posterior[:, : posterior.shape[1] // 2])
    (video.square().mean() + posterior.square().mean()).backward()
    grads = torch.cat([p.grad.flatten() for p in network.parameters() if p.grad is not None])
    assert x.grad is not None
    return posterior.detach(), video.detach(), grads, x.grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recompute_blocks", [False, True], ids=["chunks", "chunks+blocks-recomputed"])
@pytest.mark.parametrize("name", FAMILIES)
def test_chunks_give_the_whole_clip_s_outputs_and_gradients(name: str, recompute_blocks: bool) -> None:
    network = tiny(name)
    x = torch.rand(1, 3, 9, 32, 32, dtype=torch.double, generator=torch.Generator().manual_seed(1)) * 2 - 1
    whole = outputs_and_gradients(network, x)
    for time_chunk in (1, 2):  # 3 latent frames: 3 chunks, then 2 (the last one shorter)
        configure_network(network, activation_checkpointing=recompute_blocks, channels_last=True, time_chunk=time_chunk)
        chunked = outputs_and_gradients(network, x)
        for ours, reference, what in zip(
            chunked, whole, ("posterior", "video", "weights' grads", "input's grad"), strict=False
        ):
            assert ours.shape == reference.shape
            assert relative(ours, reference) < 1e-12, (time_chunk, what)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_channels_last_clip_stays_channels_last_in_chunks(name: str) -> None:
    network = build_tokenizer(name, channels=8)
    configure_network(network, channels_last=True, time_chunk=1)
    layouts: list[bool] = []
    stem = network.decoder.conv1  # its input is made channels-last; what it convolves is padded in time
    convolve = stem._conv_forward

    def recorded(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        layouts.append(x.is_contiguous(memory_format=CL))
        return convolve(x, *args)

    stem._conv_forward = recorded  # type: ignore[method-assign]
    with torch.no_grad():
        network.decode(torch.randn(1, network.config.z_dim, 3, 2, 2))
    assert layouts == [True, True, True]  # three chunks: zero frames, then carried ones, in front of each


CL = torch.channels_last_3d


def test_chunk_sizes_cover_the_clip() -> None:
    assert chunk_sizes(17, 1, 4) == [1, 4, 4, 4, 4]
    assert chunk_sizes(17, 5, 8) == [5, 8, 4]
    assert chunk_sizes(3, 5, 8) == [3]
