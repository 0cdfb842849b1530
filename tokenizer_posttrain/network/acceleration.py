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

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Fn = TypeVar("Fn", bound=Callable)


# Every ResNet block of the network runs through one compiled ``ResnetBlock.forward``: one code
# object, compiled once per distinct input shape and width (about 20 in the Cosmos networks), again
# without gradients (validation, a frozen encoder) and again for each aspect bucket's clip shape.
SEGMENT_RECOMPILE_LIMIT = 256
SEGMENT_BACKEND = "inductor"
_compiled_functions: dict[tuple[Callable, str], Callable] = {}


def run_segment(fn: Callable[[Tensor], Tensor], x: Tensor, recompute: bool, compiled: bool = False) -> Tensor:
    """``fn(x)``; with ``recompute`` (and autograd recording) its activations are recomputed in backward;
    with ``compiled``, through ``torch.compile`` of ``fn``'s class function (see :func:`compiled_segment`)."""
    if compiled:
        fn = compiled_segment(fn)
    if recompute and torch.is_grad_enabled():
        # Non-reentrant: works under torch.compile, with inputs that need no grad and with nested no_grad.
        return checkpoint(fn, x, use_reentrant=False)
    return fn(x)


def compiled_segment(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``fn`` (a module or a bound method) as a call of the compiled function of its class.

    The compiled function lives in a module-level cache, not on the instance, so a deep copy of the
    network (the EMA callback makes one) holds no function bound to the original's weights.
    """
    func, owner = (type(fn).forward, fn) if isinstance(fn, nn.Module) else (fn.__func__, fn.__self__)  # type: ignore[attr-defined]
    key = (func, SEGMENT_BACKEND)
    compiled = _compiled_functions.get(key)
    if compiled is None:
        keep_graphs_whole()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, SEGMENT_RECOMPILE_LIMIT)
        compiled = _compiled_functions[key] = torch.compile(func, backend=SEGMENT_BACKEND, dynamic=False)
    return functools.partial(compiled, owner)


def configure_network(
    network: nn.Module,
    activation_checkpointing: bool = False,
    channels_last: bool = False,
    compile_segments: bool = False,
) -> None:
    """Switch activation checkpointing, channels-last activations and compiled segments of a tokenizer on
    or off, in place.

    Every module with an ``activation_checkpointing`` attribute (encoder, decoder and their levels) gets
    the flags; the encoder and decoder get the memory format they convert their stems' outputs to.
    ``compile_segments`` compiles each ResNet block, resampler, attention pair, stem and head on its own:
    the backward pass is then a chain of compiled pieces, so DDP all-reduces the gradients of the
    pieces already done while the rest of the backward runs (one compiled graph hands DDP every
    gradient at its very end).
    """
    memory_format = torch.channels_last_3d if channels_last else torch.contiguous_format
    for module in network.modules():
        if hasattr(module, "activation_checkpointing"):
            module.activation_checkpointing = activation_checkpointing
            module.compile_segments = compile_segments
        if hasattr(module, "memory_format"):
            module.memory_format = memory_format


def compile_module_call(fn: Fn, backend: str = "inductor", mode: str | None = None) -> Fn:
    """``torch.compile`` of ``fn`` with static shapes (``mode``: torch.compile's, e.g. ``reduce-overhead``).

    Static: training clips have a fixed shape, and Inductor turns its channels-last layout optimisation of
    convolutions off for dynamic shapes. A new clip shape (an aspect bucket) compiles once more.
    """
    keep_graphs_whole()
    return torch.compile(fn, backend=backend, dynamic=False, mode=mode)


def cuda_graph_skips() -> int:
    """How many compiled graphs Inductor has run without CUDA graphs in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def warn_if_cuda_graphs_skipped() -> None:
    """Warn when ``model.cuda_graphs`` is on but Inductor fell back to launching kernels one by one
    (it logs why only under ``TORCH_LOGS=cudagraphs``)."""
    skips = cuda_graph_skips()
    if skips:
        warnings.warn(
            f"model.cuda_graphs: Inductor ran {skips} compiled graph(s) without CUDA graphs; "
            "rerun with TORCH_LOGS=cudagraphs to see why",
            stacklevel=2,
        )


def keep_graphs_whole() -> None:
    """Compile the same graphs under DDP as on one GPU.

    Code compiled inside DDP's forward (ours is) is cut by Dynamo's DDPOptimizer into one graph per
    gradient bucket, so that all-reduces can start during the backward pass. Cut that way, the
    compiled step trained 22% slower per GPU on two H200s than whole on one, while all-reducing every
    CV8x8x8 gradient took 1.4 ms there. Kept whole, DDP ran the same kernels for the same time as one
    GPU, and two GPUs went from 1.43-1.57x to 1.72x one (docs/benchmarks.md).
    """
    torch._dynamo.config.optimize_ddp = False
