"""The tiny Wan VAE bases the Wan tests of evaluation, the commands and the workflow share: a ``.pth`` of
``build_tokenizer(model, channels=8)`` (Wan2.1's by default, or Wan2.2's) saved with ``torch.save``, as Wan ships
its weights, under the file name Wan gives it."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenizer_posttrain.network import VideoTokenizer, build_tokenizer

WAN = "Wan2.1-VAE"
WAN22 = "Wan2.2-VAE"


def tiny_wan(seed: int = 0, model: str = WAN) -> VideoTokenizer:
    """The Wan VAE ``model`` at width 8 (with its released latent channels: 16 for Wan2.1, 48 for Wan2.2, whose
    decoder is then 12 wide), its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return build_tokenizer(model, channels=8).eval()


def tiny_wan_pth(folder: Path, seed: int = 0, model: str = WAN) -> Path:
    """:func:`tiny_wan`'s state dict saved as ``folder/Wan2.1_VAE.pth`` (``Wan2.2_VAE.pth`` for Wan2.2)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model.replace('-', '_')}.pth"
    torch.save(tiny_wan(seed, model).state_dict(), path)
    return path
