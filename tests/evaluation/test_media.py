"""[-1, 1] clips as viewable pixels: one conversion for validation videos, inference output and reports."""

from __future__ import annotations

import torch

from tokenizer_posttrain.evaluation.media import side_by_side_frames, to_frames, to_uint8


def test_frames_are_the_rounded_clamped_pixels_of_the_previous_formulas() -> None:
    # Out of range on purpose: reconstructions overshoot [-1, 1].
    clip = torch.randn(3, 5, 8, 12, generator=torch.Generator().manual_seed(0)) * 1.2
    frames = to_frames(clip)
    assert frames.shape == (5, 8, 12, 3) and frames.dtype == torch.uint8
    # What whole-video inference wrote before the three conversions became one.
    inference = ((clip.unsqueeze(0)[0].float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    assert torch.equal(frames, inference.permute(1, 2, 3, 0))
    assert torch.equal(to_frames(clip.unsqueeze(0)), frames)  # a batch of one
    assert torch.equal(to_uint8(clip).permute(1, 2, 3, 0), frames)


def test_side_by_side_is_input_then_reconstruction() -> None:
    clip, recon = torch.full((3, 2, 4, 4), -1.0), torch.full((3, 2, 4, 4), 1.0)
    both = side_by_side_frames(clip, recon)
    assert both.shape == (2, 4, 8, 3)
    assert int(both[..., :4, :].max()) == 0 and int(both[..., 4:, :].min()) == 255
