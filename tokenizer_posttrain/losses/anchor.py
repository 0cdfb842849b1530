"""The latent anchor: while the encoder trains, hold its output near the base encoder's on the same clip, so a world
model trained on the base's latents keeps reading inputs it knows.

Training the decoder alone keeps the latents exactly; training the encoder moves them. This term is the middle
ground: the encoder may move where reconstruction gains, at a price per unit of movement set by its weight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from ..network import VideoTokenizer, channel_scale
from .context import StepContext
from .terms import Clips, LossTerm, TermConfig


@dataclass
class LatentAnchorConfig(TermConfig):
    """Mean squared distance between the encoder's output on the clip and the frozen base encoder's, per value,
    in units of each latent channel's spread as the world model sees it (``network.channel_scale``: Wan's
    normalisation constants, else the base latents' own per-channel std), so one weight means the same in every
    family. CV and Wan compare the latent (a VAE's posterior mean); DV compares the codes before quantizing (token
    indices carry no gradient). At weight w, moving every latent value by one channel spread costs w.

    Weight 0 (default): off, no base copy is made. Needs a training encoder (``model.trainable`` all or encoder)."""

    def build(self) -> LatentAnchorTerm:
        return LatentAnchorTerm()

    def clip_problems(self, key: str, clips: Clips) -> list[str]:
        if clips.encoder_trains:
            return []
        return [
            f"{key} holds a training encoder near its base, but model.trainable=decoder keeps the encoder (and the "
            f"latents) as they are; set {key}.weight=0"
        ]


class LatentAnchorTerm(LossTerm):
    """:class:`LatentAnchorConfig`'s distance. The base encoder is a frozen copy of the network taken when the term
    is attached (before training or adapters change it), its decoder side dropped; it lives in the loss module,
    outside the trained model's checkpoint, its optimizer and DDP, like the VGG16."""

    reconstruction_only = False

    def __init__(self) -> None:
        super().__init__()
        self._base: Optional[VideoTokenizer] = None

    def attach(self, network: nn.Module) -> None:
        assert isinstance(network, VideoTokenizer)
        base = copy.deepcopy(network)
        for prefix in network.sides["decoder"]:
            # The decoder side is never run here: no copy of its weights is kept.
            name = prefix.rstrip(".")
            if "." not in name:
                setattr(base, name, None)
        base.requires_grad_(False).eval()
        if base.chunks_in_time:  # no gradients: a chunk's activations at a time cost nothing in exactness
            base.time_chunk = 2
        self._base = base

    @property
    def base(self) -> VideoTokenizer:
        if self._base is None:
            raise ValueError("loss.latent_anchor has no base encoder: the training module attaches the network first")
        return self._base

    def forward(self, context: StepContext) -> Tensor:
        if context.latent is None:
            raise ValueError("loss.latent_anchor is on but the step gave no encoder output; set its weight to 0")
        base = self.base
        with torch.no_grad():
            anchor = base.encoding_of(base.encoder_output(context.target.to(base.dtype))).continuous.float()
        scale = channel_scale(base.config, anchor)
        return ((context.latent.float() - anchor) / scale).square().mean()


__all__ = ["LatentAnchorConfig", "LatentAnchorTerm"]
