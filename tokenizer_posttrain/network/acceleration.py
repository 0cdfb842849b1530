"""Training-speed and memory switches of the network that leave its results and checkpoint keys unchanged.

* activation checkpointing: the encoder and decoder keep only the input of each ResNet block, resampler,
  stem and head for the backward pass and recompute the rest there (the attention blocks, at the lowest
  resolution, are not recomputed);
* channels-last memory: activations are laid out ``[B, T, H, W, C]`` in memory (``torch.channels_last_3d``),
  the layout cuDNN's tensor-core convolutions work in, so no transposes surround every convolution. It pays
  under ``torch.compile``; in eager mode the extra permutes and fp32 layer norms cost more than they save
  (docs/benchmarks.md).

Both are plain attributes of the encoder and decoder (no wrappers), so ``state_dict`` keys, ``deepcopy``,
tracing and export see the same modules as without them. :func:`compile_module_call` compiles a function
of the network without wrapping the module (which would prefix every checkpoint key with ``_orig_mod.``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Fn = TypeVar("Fn", bound=Callable)


def run_segment(fn: Callable[[Tensor], Tensor], x: Tensor, recompute: bool) -> Tensor:
    """``fn(x)``; with ``recompute`` (and autograd recording) its activations are recomputed in backward."""
    if recompute and torch.is_grad_enabled():
        # Non-reentrant: works under torch.compile, with inputs that need no grad and with nested no_grad.
        return checkpoint(fn, x, use_reentrant=False)
    return fn(x)


def configure_network(network: nn.Module, activation_checkpointing: bool = False, channels_last: bool = False) -> None:
    """Switch activation checkpointing and channels-last activations of a tokenizer on or off, in place.

    Every module with an ``activation_checkpointing`` attribute (encoder, decoder and their levels) gets
    the flag; the encoder and decoder get the memory format they convert their stems' outputs to.
    """
    memory_format = torch.channels_last_3d if channels_last else torch.contiguous_format
    for module in network.modules():
        if hasattr(module, "activation_checkpointing"):
            module.activation_checkpointing = activation_checkpointing
        if hasattr(module, "memory_format"):
            module.memory_format = memory_format


def compile_module_call(fn: Fn, backend: str = "inductor") -> Fn:
    """``torch.compile`` of ``fn`` with static shapes.

    Static: training clips have a fixed shape, and Inductor turns its channels-last layout optimisation of
    convolutions off for dynamic shapes. A new clip shape (an aspect bucket) compiles once more.
    """
    return torch.compile(fn, backend=backend, dynamic=False)
