"""Wan2.1-VAE: the Wan2.1 video VAE, a KL autoencoder with 4x time and 8x8 space compression (clips of 1 + 4k
frames, sides multiples of 8), 16 latent channels. Trained on a sample of its posterior (``model.sample_posterior``),
as a VAE is, with the KL term on, so the posterior keeps the spread the world models downstream read."""

import nemo_run as run

from tokenizer_posttrain.training.train import train

from .common import data, model, train_recipe, wan_loss
from .tiny import tiny_recipe

NAME = "Wan2.1-VAE"

TINY_WIDTH = 8
"""The tiny recipe's width (the released model's is 96): the Wan VAE keeps its first level at full resolution, so
at width 8 a step on 17x64x64 clips costs what a width-16 Cosmos one does four times over (about 1.3 s on two CPU
cores), and 60 steps take a minute or two."""


@run.cli.factory(target=train)
def wan21(name: str = "wan21_vae", log_dir: str = "outputs") -> run.Partial:
    """Post-train the Wan2.1 VAE on 33x256x256 clips, global batch 8, bf16-mixed, on all local GPUs; L1 +
    perceptual 0.1 + KL 1e-6 (needs torchvision's VGG16 file), decoding posterior samples."""
    return train_recipe(
        model(NAME, fast=True, sample_posterior=True),
        name,
        data_cfg=data(frames=33, size=256),
        loss_cfg=wan_loss(),
        log_dir=log_dir,
    )


@run.cli.factory(target=train)
def tiny_wan21(name: str = "tiny_wan21", log_dir: str = "outputs") -> run.Partial:
    """The Wan2.1 VAE at width 8 on 17x64x64 synthetic clips, on the CPU: L1 + KL 1e-6 (no VGG16 file needed;
    loss.perceptual.weight=0.1 turns it on), decoding posterior samples."""
    return tiny_recipe(
        model(NAME, channels=TINY_WIDTH, sample_posterior=True), name, log_dir, loss_cfg=wan_loss(perceptual_weight=0.0)
    )
