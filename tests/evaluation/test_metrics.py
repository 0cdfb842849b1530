"""PSNR, flicker and codebook statistics on inputs whose values are known."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.evaluation.evaluate import codebook_stats, temporal_flicker
from tokenizer_posttrain.evaluation.metrics import video_psnr


def test_psnr_of_known_error() -> None:
    target = torch.zeros(2, 3, 1, 8, 8)
    assert video_psnr(target + 0.2, target).item() == pytest.approx(20.0, abs=1e-3)  # error 0.1 on [0, 1]


def test_flicker_is_zero_for_an_error_constant_in_time_and_measures_a_changing_one() -> None:
    target = torch.rand(2, 3, 5, 8, 8, generator=torch.Generator().manual_seed(0)) - 0.5
    assert temporal_flicker(target + 0.1, target).abs().max() < 1e-6
    assert temporal_flicker(target, target).abs().max() == 0
    # An error flipping between +0.1 and -0.1 ([-1, 1] scale) changes by 0.2, which is 0.1 on the [0, 1] scale.
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]).view(1, 1, 5, 1, 1)
    assert torch.allclose(temporal_flicker(target + 0.1 * sign, target), torch.full((2,), 0.1), atol=1e-6)
    assert temporal_flicker(target[:, :, :1] + 0.3, target[:, :, :1]).tolist() == [0.0, 0.0]  # one frame: no pairs


def test_codebook_stats() -> None:
    histogram = torch.zeros(100, dtype=torch.long)
    histogram[:10] = 7  # ten codes, equally often
    usage, perplexity = codebook_stats(histogram)
    assert usage == pytest.approx(0.1) and perplexity == pytest.approx(10.0)
    histogram[0] = 10**6  # one code dominates: perplexity falls towards 1
    assert 1.0 <= codebook_stats(histogram)[1] < 1.01
