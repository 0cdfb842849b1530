"""Cosmos-1.0-Tokenizer-DV8x16x16: FSQ tokens (64,000 codes), 8x time, 16x16 space."""

import nemo_run as run

from tokenizer_posttrain.training.train import train

from .common import model, train_recipe

NAME = "Cosmos-1.0-Tokenizer-DV8x16x16"


@run.cli.factory(target=train)
def dv8x16x16(name: str = "cosmos_tokenizer_dv8x16x16", log_dir: str = "outputs") -> run.Partial:
    """Post-train DV8x16x16 on 33x256x256 clips, global batch 8, bf16-mixed, on all local GPUs."""
    return train_recipe(model(NAME, fast=True), name, log_dir=log_dir)
