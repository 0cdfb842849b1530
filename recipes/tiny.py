"""Tiny CPU recipes: the real architectures at a small width on small synthetic clips.

They run the whole pipeline (train, validate, checkpoint, resume, export) in minutes on
a laptop CPU and serve the README's first command and the integration tests.
"""

from typing import Optional

import nemo_run as run

from tokenizer_posttrain.losses import LossConfig
from tokenizer_posttrain.training.config import ModelConfig
from tokenizer_posttrain.training.train import train

from .common import data, loss, model, train_recipe, trainer


def tiny_recipe(
    model_cfg: run.Config[ModelConfig], name: str, log_dir: str, loss_cfg: Optional[run.Config[LossConfig]] = None
) -> run.Partial:
    """``model_cfg`` trained 60 steps on 17x64x64 synthetic clips on the CPU, validated and checkpointed every 20;
    ``loss_cfg`` defaults to L1 alone."""
    return train_recipe(
        model_cfg,
        name,
        data_cfg=data(frames=17, size=64, global_batch_size=2, micro_batch_size=2, num_workers=0),
        trainer_cfg=trainer(max_steps=60, accelerator="cpu", val_check_interval=20, checkpoint_every_n_steps=20),
        # No VGG16 file is needed on a fresh machine; loss.perceptual_weight=0.1 turns it on.
        loss_cfg=loss_cfg or loss(perceptual_weight=0.0),
        log_dir=log_dir,
    )


@run.cli.factory(target=train)
def tiny(name: str = "tiny_cv8x8x8", log_dir: str = "outputs") -> run.Partial:
    """CV8x8x8 at width 16 on 17x64x64 synthetic clips, on the CPU."""
    return tiny_recipe(model("CV8x8x8", channels=16), name, log_dir)


@run.cli.factory(target=train)
def tiny_dv(name: str = "tiny_dv8x16x16", log_dir: str = "outputs") -> run.Partial:
    """DV8x16x16 at width 16 on 17x64x64 synthetic clips, on the CPU."""
    return tiny_recipe(model("DV8x16x16", channels=16), name, log_dir)
