"""The adversarial stage of training (``loss.gan``): a discriminator with its own optimizer, trained in the same
optimizer steps as the tokenizer, and the generator's adversarial term added to the tokenizer's loss. Everything
adversarial lives in :class:`AdversarialStage`; the training step asks it which way to run and hands it the step.

How one optimizer step runs (Lightning's automatic optimization drives the tokenizer; the discriminator is
stepped by hand, because Lightning drives only one optimizer that way):

1. every micro-batch: the tokenizer's loss terms and reconstruction (the compiled step); from ``gen_start`` on,
   the generator term ``weight x ramp x adaptive weight x G(D(reconstruction))`` with the discriminator's
   weights frozen, added to the total Lightning back-propagates (with the adaptive weight, network and loss
   run as two parts so that its gradients cost next to nothing: :meth:`AdversarialStage.split_step`);
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
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from ..losses import Loss, StepContext
from ..losses.gan import (
    GANConfig,
    LeCam,
    adaptive_weight,
    build_discriminator,
    discriminator_loss,
    generator_loss,
    gradient_ratio,
    r1_penalty,
)
from ..network import VideoTokenizer
from .acceleration import StepAcceleration
from .config import ModelConfig

CHECKPOINT_KEY = "adversarial"
"""The checkpoint entry that holds the discriminator, its optimizer, the LeCam averages and the step count."""
RECONSTRUCTION = "reconstruction"
"""The training step's output key for the reconstruction, which the stage takes (it is no loss term)."""
_INIT_SEED = 20250


class AdversarialStage:
    """The discriminator of ``config``, everything that trains it, and the adversarial side of the tokenizer's
    step on ``network`` and ``loss``; see the module's docstring for the order.

    The step runs one of two ways: :meth:`split_step` where :meth:`splits` says so (the adaptive weight's
    gradients taken apart at the reconstruction), else the tokenizer's whole step followed by :meth:`add_terms`.
    """

    def __init__(self, config: GANConfig, network: VideoTokenizer, loss: Loss) -> None:
        self.config = config
        self.network = network
        self.loss = loss
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
        self._network_part: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None
        self._loss_part: Callable[[StepContext, dict[str, float]], dict[str, Tensor]] | None = None
        # A name, not the parameter: the module's state dict stays the network's alone.
        self.last_layer = gan_last_layer(network) if config.adaptive else None
        self._plan_steps()

    def _plan_steps(self) -> None:
        """Decide where :meth:`split_step` can run, and warn where the adaptive weight costs more."""
        network, last = self.network, self.last_layer
        # The split step needs the last trained weight in the decoder's head, and the head to give on a second
        # run what it gave in the forward pass (no LoRA dropout drawing another mask there).
        head = network.get_submodule(network.head)
        self.tail_splits = (
            last is not None
            and last.startswith(network.head + ".")
            and not any(isinstance(m, _DropoutNd) and m.p > 0 for m in head.modules())
        )
        beyond = [f"loss.{name}" for name, term in self.loss.terms.items() if not term.reconstruction_only]
        # Where the adaptive weight's gradients are taken through the whole step, and why (for the warnings).
        self.whole_step = last is not None and bool(beyond or not self.tail_splits)
        self._why_whole = (
            f"with {''.join(f'{name} on, ' for name in beyond)}the last trained weight ({last}) before the "
            "decoder's last layer, or LoRA dropout on it"
        )
        every = self.config.adaptive_every
        if self.whole_step and every is not None and every < 8:
            warnings.warn(
                f"loss.gan.adaptive_every={every}: {self._why_whole}, each computation of the adaptive weight "
                "takes two more backward passes of network and loss; loss.gan.adaptive_every=8 (or null) "
                "computes it every 8 steps (docs/loss.md, Adversarial fine-tuning)",
                stacklevel=4,
            )

    def resolve(self, model: ModelConfig) -> ModelConfig:
        """``model`` with ``cuda_graphs`` off (and a warning) where the adaptive weight's gradients are taken
        through the whole step: that differentiates its graphs three times (retain_graph), which recorded CUDA
        graphs cannot replay."""
        if not (self.whole_step and model.replays_cuda_graphs):
            return model
        warnings.warn(
            "loss.gan: the training step runs compiled but without CUDA graphs (model.cuda_graphs ignored): "
            f"{self._why_whole}, the adaptive weight's gradients are taken through the whole step; "
            "docs/benchmarks.md has what CUDA graphs are worth",
            stacklevel=3,
        )
        return replace(model, cuda_graphs=False)

    def accelerate_step(
        self,
        acceleration: StepAcceleration,
        network_part: Callable[[Tensor], tuple[Tensor, Tensor]],
        loss_part: Callable[[StepContext, dict[str, float]], dict[str, Tensor]],
    ) -> None:
        """The training's speed switches on the stage: on the discriminator
        (:meth:`~.acceleration.StepAcceleration.apply_discriminator`), and on the two parts :meth:`split_step`
        runs, the network's pass (reconstruction and the input of the decoder's last layer) and the loss, each
        wrapped as :meth:`~.acceleration.StepAcceleration.wrap_part` does."""
        acceleration.apply_discriminator(self)
        self._network_part = acceleration.wrap_part(network_part)
        self._loss_part = acceleration.wrap_part(loss_part)

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

    def start(self, device: torch.device, precision: str | None = None) -> None:
        """Before the first step of a fit: weights on ``device``, the optimizer, a DDP wrapper when distributed,
        and a checkpoint's states if one was read. ``precision`` (the trainer's) is refused where the adaptive
        weight would need CUDA graphs to replay a loss-scaled whole step."""
        if self.keep_gradients and self.last_layer is not None and scales_loss(precision):
            raise ValueError(
                f"loss.gan's adaptive weight under trainer.precision={precision} is taken through the "
                "whole step, which CUDA graphs cannot replay: set model.cuda_graphs=false, or train in bf16-mixed"
            )
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

    # The tokenizer's step ---------------------------------------------------------------------------------

    def splits(self, module: pl.LightningModule, weights: dict[str, float]) -> bool:
        """Whether this micro-batch runs :meth:`split_step`: the generator term on with the adaptive weight, whose
        last layer is the decoder's head (not with a term that reads the network beyond the reconstruction, such
        as loss.consistency, whose windows pass through that layer too, nor with LoRA dropout in that layer, nor
        under 16-mixed's loss scaling)."""
        return (
            self.tail_splits
            and not scales_loss(_precision(module))
            and torch.is_grad_enabled()
            and self.config.gen_factor(module.global_step) > 0
            and self.loss.reconstruction_only(weights)
        )

    def add_terms(
        self, module: pl.LightningModule, terms: dict[str, Tensor], video: Tensor, mask: Tensor
    ) -> dict[str, Tensor]:
        """``terms`` (the whole step's, with its :data:`RECONSTRUCTION`) with the stage's: the generator term added
        to ``"loss"`` (from ``loss.gan.gen_start``), and the discriminator's loss back-propagated into its own
        gradients (from ``loss.gan.disc_start``). Masked-out pixels are zero in what the discriminator sees of both
        clips."""
        terms = dict(terms)
        mask = mask.to(video.dtype)
        reconstruction = terms.pop(RECONSTRUCTION) * mask
        real = video * mask
        step = module.global_step
        last = self.network.get_parameter(self.last_layer) if self.last_layer else None
        gan = self.generator_term(reconstruction, terms["loss"], last, step)
        if gan:
            terms["loss"] = terms["loss"] + gan["gan_weight"] * gan["gan_g"]
            terms.update(gan)
        terms.update(self.discriminator_backward(real, reconstruction, step, _micro_batches(module)))
        return terms

    def split_step(
        self, module: pl.LightningModule, video: Tensor, mask: Tensor, weights: dict[str, float]
    ) -> tuple[dict[str, Tensor], Tensor]:
        """The step of :meth:`add_terms` with taming's adaptive weight at the cost of two small convolutions, not
        two more backward passes of network and loss.

        The loss terms and the generator term run on a detached copy of the reconstruction, so the gradient of
        each at the reconstruction is computed once, through the loss (and the discriminator) alone. The
        gradients at the last layer's weights follow from them through the decoder's head alone, from its saved
        input; their norms give the weight. The total's gradient at the reconstruction, the sum of the two
        weighted, then seeds the network's backward pass through a stand-in loss that adds zero to the value: the
        same gradients as back-propagating ``rec + weight x gan`` whole, by linearity. Returns the terms
        (``"loss"`` their total) and the stand-in to back-propagate.

        The copy is fp32, and the head runs in its weights' dtype (fp32 masters under mixed precision) without
        autocast: a per-pixel gradient of a mean over millions of pixels would flush to zero in fp16, and round
        in bf16.
        """
        assert self._network_part is not None and self._loss_part is not None and self.last_layer is not None
        step = module.global_step
        reconstruction, head_input = self._network_part(video)
        leaf = reconstruction.detach().float().requires_grad_(True)
        terms = dict(self._loss_part(StepContext(leaf, video, mask), weights))
        visible = mask.to(leaf.dtype)
        g_loss = self.generator_loss(leaf * visible)
        (rec_grad,) = torch.autograd.grad(terms["loss"], leaf)
        (gan_grad,) = torch.autograd.grad(g_loss, leaf)
        terms = {name: value.detach() for name, value in terms.items()}
        if self.adaptive_due(step, split=True):
            last = self.network.get_parameter(self.last_layer)
            with torch.enable_grad(), torch.autocast(video.device.type, enabled=False):
                tail = self.network.apply_head(head_input.detach().to(last.dtype))  # fp32 masters: fp32
            (rec_w,) = torch.autograd.grad(tail, last, rec_grad, retain_graph=True)
            (gan_w,) = torch.autograd.grad(tail, last, gan_grad)
            self.adaptive_computed(gradient_ratio(rec_w, gan_w, self.config.adaptive_max), step)
        assert self.adaptive is not None
        gan_weight = self.gan_weight(self.adaptive, step)
        seed = rec_grad + gan_weight * gan_grad
        stand_in = (reconstruction.float() * seed).sum()
        value = terms["loss"] + gan_weight * g_loss.detach()
        terms.update(loss=value, gan_g=g_loss.detach(), gan_weight=gan_weight)
        fake = leaf.detach().to(video.dtype) * visible.to(video.dtype)
        real = video * visible.to(video.dtype)
        terms.update(self.discriminator_backward(real, fake, step, _micro_batches(module)))
        # Adds 0 to the value. A NaN/Inf seed makes it NaN, and the gradients, which the step guard skips; the
        # logged terms stay what they were.
        return terms, value + (stand_in - stand_in.detach())

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

    def save_to(self, checkpoint: dict[str, Any]) -> None:
        """Put the stage's states in a Lightning ``checkpoint`` (under :data:`CHECKPOINT_KEY`)."""
        checkpoint[CHECKPOINT_KEY] = self.state_dict()

    def load_from(self, checkpoint: dict[str, Any]) -> None:
        """Take the stage's states from a Lightning ``checkpoint``, where it has them."""
        if CHECKPOINT_KEY in checkpoint:
            self.load_state_dict(checkpoint[CHECKPOINT_KEY])

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


def gan_last_layer(network: VideoTokenizer) -> str:
    """The name of the decoder's last convolution weight: where loss.gan's adaptive weight compares gradients."""
    # The last trained weight there: the conv's own, or a LoRA adapter's when LoRA targets it.
    prefix = network.last_layer + "."
    last = [n for n, p in network.named_parameters() if n.startswith(prefix) and n.endswith("weight")]
    trained = [n for n in last if network.get_parameter(n).requires_grad]
    if not trained:
        raise ValueError(
            f"loss.gan.adaptive compares gradients at the decoder's last layer ({network.last_layer}), which does not "
            "train in this run (model.trainable or the LoRA targets freeze it); train it, or set "
            "loss.gan.adaptive=false for a fixed generator weight"
        )
    return trained[-1]


def scales_loss(precision: str | None) -> bool:
    """Whether a trainer of ``precision`` scales the loss for fp16 gradients (16-mixed): the split step's
    gradients, taken inside the loss without that scale, would flush to zero in its fp16 convolutions."""
    return precision is not None and str(precision).startswith("16")


def _precision(module: pl.LightningModule) -> str | None:
    return str(module.trainer.precision) if module._trainer is not None else None


def _micro_batches(module: pl.LightningModule) -> int:
    """Micro-batches per optimizer step (the discriminator's gradients are their mean)."""
    return module.trainer.accumulate_grad_batches if module._trainer is not None else 1
