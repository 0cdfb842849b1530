"""How the encoder and decoder run their pieces (ResNet blocks, resamplers, attention, stems, heads).

Each piece goes through :func:`run_segment`, which the modules' switches steer: recomputation in the backward
pass (``activation_checkpointing``) and an optional wrapper (``segment_wrapper``; the training acceleration
module compiles each piece with it). Both are plain attributes, set by
:func:`tokenizer_posttrain.training.acceleration.configure_network`, never part of the state.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

Segment = Callable[[Tensor], "Tensor | tuple[Tensor, ...]"]
"""A piece: a tensor in, a tensor (or a few) out."""
SegmentWrapper = Callable[[Segment], Segment]


def _within(context: Callable[[], AbstractContextManager[object]], fn: Segment) -> Segment:
    def run(x: Tensor) -> Tensor | tuple[Tensor, ...]:
        with context():
            return fn(x)

    return run


def run_segment(
    fn: Segment,
    x: Tensor,
    recompute: bool,
    wrapper: SegmentWrapper | None = None,
    context: Callable[[], AbstractContextManager[object]] | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """``fn(x)``, through ``wrapper(fn)`` when one is set; with ``recompute`` (and autograd recording) its
    activations are recomputed in the backward pass instead of kept. ``context()`` is entered around every run
    of ``fn``, the recomputation's included (outside the wrapper: what it sets is not compiled in)."""
    if wrapper is not None:
        fn = wrapper(fn)
    if context is not None:
        fn = _within(context, fn)
    if recompute and torch.is_grad_enabled():
        # Non-reentrant: works under torch.compile, with inputs that need no grad and with nested no_grad.
        return checkpoint(fn, x, use_reentrant=False)
    return fn(x)
