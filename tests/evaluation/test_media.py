"""[-1, 1] clips as viewable pixels: one conversion for validation videos, inference output and reports."""

from __future__ import annotations

from pathlib import Path

import av
import pytest
import torch

from tokenizer_posttrain.evaluation.media import (
    LABEL_HEIGHT,
    PANEL_MIN_WIDTH,
    labelled_panels,
    side_by_side_frames,
    to_frames,
    to_uint8,
    write_mp4,
)


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


def test_labelled_panels_name_each_panel_above_it_and_scale_small_clips_up() -> None:
    panels = [torch.full((2, 64, 64, 3), value, dtype=torch.uint8) for value in (40, 120, 200)]
    frames = labelled_panels(panels, ["input", "baseline", "post-trained"])
    scale = -(-PANEL_MIN_WIDTH // 64)  # 3: a 64-pixel clip is too small to look at
    assert frames.shape == (2, LABEL_HEIGHT + 64 * scale, 3 * 64 * scale, 3) and frames.dtype == torch.uint8
    header, body = frames[:, :LABEL_HEIGHT], frames[:, LABEL_HEIGHT:]
    for i, value in enumerate((40, 120, 200)):  # each panel where it was, scaled
        assert bool((body[:, :, i * 64 * scale : (i + 1) * 64 * scale] == value).all())
        assert int(header[0, :, i * 64 * scale : (i + 1) * 64 * scale].max()) > 200  # white text over each
    assert torch.equal(header[0], header[1])
    with pytest.raises(ValueError, match="one label per panel"):
        labelled_panels(panels, ["input"])


@pytest.mark.parametrize("fps", [25.0, 30000 / 1001])
def test_mp4s_play_at_the_frame_rate_given(tmp_path: Path, fps: float) -> None:
    # Before: every report video played at 8 fps, whatever its source's rate (25 for bigbuckbunny).
    path = write_mp4(tmp_path / "clip.mp4", torch.zeros(5, 32, 48, 3, dtype=torch.uint8), fps=fps)
    with av.open(str(path)) as container:
        assert float(container.streams.video[0].average_rate) == pytest.approx(fps, rel=1e-4)
