"""The pieces of an adversarial fine-tuning stage: its config, a PatchGAN discriminator, the discriminator's and
generator's losses, LeCam and R1 regularisation, and taming-transformers' adaptive weight.

The Cosmos tokenizer paper fine-tunes with an adversarial loss added to the reconstruction terms; VidTok and
taming-transformers train one the same way. Nothing here trains anything: the training step owns the second
optimizer and decides, with :meth:`GANConfig.disc_on` and :meth:`GANConfig.gen_factor`, which part runs at a step.

The discriminator sees videos ``[B, 3, T, H, W]`` in [-1, 1] and returns a map of logits, one per patch: positive
means "real". ``patch3d`` judges spatio-temporal patches (motion artefacts count); ``patch2d`` judges every frame
on its own, with the frames folded into the batch.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

DISCRIMINATORS = ("patch3d", "patch2d")
"""Values of ``loss.gan.discriminator``."""
NORMS = ("group", "batch", "instance", "none")
"""Values of ``loss.gan.norm``."""
LOSSES = ("hinge", "non_saturating")
"""Values of ``loss.gan.loss``."""
MAX_WIDTH = 8
"""The discriminator's widest layer, as a multiple of ``channels`` (PatchGAN's cap)."""


@dataclass
class GANConfig:
    """Adversarial fine-tuning (``loss.gan.*``): a discriminator trained beside the tokenizer, and a generator term
    that pushes reconstructions towards what the discriminator calls real. Weight 0 (default): off, nothing built."""

    weight: float = 0.0
    """Weight of the generator's adversarial term (times the adaptive weight when ``adaptive``); 0 turns the stage
    off."""
    discriminator: str = "patch3d"
    """``patch3d``: spatio-temporal PatchGAN on the clip; ``patch2d``: PatchGAN on every frame."""
    channels: int = 64
    """Width of the discriminator's first layer; each downsampling layer doubles it, up to 8x."""
    layers: int = 3
    """Strided (2x) downsampling layers; frames must be at least ``2 ** layers`` pixels high and wide."""
    norm: str = "group"
    """Normalisation after the inner convolutions: ``group``, ``batch``, ``instance`` or ``none``."""
    spectral_norm: bool = False
    """Spectral normalisation on every convolution (then ``norm`` is usually ``none``)."""
    loss: str = "hinge"
    """Adversarial loss: ``hinge`` or ``non_saturating`` (softplus)."""
    lecam_weight: float = 0.0
    """Weight of the LeCam regulariser on the discriminator (VidTok and MAGVIT-v2 use about 0.001-0.005); 0: off."""
    lecam_decay: float = 0.999
    """Decay of LeCam's moving averages of the mean real and fake logits."""
    r1_weight: float = 0.0
    """Weight of the R1 gradient penalty on real clips; 0: off."""
    r1_every: int = 16
    """Apply R1 every this many discriminator steps, its weight scaled by the same factor (lazy regularisation)."""
    adaptive: bool = True
    """Scale the generator term by ||grad rec|| / (||grad gan|| + 1e-4) at the decoder's last layer (taming's rule)."""
    adaptive_max: float = 1e4
    """Upper clamp of the adaptive weight."""
    adaptive_every: Optional[int] = None
    """Recompute the adaptive weight every this many optimizer steps and reuse it in between (1: every
    micro-batch, taming's rule exactly). The training step takes both gradients apart at the reconstruction and
    carries them through the decoder's last layer alone, at the cost of two small convolutions. Where it cannot
    (loss.consistency on, whose windows pass through that layer too; the last trained weight before that layer;
    LoRA dropout on it; trainer.precision=16-mixed, whose loss scale those gradients would lack), each
    computation takes two more backward passes of network and loss. None: 1 where the step takes the gradients
    apart, else 8."""
    disc_start: int = 0
    """Optimizer step (0-based) from which the discriminator trains."""
    gen_start: int = 0
    """Optimizer step from which the generator term is on; not before ``disc_start``."""
    ramp_steps: int = 0
    """The generator term ramps linearly from 0 to its weight over this many steps from ``gen_start``; 0: no ramp."""
    lr: float = 1e-4
    """Learning rate of the discriminator's optimizer."""
    betas: list[float] = field(default_factory=lambda: [0.5, 0.9])
    """Adam betas of the discriminator's optimizer (a low beta1, as GANs usually train)."""
    weight_decay: float = 0.0
    """Weight decay of the discriminator's optimizer."""
    gradient_clip_val: float = 0.0
    """Clip the discriminator's gradient norm to this value; 0: no clipping."""

    @property
    def ever_on(self) -> bool:
        """Whether the stage runs at all (and a discriminator must be built)."""
        return self.weight > 0

    def problems(self, key: str = "loss.gan") -> list[str]:
        """What is wrong with these settings, each naming ``key.<field>`` and the fix."""
        problems = [*self._choice_problems(key), *self._count_problems(key)]
        for name in ("weight", "lecam_weight", "r1_weight", "weight_decay", "gradient_clip_val"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                problems.append(f"{key}.{name}={value} must be finite and >= 0")
        if not 0 <= self.lecam_decay < 1:
            problems.append(f"{key}.lecam_decay={self.lecam_decay} must be in [0, 1), e.g. 0.999")
        if not self.adaptive_max > 0:
            problems.append(f"{key}.adaptive_max={self.adaptive_max} must be > 0, e.g. 1e4")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"{key}.lr={self.lr} must be finite and > 0, e.g. 1e-4")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            problems.append(f"{key}.betas={self.betas} must be two values in [0, 1), e.g. [0.5, 0.9]")
        return problems

    def _choice_problems(self, key: str) -> list[str]:
        """The settings that must be one of a few names."""
        choices = {"discriminator": DISCRIMINATORS, "norm": NORMS, "loss": LOSSES}
        return [
            f"{key}.{name}={getattr(self, name)!r} must be one of {', '.join(allowed)}"
            for name, allowed in choices.items()
            if getattr(self, name) not in allowed
        ]

    def _count_problems(self, key: str) -> list[str]:
        """The integer settings: sizes and steps."""
        problems = [
            f"{key}.{name}={getattr(self, name)} must be >= {least}"
            for name, least in (
                ("channels", 1),
                ("layers", 1),
                ("r1_every", 1),
                ("disc_start", 0),
                ("ramp_steps", 0),
            )
            if getattr(self, name) < least
        ]
        if self.adaptive_every is not None and not (
            isinstance(self.adaptive_every, int)
            and not isinstance(self.adaptive_every, bool)
            and self.adaptive_every >= 1
        ):
            problems.append(f"{key}.adaptive_every={self.adaptive_every} must be >= 1 (or null: chosen by the step)")
        if self.gen_start < self.disc_start:
            problems.append(
                f"{key}.gen_start={self.gen_start} is before {key}.disc_start={self.disc_start}; the generator needs "
                f"a discriminator that trains: give gen_start >= disc_start"
            )
        return problems

    def disc_on(self, step: int) -> bool:
        """Whether the discriminator trains at optimizer step ``step``."""
        return self.ever_on and step >= self.disc_start

    def gen_factor(self, step: int) -> float:
        """The share (0 to 1) of ``weight`` the generator term gets at optimizer step ``step``."""
        if not self.ever_on or step < self.gen_start:
            return 0.0
        if self.ramp_steps > 0:
            return min(1.0, (step - self.gen_start + 1) / self.ramp_steps)
        return 1.0


def min_input_size(config: GANConfig) -> int:
    """The smallest frame height and width the discriminator of ``config`` takes (any number of frames >= 1 works).

    Each strided convolution (kernel 4, padding 1) takes a side ``s >= 2`` to ``s // 2``.
    """
    return 2**config.layers


def group_count(channels: int) -> int:
    """GroupNorm's groups for ``channels``: the largest divisor of ``channels`` that is at most 32."""
    return max(g for g in range(1, min(32, channels) + 1) if channels % g == 0)


def _norm(kind: str, channels: int, dims: int) -> nn.Module:
    """The normalisation layer ``kind`` for ``channels`` features of a ``dims``-D convolution."""
    if kind == "group":
        return nn.GroupNorm(group_count(channels), channels)
    if kind == "batch":
        return nn.BatchNorm3d(channels) if dims == 3 else nn.BatchNorm2d(channels)
    if kind == "instance":
        # Affine, so that every norm choice has a learnt scale and shift.
        return nn.InstanceNorm3d(channels, affine=True) if dims == 3 else nn.InstanceNorm2d(channels, affine=True)
    return nn.Identity()


def _init(module: nn.Module) -> None:
    """PatchGAN's initialisation: convolutions N(0, 0.02), norm scales N(1, 0.02), biases 0."""
    if isinstance(module, (nn.Conv2d, nn.Conv3d)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, (nn.GroupNorm, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm2d, nn.InstanceNorm3d)):
        nn.init.normal_(module.weight, 1.0, 0.02)
    if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


class PatchDiscriminator(nn.Module):
    """PatchGAN on videos ``[B, 3, T, H, W]``: ``patch3d`` -> logits ``[B, 1, t, h, w]``, ``patch2d`` (per frame)
    -> ``[B * T, 1, h, w]``."""

    def __init__(self, config: GANConfig) -> None:
        super().__init__()
        self.per_frame = config.discriminator == "patch2d"
        # Channels-last inputs (NDHWC, or NHWC frames), the layout of cuDNN's tensor-core convolutions; set by the
        # training's acceleration switches with the weights' layout, the values are the same.
        self.channels_last = False
        # Set by the training's acceleration switches: how the network runs (e.g. compiled), given the bound
        # method; None runs it as it is. A function held here, not a compiled one: a deep copy stays plain.
        self.forward_wrapper: Callable[[Callable[[Tensor], Tensor]], Callable[[Tensor], Tensor]] | None = None
        self.layers = config.layers
        self.min_size = min_input_size(config)
        dims = 2 if self.per_frame else 3
        self.net = nn.Sequential(*_layers(config, dims))
        self.net.apply(_init)
        if config.spectral_norm:
            # After the initialisation: the parametrisation normalises whatever weight it wraps.
            for name, module in list(self.net.named_children()):
                if isinstance(module, (nn.Conv2d, nn.Conv3d)):
                    setattr(self.net, name, spectral_norm(module))

    def forward(self, video: Tensor) -> Tensor:
        self._check(video)
        run = self._run if self.forward_wrapper is None else self.forward_wrapper(self._run)
        return run(video)

    def eager(self, video: Tensor) -> Tensor:
        """:meth:`forward` never through ``forward_wrapper`` (R1 differentiates it twice, which compiled code
        does not support)."""
        self._check(video)
        return self._run(video)

    def _check(self, video: Tensor) -> None:
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"the discriminator takes videos [B, 3, T, H, W]; got shape {list(video.shape)}")
        height, width = video.shape[-2:]
        if min(height, width) < self.min_size:
            raise ValueError(
                f"frames of {height}x{width} are too small for loss.gan.layers={self.layers}: "
                f"they need at least {self.min_size}x{self.min_size}; lower loss.gan.layers or use larger crops"
            )

    def _run(self, video: Tensor) -> Tensor:
        if self.per_frame:
            # [B, 3, T, H, W] -> [B * T, 3, H, W]: every frame is judged on its own.
            video = video.transpose(1, 2).flatten(0, 1)
        if self.channels_last:
            video = video.contiguous(memory_format=torch.channels_last if self.per_frame else torch.channels_last_3d)
        return self.net(video)


def _layers(config: GANConfig, dims: int) -> list[nn.Module]:
    """The discriminator's convolutions, norms and activations, in order."""
    conv = nn.Conv3d if dims == 3 else nn.Conv2d
    # patch3d: kernel 3 and padding 1 in time, so a strided layer takes T to ceil(T / 2) and T = 1 works.
    kernel, padding = ((3, 4, 4), (1, 1, 1)) if dims == 3 else (4, 1)
    has_norm = config.norm != "none"
    widths = [config.channels * min(2**i, MAX_WIDTH) for i in range(config.layers)]
    # The first layer sees raw pixels: no norm, as in PatchGAN.
    modules: list[nn.Module] = [conv(3, widths[0], kernel, 2, padding), nn.LeakyReLU(0.2)]
    for width_in, width_out in zip(widths, widths[1:], strict=False):
        # A norm right after removes a bias: leave it out.
        modules += [
            conv(width_in, width_out, kernel, 2, padding, bias=not has_norm),
            _norm(config.norm, width_out, dims),
            nn.LeakyReLU(0.2),
        ]
    # One logit per patch; kernel 3 with padding 1 keeps the map's size.
    modules.append(conv(widths[-1], 1, 3, 1, 1))
    return modules


def build_discriminator(config: GANConfig) -> nn.Module:
    """A freshly initialised discriminator (no weights read) for ``config``; raises ``ValueError`` naming the bad
    ``loss.gan.*`` settings."""
    problems = config.problems()
    if problems:
        raise ValueError("invalid loss.gan settings: " + "; ".join(problems))
    return PatchDiscriminator(config)


def _check_kind(kind: str) -> None:
    if kind not in LOSSES:
        raise ValueError(f"loss.gan.loss={kind!r} must be one of {', '.join(LOSSES)}")


def discriminator_loss(kind: str, real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    """The discriminator's loss (fp32 scalar): real logits pushed up, fake ones down, half from each side."""
    _check_kind(kind)
    real, fake = real_logits.float(), fake_logits.float()
    if kind == "hinge":
        return 0.5 * (F.relu(1 - real).mean() + F.relu(1 + fake).mean())
    return 0.5 * (F.softplus(-real).mean() + F.softplus(fake).mean())


def generator_loss(kind: str, fake_logits: Tensor) -> Tensor:
    """The generator's adversarial loss (fp32 scalar): low when the discriminator calls reconstructions real."""
    _check_kind(kind)
    fake = fake_logits.float()
    if kind == "hinge":
        return -fake.mean()
    return F.softplus(-fake).mean()


class LeCam(nn.Module):
    """LeCam regularisation (Tseng et al. 2021, as in VidTok and MAGVIT-v2): penalises real logits above the moving
    average of the fake ones and fake logits below that of the real ones, which keeps the discriminator from
    running away on small data. The averages are buffers, so a checkpoint carries them."""

    def __init__(self, decay: float = 0.999) -> None:
        super().__init__()
        self.decay = decay
        self.register_buffer("ema_real", torch.zeros((), dtype=torch.float32))
        self.register_buffer("ema_fake", torch.zeros((), dtype=torch.float32))
        # How many times update() ran; 0: the next update sets the averages to the batch means, not a blend with 0.
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    @torch.no_grad()
    def update(self, real_logits: Tensor, fake_logits: Tensor) -> None:
        """Move the averages towards the mean real and fake logits of this batch."""
        first = self.updates == 0
        for ema, logits in ((self.ema_real, real_logits), (self.ema_fake, fake_logits)):
            mean = logits.detach().float().mean()
            # torch.where, not an if on the count: no device-to-host sync in the training step.
            ema.copy_(torch.where(first, mean, self.decay * ema + (1 - self.decay) * mean))
        self.updates += 1

    def penalty(self, real_logits: Tensor, fake_logits: Tensor) -> Tensor:
        """``mean(relu(real - ema_fake)^2) + mean(relu(ema_real - fake)^2)`` (fp32 scalar)."""
        real, fake = real_logits.float(), fake_logits.float()
        return F.relu(real - self.ema_fake).pow(2).mean() + F.relu(self.ema_real - fake).pow(2).mean()


def r1_penalty(discriminator: Callable[[Tensor], Tensor], real: Tensor) -> Tensor:
    """R1 (Mescheder et al. 2018): the mean over the batch of the squared L2 norm of the gradient of the summed
    logits of ``discriminator`` with respect to its input ``real`` (fp32 scalar). The graph is kept
    (``create_graph``), so the penalty trains the discriminator."""
    real = real.detach().requires_grad_(True)
    logits = discriminator(real)
    (grad,) = torch.autograd.grad(logits.float().sum(), real, create_graph=True)
    return grad.float().pow(2).flatten(1).sum(1).mean()


def adaptive_weight(
    reconstruction_loss: Tensor, gan_loss: Tensor, last_layer: Tensor, max_weight: float = 1e4
) -> Tensor:
    """taming-transformers' balance of the generator term: ``||d rec / d W|| / (||d gan / d W|| + 1e-4)`` at the
    decoder's last weight ``W``, clamped to [0, ``max_weight``], detached (fp32 scalar). Both graphs are kept for
    the backward pass that follows."""
    (rec_grad,) = torch.autograd.grad(reconstruction_loss, last_layer, retain_graph=True)
    (gan_grad,) = torch.autograd.grad(gan_loss, last_layer, retain_graph=True)
    return gradient_ratio(rec_grad, gan_grad, max_weight)


def gradient_ratio(rec_grad: Tensor, gan_grad: Tensor, max_weight: float = 1e4) -> Tensor:
    """:func:`adaptive_weight` from the two gradients at the last weight, however they were computed."""
    ratio = rec_grad.float().norm() / (gan_grad.float().norm() + 1e-4)
    return ratio.clamp(0.0, max_weight).detach()
