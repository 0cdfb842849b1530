"""Shared recipe pieces: small pure functions returning ``run.Config``/``run.Partial``.

No I/O and no environment reads here: anything that depends on the machine (GPUs,
SLURM_NNODES) is resolved when the run starts, so a recipe renders the same anywhere.
"""

from __future__ import annotations

from typing import Any, Optional

import nemo_run as run

from tokenizer_posttrain.losses import LossConfig
from tokenizer_posttrain.losses.consistency import ConsistencyConfig
from tokenizer_posttrain.losses.flow import FlowConfig
from tokenizer_posttrain.losses.gram import GramConfig
from tokenizer_posttrain.losses.high_freq import HighFreqConfig
from tokenizer_posttrain.losses.kl import VAE_KL_WEIGHT, KLConfig
from tokenizer_posttrain.losses.l1 import L1Config
from tokenizer_posttrain.losses.perceptual import PerceptualConfig
from tokenizer_posttrain.training import run_config
from tokenizer_posttrain.training.config import DataConfig, ModelConfig, TrainerConfig
from tokenizer_posttrain.training.train import train

# The configs themselves are assembled in tokenizer_posttrain.training.run_config, which the posttrain workflow
# also builds its runs with: these recipes only make each piece a run.Config, so that it stays overridable.


def model(
    name: str,
    jit_ckpt_pth: Optional[str] = None,
    channels: Optional[int] = None,
    fast: bool = False,
    **settings: Any,
) -> run.Config[ModelConfig]:
    """``fast``: the GPU settings of the acceleration module (compiled, channels-last training step replayed
    as CUDA graphs; docs/benchmarks.md has what they measured); ``settings``: other ``ModelConfig`` fields
    (``sample_posterior``)."""
    return run_config.model_config(run.Config, name, jit_ckpt_pth, channels, fast, **settings)


def loss_config(**terms: Any) -> run.Config[LossConfig]:
    """``LossConfig`` with every term's settings (``loss.gan`` too) a ``run.Config`` of its own: ``terms`` where
    given, the defaults elsewhere. NeMo-Run cannot reach into a dataclass default (``default_factory``), so an
    override ``loss.<term>.<setting>`` needs its term here."""
    return run_config.loss_config(run.Config, **terms)


def loss(perceptual_weight: float = 0.1) -> run.Config[LossConfig]:
    """L1 + VGG16 perceptual loss (weight 0.1 as in the Cosmos recipe; 0 needs no VGG16 file)."""
    return loss_config(l1=run.Config(L1Config), perceptual=run.Config(PerceptualConfig, weight=perceptual_weight))


def cosmos_loss() -> run.Config[LossConfig]:
    """The loss of NVIDIA's NeMo post-training of the Cosmos tokenizers (its ``tokenizer/losses/config.py``):
    L1 at weight 1; perceptual 0.1, 0.073 from step 500000; Gram 0, 0.062 from step 500000; optical flow (RAFT
    large, frames scaled by 2, bf16) 0, 0.01 from step 250000. NeMo's loss has no high-frequency or consistency
    term (cosmos-predict1's trainer ships both off): weight 0 here. Needs torchvision's VGG16 and RAFT large files."""
    return loss_config(
        l1=run.Config(L1Config, weight=1.0),
        perceptual=run.Config(PerceptualConfig, boundaries=[500000], values=[0.1, 0.073]),
        gram=run.Config(GramConfig, boundaries=[500000], values=[0.0, 0.062]),
        high_freq=run.Config(HighFreqConfig, weight=0.0),
        flow=run.Config(FlowConfig, boundaries=[250000], values=[0.0, 0.01], raft="large", scale=2, dtype="bfloat16"),
        consistency=run.Config(ConsistencyConfig, weight=0.0),
    )


def wan_loss(perceptual_weight: float = 0.1, kl_weight: float = VAE_KL_WEIGHT) -> run.Config[LossConfig]:
    """The loss of a KL-VAE (the Wan2.1 VAE): L1 at weight 1, VGG16 perceptual (0.1; 0 needs no VGG16 file) and the
    posterior's KL term at the 1e-6 of the latent-diffusion VAEs, which holds the posterior near the one the
    world models downstream were trained on."""
    return loss_config(
        l1=run.Config(L1Config),
        perceptual=run.Config(PerceptualConfig, weight=perceptual_weight),
        kl=run.Config(KLConfig, weight=kl_weight),
    )


def data(
    frames: int = 33, size: int = 256, global_batch_size: int = 8, micro_batch_size: int = 1, num_workers: int = 2
) -> run.Config[DataConfig]:
    """Square ``size`` x ``size`` clips of ``frames`` frames; NeMo's batch sizes by default."""
    return run_config.data_config(run.Config, frames, size, global_batch_size, micro_batch_size, num_workers)


def trainer(
    max_steps: int = -1, accelerator: str = "gpu", val_check_interval: int = 100, checkpoint_every_n_steps: int = 100
) -> run.Config[TrainerConfig]:
    """How long, where, and how often to validate and checkpoint; NeMo's defaults otherwise."""
    return run_config.trainer_config(run.Config, max_steps, accelerator, val_check_interval, checkpoint_every_n_steps)


def train_recipe(
    model_cfg: run.Config[ModelConfig],
    name: str,
    data_cfg: Optional[run.Config[DataConfig]] = None,
    trainer_cfg: Optional[run.Config[TrainerConfig]] = None,
    loss_cfg: Optional[run.Config[LossConfig]] = None,
    log_dir: str = "outputs",
) -> run.Partial:
    """The full training task; every field stays overridable on the command line."""
    arguments = run_config.train_arguments(
        run.Config, model_cfg, data_cfg or data(), trainer_cfg or trainer(), loss_cfg or loss(), name, log_dir
    )
    return run.Partial(train, **arguments)
