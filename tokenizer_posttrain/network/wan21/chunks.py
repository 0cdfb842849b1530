"""A clip's causal pass in chunks of time, with the causal state carried from chunk to chunk.

The whole-clip pass (:mod:`.blocks`) keeps every frame's activations at once: a 93x704x1280 clip holds 16 GB per
full-resolution tensor of Wan2.1's decoder in bf16, more than inference should need and more than training can
hold even with every block recomputed. Cut in time, the same pass needs one chunk's activations at a time:

* the encoder reads ``1 + tc (n - 1)`` frames, then ``tc n`` at a time; the decoder ``n`` latent frames at a time
  (``n = time_chunk``; the official code's chunks are ``n = 1``);
* every causal convolution reads, in front of a chunk, the last ``kt - 1`` frames its input had in the previous
  chunk (zeros in front of the first), instead of zero padding;
* the encoder's temporal downsampler reads the previous chunk's last frame in front (its windows straddle the cut);
* what only the clip's first frames do (frame 0 passing a temporal resampler alone, Wan2.2's shortcuts trimming
  the copy before frame 0) happens in the first chunk only.

So the result is the whole-clip pass's, to rounding, for any ``n``. In training, :func:`run_in_chunks` recomputes
each chunk in the backward pass (``recompute``): autograd keeps only the chunks' inputs and the carried frames,
and gradients flow back through the carried frames into the chunk before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class Stream:
    """The causal state of one chunk of a clip: what the previous chunk left each module, and what this one hands
    the next. A module looks itself up in :attr:`carried` (None before the first chunk) and :meth:`hand`s on."""

    def __init__(self, first: bool, carried: dict[nn.Module, Tensor | None], hands_on: bool = True) -> None:
        self.first = first
        """Whether this chunk holds the clip's first frame."""
        self.carried = carried
        self.hands_on = hands_on
        self.handed: dict[nn.Module, Tensor] = {}

    def hand(self, module: nn.Module, frames: Tensor) -> None:
        """Leave ``frames`` (a few of a chunk's frames) to ``module`` in the next chunk: a copy, since a view would
        keep the whole chunk's tensor alive until the backward pass."""
        if self.hands_on:
            self.handed[module] = frames.clone()

    def replay(self) -> Stream:
        """The state again for a piece recomputed in the backward pass, which hands nothing on. (A recomputation
        keeps what it runs with; were that the stream itself, the frames it handed would reference the graph
        that references them, a cycle that keeps a chunk's tensors alive to the end of the backward pass.)"""
        return Stream(self.first, self.carried, hands_on=False)

    def padded(self, module: nn.Module, x: Tensor, frames: int) -> Tensor:
        """``x`` with its causal past in front: the frames ``module`` carried from the previous chunk, or ``frames``
        zero frames before the first (padded as the whole-clip pass pads, so a channels-last clip stays so)."""
        carried = self.carried.get(module)
        if carried is None:
            return F.pad(x, (0, 0, 0, 0, frames, 0))
        if carried.requires_grad:
            carried = _CompactGradient.apply(carried)
        return torch.cat([carried, x], dim=2)


@contextmanager
def attached(stream: Stream, modules: Sequence[Streaming]) -> Iterator[None]:
    """``modules`` read ``stream`` inside the block. Whatever runs a chunk's pieces again in the backward pass
    (a recomputed chunk, a recomputed block inside one) enters it again: the state it ran with the first time."""
    before = [m.stream for m in modules]
    for module in modules:
        module.stream = stream
    try:
        yield
    finally:
        for module, previous in zip(modules, before, strict=True):
            module.stream = previous


class Rerun:
    """The context of one piece of a chunk (a block), entered at each run of it: the chunk's stream the first
    time, its :meth:`Stream.replay` when the backward pass recomputes the piece. Holds the stream itself only until
    the first run, so nothing the piece handed on stays referenced by the recomputation."""

    def __init__(self, stream: Stream, modules: Sequence[Streaming]) -> None:
        self.stream: Stream | None = stream
        self.replay = stream.replay()
        self.modules = modules

    def __call__(self) -> AbstractContextManager[None]:
        stream, self.stream = self.stream or self.replay, None
        return attached(stream, self.modules)


class Streaming(nn.Module):
    """A module whose output depends on earlier chunks or on holding frame 0 (or that runs such modules in
    recomputed pieces): it reads :attr:`stream`, None in the whole-clip pass. A plain attribute, set by
    :func:`attached`, never part of the state."""

    stream: Stream | None = None

    @property
    def first_chunk(self) -> bool:
        """True in the whole-clip pass and in a clip's first chunk."""
        return self.stream is None or self.stream.first


def chunk_sizes(frames: int, first: int, rest: int) -> list[int]:
    """Lengths of the pieces of ``frames``: ``first``, then ``rest`` each (the last one may be shorter)."""
    sizes = [min(first, frames)]
    while sum(sizes) < frames:
        sizes.append(min(rest, frames - sum(sizes)))
    return sizes


def run_in_chunks(
    fn: Callable[[Tensor], Tensor],
    x: Tensor,
    sizes: Sequence[int],
    modules: Sequence[Streaming],
    recompute: bool = False,
) -> Tensor:
    """``fn`` over ``x`` ``[B, C, T, ...]`` cut into pieces of ``sizes`` frames, the causal state of ``modules``
    carried from piece to piece; the outputs joined in time. With ``recompute`` (and autograd recording) each
    piece's activations are recomputed in the backward pass."""
    carried: list[Tensor | None] = [None] * len(modules)

    def piece_pass(piece: Tensor, first: bool, *past: Tensor | None) -> tuple[Tensor | None, ...]:
        stream = Stream(first, dict(zip(modules, past, strict=True)))
        with attached(stream, modules):
            out = fn(piece)
        return (out, *(stream.handed.get(m, stream.carried[m]) for m in modules))

    outputs: list[Tensor] = []
    for i, piece in enumerate(x.split(list(sizes), dim=2)):
        if recompute and torch.is_grad_enabled():
            results = checkpoint(piece_pass, piece, i == 0, *carried, use_reentrant=False)
        else:
            results = piece_pass(piece, i == 0, *carried)
        out = results[0]
        assert isinstance(out, Tensor)
        outputs.append(out)
        carried = list(results[1:])
    return torch.cat(outputs, dim=2)


class _CompactGradient(torch.autograd.Function):
    """``x`` unchanged; its gradient copied into a tensor of its own.

    A carried frame's gradient is a slice of the gradient of the whole padded input of a convolution in the next
    chunk; handed back as a view, it would keep that whole gradient alive until the earlier chunk's backward pass
    runs, for every convolution at once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # noqa: ARG004
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.clone()


def streaming_modules(module: nn.Module) -> list[Streaming]:
    """The modules under ``module`` that carry state between chunks, in registration order."""
    return [m for m in module.modules() if isinstance(m, Streaming)]
