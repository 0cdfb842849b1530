"""The adversarial stage's pieces: config checks and schedules, the PatchGAN discriminators, the losses against
hand computation, LeCam, R1, the adaptive weight, and a discriminator that learns to tell real from fake."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tokenizer_posttrain.losses.gan import (
    GANConfig,
    LeCam,
    adaptive_weight,
    build_discriminator,
    discriminator_loss,
    generator_loss,
    group_count,
    min_input_size,
    r1_penalty,
)

SMALL = {"weight": 0.1, "channels": 8, "layers": 2}
"""A discriminator small enough for CPU tests."""


# Config


def test_defaults_are_valid_and_off() -> None:
    config = GANConfig()
    assert config.problems() == []
    assert not config.ever_on
    assert not config.disc_on(10**6)
    assert config.gen_factor(10**6) == 0.0
    assert GANConfig(weight=0.1).ever_on


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"weight": -1.0}, "loss.gan.weight="),
        ({"weight": math.nan}, "loss.gan.weight="),
        ({"discriminator": "stylegan"}, "loss.gan.discriminator="),
        ({"norm": "layer"}, "loss.gan.norm="),
        ({"loss": "wasserstein"}, "loss.gan.loss="),
        ({"channels": 0}, "loss.gan.channels="),
        ({"layers": 0}, "loss.gan.layers="),
        ({"lecam_weight": -0.001}, "loss.gan.lecam_weight="),
        ({"r1_weight": math.inf}, "loss.gan.r1_weight="),
        ({"r1_every": 0}, "loss.gan.r1_every="),
        ({"lecam_decay": 1.0}, "loss.gan.lecam_decay="),
        ({"adaptive_max": 0.0}, "loss.gan.adaptive_max="),
        ({"disc_start": -1, "gen_start": -1}, "loss.gan.disc_start="),
        ({"disc_start": 10, "gen_start": 5}, "loss.gan.gen_start="),
        ({"ramp_steps": -2}, "loss.gan.ramp_steps="),
        ({"lr": 0.0}, "loss.gan.lr="),
        ({"betas": [0.5]}, "loss.gan.betas="),
        ({"betas": [0.5, 1.0]}, "loss.gan.betas="),
        ({"weight_decay": -0.1}, "loss.gan.weight_decay="),
        ({"gradient_clip_val": -1.0}, "loss.gan.gradient_clip_val="),
    ],
)
def test_each_bad_setting_is_named(settings: dict, named: str) -> None:
    problems = GANConfig(**settings).problems()
    assert len(problems) == 1, problems
    assert problems[0].startswith(named)
    # Building refuses the same settings, naming the key.
    with pytest.raises(ValueError, match=named.rstrip("=")):
        build_discriminator(GANConfig(**{"weight": 0.1, **settings}))


def test_problems_use_the_given_key() -> None:
    assert GANConfig(layers=0).problems("gan")[0].startswith("gan.layers=0")


def test_the_discriminator_and_generator_start_at_their_steps() -> None:
    config = GANConfig(weight=0.1, disc_start=3, gen_start=5, ramp_steps=4)
    assert [config.disc_on(step) for step in (0, 2, 3, 100)] == [False, False, True, True]
    factors = [config.gen_factor(step) for step in (4, 5, 6, 7, 8, 9, 1000)]
    assert factors == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    no_ramp = GANConfig(weight=0.1, disc_start=3, gen_start=5)
    assert [no_ramp.gen_factor(step) for step in (0, 4, 5, 6)] == [0.0, 0.0, 1.0, 1.0]


# Discriminator


def clips(batch: int = 2, frames: int = 9, size: int = 32) -> Tensor:
    return torch.rand(batch, 3, frames, size, size) * 2 - 1


def test_patch3d_maps_a_clip_to_spatio_temporal_patches() -> None:
    torch.manual_seed(0)
    discriminator = build_discriminator(GANConfig(**SMALL))
    # Two strided layers: 9 -> 5 -> 3 frames, 32 -> 16 -> 8 pixels; the last conv keeps the size.
    assert discriminator(clips()).shape == (2, 1, 3, 8, 8)
    assert discriminator(clips(frames=1)).shape == (2, 1, 1, 8, 8)
    assert discriminator(clips(batch=1, frames=17, size=64)).shape == (1, 1, 5, 16, 16)


def test_patch2d_judges_every_frame() -> None:
    torch.manual_seed(0)
    discriminator = build_discriminator(GANConfig(**SMALL, discriminator="patch2d"))
    video = clips()
    logits = discriminator(video)
    assert logits.shape == (2 * 9, 1, 8, 8)
    # Frame 4 of clip 1 lands at index 1 * 9 + 4, judged alone.
    alone = discriminator(video[1:2, :, 4:5])
    torch.testing.assert_close(logits[1 * 9 + 4], alone[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("discriminator", ["patch3d", "patch2d"])
@pytest.mark.parametrize("norm", ["group", "batch", "instance", "none"])
@pytest.mark.parametrize("spectral", [False, True])
def test_every_norm_builds_and_runs_in_fp32_and_bf16(discriminator: str, norm: str, spectral: bool) -> None:
    torch.manual_seed(0)
    config = GANConfig(**SMALL, discriminator=discriminator, norm=norm, spectral_norm=spectral)
    model = build_discriminator(config)
    video = clips(frames=5)
    logits = model(video)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = model(video)
    assert torch.isfinite(mixed.float()).all()
    discriminator_loss("hinge", logits, -logits).backward()
    assert all(p.grad is not None for p in model.parameters())
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    assert len(convs) == config.layers + 1
    assert [hasattr(m, "parametrizations") for m in convs] == [spectral] * len(convs)


def test_fresh_init_follows_patchgan() -> None:
    torch.manual_seed(0)
    model = build_discriminator(GANConfig(weight=0.1, channels=32, layers=3))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv3d)]
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 2 and [n.num_groups for n in norms] == [32, 32]
    for conv in convs:
        assert conv.weight.mean().abs() < 0.005
        assert conv.weight.std().item() == pytest.approx(0.02, rel=0.15)
        assert conv.bias is None or (conv.bias == 0).all()
    # Widths double from ``channels``: 32 -> 64 -> 128, then one logit.
    assert [c.out_channels for c in convs] == [32, 64, 128, 1]
    for norm in norms:
        assert norm.weight.mean().item() == pytest.approx(1.0, abs=0.01)
        assert 0.01 < norm.weight.std().item() < 0.03
        assert (norm.bias == 0).all()


def test_widths_stop_at_eight_times_channels() -> None:
    model = build_discriminator(GANConfig(weight=0.1, channels=2, layers=5))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv3d)]
    assert [c.out_channels for c in convs] == [2, 4, 8, 16, 16, 1]


def test_group_norm_takes_the_largest_divisor_up_to_32() -> None:
    assert [group_count(c) for c in (1, 8, 24, 48, 64, 96, 100, 512)] == [1, 8, 24, 24, 32, 32, 25, 32]


def test_too_small_frames_name_the_layers_setting() -> None:
    config = GANConfig(**{**SMALL, "layers": 3})
    assert min_input_size(config) == 8
    model = build_discriminator(config)
    assert model(clips(batch=1, size=8)).shape[-2:] == (1, 1)
    with pytest.raises(ValueError, match=r"loss\.gan\.layers=3"):
        model(torch.zeros(1, 3, 9, 8, 7))
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        model(torch.zeros(1, 3, 32, 32))


# Losses


REAL = torch.tensor([2.0, -0.5])
FAKE = torch.tensor([0.5, -2.0])


def test_hinge_losses_by_hand() -> None:
    # relu(1 - real) = [0, 1.5] -> 0.75; relu(1 + fake) = [1.5, 0] -> 0.75.
    assert discriminator_loss("hinge", REAL, FAKE).item() == pytest.approx(0.5 * (0.75 + 0.75))
    assert generator_loss("hinge", FAKE).item() == pytest.approx(0.75)


def test_non_saturating_losses_by_hand() -> None:
    def softplus(x: float) -> float:
        return math.log1p(math.exp(x))

    real_term = (softplus(-2.0) + softplus(0.5)) / 2
    fake_term = (softplus(0.5) + softplus(-2.0)) / 2
    assert discriminator_loss("non_saturating", REAL, FAKE).item() == pytest.approx(0.5 * (real_term + fake_term))
    assert generator_loss("non_saturating", FAKE).item() == pytest.approx((softplus(-0.5) + softplus(2.0)) / 2)


def test_losses_are_fp32_and_refuse_unknown_kinds() -> None:
    assert discriminator_loss("hinge", REAL.bfloat16(), FAKE.bfloat16()).dtype == torch.float32
    assert generator_loss("non_saturating", FAKE.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="loss.gan.loss"):
        generator_loss("wgan", FAKE)


# LeCam


def test_lecam_starts_at_the_means_then_decays() -> None:
    lecam = LeCam(decay=0.9)
    lecam.update(torch.tensor([1.0, 3.0]), torch.tensor([-1.0, -2.0]))
    assert (lecam.ema_real.item(), lecam.ema_fake.item()) == (2.0, -1.5)
    lecam.update(torch.tensor([4.0]), torch.tensor([0.5]))
    assert lecam.ema_real.item() == pytest.approx(0.9 * 2.0 + 0.1 * 4.0)
    assert lecam.ema_fake.item() == pytest.approx(0.9 * -1.5 + 0.1 * 0.5)
    assert lecam.ema_real.dtype == torch.float32
    # The averages are checkpointed, and so is whether they were started.
    assert set(lecam.state_dict()) == {"ema_real", "ema_fake", "updates"}


def test_lecam_penalty_by_hand() -> None:
    lecam = LeCam(decay=0.5)
    lecam.update(torch.tensor([1.0]), torch.tensor([-1.0]))  # ema_real 1, ema_fake -1
    real = torch.tensor([2.0, -3.0, 0.0], requires_grad=True)
    fake = torch.tensor([0.5, -2.0], requires_grad=True)
    # relu(real + 1)^2 = [9, 0, 1] -> 10/3; relu(1 - fake)^2 = [0.25, 9] -> 4.625.
    penalty = lecam.penalty(real, fake)
    assert penalty.item() == pytest.approx(10 / 3 + 4.625)
    penalty.backward()
    assert real.grad is not None and fake.grad is not None


# R1


class Linear(nn.Module):
    """D(x) = sum(w * x) per clip: its input gradient is w, so R1 is ||w||^2."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape))

    def forward(self, x: Tensor) -> Tensor:
        return (self.w * x).flatten(1).sum(1)


def test_r1_penalty_is_the_squared_input_gradient() -> None:
    torch.manual_seed(0)
    model = Linear((3, 2, 4, 4))
    real = torch.randn(5, 3, 2, 4, 4)
    penalty = r1_penalty(model, real)
    assert penalty.item() == pytest.approx(model.w.pow(2).sum().item(), rel=1e-5)
    # The penalty trains D: d||w||^2 / dw = 2w.
    penalty.backward()
    torch.testing.assert_close(model.w.grad, 2 * model.w.detach())
    assert not real.requires_grad


def test_r1_penalty_on_the_discriminator_is_positive_and_trains_it() -> None:
    torch.manual_seed(0)
    model = build_discriminator(GANConfig(**SMALL))
    penalty = r1_penalty(model, clips(frames=3, size=16))
    assert penalty.dtype == torch.float32 and penalty.item() > 0
    penalty.backward()
    # Every weight gets a gradient; the last bias cannot (the input gradient does not depend on it).
    weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in weights)


# Adaptive weight


def test_adaptive_weight_is_the_gradient_norm_ratio() -> None:
    torch.manual_seed(0)
    decoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Conv1d(1, 1, 3, padding=1))
    x = torch.randn(6, 1, 4)
    out = decoder(x)
    rec, gan = (out - 1).abs().mean(), -(out * 3).mean()
    last = decoder[-1].weight
    rec_grad = torch.autograd.grad(rec, last, retain_graph=True)[0]
    gan_grad = torch.autograd.grad(gan, last, retain_graph=True)[0]
    expected = rec_grad.norm() / (gan_grad.norm() + 1e-4)
    weight = adaptive_weight(rec, gan, last)
    assert weight.item() == pytest.approx(expected.item(), rel=1e-5)
    assert weight.dtype == torch.float32 and not weight.requires_grad
    # The graphs are kept: the total still backpropagates.
    (rec + weight * gan).backward()
    assert last.grad is not None


def test_adaptive_weight_is_clamped() -> None:
    w = torch.ones(3, requires_grad=True)
    rec, gan = (w * 100).sum(), (w * 1e-3).sum()  # ratio 1e5 / (1 + 0.1): above the clamp
    assert adaptive_weight(rec, gan, w, max_weight=50.0).item() == 50.0
    assert adaptive_weight(rec, gan, w).item() == 1e4


# Learning


def smooth_clips(batch: int) -> Tensor:
    """Random clips that vary slowly in time and space: coarse noise upsampled."""
    coarse = torch.rand(batch, 3, 3, 4, 4) * 2 - 1
    return F.interpolate(coarse, size=(9, 32, 32), mode="trilinear", align_corners=False)


def test_the_discriminator_learns_real_from_noisy() -> None:
    torch.manual_seed(0)
    model = build_discriminator(GANConfig(**SMALL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.5, 0.9))
    losses = []
    for _ in range(60):
        real = smooth_clips(4)
        # A bad reconstruction of the same clips: grainy.
        fake = (real + 0.3 * torch.randn_like(real)).clamp(-1, 1)
        loss = discriminator_loss("hinge", model(real), model(fake))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        real = smooth_clips(8)
        fake = (real + 0.3 * torch.randn_like(real)).clamp(-1, 1)
        margin = model(real).mean() - model(fake).mean()
    assert margin > 0.5, margin
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], (losses[0], losses[-5:])
