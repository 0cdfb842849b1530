"""The LightningModule: step logic only. Networks, losses, checkpoint I/O and data live elsewhere."""

from __future__ import annotations

import time
import warnings
from collections import deque
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
from .network.acceleration import compile_module_call, configure_network, warn_if_cuda_graphs_skipped
from .optim import build_optimizer
from .step_scalars import DeviceScalars, NonFiniteLossError, NonFiniteSteps, grad_norm, is_log_step, skip_flag
from .trainable import configure_trainable

THROUGHPUT_WINDOW = 10
"""Batches over which ``train/clips_per_sec`` and ``train/step_time`` are averaged."""


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
        # Compiled functions, not compiled modules: wrapping the network would rename every checkpoint key.
        compiled, scope = self.model_config.compile, self.model_config.compile_scope
        self._cuda_graphs = self.model_config.replays_cuda_graphs
        self._graphs_checked = False
        self._step_terms = self._train_terms
        if compiled and scope == "step":
            mode = "reduce-overhead" if self._cuda_graphs else None
            self._step_terms = compile_module_call(self._train_terms, mode=mode)
        self._loss_terms = (
            compile_module_call(reconstruction_losses) if compiled and scope == "blocks" else reconstruction_losses
        )
        self.nonfinite = NonFiniteSteps(max_bad_steps)
        self._to_host = DeviceScalars()
        self._step_sums: dict[str, Tensor] = {}  # loss terms summed over this optimizer step's micro-batches
        self._micro_batches = 0
        self._deferred_stop: NonFiniteLossError | None = None
        self.loss_history: list[tuple[int, float]] = []
        """``(optimizer step, train/loss)`` of every logged step."""
        # Clipped here, from the norm logged anyway, rather than by Lightning: Lightning refuses to
        # clip for fused AdamW (our CUDA optimizer) under mixed precision, even bf16, which has no scaler.
        self.gradient_clip_val = gradient_clip_val
        self._batch_ends: deque[tuple[float, int]] = deque(maxlen=THROUGHPUT_WINDOW + 1)

    def _configure_speed(self, training: bool) -> None:
        """Checkpointing and channels-last while training; the plain network for export afterwards."""
        cfg = self.model_config
        configure_network(
            self.network,
            activation_checkpointing=training and cfg.activation_checkpointing,
            channels_last=training and cfg.channels_last,
            compile_segments=training and cfg.compile and cfg.compile_scope == "blocks",
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
        """Forward of network and losses: the part ``model.compile`` compiles (as one graph, or in pieces)."""
        cfg = self.loss_config
        reconstruction = self.reconstruct(video)
        return self._loss_terms(reconstruction, video, mask, cfg.l1_weight, perceptual, cfg.perceptual_weight)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        video, mask = self._input(batch)
        if self._cuda_graphs:
            # Each micro-batch is a new replay; outputs of the last one are no longer read.
            torch.compiler.cudagraph_mark_step_begin()
        terms = self._step_terms(video, mask, self._perceptual_on(video.device))
        # A NaN/Inf loss is not caught here: it makes NaN gradients, which on_before_optimizer_step
        # detects after DDP's all-reduce, so every rank skips the same step. Returning None on one
        # rank would leave the others waiting in the all-reduce.
        for name, value in terms.items():
            value = value.detach()
            # A copy where the output itself would be kept: a CUDA graph overwrites it at its next replay.
            self._step_sums[name] = self._step_sums[name] + value if name in self._step_sums else value.clone()
        self._micro_batches += 1
        return terms["loss"]

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if not self._cuda_graphs:
            optimizer.zero_grad(set_to_none=True)
            return
        torch._foreach_zero_(self._allocated_gradients())

    def on_before_backward(self, loss: Tensor) -> None:
        # Lightning zeroes gradients only at a step's first micro-batch: a run resumed from a
        # checkpoint written between micro-batches starts its backward without that.
        if self._cuda_graphs:
            self._allocated_gradients()

    def on_validation_model_zero_grad(self) -> None:
        if not self._cuda_graphs:  # Lightning frees the gradients; with CUDA graphs they stay allocated
            super().on_validation_model_zero_grad()

    def _allocated_gradients(self) -> list[Tensor]:
        """The trainable parameters' gradients, allocated where missing. Under CUDA graphs a gradient
        that is None when backward reaches it becomes the graph's own output tensor, which the next
        replay overwrites (accumulated micro-batches or the next step would read another step's
        values); a gradient that exists is added into instead."""
        grads = []
        for param in self.parameters():
            if param.requires_grad:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        return grads

    @property
    def bad_steps(self) -> int:
        """Optimizer steps skipped in a row so far for a NaN/Inf gradient norm (as far as read back)."""
        return self.nonfinite.in_a_row

    def on_train_start(self) -> None:
        # A second fit() of the same module (after an exception) starts with nothing left over.
        self._step_sums, self._micro_batches, self._to_host = {}, 0, DeviceScalars()
        self._graphs_checked = False
        self._batch_ends.clear()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._deferred_stop is not None:
            raise self._deferred_stop
        step = self.global_step
        scalars = {f"train/{name}": total / self._micro_batches for name, total in self._step_sums.items()}
        self._step_sums, self._micro_batches = {}, 0
        params = [p for p in self.network.parameters() if p.grad is not None]
        if not params:
            return
        # After DDP's all-reduce: the same norm, hence the same verdict, on every rank.
        norm = grad_norm([p.grad for p in params])
        self._to_host.push(step, {**scalars, "train/grad_norm": norm})  # grad_norm: before clipping
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, if any
        fused = bool(optimizer.defaults.get("fused"))
        if fused:
            # Fused AdamW leaves parameters, moments and step count alone where found_inf is 1 (the
            # hook GradScaler uses), on the device: no host wait; the verdict is read a step later.
            optimizer.found_inf = skip_flag(norm)  # type: ignore[attr-defined]
        if self._settle(keep_last=1 if fused else 0) and not fused:  # the verdict is this step's
            optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without gradients
            return
        if self.gradient_clip_val > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.gradient_clip_val, norm, foreach=True)

    def _settle(self, keep_last: int, to_bar: bool = True) -> bool:
        """Read back the queued steps' scalars: skip verdicts, loggers, progress bar. Whether the
        newest step read was skipped."""
        skipped = logged = False
        every = self.trainer.log_every_n_steps if self._trainer else 1
        for step, values in self._to_host.pop(keep_last):
            skipped = self.nonfinite.check(step, values["train/grad_norm"])
            if skipped:
                values["train/bad_steps"] = float(self.nonfinite.in_a_row)
            # Lightning's own logging cadence and step numbers.
            if is_log_step(step, every) or skipped:
                logged = True
                for logger in self.loggers:
                    logger.log_metrics(values, step=step)
                if "train/loss" in values:
                    self.loss_history.append((step, values["train/loss"]))
                    if to_bar:  # a CPU value: the bar reads it without waiting for the GPU
                        self.log("train/loss", torch.tensor(values["train/loss"]), prog_bar=True, logger=False)
        if logged:  # rows read back after Lightning's own last save would otherwise stay unwritten
            for logger in self.loggers:
                logger.save()
        return skipped

    def on_train_end(self) -> None:
        if self._deferred_stop is not None:
            raise self._deferred_stop
        self._settle(keep_last=0, to_bar=False)  # the last step's verdict and scalars (no self.log here)

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
        # Clips over the wall time of the last few batches: it includes data loading, and on a GPU
        # the queue of asynchronous kernels keeps the host no more than a step ahead. Logged as CPU
        # tensors: a Python number would become a CUDA tensor, a copy that waits for the GPU.
        self._batch_ends.append((time.perf_counter(), batch[VIDEO].shape[0] * self.trainer.world_size))
        if self._cuda_graphs and not self._graphs_checked:  # the first batch has compiled the step
            self._graphs_checked = True
            warn_if_cuda_graphs_skipped()
        if len(self._batch_ends) > 1:
            elapsed = self._batch_ends[-1][0] - self._batch_ends[0][0]
            clips = sum(n for _, n in list(self._batch_ends)[1:])
            self.log("train/clips_per_sec", torch.tensor(clips / max(elapsed, 1e-9)), batch_size=1, prog_bar=True)
            self.log("train/step_time", torch.tensor(elapsed / (len(self._batch_ends) - 1)), batch_size=1)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            self.log("train/gpu_mem_gib", torch.tensor(peak), batch_size=1)

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
        # The step still on its way to the host goes to the loggers now: a run stopped right after
        # this checkpoint (preemption) must not leave a gap in the logs at the step it resumes from.
        # A stop for NaN steps waits for the next step: raised here it would break the save (and
        # the preemption handling that may have asked for it).
        try:
            self._settle(keep_last=0, to_bar=False)
        except NonFiniteLossError as stop:
            self._deferred_stop = stop
        # Lets load_tokenizer() rebuild the exact network from a .ckpt alone.
        checkpoint[CONFIG_KEY] = self.network.config.to_dict()
