"""The adversarial stage of training (``loss.gan``): a discriminator with its own optimizer, trained in the same
optimizer steps as the tokenizer, and the generator's adversarial term added to the tokenizer's loss.

How one optimizer step runs (Lightning's automatic optimization drives the tokenizer; the discriminator is
stepped by hand, because Lightning drives only one optimizer that way):

1. every micro-batch: the tokenizer's loss terms and reconstruction (the compiled step); from ``gen_start`` on,
   the generator term ``weight x ramp x adaptive weight x G(D(reconstruction))`` with the discriminator's
   weights frozen, added to the total Lightning back-propagates (with the adaptive weight, network and loss
   run as two parts so that its gradients cost next to nothing: ``TokenizerModel.split_adversarial_step``);
2. every micro-batch from ``disc_start`` on: the discriminator's loss on the real clip and the detached
   reconstruction (plus LeCam and R1 when set), back-propagated at once into the discriminator's gradients,
   divided by the micro-batches per step so that they accumulate to a mean as the tokenizer's do;
3. at the optimizer step, after the tokenizer's backward: the discriminator's own NaN/Inf check, clipping and
   AdamW step (not before: its weights are saved for the tokenizer's backward pass through it).

The discriminator is held outside the LightningModule's children, like the loss's frozen networks: the tokenizer's
DDP never sees it (its parameters get no gradient in the tokenizer's backward pass, which DDP would report as
unused), and under DDP it has a DDP wrapper of its own for step 2. Its weights, optimizer, LeCam averages and
step count travel in checkpoints under their own key; the export never includes them. Its weights are fp32 masters
under the trainer's autocast, as the tokenizer's. It is built with a random-number generator of its own, so that
a run with the stage on is the same run as without it until ``disc_start``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..losses.gan import (
    GANConfig,
    LeCam,
    adaptive_weight,
    build_discriminator,
    discriminator_loss,
    generator_loss,
    r1_penalty,
)

CHECKPOINT_KEY = "adversarial"
"""The checkpoint entry that holds the discriminator, its optimizer, the LeCam averages and the step count."""
_INIT_SEED = 20250


class AdversarialStage:
    """The discriminator of ``config`` and everything that trains it; see the module's docstring for the order."""

    def __init__(self, config: GANConfig) -> None:
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_INIT_SEED)
            self.discriminator = build_discriminator(config)
        self.lecam = LeCam(config.lecam_decay)
        self.optimizer: torch.optim.Optimizer | None = None
        self.wrapped: nn.Module = self.discriminator
        self.steps = 0  # discriminator optimizer steps taken (R1's cadence)
        # The adaptive weight last computed, and at which optimizer step (loss.gan.adaptive_every > 1 reuses it).
        self.adaptive: Tensor | None = None
        self.adaptive_step = -1
        self._pending: dict[str, Any] | None = None
        self._has_grad = False
        self.keep_gradients = False

    def accelerate(
        self, wrapper: Callable[[Callable], Callable] | None, channels_last: bool, keep_gradients: bool = False
    ) -> None:
        """The training's speed switches on the discriminator: its forward passes (the generator term's and the
        discriminator step's, also inside DDP) through ``wrapper`` (e.g. compiled), and channels-last weights
        and inputs. Neither changes its values or state-dict keys. ``keep_gradients`` (CUDA graphs): its
        gradients are allocated before its first backward pass and zeroed in place after each step, never set
        to None (a replayed backward would otherwise hand it the graph's own output, which the next replay
        overwrites)."""
        self.keep_gradients = keep_gradients
        disc = self.discriminator
        if channels_last:
            disc.channels_last = True
            disc.to(memory_format=torch.channels_last if disc.per_frame else torch.channels_last_3d)
        disc.forward_wrapper = wrapper

    @property
    def dtype(self) -> torch.dtype:
        """The discriminator's weights' (fp32, whatever the trainer's precision): what its inputs are cast to,
        so that bf16-true clips meet fp32 weights. Under mixed precision autocast still picks the convolutions'
        precision; under bf16-true (no autocast) the discriminator runs in fp32."""
        return next(self.discriminator.parameters()).dtype

    def parameters(self) -> list[nn.Parameter]:
        return list(self.discriminator.parameters())

    def start(self, device: torch.device) -> None:
        """Before the first step of a fit: weights on ``device``, the optimizer, a DDP wrapper when distributed,
        and a checkpoint's states if one was read."""
        self.discriminator.to(device)
        self.lecam.to(device)
        if self.optimizer is None:
            cfg = self.config
            self.optimizer = torch.optim.AdamW(
                self.discriminator.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.wrapped = nn.parallel.DistributedDataParallel(self.discriminator, device_ids=ids)
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    # The generator side ---------------------------------------------------------------------------------

    def generator_term(
        self, reconstruction: Tensor, reconstruction_loss: Tensor, last_layer: Tensor | None, step: int
    ) -> dict[str, Tensor]:
        """``{"gan_g": G loss, "gan_weight": its weight}`` at optimizer ``step`` (empty before ``gen_start``):
        the term the tokenizer's total adds as ``gan_weight * gan_g``. The discriminator is frozen meanwhile:
        gradients reach the reconstruction, not its weights."""
        factor = self.config.gen_factor(step)
        if factor == 0:
            return {}
        g_loss = self.generator_loss(reconstruction)
        if self.config.adaptive and last_layer is not None and torch.is_grad_enabled():
            if self.adaptive_due(step, split=False):
                self.adaptive_computed(
                    adaptive_weight(reconstruction_loss, g_loss, last_layer, self.config.adaptive_max), step
                )
            assert self.adaptive is not None
            weight = self.adaptive
        else:
            weight = torch.ones((), device=g_loss.device)
        return {"gan_g": g_loss, "gan_weight": self.gan_weight(weight, step)}

    def generator_loss(self, reconstruction: Tensor) -> Tensor:
        """The generator's loss on ``reconstruction``, the discriminator frozen (gradients reach the
        reconstruction only)."""
        self.discriminator.requires_grad_(False)
        try:
            return generator_loss(self.config.loss, self.discriminator(reconstruction.to(self.dtype)))
        finally:
            self.discriminator.requires_grad_(True)

    def gan_weight(self, adaptive: Tensor, step: int) -> Tensor:
        """The generator term's factor at optimizer ``step`` for the adaptive weight ``adaptive`` (detached)."""
        return (adaptive * self.config.weight * self.config.gen_factor(step)).detach()

    def adaptive_every(self, split: bool) -> int:
        """``loss.gan.adaptive_every``, or where it is null: 1 in the training step that takes the weight's
        gradients apart (``split``), 8 where each computation costs two more backward passes."""
        return self.config.adaptive_every or (1 if split else 8)

    def adaptive_due(self, step: int, split: bool) -> bool:
        """Whether taming's weight is computed at optimizer ``step`` (every micro-batch with an
        :meth:`adaptive_every` of 1), rather than the last one reused."""
        every = self.adaptive_every(split)
        return every == 1 or self.adaptive is None or (step % every == 0 and step != self.adaptive_step)

    def adaptive_computed(self, weight: Tensor, step: int) -> None:
        """Keep ``weight``, computed at optimizer ``step``, for the steps that reuse it."""
        self.adaptive = weight.detach()
        self.adaptive_step = step

    # The discriminator side -----------------------------------------------------------------------------

    def discriminator_backward(self, real: Tensor, reconstruction: Tensor, step: int, micro_batches: int) -> dict:
        """From ``disc_start`` on: the discriminator's loss on ``real`` and the detached ``reconstruction``,
        back-propagated into its gradients (scaled by ``1 / micro_batches``); its logged values."""
        if not self.config.disc_on(step):
            return {}
        cfg = self.config
        real = real.detach().to(self.dtype)
        # One forward of real and fake together: one pass through the (possibly DDP-wrapped) network.
        logits = self.wrapped(torch.cat([real, reconstruction.detach().to(self.dtype)]))
        real_logits, fake_logits = logits.float().chunk(2)
        d_loss = discriminator_loss(cfg.loss, real_logits, fake_logits)
        total = d_loss
        values = {"gan_d": d_loss, "d_real": real_logits.mean(), "d_fake": fake_logits.mean()}
        values = {name: value.detach() for name, value in values.items()}
        if cfg.lecam_weight > 0:
            lecam = self.lecam.penalty(real_logits, fake_logits)
            self.lecam.update(real_logits.detach(), fake_logits.detach())
            total = total + cfg.lecam_weight * lecam
            values["lecam"] = lecam.detach()
        if cfg.r1_weight > 0 and self.steps % cfg.r1_every == 0:
            # Lazy R1: every r1_every discriminator steps, its weight scaled by r1_every.
            r1 = r1_penalty(self.discriminator.eager, real)
            total = total + cfg.r1_weight * cfg.r1_every * r1
            values["r1"] = r1.detach()
        if self.keep_gradients:
            for param in self.discriminator.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        (total / micro_batches).backward()
        self._has_grad = True
        return values

    def optimizer_step(self) -> float | None:
        """After the tokenizer's backward of an optimizer step: clip and step the discriminator, or skip a
        step whose gradient norm is NaN/Inf (its gradients are dropped). The gradient norm, or None if the
        discriminator had no gradients this step."""
        if not self._has_grad or self.optimizer is None:
            return None
        self._has_grad = False
        params = [p for p in self.discriminator.parameters() if p.grad is not None]
        clip = self.config.gradient_clip_val if self.config.gradient_clip_val > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip, foreach=True))
        if math.isfinite(norm):
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=not self.keep_gradients)
        return norm

    # Checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (checkpoints are read weights-only)."""
        return {
            "discriminator": self.discriminator.state_dict(),
            "lecam": self.lecam.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "steps": self.steps,
            "adaptive": self.adaptive.detach().cpu() if self.adaptive is not None else None,
            "adaptive_step": self.adaptive_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state`` now if the stage has started, else at :meth:`start` (after the move to the device,
        so that the optimizer's moments land where the weights are)."""
        if self.optimizer is None:
            self._pending = state
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.discriminator.load_state_dict(state["discriminator"], strict=True)
        self.lecam.load_state_dict(state["lecam"], strict=True)
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        adaptive = state.get("adaptive")
        device = next(self.discriminator.parameters()).device
        self.adaptive = adaptive.to(device) if adaptive is not None else None
        self.adaptive_step = int(state.get("adaptive_step", -1))
