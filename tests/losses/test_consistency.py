"""The temporal consistency term: the windows it cuts, its value by hand, masking, and its settings' errors."""

from __future__ import annotations

import pytest
import torch

from tokenizer_posttrain.losses import LossConfig
from tokenizer_posttrain.losses.consistency import (
    ConsistencyConfig,
    ConsistencyWindows,
    consistency_loss,
    cut_windows,
    window_count,
)
from tokenizer_posttrain.losses.terms import Clips


def test_the_windows_batch_holds_each_clips_windows_in_order() -> None:
    # Frame f of clip b holds 100 b + f.
    video = (torch.arange(9.0) + 100 * torch.arange(2.0)[:, None]).view(2, 1, 9, 1, 1).expand(2, 3, 9, 2, 2)
    windows = cut_windows(video, window=5, step=2)
    assert window_count(9, 5, 2) == 3 and windows.shape == (6, 3, 5, 2, 2)
    starts = [0, 2, 4]
    expected = torch.tensor([[100.0 * b + s + f for f in range(5)] for b in range(2) for s in starts])
    assert torch.equal(windows[:, 0, :, 0, 0], expected)
    assert torch.equal(windows[:, 2, :, 1, 1], expected)


def test_identical_shared_frames_give_zero() -> None:
    video = torch.rand(2, 3, 9, 4, 4)
    latent = torch.rand(2, 4, 5, 1, 1)  # a latent video of 5 frames at 2x in time: windows of 5 -> 3 latent frames
    windows = ConsistencyWindows(cut_windows(video, 5, 2), cut_windows(latent, 3, 1))
    assert consistency_loss(windows, torch.ones(2, 1, 9, 4, 4), 5, 2).item() == 0


def test_a_hand_computed_value_and_masking() -> None:
    # One clip of 5 frames, windows of 3 every 2: window 0 = frames 0-2, window 1 = frames 2-4; they share frame 2.
    recon = torch.zeros(2, 3, 3, 2, 2)
    recon[1, :, 0, 0, :] = 1.0  # window 1's frame 0 (clip frame 2) differs by 1 on its top row: half the pixels
    recon[0, :, :2] = 7.0  # unshared frames (clip frames 0, 1 and 3, 4) count for nothing
    recon[1, :, 1:] = -7.0
    mask = torch.ones(1, 1, 5, 2, 2)
    assert consistency_loss(ConsistencyWindows(recon), mask, 3, 2).item() == pytest.approx(0.5)
    # Masked out at the differing pixels of frame 2: 0; at one agreeing pixel: 2 of the 3 counted pixels differ.
    mask[:, :, 2, 0, :] = 0
    assert consistency_loss(ConsistencyWindows(recon), mask, 3, 2).item() == 0
    mask = torch.ones(1, 1, 5, 2, 2)
    mask[:, :, 2, 1, 0] = 0
    assert consistency_loss(ConsistencyWindows(recon), mask, 3, 2).item() == pytest.approx(2 / 3)
    # Latents [2 windows, 4 channels, 2 frames (window 3 = 1 + 2x1 at 2x), 1, 1]: step 2 = 1 latent frame, so window
    # 0's latent frame 1 meets window 1's frame 0; they differ by 0.5, scaled by 3 x 2 x (2 x 2) / 4 = 6 -> 3.
    latent = torch.zeros(2, 4, 2, 1, 1)
    latent[0, :, 1] = 0.5
    latent[1, :, 1] = 9.0  # not shared
    value = consistency_loss(ConsistencyWindows(recon, latent), torch.ones(1, 1, 5, 2, 2), 3, 2)
    assert value.item() == pytest.approx(0.5 + 3.0)


def test_shared_latents_count_by_the_share_of_their_pixels_the_mask_keeps() -> None:
    # Windows of 3 frames every 2 at 2x in time: window 0's latent frame 1 meets window 1's latent frame 0, which
    # stands for clip frame 2 alone. Latents 2x1 over 2x2 pixels: each value stands for one row of 2 pixels.
    recon = torch.zeros(2, 3, 3, 2, 2)
    latent = torch.zeros(2, 4, 2, 2, 1)
    latent[0, :, 1, 0] = 0.5
    latent[0, :, 1, 1] = 1.5
    scale = 3 * 2 * (1 * 2) / 4  # pixels per latent value

    def value(mask: torch.Tensor) -> float:
        return consistency_loss(ConsistencyWindows(recon, latent), mask, 3, 2).item()

    mask = torch.ones(1, 1, 5, 2, 2)
    assert value(mask) == pytest.approx(1.0 * scale)
    mask[:, :, 2, 1, :] = 0  # frame 2's bottom row: its latent value counts for nothing
    assert value(mask) == pytest.approx(0.5 * scale)
    mask = torch.ones(1, 1, 5, 2, 2)
    mask[:, :, 2, 1, 0] = 0  # half of that row: the bottom value at half weight
    assert value(mask) == pytest.approx((0.5 + 1.5 * 0.5) / 1.5 * scale)
    mask = torch.ones(1, 1, 5, 2, 2)
    mask[:, :, [0, 1, 3, 4]] = 0  # frames the shared latents do not stand for change nothing
    assert value(mask) == pytest.approx(1.0 * scale)
    assert value(torch.zeros(1, 1, 5, 2, 2)) == 0


def test_gradients_reach_both_windows() -> None:
    recon = torch.rand(4, 3, 3, 2, 2, requires_grad=True)
    consistency_loss(ConsistencyWindows(recon), torch.ones(2, 1, 5, 2, 2), 3, 2).backward()
    assert recon.grad is not None
    assert recon.grad[0::2, :, 2].abs().sum() > 0 and recon.grad[1::2, :, 0].abs().sum() > 0
    assert recon.grad[0::2, :, :2].abs().sum() == 0  # unshared frames


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"step": 25}, r"loss\.consistency\.step=25 must be < loss\.consistency\.window=25 .* at most 24"),
        ({"window": 1, "step": 1}, r"loss\.consistency\.window=1 must be >= 2"),
        ({"step": 0}, r"loss\.consistency\.step=0 must be >= 1"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_key(settings: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        LossConfig(consistency=ConsistencyConfig(1.0, **settings))
    assert "\n" not in str(err.value)


def clips(frames: int, temporal_compression: int, continuous: bool) -> Clips:
    """Clips of ``frames`` frames (of any size: this term does not look at it)."""
    return Clips(frames, ((64, 64),), temporal_compression, continuous)


def test_clip_problems_say_what_to_set() -> None:
    config = ConsistencyConfig(1.0, window=10, step=4)
    problems = config.clip_problems("loss.consistency", clips(17, 8, continuous=True))
    assert problems[0] == "loss.consistency.window=10 is not 1+8k frames (use 9 or 17)"
    assert problems[1].startswith("loss.consistency.step=4 is not a multiple of the temporal compression 8")
    assert "(use 8)" in problems[1]
    assert config.clip_problems("loss.consistency", clips(17, 8, continuous=False))[1:] == []  # DV: any step
    too_long = ConsistencyConfig(1.0, window=33, step=8).clip_problems("loss.consistency", clips(17, 8, True))
    assert too_long == [
        "loss.consistency.window=33 + loss.consistency.step=8 > data.frames=17: a clip holds no two overlapping "
        "windows; set loss.consistency.window=9 or raise data.frames to >= 41"
    ]
    assert ConsistencyConfig(1.0, window=9, step=8).clip_problems("loss.consistency", clips(17, 8, True)) == []


@pytest.mark.parametrize("temporal_compression", [4, 8])
def test_the_default_windows_fit_the_default_clips(temporal_compression: int) -> None:
    from tokenizer_posttrain.training.config import DataConfig

    frames = DataConfig().frames  # data.frames, also the recipes' default
    config = ConsistencyConfig(1.0)
    assert config.clip_problems("loss.consistency", clips(frames, temporal_compression, continuous=True)) == []
    assert window_count(frames, config.window, config.step) >= 2
