"""The LightningModule: the step logic (forward, loss, backward hand-off, validation) and nothing else.

Speed switches are :class:`~.acceleration.StepAcceleration`'s, the per-step bookkeeping (NaN/Inf skips,
clipping, logged scalars) is :class:`~.step_guard.StepGuard`'s, the loss is :mod:`tokenizer_posttrain.losses`',
the GAN stage (its discriminator, optimizer, schedule, backward pass and checkpoint entry) is
:class:`~.adversarial.AdversarialStage`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from ..data.batch import LOSS_MASK, VIDEO
from ..evaluation.metrics import video_psnr, video_ssim
from ..io.checkpoint import CONFIG_KEY, TRAIN_OVERRIDES, load_tokenizer
from ..losses import Loss, LossConfig, NetworkOutput, Posterior, StepContext, build_loss
from ..network import Encoding, VideoTokenizer, build_tokenizer, channel_scale
from .acceleration import StepAcceleration
from .adversarial import RECONSTRUCTION, AdversarialStage
from .config import ModelConfig, OptimConfig
from .monitoring import save_validation_video
from .optim import build_optimizer
from .step_guard import StepGuard
from .trainable import configure_trainable


class TokenizerModel(pl.LightningModule):
    """Post-trains a tokenizer on its loss (L1 + VGG16 perceptual by default): all weights, one side or LoRA."""

    def __init__(
        self,
        model: ModelConfig | None = None,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        max_bad_steps: int = 10,
        gradient_clip_val: float = 0.0,
    ) -> None:
        super().__init__()
        self.model_config = model or ModelConfig()
        self.optim_config = optim or OptimConfig()
        self.loss_config = loss or LossConfig()
        self.save_hyperparameters(
            {"model": asdict(self.model_config), "optim": asdict(self.optim_config), "loss": asdict(self.loss_config)}
        )
        self.network = build_network(self.model_config)
        # Held in a list, not as a child: its frozen networks (59 MB of VGG16, a base encoder) stay out of
        # checkpoints and DDP. Attached before adapters or training change the network.
        self._loss: list[Loss] = [build_loss(self.loss_config)]
        self.loss.attach(self.network)
        self.trainable_names = configure_trainable(self.network, self.model_config.trainable, self.model_config.lora)
        gan = self.loss_config.gan
        # Built before anything compiles; None when loss.gan is off (then nothing of it exists).
        self.adversarial = AdversarialStage(gan, self.network, self.loss) if gan.ever_on else None
        if self.adversarial is not None:  # some of its steps cannot replay CUDA graphs
            self.model_config = self.adversarial.resolve(self.model_config)
        self.acceleration = StepAcceleration(self.model_config)
        self.acceleration.apply(self.network, self.loss)
        self._loss_call = self.acceleration.wrap_loss(self.loss.forward)
        if self.adversarial is not None:
            self.adversarial.accelerate_step(self.acceleration, self._reconstruct_with_head_input, self._loss_call)
        self.step_forward = self.acceleration.wrap_step(self._step_forward)
        self.guard = StepGuard(max_bad_steps, gradient_clip_val)
        # model.latent_noise's level at this step, set before the compiled step runs, which reads it as a constant:
        # a schedule's few values compile a few times, where the step counter itself would recompile every step.
        self.latent_noise_level = self.model_config.latent_noise.weight_at(0)

    @property
    def loss(self) -> Loss:
        return self._loss[0]

    def _input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        # Loaders give bf16; the weights' dtype lets autocast choose conv precision (bf16-true, fp32 alike).
        return batch[VIDEO].to(self.network.dtype), batch[LOSS_MASK]

    def _encoding(self, video: Tensor) -> Encoding:
        if self.model_config.trainable == "decoder" and self.training:  # frozen: no activations kept, no gradients
            with torch.no_grad():
                return self.network.encoding(video)
        return self.network.encoding(video)

    def _decoded(self, encoding: Encoding) -> Tensor:
        """What the decoder reads: a posterior sample with model.sample_posterior (training), else the latent;
        while training with model.latent_noise, plus Gaussian noise in units of each channel's spread."""
        if not self.training:
            return encoding.latent
        latent = encoding.sample() if self.model_config.sample_posterior else encoding.latent
        level = self.latent_noise_level
        if level:
            scale = channel_scale(self.network.config, encoding.latent.detach())
            latent = latent + (level * scale).to(latent.dtype) * torch.randn_like(latent)
        return latent

    def _reconstruct_with_head_input(self, video: Tensor) -> tuple[Tensor, Tensor]:
        """The reconstruction, and the input of the decoder's last layer (the GAN stage's split step)."""
        return self.network.decode_with_head_input(self._decoded(self._encoding(video)))

    def _extra_pass(self, clips: Tensor) -> NetworkOutput:
        """The network on the clips a loss term asked for (the continuous latents too; DV: pixels only)."""
        latent = self._encoding(clips).latent
        return NetworkOutput(self.network.decode(latent), None if self.network.is_discrete else latent)

    def losses(self, recon: Tensor, video: Tensor, mask: Tensor, encoding: Encoding | None = None) -> dict[str, Tensor]:
        """Every loss term active now on ``video``'s reconstruction ``recon`` (from ``encoding``, when the terms
        read the encoder's output), and their total (not compiled)."""
        weights = self.loss.prepare(self.global_step, video.device)
        extras = self.loss.extra_passes(video, weights, self._extra_pass)
        return self.loss(_context(recon, video, mask, encoding, extras), weights)

    def _step_forward(self, video: Tensor, mask: Tensor, weights: dict[str, float]) -> dict[str, Tensor]:
        """Forward of network and loss: the part ``model.compile`` compiles (as one graph, or in pieces)."""
        extras = self.loss.extra_passes(video, weights, self._extra_pass)  # none unless a term asks
        encoding = self._encoding(video)
        # Not decode_with_head_input: in chunks of time it keeps the whole head input, which only the GAN's split
        # step (its own path) reads.
        reconstruction = self.network.decode(self._decoded(encoding))
        terms = self._loss_call(_context(reconstruction, video, mask, encoding, extras), weights)
        if self.adversarial is not None:  # the discriminator needs it, outside the compiled step
            terms = {**terms, RECONSTRUCTION: reconstruction}
        return terms

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        video, mask = self._input(batch)
        # Terms are built and moved outside the compiled step; a term at weight 0 now is not computed.
        weights = self.loss.prepare(self.global_step, video.device)
        self.latent_noise_level = self.model_config.latent_noise.weight_at(self.global_step)
        self.acceleration.begin_micro_batch()
        stage = self.adversarial
        if stage is not None and stage.splits(self, weights):
            terms, backward = stage.split_step(self, video, mask, weights)
        else:
            terms = self.step_forward(video, mask, weights)
            if stage is not None:
                terms = stage.add_terms(self, terms, video, mask)
            backward = terms["loss"]
        # A NaN/Inf loss is not caught here: its NaN gradients are, after DDP's all-reduce (on_before_optimizer_step),
        # so every rank skips the same step. Returning None on one rank would leave the others waiting there.
        self.guard.add_micro_batch(terms)
        return backward

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self.acceleration.zero_grad(optimizer, self.parameters())

    def on_before_backward(self, loss: Tensor) -> None:
        self.acceleration.before_backward(self.parameters())

    def on_validation_model_zero_grad(self) -> None:
        if not self.acceleration.keeps_gradients:
            super().on_validation_model_zero_grad()

    def on_train_start(self) -> None:
        if self.adversarial is not None:
            self.adversarial.start(self.device, str(self.trainer.precision))
        self.guard.reset()
        self.acceleration.start_fit()

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.acceleration.after_first_batch()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.guard.before_optimizer_step(self, optimizer)
        if self.adversarial is not None:  # after the tokenizer's backward, which reads its weights
            self.adversarial.optimizer_step()

    def on_train_end(self) -> None:
        self.guard.on_train_end(self)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        video, mask = self._input(batch)
        encoding = self.network.encoding(video)
        reconstruction = self.network.decode(encoding.latent)
        n = video.shape[0]
        for name, value in self.losses(reconstruction, video, mask, encoding).items():
            self.log(f"val/{name}", value, batch_size=n, sync_dist=True)
        self.log("val/psnr", video_psnr(reconstruction, video), batch_size=n, sync_dist=True, prog_bar=True)
        self.log("val/ssim", video_ssim(reconstruction, video), batch_size=n, sync_dist=True)
        if batch_idx == 0 and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            save_validation_video(self.trainer, video[0], reconstruction[0])

    def on_fit_end(self) -> None:
        self.acceleration.release(self.network)

    def configure_optimizers(self) -> dict:
        max_steps = self.trainer.max_steps if self._trainer else -1
        return build_optimizer(self.network, self.optim_config, max_steps, fused=self.device.type == "cuda")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.guard.on_save_checkpoint(self)
        # Lets load_tokenizer() rebuild the exact network from a .ckpt alone.
        checkpoint[CONFIG_KEY] = self.network.config.to_dict()
        if self.adversarial is not None:
            self.adversarial.save_to(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.adversarial is not None:
            self.adversarial.load_from(checkpoint)


def _context(
    reconstruction: Tensor,
    video: Tensor,
    mask: Tensor,
    encoding: Encoding | None,
    extras: dict[str, NetworkOutput] | None = None,
) -> StepContext:
    """What the loss terms read of a step on ``video``, whose ``encoding`` gave ``reconstruction``."""
    if encoding is None:
        return StepContext(reconstruction, video, mask, None, extras)
    return StepContext(reconstruction, video, mask, Posterior.of(encoding), extras, encoding.continuous)


def build_network(cfg: ModelConfig) -> VideoTokenizer:
    """The network to post-train: ``model.jit_ckpt_pth`` loaded strictly, else random weights (warned)."""
    overrides = {"channels": cfg.channels} if cfg.channels else {}
    if cfg.jit_ckpt_pth is None:
        warnings.warn(
            f"model.jit_ckpt_pth is not set: training {cfg.model} from RANDOM weights. "
            "Point it at the model's weights (a checkpoint folder or file) to post-train.",
            stacklevel=2,
        )
        return build_tokenizer(cfg.model, **overrides)
    return load_tokenizer(cfg.jit_ckpt_pth, cfg.model, setting_names=TRAIN_OVERRIDES, **overrides)
