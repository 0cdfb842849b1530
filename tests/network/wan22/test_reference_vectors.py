"""The whole-clip causal pass reproduces the official chunked encode (frame 0, then chunks of 4 frames) and
decode (one latent frame at a time, the first with ``first_chunk``) of Wan2.2's ``WanVAE_``: fp32 on the CPU,
1e-5 relative L2 on every tensor."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.network.family import VideoTokenizer

TOLERANCE = 1e-5


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("time_chunk", [0, 1, 2], ids=["whole-clip", "chunks-of-1", "chunks-of-2"])
@pytest.mark.parametrize("tag", ["video", "image"])
def test_posterior_and_reconstruction_match_the_official_code(
    tiny_wan22: VideoTokenizer, wan22_io: dict[str, torch.Tensor], tag: str, time_chunk: int
) -> None:
    # Chunks of 1 latent frame are the official code's own; any chunk length gives the whole clip's result.
    tiny_wan22.time_chunk = time_chunk
    x = wan22_io[f"{tag}_input"]
    with torch.no_grad():
        encoding = tiny_wan22.encoding(x)
        # The reference decodes the official mu, so a difference in the encoder does not hide one in the decoder.
        reconstruction = tiny_wan22.decode(wan22_io[f"{tag}_mu"])
    assert encoding.mean is not None and encoding.logvar is not None
    for ours, key in ((encoding.mean, "mu"), (encoding.logvar, "log_var"), (reconstruction, "reconstruction")):
        official = wan22_io[f"{tag}_{key}"]
        assert ours.shape == official.shape, key
        assert rel_l2(ours, official) <= TOLERANCE, key


def test_the_image_is_the_first_frame_of_the_video(tiny_wan22: VideoTokenizer) -> None:
    # Causality, as the official chunked pass has it: the first 1 + 4j frames give the first 1 + j latent frames,
    # and the first 1 + j latent frames decode to the first 1 + 4j frames, whatever follows.
    x = torch.rand(1, 3, 13, 32, 32) * 2 - 1
    with torch.no_grad():
        whole = tiny_wan22.encoding(x).latent
        video = tiny_wan22.decode(whole)
        for j in (0, 1):
            part = tiny_wan22.encoding(x[:, :, : 1 + 4 * j]).latent
            assert rel_l2(part, whole[:, :, : 1 + j]) <= TOLERANCE
            assert rel_l2(tiny_wan22.decode(whole[:, :, : 1 + j]), video[:, :, : 1 + 4 * j]) <= TOLERANCE
