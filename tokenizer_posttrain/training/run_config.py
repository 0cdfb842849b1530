"""A training run's configs assembled from plain values, in one place for both of its callers.

The NeMo-Run recipes (``recipes/``) pass ``make=run.Config``, so every field of the run stays an override on the
command line; the posttrain workflow passes :func:`instance` and gets the dataclasses themselves. Both therefore
build the same run from the same settings, and a new setting is added here once. Defaults stay with the callers
(the recipes' are NeMo's, posttrain's its options').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

from .acceleration import GPU_SETTINGS
from .config import (
    DataConfig,
    LatentNoiseConfig,
    LogConfig,
    LoRAConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ResumeConfig,
    TrainerConfig,
)

Make = Callable[..., Any]
"""How a config is made from its class and keyword settings: :func:`instance`, or NeMo-Run's ``run.Config``."""


def instance(cls: type, /, **settings: Any) -> Any:
    """``cls(**settings)``: the :data:`Make` of a caller that runs the training itself (posttrain)."""
    return cls(**settings)


def model_config(
    make: Make,
    name: str,
    jit_ckpt_pth: Optional[str] = None,
    channels: Optional[int] = None,
    fast: bool = False,
    lora_rank: Optional[int] = None,
    **settings: Any,
) -> Any:
    """``model.*``: the registry's ``name``, weights from ``jit_ckpt_pth`` and the width ``channels``. ``fast``:
    the GPU settings of the acceleration module (compiled, channels-last training step replayed as CUDA graphs;
    docs/benchmarks.md has what they measured), else each off. ``lora_rank`` sets ``model.lora.rank`` (None: its
    default, left unset so that a recipe shows no override); ``settings``: other ``ModelConfig`` fields."""
    lora = make(LoRAConfig) if lora_rank is None else make(LoRAConfig, rank=lora_rank)
    settings.setdefault("latent_noise", make(LatentNoiseConfig))  # NeMo-Run reaches no default_factory
    return make(
        ModelConfig,
        model=name,
        jit_ckpt_pth=jit_ckpt_pth,
        channels=channels,
        lora=lora,
        **{key: fast and value for key, value in GPU_SETTINGS.items()},
        **settings,
    )


def data_config(
    make: Make,
    frames: int,
    size: int,
    global_batch_size: int,
    micro_batch_size: int,
    num_workers: int,
    **settings: Any,
) -> Any:
    """``data.*``: square ``size`` x ``size`` clips of ``frames`` frames; ``settings``: other ``DataConfig``
    fields (the dataset's ``path``, ``resize_short_side``)."""
    return make(
        DataConfig,
        frames=frames,
        height=size,
        width=size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        num_workers=num_workers,
        **settings,
    )


def trainer_config(
    make: Make,
    max_steps: int,
    accelerator: str,
    val_check_interval: int,
    checkpoint_every_n_steps: int,
    **settings: Any,
) -> Any:
    """``trainer.*``: how long, where, and how often to validate and checkpoint; ``settings``: other
    ``TrainerConfig`` fields (``devices``)."""
    return make(
        TrainerConfig,
        max_steps=max_steps,
        accelerator=accelerator,
        val_check_interval=val_check_interval,
        checkpoint_every_n_steps=checkpoint_every_n_steps,
        **settings,
    )


def loss_config(make: Make, **terms: Any) -> Any:
    """``LossConfig`` with every term's settings (``loss.gan`` too) made with ``make``: ``terms`` where given, the
    defaults elsewhere (other ``terms``, such as the ``perceptual_weight`` shorthand, pass through). NeMo-Run
    cannot reach into a dataclass default (``default_factory``), so an override ``loss.<term>.<setting>`` needs
    its term made here."""
    for f in dataclasses.fields(LossConfig):
        if f.name not in terms and dataclasses.is_dataclass(f.default_factory):
            terms[f.name] = make(f.default_factory)
    return make(LossConfig, **terms)


def train_arguments(
    make: Make,
    model: Any,
    data: Any,
    trainer: Any,
    loss: Any,
    name: str,
    log_dir: str,
    optim: Optional[Mapping[str, Any]] = None,
    log: Optional[Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """The keyword arguments of :func:`~tokenizer_posttrain.training.train.train`: the given configs, the
    optimizer (``optim``: its settings), a fresh resume policy, and the run folder ``log_dir/name`` (``log``:
    the log's other settings)."""
    return {
        "model": model,
        "data": data,
        "trainer": trainer,
        "optim": make(OptimConfig, **(optim or {})),
        "resume": make(ResumeConfig),
        "log": make(LogConfig, log_dir=log_dir, name=name, **(log or {})),
        "loss": loss,
    }
