"""The high-frequency term: the Laplacian by hand, against the trainers' convolution, masking, gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenizer_posttrain.losses import LossConfig, StepContext, build_loss
from tokenizer_posttrain.losses.high_freq import HighFreqConfig, masked_laplacian, masked_laplacian_l1

CPU = torch.device("cpu")
KERNEL = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]])


def frame(values: list[list[float]]) -> torch.Tensor:
    """One single-channel frame as a [1, 1, 1, H, W] video."""
    return torch.tensor(values).view(1, 1, 1, len(values), len(values[0]))


def ones_like_mask(video: torch.Tensor) -> torch.Tensor:
    b, _, t, h, w = video.shape
    return torch.ones(b, 1, t, h, w)


def test_the_laplacian_of_a_constant_frame_is_zero_border_included() -> None:
    video = torch.full((2, 3, 2, 5, 6), 0.7)
    assert torch.equal(masked_laplacian(video, ones_like_mask(video)), torch.zeros_like(video))


def test_the_laplacian_of_an_impulse_by_hand() -> None:
    impulse = [[0.0] * 5 for _ in range(5)]
    impulse[2][2] = 1.0
    expected = [[0.0] * 5 for _ in range(5)]
    expected[2][2] = -4.0
    expected[1][2] = expected[3][2] = expected[2][1] = expected[2][3] = 1.0
    video = frame(impulse)
    assert torch.equal(masked_laplacian(video, ones_like_mask(video)), frame(expected))
    # In the corner only two neighbours are inside the frame (replicate padding): -2 there.
    corner = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    video = frame(corner)
    expected = [[-2.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert torch.equal(masked_laplacian(video, ones_like_mask(video)), frame(expected))
    # Mean |Laplacian| over the 25 pixels of the impulse: (4 + 4 x 1) / 25.
    zero = torch.zeros(1, 1, 1, 5, 5)
    value = masked_laplacian_l1(frame(impulse), zero, torch.ones(1, 1, 1, 5, 5))
    torch.testing.assert_close(value, torch.tensor(8 / 25))


def test_inside_the_frame_it_is_the_trainers_depthwise_convolution() -> None:
    video = torch.randn(2, 3, 4, 8, 9, generator=torch.Generator().manual_seed(0))
    b, c, t, h, w = video.shape
    folded = video.transpose(1, 2).reshape(b * t, c, h, w)
    conv = F.conv2d(folded, KERNEL.expand(c, 1, 3, 3), padding=1, groups=c).view(b, t, c, h, w).transpose(1, 2)
    ours = masked_laplacian(video, ones_like_mask(video))
    torch.testing.assert_close(ours[..., 1:-1, 1:-1], conv[..., 1:-1, 1:-1])


def test_masked_out_pixels_change_nothing() -> None:
    generator = torch.Generator().manual_seed(1)
    target = torch.rand(2, 3, 2, 6, 6, generator=generator) * 2 - 1
    recon = target + 0.2 * torch.randn(2, 3, 2, 6, 6, generator=generator)
    mask = torch.ones(2, 1, 2, 6, 6)
    mask[0, :, 0, 2:4, 1:3] = 0  # a hole with counted pixels all around it
    mask[1, :, 1] = 0  # a whole frame
    changed = recon.clone()
    changed[0, :, 0, 2:4, 1:3] = 5.0
    changed[1, :, 1] = -3.0
    masked = masked_laplacian_l1(recon, target, mask)
    torch.testing.assert_close(masked_laplacian_l1(changed, target, mask), masked)
    assert masked_laplacian_l1(changed, target, torch.ones_like(mask)) != masked_laplacian_l1(
        recon, target, ones_like_mask(recon)
    )
    # The mean is over counted pixels and channels (as the L1 term's); nothing counted: 0, not NaN.
    laplacian = masked_laplacian(recon - target, mask)
    torch.testing.assert_close(masked, (laplacian.abs() * mask).sum() / (mask.sum() * 3))
    assert masked_laplacian_l1(recon, target, torch.zeros_like(mask)).item() == 0


def test_zero_for_videos_that_differ_by_a_constant_and_gradients_reach_the_reconstruction() -> None:
    target = torch.rand(1, 3, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    mask = ones_like_mask(target)
    # 0 up to the rounding of (target + 0.25) - target
    torch.testing.assert_close(masked_laplacian_l1(target + 0.25, target, mask), torch.tensor(0.0), atol=1e-6, rtol=0)
    recon = (target + 0.1 * torch.randn(1, 3, 2, 8, 8)).requires_grad_(True)
    masked_laplacian_l1(recon, target, mask).backward()
    assert recon.grad is not None and recon.grad.abs().sum() > 0


def test_bf16_videos_give_an_fp32_value() -> None:
    target = torch.rand(1, 3, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    recon = target + 0.1 * torch.randn(1, 3, 2, 8, 8)
    value = masked_laplacian_l1(recon.bfloat16(), target.bfloat16(), ones_like_mask(target))
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, masked_laplacian_l1(recon, target, ones_like_mask(target)), rtol=2e-2, atol=0)


def test_the_term_in_the_loss_and_weight_zero_builds_nothing() -> None:
    assert "high_freq" not in build_loss(LossConfig(perceptual_weight=0.0)).terms
    assert HighFreqConfig().weight == 0.0
    loss = build_loss(LossConfig(perceptual_weight=0.0, high_freq=HighFreqConfig(0.5)))
    target = torch.rand(1, 3, 2, 8, 8, generator=torch.Generator().manual_seed(4))
    recon, mask = target + 0.1 * torch.randn(1, 3, 2, 8, 8), ones_like_mask(target)
    terms = loss(StepContext(recon, target, mask), loss.prepare(0, CPU))
    assert set(terms) == {"l1", "high_freq", "loss"} and loss.vgg is None
    assert torch.equal(terms["high_freq"], masked_laplacian_l1(recon, target, mask))
    torch.testing.assert_close(terms["loss"], terms["l1"] + 0.5 * terms["high_freq"])


@pytest.mark.parametrize("height, width", [(1, 5), (4, 1)])
def test_frames_one_pixel_wide(height: int, width: int) -> None:
    video = torch.randn(1, 3, 2, height, width)
    assert masked_laplacian(video, ones_like_mask(video)).shape == video.shape
