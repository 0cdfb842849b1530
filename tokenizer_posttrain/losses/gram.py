"""Gram-matrix (style) loss of NVIDIA's Cosmos tokenizer trainers, on the VGG16 features of the perceptual term.

For each of the five VGG16 layers, the Gram matrix of the features of input and of reconstruction: the mean over
feature positions of the outer product ``f fᵀ`` of the ``C`` channels (``C x C``). The term is the weighted sum
over layers (the perceptual term's layer weights) of the mean squared difference of the two Gram matrices.
As in the trainers, one Gram matrix covers all frames of a clip (``temporal``); or one covers each frame.

The mask weighs every feature position by the fraction of counted pixels under it (the perceptual term's mask
at that layer's resolution), and the Gram matrix is the weighted mean over positions, so padding changes neither
the matrices' scale nor their values. A clip (or frame) without a counted pixel does not count.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .perceptual import DEFAULT_LAYER_WEIGHTS, FeatureTerm, checked_layer_weights
from .terms import TermConfig


@dataclass
class GramConfig(TermConfig):
    """Gram-matrix (style) loss on the perceptual term's VGG16 features (same layers and layer weights, no
    second VGG pass); it reads the VGG16 set by loss.perceptual even when loss.perceptual.weight=0."""

    temporal: bool = True
    """One Gram matrix per clip over all its frames (NVIDIA's trainers, for videos); False: one per frame."""


def weighted_gram_sums(features: Tensor, weight: Tensor) -> Tensor:
    """``[N, C, h, w]`` features, ``[N, 1, h, w]`` weights -> ``[N, C, C]``: the weighted sum over positions of
    ``f fᵀ``, in fp32 (a difference of two such matrices would lose its digits in bf16)."""
    with torch.autocast(features.device.type, enabled=False):
        # sqrt(w) f on both sides: one weighted copy, the only one the backward pass keeps. flatten(2) is a
        # view of NHWC features too, and the product keeps their layout.
        scaled = features.float().flatten(2) * weight.float().flatten(2).sqrt()  # [N, C, h*w]
        return torch.matmul(scaled, scaled.transpose(1, 2))


def gram_distance(reconstruction: Tensor, target: Tensor, mass: Tensor, clips: int | None = None) -> Tensor:
    """Mean squared difference of Gram matrices from :func:`weighted_gram_sums` (``[N, C, C]`` each) and the
    weights' sums ``mass`` ``[N]``: per frame, or per clip of ``N / clips`` consecutive frames when ``clips`` is
    given; averaged over the frames (clips) with a counted pixel."""
    if clips is not None:
        channels = reconstruction.shape[-1]
        reconstruction = reconstruction.view(clips, -1, channels, channels).sum(1)
        target = target.view(clips, -1, channels, channels).sum(1)
        mass = mass.view(clips, -1).sum(1)
    # Weighted means over positions; where nothing counts both sums are 0, and so is their difference.
    difference = (reconstruction - target) / mass.clamp_min(1e-12)[:, None, None]
    per_unit = difference.square().mean(dim=(1, 2))
    counted = (mass > 0).float()
    return (per_unit * counted).sum() / counted.sum().clamp_min(1)


class GramTerm(FeatureTerm):
    """:data:`~.perceptual.DEFAULT_LAYER_WEIGHTS`-weighted sum over the VGG16 layers of :func:`gram_distance`;
    computed in the Loss module's shared VGG16 pass."""

    def __init__(self, config: GramConfig, layer_weights: Sequence[float] = DEFAULT_LAYER_WEIGHTS) -> None:
        super().__init__()
        self.config = config
        self.layer_weights = checked_layer_weights(layer_weights)

    def statistics(
        self, reconstruction: list[Tensor], target: list[Tensor], weights: list[Tensor]
    ) -> tuple[Tensor, ...]:
        """Per layer and frame: the weighted Gram sums of reconstruction and target, and the weights' sum."""
        out: list[Tensor] = []
        for rec, tgt, weight in zip(reconstruction, target, weights, strict=True):
            out += [weighted_gram_sums(rec, weight), weighted_gram_sums(tgt, weight), weight.sum(dim=(1, 2, 3))]
        return tuple(out)

    def value(self, chunks: list[tuple[Tensor, ...]], clips: int) -> Tensor:
        # Per-frame statistics, concatenated over the chunks: the chunk size cannot change the result.
        stats = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*chunks, strict=True)]
        per_clip = clips if self.config.temporal else None
        total: Tensor | None = None
        for layer, layer_weight in enumerate(self.layer_weights):
            rec, tgt, mass = stats[3 * layer : 3 * layer + 3]
            value = layer_weight * gram_distance(rec, tgt, mass, per_clip)
            total = value if total is None else total + value
        assert total is not None
        return total
