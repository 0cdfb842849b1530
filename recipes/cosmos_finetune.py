"""The official post-training configuration of NVIDIA's NeMo Cosmos tokenizer script, for CV8x8x8: the cv8x8x8
recipe's model, data and trainer with NeMo's loss (L1, perceptual, Gram and optical flow on their schedules)."""

import nemo_run as run

from tokenizer_posttrain.training.train import train

from .common import cosmos_loss, model, train_recipe
from .cv8x8x8 import NAME


@run.cli.factory(target=train)
def cosmos_finetune(
    name: str = "cosmos_finetune_cv8x8x8", log_dir: str = "outputs", model_name: str = NAME
) -> run.Partial:
    """Post-train CV8x8x8 (or ``model_name``) on 33x256x256 clips, global batch 8, bf16-mixed, on all local GPUs,
    with NeMo's loss; needs torchvision's VGG16 and RAFT large files in the torch hub cache."""
    return train_recipe(model(model_name, fast=True), name, loss_cfg=cosmos_loss(), log_dir=log_dir)
