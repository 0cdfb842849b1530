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

    def build(self) -> "GramTerm":
        return GramTerm(self)


def weighted_gram_difference(reconstruction: Tensor, target: Tensor, weight: Tensor) -> Tensor:
    """``[N, C, h, w]`` features of reconstruction and target, ``[N, 1, h, w]`` weights -> ``[N, C, C]`` fp32
    (fp64 for fp64 features): the weighted sum over positions of ``r rᵀ - t tᵀ``, the difference of the two Gram
    sums; differentiable in the reconstruction only.

    It is the symmetric part of ``(w (r - t)) (r + t)ᵀ``: one product that yields the difference itself, so its
    rounding is relative to the difference, not to the far larger Gram sums that two products subtracted would
    lose it in (in fp32 too, over the 65536 positions of a 256x256 frame). bf16 features multiply on tensor cores
    into fp32 (CUDA) or are cast up (elsewhere). The backward pass is one product of the reconstruction's
    features, ``∂L/∂r_p = w_p (G + Gᵀ) r_p`` for the incoming gradient ``G`` (:class:`_GramDifference`); nothing
    of the features' size is kept for it but the features themselves.
    """
    if torch.is_grad_enabled() and (target.requires_grad or weight.requires_grad):
        raise ValueError("weighted_gram_difference: only the reconstruction's features may need gradients")
    if weight.dim() != 4 or weight.shape[1] != 1:
        raise ValueError(f"weighted_gram_difference: weights must be [N, 1, h, w], got {tuple(weight.shape)}")
    with torch.autocast(reconstruction.device.type, enabled=False):
        return _GramDifference.apply(reconstruction, target, weight)


class _GramDifference(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, rec: Tensor, tgt: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(rec, weight)
        dtype = rec.dtype
        tgt = tgt.to(dtype)
        scaled_difference, total = (rec - tgt) * weight.to(dtype), rec + tgt
        left, right = _channels_by_positions(scaled_difference), _positions_by_channels(total)
        if dtype not in (torch.bfloat16, torch.float16):
            product = torch.bmm(left, right)
        elif rec.is_cuda:
            product = torch.bmm(left, right, out_dtype=torch.float32)
        else:
            product = torch.bmm(left.float(), right.float())
        return (product + product.transpose(1, 2)) / 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        rec, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        # fp16 would flush the incoming gradient (about 1 / (positions x C^2)) to zero: it multiplies in fp32.
        work = torch.float32 if rec.dtype == torch.float16 else rec.dtype
        symmetric = (grad + grad.transpose(1, 2)).to(work)
        features = rec.to(work)
        n, c, h, w = rec.shape
        if _is_nhwc(features):
            # [N, P, C] x [N, C, C]: the gradient comes out in the features' own (NHWC) memory order.
            product = torch.bmm(_positions_by_channels(features), symmetric).view(n, h, w, c).permute(0, 3, 1, 2)
        else:
            product = torch.bmm(symmetric, _channels_by_positions(features)).view(n, c, h, w)
        return (product * weight.to(work)).to(rec.dtype), None, None


def _is_nhwc(features: Tensor) -> bool:
    return features.stride(1) == 1 and features.shape[1] > 1


def _channels_by_positions(features: Tensor) -> Tensor:
    """``[N, C, h, w]`` -> ``[N, C, h*w]``, a view wherever the layout allows (a transposed one of NHWC)."""
    return _positions(features, True).transpose(1, 2) if _is_nhwc(features) else _positions(features, False)


def _positions_by_channels(features: Tensor) -> Tensor:
    """``[N, C, h, w]`` -> ``[N, h*w, C]``, a view wherever the layout allows."""
    return _positions(features, True) if _is_nhwc(features) else _positions(features, False).transpose(1, 2)


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
