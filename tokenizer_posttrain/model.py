"""The LightningModule: step logic only. Networks, checkpoint I/O and data live elsewhere."""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics.functional.image import peak_signal_noise_ratio

from .checkpoint import CONFIG_KEY, load_tokenizer
from .config import ModelConfig, OptimConfig
from .data.batch import LOSS_MASK, VIDEO
from .network import CausalVideoTokenizer, build_tokenizer


def masked_l1(reconstruction: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean absolute error over the pixels where ``mask`` is 1 (computed in fp32)."""
    mask = mask.float().expand_as(target)
    return ((reconstruction.float() - target.float()).abs() * mask).sum() / mask.sum().clamp_min(1)


def video_psnr(reconstruction: Tensor, target: Tensor) -> Tensor:
    """PSNR in dB of [-1, 1] videos mapped to [0, 1], per clip, then averaged."""
    rec = ((reconstruction.float() + 1) / 2).clamp(0, 1)
    ref = ((target.float() + 1) / 2).clamp(0, 1)
    return peak_signal_noise_ratio(
        rec, ref, data_range=1.0, reduction="elementwise_mean", dim=tuple(range(1, ref.dim()))
    )


class TokenizerModel(pl.LightningModule):
    """Post-trains a Cosmos tokenizer with an L1 reconstruction loss."""

    def __init__(self, model: ModelConfig | None = None, optim: OptimConfig | None = None) -> None:
        super().__init__()
        self.model_config = model or ModelConfig()
        self.optim_config = optim or OptimConfig()
        self.save_hyperparameters({"model": asdict(self.model_config), "optim": asdict(self.optim_config)})
        self.network = self._build_network(self.model_config)
        self._step_start = 0.0

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

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        video, mask = self._input(batch)
        loss = masked_l1(self.network(video), video, mask)
        self.log("train/loss", loss, prog_bar=True, batch_size=video.shape[0], sync_dist=False)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        video, mask = self._input(batch)
        reconstruction = self.network(video)
        batch_size = video.shape[0]
        self.log("val/loss", masked_l1(reconstruction, video, mask), batch_size=batch_size, sync_dist=True)
        self.log("val/psnr", video_psnr(reconstruction, video), batch_size=batch_size, sync_dist=True, prog_bar=True)

    def on_train_batch_start(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Tensor], batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._step_start
        clips = batch[VIDEO].shape[0] * self.trainer.world_size
        self.log("train/clips_per_sec", clips / max(elapsed, 1e-9), batch_size=1)
        self.log("train/step_time", elapsed, batch_size=1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        cfg = self.optim_config
        return torch.optim.AdamW(
            self.network.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lets load_tokenizer() rebuild the exact network from a .ckpt alone.
        checkpoint[CONFIG_KEY] = self.network.config.to_dict()
