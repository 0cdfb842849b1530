"""Cosmos-1.0-Tokenizer-CV8x8x8: continuous latents, 8x time, 8x8 space (the default recipe)."""

import nemo_run as run

from tokenizer_posttrain.training.train import train

from .common import model, train_recipe

NAME = "Cosmos-1.0-Tokenizer-CV8x8x8"


@run.cli.factory(target=train)
def cv8x8x8(name: str = "cosmos_tokenizer_cv8x8x8", log_dir: str = "outputs") -> run.Partial:
    """Post-train CV8x8x8 on 33x256x256 clips, global batch 8, bf16-mixed, on all local GPUs."""
    return train_recipe(model(NAME, fast=True), name, log_dir=log_dir)
