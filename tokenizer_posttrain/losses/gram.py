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


def weighted_gram_difference(reconstruction: Tensor, target: Tensor, weight: Tensor) -> Tensor:
    """``[N, C, h, w]`` features of reconstruction and target, ``[N, 1, h, w]`` weights -> ``[N, C, C]`` fp32:
    the weighted sum over positions of ``r rᵀ - t tᵀ``, the difference of the two Gram sums.

    Each Gram sum is one product of the features scaled by the weights' square roots, with fp32 output: bf16
    features multiply on tensor cores into fp32 (CUDA) or are cast up (elsewhere), so the products of the bf16
    values are exact up to fp32 accumulation and their difference keeps its digits (two bf16 outputs subtracted
    would lose it in their rounding). Fractional weights round with the features to bf16. The reconstruction's
    backward pass is one product too (:class:`_GramSum`), and nothing of the size of the features is kept for it
    but the features themselves.
    """
    with torch.autocast(reconstruction.device.type, enabled=False):
        root = weight.sqrt()
        with torch.no_grad():
            target_gram = gram_sum(target * root.to(target.dtype))
        return _GramSum.apply(reconstruction * root.to(reconstruction.dtype)) - target_gram


def gram_sum(features: Tensor) -> Tensor:
    """``[N, C, h, w]`` -> ``[N, C, C]`` fp32: the sum over positions of ``f fᵀ``; differentiable
    (:class:`_GramSum`)."""
    return _GramSum.apply(features)


class _GramSum(torch.autograd.Function):
    """``f ↦ Σ_p f_p f_pᵀ`` with a backward pass of one product: ``∂L/∂f_p = (G + Gᵀ) f_p`` for the incoming
    gradient ``G`` (autograd's own would be two products, one of them of a copy of the features)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, features: Tensor) -> Tensor:
        ctx.save_for_backward(features)
        nhwc = _is_nhwc(features)
        positions = _positions(features, nhwc)
        # [N, C, P] x [N, P, C] either way; the layout only picks which operand is the transposed view.
        left, right = (positions.transpose(1, 2), positions) if nhwc else (positions, positions.transpose(1, 2))
        if positions.dtype not in (torch.bfloat16, torch.float16):
            return torch.bmm(left, right)
        if positions.is_cuda:
            return torch.bmm(left, right, out_dtype=torch.float32)
        return torch.bmm(left.float(), right.float())

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        (features,) = ctx.saved_tensors  # type: ignore[attr-defined]
        nhwc = _is_nhwc(features)
        positions = _positions(features, nhwc)
        symmetric = (grad + grad.transpose(1, 2)).to(positions.dtype)
        if not nhwc:
            return torch.bmm(symmetric, positions).view_as(features)
        # [N, P, C] x [N, C, C]: the gradient comes out in the features' own (NHWC) memory order.
        n, c, h, w = features.shape
        return torch.bmm(positions, symmetric).view(n, h, w, c).permute(0, 3, 1, 2)


def _is_nhwc(features: Tensor) -> bool:
    return features.stride(1) == 1 and features.shape[1] > 1


def _positions(features: Tensor, nhwc: bool) -> Tensor:
    """``[N, C, h, w]`` -> ``[N, h*w, C]`` (``nhwc``: a view of NHWC features) or ``[N, C, h*w]``.

    Keeping the channels innermost where they are innermost lets every elementwise kernel of the term (forward
    and backward) read and write in memory order: under Inductor, NHWC features flattened channels-first made
    each of them a strided transpose, which cost more than the products themselves (docs/benchmarks.md).
    """
    return features.permute(0, 2, 3, 1).flatten(1, 2) if nhwc else features.flatten(2)


def gram_distance(difference: Tensor, mass: Tensor, clips: int | None = None) -> Tensor:
    """Mean squared difference of Gram matrices, from :func:`weighted_gram_difference` (``[N, C, C]``) and the
    weights' sums ``mass`` ``[N]``: per frame, or per clip of ``N / clips`` consecutive frames when ``clips`` is
    given; averaged over the frames (clips) with a counted pixel."""
    if clips is not None:
        channels = difference.shape[-1]
        difference = difference.view(clips, -1, channels, channels).sum(1)
        mass = mass.view(clips, -1).sum(1)
    # Weighted means over positions; where nothing counts the sum is 0, and so is the mean.
    per_unit = (difference / mass.clamp_min(1e-12)[:, None, None]).square().mean(dim=(1, 2))
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
        """Per layer and frame: the difference of the weighted Gram sums, and the weights' sum."""
        out: list[Tensor] = []
        for rec, tgt, weight in zip(reconstruction, target, weights, strict=True):
            out += [weighted_gram_difference(rec, tgt, weight), weight.sum(dim=(1, 2, 3))]
        return tuple(out)

    def value(self, chunks: list[tuple[Tensor, ...]], clips: int) -> Tensor:
        # Per-frame statistics, concatenated over the chunks: the chunk size cannot change the result.
        stats = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*chunks, strict=True)]
        per_clip = clips if self.config.temporal else None
        total: Tensor | None = None
        for layer, layer_weight in enumerate(self.layer_weights):
            difference, mass = stats[2 * layer : 2 * layer + 2]
            value = layer_weight * gram_distance(difference, mass, per_clip)
            total = value if total is None else total + value
        assert total is not None
        return total
