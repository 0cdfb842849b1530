"""The checks both Wan families' reference-vector tests run (tests/network/wan21 and wan22/test_reference_vectors.py):
the whole-clip causal pass, or any chunking of it, against the official chunked encode and decode."""

from __future__ import annotations

import torch

from tokenizer_posttrain.network.family import VideoTokenizer

TOLERANCE = 1e-5


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_matches_the_official_code(
    network: VideoTokenizer, io: dict[str, torch.Tensor], tag: str, time_chunk: int
) -> None:
    """Posterior mean, log-variance and reconstruction of ``io``'s ``tag`` input within :data:`TOLERANCE`."""
    # Chunks of 1 latent frame are the official code's own; any chunk length gives the whole clip's result.
    network.time_chunk = time_chunk
    with torch.no_grad():
        encoding = network.encoding(io[f"{tag}_input"])
        # The reference decodes the official mu, so a difference in the encoder does not hide one in the decoder.
        reconstruction = network.decode(io[f"{tag}_mu"])
    assert encoding.mean is not None and encoding.logvar is not None
    for ours, key in ((encoding.mean, "mu"), (encoding.logvar, "log_var"), (reconstruction, "reconstruction")):
        official = io[f"{tag}_{key}"]
        assert ours.shape == official.shape, key
        assert rel_l2(ours, official) <= TOLERANCE, key


def assert_the_image_is_the_first_frame(network: VideoTokenizer, side: int) -> None:
    """Causality, as the official chunked pass has it: the first 1 + 4j frames give the first 1 + j latent frames,
    and the first 1 + j latent frames decode to the first 1 + 4j frames, whatever follows."""
    x = torch.rand(1, 3, 13, side, side) * 2 - 1
    with torch.no_grad():
        whole = network.encoding(x).latent
        video = network.decode(whole)
        for j in (0, 1):
            part = network.encoding(x[:, :, : 1 + 4 * j]).latent
            assert rel_l2(part, whole[:, :, : 1 + j]) <= TOLERANCE
            assert rel_l2(network.decode(whole[:, :, : 1 + j]), video[:, :, : 1 + 4 * j]) <= TOLERANCE
