"""Wan2.2-VAE: the video VAE of Wan2.2-TI2V-5B and Cosmos 3, a KL autoencoder with 4x time and 16x16 space
compression (the video patchified 2x2 first; clips of 1 + 4k frames, sides multiples of 16), 48 latent channels,
705M parameters at its released width. Trained as the Wan2.1 VAE is (posterior samples, KL term on), with
activation checkpointing: that is what fits it on one 80 GB GPU at 33x256x256."""

import nemo_run as run

from tokenizer_posttrain.training.train import train

from .common import data, model, train_recipe, wan_loss
from .tiny import tiny_recipe

NAME = "Wan2.2-VAE"

TINY_WIDTH = 8
"""The tiny recipe's encoder width (the released model's is 160; its decoder's 256): as small as the Wan2.1 tiny
recipe's, so 60 steps on the CPU take a minute or two."""


@run.cli.factory(target=train)
def wan22(name: str = "wan22_vae", log_dir: str = "outputs") -> run.Partial:
    """Post-train the Wan2.2 VAE on 33x256x256 clips, global batch 8, bf16-mixed, activation checkpointing, on all
    local GPUs; L1 + perceptual 0.1 + KL 1e-6 (needs torchvision's VGG16 file), decoding posterior samples."""
    return train_recipe(
        model(NAME, fast=True, sample_posterior=True, activation_checkpointing=True),
        name,
        data_cfg=data(frames=33, size=256),
        loss_cfg=wan_loss(),
        log_dir=log_dir,
    )


@run.cli.factory(target=train)
def tiny_wan22(name: str = "tiny_wan22", log_dir: str = "outputs") -> run.Partial:
    """The Wan2.2 VAE at width 8 on 17x64x64 synthetic clips, on the CPU: L1 + KL 1e-6 (no VGG16 file needed;
    loss.perceptual.weight=0.1 turns it on), decoding posterior samples."""
    return tiny_recipe(
        model(NAME, channels=TINY_WIDTH, sample_posterior=True), name, log_dir, loss_cfg=wan_loss(perceptual_weight=0.0)
    )
