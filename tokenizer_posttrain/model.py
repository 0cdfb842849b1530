"""The LightningModule: step logic only. Networks, losses, checkpoint I/O and data live elsewhere."""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from .checkpoint import CONFIG_KEY, load_tokenizer
from .config import LossConfig, ModelConfig, OptimConfig
from .data.batch import LOSS_MASK, VIDEO
from .losses import PerceptualLoss, build_perceptual_loss, reconstruction_losses
from .media import side_by_side_frames, write_mp4
from .metrics import video_psnr, video_ssim
from .network import CausalVideoTokenizer, build_tokenizer
from .network.acceleration import compile_module_call, configure_network
from .optim import build_optimizer
from .trainable import configure_trainable


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN/Inf loss or gradient."""


class TokenizerModel(pl.LightningModule):
    """Post-trains a Cosmos tokenizer: L1 + VGG16 perceptual loss, on all weights, one side or LoRA."""

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
        self.network = self._build_network(self.model_config)
        self.trainable_names = configure_trainable(self.network, self.model_config.trainable, self.model_config.lora)
        self._configure_speed(training=True)
        # Built only when its weight is > 0; a missing VGG16 file is an error that says where to put it.
        # Held in a list, not as a child: its frozen 59 MB of VGG weights stay out of checkpoints and DDP.
        perceptual = build_perceptual_loss(
            self.loss_config.perceptual_weight,
            self.loss_config.perceptual.weights_path,
            self.loss_config.perceptual.frame_chunk,
            channels_last=self.model_config.channels_last,
        )
        self._perceptual = [perceptual] if perceptual is not None else []
        # A compiled function, not a compiled module: wrapping the network would rename every checkpoint key.
        self._step_terms = compile_module_call(self._train_terms) if self.model_config.compile else self._train_terms
        self.max_bad_steps = max_bad_steps
        # Clipped here, from the norm logged anyway, rather than by Lightning: Lightning refuses to
        # clip for fused AdamW (our CUDA optimizer) under mixed precision, even bf16, which has no scaler.
        self.gradient_clip_val = gradient_clip_val
        self.bad_steps = 0
        self._last_batch_end: float | None = None

    def _configure_speed(self, training: bool) -> None:
        """Checkpointing and channels-last while training; the plain network for export afterwards."""
        cfg = self.model_config
        configure_network(
            self.network,
            activation_checkpointing=training and cfg.activation_checkpointing,
            channels_last=training and cfg.channels_last,
        )

    @staticmethod
    def _build_network(cfg: ModelConfig) -> CausalVideoTokenizer:
        overrides = {"channels": cfg.channels} if cfg.channels else {}
        if cfg.jit_ckpt_pth is None:
            warnings.warn(
                f"model.jit_ckpt_pth is not set: training {cfg.model} from RANDOM weights. "
                "Point it at a Cosmos checkpoint folder to post-train.",
                stacklevel=2,
            )
            return build_tokenizer(cfg.model, **overrides)
        return load_tokenizer(cfg.jit_ckpt_pth, cfg.model, **overrides)

    def _input(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        # Loaders give bf16; feeding the parameters' dtype lets autocast choose conv precision
        # and keeps bf16-true and fp32 runs consistent.
        dtype = self.network.post_quant_conv.conv3d.weight.dtype
        return batch[VIDEO].to(dtype), batch[LOSS_MASK]

    def reconstruct(self, video: Tensor) -> Tensor:
        net = self.network
        if self.model_config.trainable == "decoder" and self.training:
            # The encoder is frozen: no activations kept for it, no gradients computed.
            net.check_video(video)
            with torch.no_grad():
                encoded = net._encode(video)
            return net._decode(encoded[1] if net.is_discrete else encoded[0])
        return net(video)

    def _perceptual_on(self, device: torch.device) -> PerceptualLoss | None:
        # Moved here, outside the compiled step: not a child module, so Lightning does not move it.
        return self._perceptual[0].to(device) if self._perceptual else None

    def losses(self, reconstruction: Tensor, video: Tensor, mask: Tensor) -> dict[str, Tensor]:
        cfg = self.loss_config
        perceptual = self._perceptual_on(video.device)
        return reconstruction_losses(reconstruction, video, mask, cfg.l1_weight, perceptual, cfg.perceptual_weight)

    def _train_terms(self, video: Tensor, mask: Tensor, perceptual: PerceptualLoss | None) -> dict[str, Tensor]:
        """Forward of network and losses: the part ``model.compile`` compiles as one graph."""
        cfg = self.loss_config
        reconstruction = self.reconstruct(video)
        return reconstruction_losses(reconstruction, video, mask, cfg.l1_weight, perceptual, cfg.perceptual_weight)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        video, mask = self._input(batch)
        terms = self._step_terms(video, mask, self._perceptual_on(video.device))
        # A NaN/Inf loss is not caught here: it makes NaN gradients, which on_before_optimizer_step
        # detects after DDP's all-reduce, so every rank skips the same step. Returning None on one
        # rank would leave the others waiting in the all-reduce, and checking here would make the
        # host wait for the GPU at every micro-batch.
        batch_size = video.shape[0]
        for name, value in terms.items():
            self.log(f"train/{name}", value, prog_bar=name == "loss", batch_size=batch_size)
        return terms["loss"]

    def _bad_step(self, why: str) -> None:
        self.bad_steps += 1
        self.log("train/bad_steps", float(self.bad_steps), batch_size=1)
        warnings.warn(f"step {self.global_step}: {why}; step skipped ({self.bad_steps} in a row)", stacklevel=2)
        if self.bad_steps >= self.max_bad_steps:
            raise NonFiniteLossError(
                f"{self.bad_steps} steps in a row had a NaN/Inf loss or gradient (trainer.max_bad_steps="
                f"{self.max_bad_steps}); stopping. The newest checkpoint is from before them: lower optim.lr, "
                "check the data (python -m data_tools check) or use trainer.precision=32-true, then resume."
            )

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for p in self.network.parameters() if p.grad is not None]
        if not params:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))
        if not torch.isfinite(norm):
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without gradients
            self._bad_step(f"gradient norm is {norm.item()}")
            return
        self.bad_steps = 0
        self.log("train/grad_norm", norm, batch_size=1)  # before clipping: what the data asked for
        if self.gradient_clip_val > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.gradient_clip_val, norm)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        video, mask = self._input(batch)
        reconstruction = self.network(video)
        n = video.shape[0]
        for name, value in self.losses(reconstruction, video, mask).items():
            self.log(f"val/{name}", value, batch_size=n, sync_dist=True)
        self.log("val/psnr", video_psnr(reconstruction, video), batch_size=n, sync_dist=True, prog_bar=True)
        self.log("val/ssim", video_ssim(reconstruction, video), batch_size=n, sync_dist=True)
        if batch_idx == 0 and self.trainer.is_global_zero and not self.trainer.sanity_checking:
            self._save_video(video[0], reconstruction[0])

    def _save_video(self, video: Tensor, reconstruction: Tensor) -> None:
        frames = side_by_side_frames(video, reconstruction)
        path = write_mp4(Path(self.trainer.default_root_dir) / "val_videos" / f"step{self.global_step:07d}.mp4", frames)
        for logger in self.loggers:
            if isinstance(logger, pl.loggers.WandbLogger):
                import wandb

                logger.experiment.log({"val/video": wandb.Video(str(path), format="mp4")}, step=self.global_step)

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        # Wall time between successive batch ends: it includes data loading, and on a GPU the
        # queue of asynchronous kernels catches up, unlike timing one batch's Python calls.
        now = time.perf_counter()
        last, self._last_batch_end = self._last_batch_end, now
        if last is not None:
            elapsed = now - last
            clips = batch[VIDEO].shape[0] * self.trainer.world_size
            self.log("train/clips_per_sec", clips / max(elapsed, 1e-9), batch_size=1, prog_bar=True)
            self.log("train/step_time", elapsed, batch_size=1)
        if torch.cuda.is_available() and self.device.type == "cuda":
            self.log("train/gpu_mem_gib", torch.cuda.max_memory_allocated(self.device) / 2**30, batch_size=1)

    def on_fit_end(self) -> None:
        self._configure_speed(training=False)

    def configure_optimizers(self) -> dict:
        return build_optimizer(
            self.network,
            self.optim_config,
            self.trainer.max_steps if self._trainer else -1,
            fused=self.device.type == "cuda",
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lets load_tokenizer() rebuild the exact network from a .ckpt alone.
        checkpoint[CONFIG_KEY] = self.network.config.to_dict()
