"""The LightningModule: the step logic (forward, loss, backward hand-off, validation) and nothing else.

Speed switches are :class:`~.acceleration.StepAcceleration`'s, the per-step bookkeeping (NaN/Inf skips,
clipping, logged scalars) is :class:`~.step_guard.StepGuard`'s, the loss is :mod:`tokenizer_posttrain.losses`'.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn.modules.dropout import _DropoutNd

from ..data.batch import LOSS_MASK, VIDEO
from ..evaluation.metrics import video_psnr, video_ssim
from ..io.checkpoint import CONFIG_KEY, TRAIN_OVERRIDES, load_tokenizer
from ..losses import Loss, LossConfig, build_loss
from ..losses.consistency import ConsistencyWindows
from ..losses.gan import gradient_ratio
from ..network import VideoTokenizer, build_tokenizer
from .acceleration import StepAcceleration
from .adversarial import CHECKPOINT_KEY as ADVERSARIAL_KEY
from .adversarial import AdversarialStage
from .config import ModelConfig, OptimConfig
from .monitoring import save_validation_video
from .optim import build_optimizer
from .step_guard import StepGuard
from .trainable import configure_trainable

RECONSTRUCTION = "reconstruction"
"""The step's output key for the reconstruction, present only with loss.gan on (it is no loss term)."""


class TokenizerModel(pl.LightningModule):
    """Post-trains a Cosmos tokenizer on its loss (L1 + VGG16 perceptual by default): all weights, one side
    or LoRA adapters."""

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
        self.trainable_names = configure_trainable(self.network, self.model_config.trainable, self.model_config.lora)
        # Held in a list, not as a child: its frozen networks (59 MB of VGG16) stay out of checkpoints and DDP.
        self._loss: list[Loss] = [build_loss(self.loss_config)]
        gan = self.loss_config.gan
        # Built before anything compiles; None when loss.gan is off (then nothing of it exists).
        self.adversarial = AdversarialStage(gan) if gan.ever_on else None
        # A name, not the parameter: a Parameter set as an attribute would join this module's state dict.
        self._gan_last_layer = gan_last_layer(self.network) if self.adversarial is not None and gan.adaptive else None
        # The split step needs the last trained weight in the decoder's tail, and the tail to give on a second
        # run what it gave in the forward pass (no LoRA dropout drawing another mask there).
        last = self._gan_last_layer
        self._tail_splits = (
            last is not None
            and last.startswith(self.network.head + ".")
            and not any(
                isinstance(m, _DropoutNd) and m.p > 0 for m in self.network.get_submodule(self.network.head).modules()
            )
        )
        whole = last is not None and (self.loss_config.consistency.ever_on or not self._tail_splits)
        if whole and self.model_config.replays_cuda_graphs:
            # Taking the adaptive weight's gradients through the whole step differentiates its graphs three
            # times (retain_graph), which recorded CUDA graphs cannot replay.
            warnings.warn(
                "loss.gan: the training step runs compiled but without CUDA graphs (model.cuda_graphs ignored): "
                f"with loss.consistency on, the last trained weight ({last}) before the decoder's last layer, or "
                "LoRA dropout on it, the adaptive weight's gradients are taken through the whole step; "
                "docs/benchmarks.md has what CUDA graphs are worth",
                stacklevel=2,
            )
            self.model_config = replace(self.model_config, cuda_graphs=False)
        if whole and gan.adaptive_every is not None and gan.adaptive_every < 8:
            warnings.warn(
                f"loss.gan.adaptive_every={gan.adaptive_every}: with loss.consistency on, the last trained weight "
                f"({last}) before the decoder's last layer, or LoRA dropout on it, each computation of the adaptive "
                "weight takes two more backward passes of network and loss; loss.gan.adaptive_every=8 (or null) "
                "computes it every 8 steps (docs/loss.md, Adversarial fine-tuning)",
                stacklevel=2,
            )
        self.acceleration = StepAcceleration(self.model_config)
        self.acceleration.apply(self.network, self.loss)
        if self.adversarial is not None:
            self.acceleration.apply_discriminator(self.adversarial)
        self.step_forward = self.acceleration.wrap_step(self._step_forward)
        self._loss_call = self.acceleration.wrap_loss(self.loss.forward)
        # The GAN stage's step with the adaptive weight (split_adversarial_step): network and loss as two parts.
        self._network_part = self.acceleration.wrap_part(self._reconstruct_with_head_input)
        self._loss_part = self.acceleration.wrap_part(self._loss_call)
        self.guard = StepGuard(max_bad_steps, gradient_clip_val)

    @property
    def loss(self) -> Loss:
        return self._loss[0]

    @property
    def loss_history(self) -> list[tuple[int, float]]:
        """``(optimizer step, train/loss)`` of every logged step."""
        return self.guard.loss_history

    @property
    def bad_steps(self) -> int:
        """Optimizer steps skipped in a row so far for a NaN/Inf gradient norm (as far as read back)."""
        return self.guard.nonfinite.in_a_row

    def _input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        # Loaders give bf16; feeding the parameters' dtype lets autocast choose conv precision
        # and keeps bf16-true and fp32 runs consistent.
        dtype = self.network.dtype
        return batch[VIDEO].to(dtype), batch[LOSS_MASK]

    def reconstruct(self, video: Tensor) -> Tensor:
        return self._reconstruct_with_head_input(video)[0]

    def _reconstruct_with_head_input(self, video: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`reconstruct`, and the input of the decoder's last layer."""
        if self.model_config.trainable == "decoder" and self.training:
            # The encoder is frozen: no activations kept for it, no gradients computed.
            with torch.no_grad():
                latent = self.network.encoding(video).latent
        else:
            latent = self.network.encoding(video).latent
        return self.network.decode_with_head_input(latent)

    def consistency_windows(self, video: Tensor, weights: dict[str, float]) -> ConsistencyWindows | None:
        """The network's outputs on the overlapping windows of every clip, all in one batch (one more network
        pass), when ``loss.consistency`` is on in ``weights``; else None, at no cost."""
        term = self.loss.consistency(weights)
        if term is None:
            return None
        windows = term.cut(video)
        if self.model_config.trainable == "decoder" and self.training:
            with torch.no_grad():
                latent = self.network.encoding(windows).latent
        else:
            latent = self.network.encoding(windows).latent
        # DV: pixels only (the codes are quantized, FSQ levels; they agree or not through the pixels).
        return ConsistencyWindows(self.network.decode(latent), None if self.network.is_discrete else latent)

    def losses(self, reconstruction: Tensor, video: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """Every loss term active at the current step, and their total ``"loss"`` (not compiled)."""
        weights = self.loss.prepare(self.global_step, video.device)
        return self.loss(reconstruction, video, mask, weights, self.consistency_windows(video, weights))

    def _step_forward(self, video: Tensor, mask: Tensor, weights: dict[str, float]) -> dict[str, Tensor]:
        """Forward of network and loss: the part ``model.compile`` compiles (as one graph, or in pieces)."""
        windows = self.consistency_windows(video, weights)
        reconstruction = self.reconstruct(video)
        terms = self._loss_call(reconstruction, video, mask, weights, windows)
        if self.adversarial is not None:  # the discriminator needs it, outside the compiled step
            terms = {**terms, RECONSTRUCTION: reconstruction}
        return terms

    def adversarial_terms(self, terms: dict[str, Tensor], video: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """``terms`` with the GAN stage's: the generator term added to ``"loss"`` (from ``loss.gan.gen_start``),
        and the discriminator's loss back-propagated into its own gradients (from ``loss.gan.disc_start``).
        Masked-out pixels are zero in what the discriminator sees of both clips."""
        assert self.adversarial is not None
        terms = dict(terms)
        mask = mask.to(video.dtype)
        reconstruction = terms.pop(RECONSTRUCTION) * mask
        real = video * mask
        step = self.global_step
        last = self.network.get_parameter(self._gan_last_layer) if self._gan_last_layer else None
        gan = self.adversarial.generator_term(reconstruction, terms["loss"], last, step)
        if gan:
            terms["loss"] = terms["loss"] + gan["gan_weight"] * gan["gan_g"]
            terms.update(gan)
        micro_batches = self.trainer.accumulate_grad_batches if self._trainer else 1
        terms.update(self.adversarial.discriminator_backward(real, reconstruction, step, micro_batches))
        return terms

    def splits_adversarial_step(self, weights: dict[str, float]) -> bool:
        """Whether this micro-batch runs :meth:`split_adversarial_step`: the generator term on with the adaptive
        weight, whose last layer is the decoder's :meth:`tail` (not with loss.consistency, whose windows pass
        through that layer too, nor with LoRA dropout in that layer, nor under 16-mixed's loss scaling)."""
        stage = self.adversarial
        return (
            stage is not None
            and self._tail_splits
            and not self._loss_scaled()
            and torch.is_grad_enabled()
            and stage.config.gen_factor(self.global_step) > 0
            and self.loss.consistency(weights) is None
        )

    def _loss_scaled(self) -> bool:
        """Whether the trainer scales the loss for fp16 gradients (16-mixed): the split step's gradients, taken
        inside the loss without that scale, would flush to zero in its fp16 convolutions."""
        return self._trainer is not None and str(self.trainer.precision).startswith("16")

    def split_adversarial_step(
        self, video: Tensor, mask: Tensor, weights: dict[str, float]
    ) -> tuple[dict[str, Tensor], Tensor]:
        """The step of :meth:`adversarial_terms` with taming's adaptive weight at the cost of two small
        convolutions, not two more backward passes of network and loss.

        The loss terms and the generator term run on a detached copy of the reconstruction, so the gradient of
        each at the reconstruction is computed once, through the loss (and the discriminator) alone. The
        gradients at the last layer's weights follow from them through the decoder's :meth:`tail` alone, from
        its saved input; their norms give the weight. The total's gradient at the reconstruction, the sum of
        the two weighted, then seeds the network's backward pass through a stand-in loss that adds zero to the
        value: the same gradients as back-propagating ``rec + weight x gan`` whole, by linearity. Returns the
        terms (``"loss"`` their total) and the stand-in to back-propagate.

        The copy is fp32, and the tail runs in its weights' dtype (fp32 masters under mixed precision) without
        autocast: a per-pixel gradient of a mean over millions of pixels would flush to zero in fp16, and round
        in bf16.
        """
        stage = self.adversarial
        assert stage is not None and self._gan_last_layer is not None
        step = self.global_step
        reconstruction, head_input = self._network_part(video)
        leaf = reconstruction.detach().float().requires_grad_(True)
        terms = dict(self._loss_part(leaf, video, mask, weights, None))
        visible = mask.to(leaf.dtype)
        g_loss = stage.generator_loss(leaf * visible)
        (rec_grad,) = torch.autograd.grad(terms["loss"], leaf)
        (gan_grad,) = torch.autograd.grad(g_loss, leaf)
        terms = {name: value.detach() for name, value in terms.items()}
        if stage.adaptive_due(step, split=True):
            last = self.network.get_parameter(self._gan_last_layer)
            with torch.enable_grad(), torch.autocast(video.device.type, enabled=False):
                tail = self.network.apply_head(head_input.detach().to(last.dtype))  # fp32 masters: fp32
            (rec_w,) = torch.autograd.grad(tail, last, rec_grad, retain_graph=True)
            (gan_w,) = torch.autograd.grad(tail, last, gan_grad)
            stage.adaptive_computed(gradient_ratio(rec_w, gan_w, stage.config.adaptive_max), step)
        assert stage.adaptive is not None
        gan_weight = stage.gan_weight(stage.adaptive, step)
        seed = rec_grad + gan_weight * gan_grad
        stand_in = (reconstruction.float() * seed).sum()
        value = terms["loss"] + gan_weight * g_loss.detach()
        terms.update(loss=value, gan_g=g_loss.detach(), gan_weight=gan_weight)
        micro_batches = self.trainer.accumulate_grad_batches if self._trainer else 1
        fake = leaf.detach().to(video.dtype) * visible.to(video.dtype)
        terms.update(stage.discriminator_backward(video * visible.to(video.dtype), fake, step, micro_batches))
        # Adds 0 to the value. A NaN/Inf seed makes it NaN, and the gradients, which the step guard skips; the
        # logged terms stay what they were.
        return terms, value + (stand_in - stand_in.detach())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        video, mask = self._input(batch)
        # Terms are built and moved outside the compiled step; a term at weight 0 now is not computed.
        weights = self.loss.prepare(self.global_step, video.device)
        self.acceleration.begin_micro_batch()
        if self.splits_adversarial_step(weights):
            terms, backward = self.split_adversarial_step(video, mask, weights)
        else:
            terms = self.step_forward(video, mask, weights)
            if self.adversarial is not None:
                terms = self.adversarial_terms(terms, video, mask)
            backward = terms["loss"]
        # A NaN/Inf loss is not caught here: it makes NaN gradients, which on_before_optimizer_step
        # detects after DDP's all-reduce, so every rank skips the same step. Returning None on one
        # rank would leave the others waiting in the all-reduce.
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
        if self.acceleration.cuda_graphs and self._gan_last_layer is not None and self._loss_scaled():
            raise ValueError(
                f"loss.gan's adaptive weight under trainer.precision={self.trainer.precision} is taken through the "
                "whole step, which CUDA graphs cannot replay: set model.cuda_graphs=false, or train in bf16-mixed"
            )
        self.guard.reset()
        self.acceleration.start_fit()
        if self.adversarial is not None:
            self.adversarial.start(self.device)

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
        reconstruction = self.network(video)
        n = video.shape[0]
        for name, value in self.losses(reconstruction, video, mask).items():
            self.log(f"val/{name}", value, batch_size=n, sync_dist=True)
        self.log("val/psnr", video_psnr(reconstruction, video), batch_size=n, sync_dist=True, prog_bar=True)
        self.log("val/ssim", video_ssim(reconstruction, video), batch_size=n, sync_dist=True)
        if batch_idx == 0 and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            save_validation_video(self.trainer, video[0], reconstruction[0])

    def on_fit_end(self) -> None:
        self.acceleration.release(self.network)

    def configure_optimizers(self) -> dict:
        return build_optimizer(
            self.network,
            self.optim_config,
            self.trainer.max_steps if self._trainer else -1,
            fused=self.device.type == "cuda",
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.guard.on_save_checkpoint(self)
        # Lets load_tokenizer() rebuild the exact network from a .ckpt alone.
        checkpoint[CONFIG_KEY] = self.network.config.to_dict()
        if self.adversarial is not None:
            checkpoint[ADVERSARIAL_KEY] = self.adversarial.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.adversarial is not None and ADVERSARIAL_KEY in checkpoint:
            self.adversarial.load_state_dict(checkpoint[ADVERSARIAL_KEY])


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


def build_network(cfg: ModelConfig) -> VideoTokenizer:
    """The network to post-train: ``model.jit_ckpt_pth`` loaded strictly, else random weights (warned)."""
    overrides = {"channels": cfg.channels} if cfg.channels else {}
    if cfg.jit_ckpt_pth is None:
        warnings.warn(
            f"model.jit_ckpt_pth is not set: training {cfg.model} from RANDOM weights. "
            "Point it at a Cosmos checkpoint folder to post-train.",
            stacklevel=2,
        )
        return build_tokenizer(cfg.model, **overrides)
    return load_tokenizer(cfg.jit_ckpt_pth, cfg.model, setting_names=TRAIN_OVERRIDES, **overrides)
