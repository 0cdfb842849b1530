"""The whole-clip causal pass reproduces the official chunked encode (frame 0, then chunks of 4 frames) and
decode (one latent frame at a time) of Wan2.1's ``WanVAE_``: fp32 on the CPU, 1e-5 relative L2 on every tensor."""

from __future__ import annotations

import pytest
import torch

from tests.network.wan_vectors import assert_matches_the_official_code, assert_the_image_is_the_first_frame
from tokenizer_posttrain.network.family import VideoTokenizer


@pytest.mark.parametrize("time_chunk", [0, 1, 2], ids=["whole-clip", "chunks-of-1", "chunks-of-2"])
@pytest.mark.parametrize("tag", ["video", "image"])
def test_posterior_and_reconstruction_match_the_official_code(
    tiny_wan: VideoTokenizer, reference_io: dict[str, torch.Tensor], tag: str, time_chunk: int
) -> None:
    assert_matches_the_official_code(tiny_wan, reference_io, tag, time_chunk)


def test_the_image_is_the_first_frame_of_the_video(tiny_wan: VideoTokenizer) -> None:
    assert_the_image_is_the_first_frame(tiny_wan, side=16)
