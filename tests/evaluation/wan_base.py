"""The tiny Wan2.1 VAE base the Wan tests of evaluation, the commands and the workflow share: a ``.pth`` of
``build_tokenizer("Wan2.1-VAE", channels=8)`` saved with ``torch.save``, as Wan ships its weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenizer_posttrain.network import VideoTokenizer, build_tokenizer

WAN = "Wan2.1-VAE"


def tiny_wan(seed: int = 0) -> VideoTokenizer:
    """The Wan2.1 VAE at width 8 (16 latent channels, as released), its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return build_tokenizer(WAN, channels=8).eval()


def tiny_wan_pth(folder: Path, seed: int = 0) -> Path:
    """:func:`tiny_wan`'s state dict saved as ``folder/Wan2.1_VAE.pth``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "Wan2.1_VAE.pth"
    torch.save(tiny_wan(seed).state_dict(), path)
    return path
