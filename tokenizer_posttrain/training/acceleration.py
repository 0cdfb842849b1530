"""Every speed and memory switch of training, in one place; none changes results or checkpoint keys.

* ``torch.compile`` of the training forward: the whole step as one graph (``compile_scope=step``), or each
  ResNet block, resampler, attention pair, stem and head on its own and the loss apart (``blocks``), so
  that DDP all-reduces finished pieces' gradients while the backward pass still runs;
* CUDA graphs (``cuda_graphs``): the compiled step replayed through torch.compile's ``reduce-overhead``
  mode, with the gradient handling that needs (:class:`StepAcceleration`);
* channels-last activations (``torch.channels_last_3d``; NHWC images for the VGG16), the layout of cuDNN's
  tensor-core convolutions. It pays under ``torch.compile``; in eager mode the extra permutes and fp32
  layer norms cost more than they save (docs/benchmarks.md);
* activation checkpointing: the encoder and decoder keep only the input of each ResNet block, resampler,
  stem and head for the backward pass and recompute the rest there;
* the GAN stage's discriminator, compiled and channels-last as the step is
  (:meth:`StepAcceleration.apply_discriminator`);
* DDP settings that keep the host's work per step small (:func:`ddp_kwargs`);
* during a bf16-mixed fit on a GPU, fp32 matrix products on tensor cores (TF32, :func:`tensor_core_matmuls`):
  under bf16 autocast the only ones left are the Gram term's products of the VGG16's bf16 features.

The network's own part is two plain attributes per encoder/decoder level (see
:mod:`tokenizer_posttrain.network.segments`), so ``state_dict`` keys, ``deepcopy``, tracing and export see
the same modules as without them. :class:`StepAcceleration` is the one entry the LightningModule uses.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..losses import Loss
from ..network import VideoTokenizer
from .config import ModelConfig, TrainerConfig


class SpeedSwitches(Protocol):
    """What takes the training's speed switches besides the tokenizer (the GAN stage's discriminator): typed here
    so that this module needs nothing of the stage's."""

    def accelerate(
        self, wrapper: Callable[[Callable], Callable] | None, channels_last: bool, keep_gradients: bool = False
    ) -> None: ...


Fn = TypeVar("Fn", bound=Callable)

GPU_SETTINGS: dict[str, bool] = {"compile": True, "cuda_graphs": True, "channels_last": True}
"""The ``model.*`` switches the GPU recipes turn on (docs/benchmarks.md has what each one measured)."""

# Every ResNet block of the network runs through one compiled ``ResnetBlock.forward``: one code
# object, compiled once per distinct input shape and width (about 20 in the Cosmos networks), again
# without gradients (validation, a frozen encoder) and again for each aspect bucket's clip shape.
SEGMENT_RECOMPILE_LIMIT = 256
SEGMENT_BACKEND = "inductor"
COMPILE_BACKEND = "inductor"
"""torch.compile's backend for the step and the loss (benchmarks use ``aot_eager`` for a quick CPU run)."""
WHOLE_STEP_BUCKET_MB = 4096
"""Larger than every Cosmos tokenizer's fp32 gradients (CV8x8x8: 403 MiB)."""
_compiled_functions: dict[tuple[Callable, str, str | None], Callable] = {}


def compiled_segment(fn: Callable[[Tensor], Tensor], mode: str | None = None) -> Callable[[Tensor], Tensor]:
    """``fn`` (a module or a bound method) as a call of the compiled function of its class (``mode``:
    torch.compile's, e.g. ``reduce-overhead`` for CUDA graphs).

    The compiled function lives in a module-level cache, not on the instance, so a deep copy of the
    network (the EMA callback makes one) holds no function bound to the original's weights.
    """
    func, owner = (type(fn).forward, fn) if isinstance(fn, nn.Module) else (fn.__func__, fn.__self__)  # type: ignore[attr-defined]
    key = (func, SEGMENT_BACKEND, mode)
    compiled = _compiled_functions.get(key)
    if compiled is None:
        keep_graphs_whole()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, SEGMENT_RECOMPILE_LIMIT)
        compiled = _compiled_functions[key] = torch.compile(func, backend=SEGMENT_BACKEND, dynamic=False, mode=mode)
    return functools.partial(compiled, owner)


def configure_network(
    network: nn.Module,
    activation_checkpointing: bool = False,
    channels_last: bool = False,
    compile_segments: bool = False,
    time_chunk: int = 0,
) -> None:
    """Switch activation checkpointing, channels-last activations and compiled segments of a tokenizer on
    or off, in place (all off: the plain network, as exported).

    Every module with an ``activation_checkpointing`` attribute (encoder, decoder and their levels) gets
    the flags; the encoder and decoder get the memory format they convert their stems' outputs to. ``time_chunk``
    cuts each clip's causal pass in time (a network with ``chunks_in_time`` only; a ``ValueError`` otherwise).
    """
    if time_chunk and not getattr(network, "chunks_in_time", False):
        raise ValueError(
            f"model.time_chunk={time_chunk}: {type(network).__name__} cannot run a clip in chunks of time "
            "(the Wan VAEs can); set model.time_chunk=0"
        )
    if hasattr(network, "time_chunk"):
        network.time_chunk = time_chunk
    memory_format = torch.channels_last_3d if channels_last else torch.contiguous_format
    for module in network.modules():
        if hasattr(module, "activation_checkpointing"):
            module.activation_checkpointing = activation_checkpointing
            module.segment_wrapper = compiled_segment if compile_segments else None
        if hasattr(module, "memory_format"):
            module.memory_format = memory_format


def configure_loss(loss: Loss, channels_last: bool = False) -> None:
    """Channels-last inputs for the loss terms that run image networks (the VGG16)."""
    for module in loss.modules():
        if hasattr(module, "channels_last"):
            module.channels_last = channels_last


def compile_module_call(fn: Fn, backend: str | None = None, mode: str | None = None) -> Fn:
    """``torch.compile`` of ``fn`` with static shapes (``mode``: torch.compile's, e.g. ``reduce-overhead``).

    Static: training clips have a fixed shape, and Inductor turns its channels-last layout optimisation of
    convolutions off for dynamic shapes. A new clip shape (an aspect bucket) compiles once more. A function,
    not the module, is compiled: wrapping the network would rename every checkpoint key (``_orig_mod.``).
    """
    keep_graphs_whole()
    return torch.compile(fn, backend=backend or COMPILE_BACKEND, dynamic=False, mode=mode)


def fast_encoder(network: VideoTokenizer) -> Callable[[Tensor], Tensor]:
    """``network.latent`` for inference on a GPU: channels-last activations, compiled (once per clip shape)."""
    configure_network(network, channels_last=True)
    return compile_module_call(network.latent)


def keep_graphs_whole() -> None:
    """Compile the same graphs under DDP as on one GPU.

    Code compiled inside DDP's forward (ours is) is cut by Dynamo's DDPOptimizer into one graph per
    gradient bucket, so that all-reduces can start during the backward pass. Cut that way, the compiled
    step trained slower per GPU on two H200s than whole on one; kept whole, DDP ran the same kernels for
    the same time as one GPU (docs/benchmarks.md).
    """
    torch._dynamo.config.optimize_ddp = False


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


def resolve_compile(model: ModelConfig, accelerator: str) -> ModelConfig:
    """``model`` with ``compile`` and ``cuda_graphs`` off (and a warning) on a CPU: the GPU recipes turn
    them on, and on a CPU Inductor would spend minutes generating code for no gain. ``cuda_graphs``
    is also turned off, with a warning, where the step is not compiled whole."""
    if model.compile and accelerator == "cpu":
        warnings.warn("model.compile is for GPUs: training eagerly on the CPU", stacklevel=2)
        return replace(model, compile=False, cuda_graphs=False)
    if model.cuda_graphs and not model.replays_cuda_graphs:
        warnings.warn(
            f"model.cuda_graphs=true needs model.compile=true and model.compile_scope=step (got compile="
            f"{str(model.compile).lower()}, compile_scope={model.compile_scope}): training without CUDA graphs",
            stacklevel=2,
        )
        return replace(model, cuda_graphs=False)
    return model


def ddp_kwargs(model: ModelConfig) -> dict[str, Any]:
    """DistributedDataParallel's settings for ``trainer.strategy=ddp``, chosen to keep the host's work
    per step small, since a compiled step leaves the host little time to launch it (docs/benchmarks.md).

    * no buffer broadcast in every forward: the networks' buffers (Haar filters, FSQ levels, VGG input
      scaling) are constants, built equal on every rank;
    * gradients are views into DDP's buckets, so they are not copied back out of them after the
      all-reduce (with ``model.cuda_graphs`` they also stay there between steps; otherwise gradients
      are set to None every step, and each is copied in again);
    * one bucket when the whole step is compiled: its backward hands DDP every gradient at its end,
      so smaller buckets only add all-reduce calls, with nothing left to overlap them with.
    """
    whole_step = model.compile and model.compile_scope == "step"
    options: dict[str, Any] = {
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": WHOLE_STEP_BUCKET_MB if whole_step else None,
    }
    # torch 2.13 renamed the switch (the old name warns); older releases know only the old one.
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    options["forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"] = False
    return options


def ddp_strategy(trainer: TrainerConfig, model: ModelConfig) -> str | DDPStrategy:
    """The Trainer's strategy: ``ddp`` with :func:`ddp_kwargs`, any other Lightning strategy by name."""
    return DDPStrategy(**ddp_kwargs(model)) if trainer.strategy == "ddp" else trainer.strategy


class StepAcceleration:
    """The switches of ``config`` applied to one training setup: what the LightningModule calls.

    * :meth:`wrap_step` / :meth:`wrap_loss`: the training forward (network and loss) and the loss alone,
      compiled as ``compile_scope`` says;
    * :meth:`begin_micro_batch`, :meth:`zero_grad`, :meth:`before_backward`, :attr:`keeps_gradients`: the
      gradient handling of CUDA graphs. A gradient that is None when a replayed backward reaches it becomes
      the graph's own output tensor, which the next replay overwrites (accumulated micro-batches or the next
      step would read another step's values); so gradients are allocated once and zeroed in place;
    * :meth:`after_first_batch`: the warning when Inductor skipped CUDA graphs, once per fit;
    * :meth:`apply` / :meth:`release`: the switches on for training, off for export.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.cuda_graphs = config.replays_cuda_graphs
        self._graphs_checked = False

    def apply(self, network: nn.Module, loss: Loss) -> None:
        """Checkpointing, channels-last and compiled segments on ``network`` (and ``loss``), as configured."""
        cfg = self.config
        configure_network(
            network,
            activation_checkpointing=cfg.activation_checkpointing,
            channels_last=cfg.channels_last,
            compile_segments=cfg.compile and cfg.compile_scope == "blocks",
            time_chunk=cfg.time_chunk,
        )
        configure_loss(loss, channels_last=cfg.channels_last)

    def apply_discriminator(self, stage: SpeedSwitches) -> None:
        """The same switches on the GAN stage's discriminator: compiled forward passes with ``compile`` (static
        shapes; CUDA graphs with ``cuda_graphs``, its gradients then kept allocated and zeroed in place, as the
        tokenizer's), channels-last with ``channels_last``.

        Where the step cannot take the adaptive weight's gradients apart (``AdversarialStage.splits``),
        it differentiates the compiled graphs with ``retain_graph`` (twice, then the step's backward), which
        AOTAutograd refuses for graphs compiled with donated buffers: those are turned off (for this process)
        when the stage is compiled.
        """
        cfg = self.config
        if cfg.compile:
            torch._functorch.config.donated_buffer = False
        wrapper = functools.partial(compiled_segment, mode=self._mode) if cfg.compile else None
        stage.accelerate(wrapper, cfg.channels_last, keep_gradients=self.cuda_graphs)

    def release(self, network: nn.Module) -> None:
        """The plain network again (training is over: export traces it as it is)."""
        configure_network(network)

    def wrap_step(self, fn: Fn) -> Fn:
        """The training forward ``fn``, compiled whole under ``compile_scope=step`` (as CUDA graphs with
        ``cuda_graphs``), else as it is."""
        if self.config.compile and self.config.compile_scope == "step":
            return compile_module_call(fn, mode=self._mode)
        return fn

    @property
    def _mode(self) -> str | None:
        """torch.compile's mode for the step's graphs: ``reduce-overhead`` (CUDA graphs) with ``cuda_graphs``."""
        return "reduce-overhead" if self.cuda_graphs else None

    def wrap_loss(self, fn: Fn) -> Fn:
        """The loss, compiled on its own under ``compile_scope=blocks`` (the network is compiled piecewise)."""
        return compile_module_call(fn) if self.config.compile and self.config.compile_scope == "blocks" else fn

    def wrap_part(self, fn: Fn) -> Fn:
        """A part of the training forward that runs on its own (the GAN stage's network and loss, whose
        gradients it takes apart): compiled under ``compile_scope=step`` (as CUDA graphs with ``cuda_graphs``);
        under ``blocks`` its pieces are compiled already."""
        if self.config.compile and self.config.compile_scope == "step":
            return compile_module_call(fn, mode=self._mode)
        return fn

    def begin_micro_batch(self) -> None:
        """Before each micro-batch's forward: under CUDA graphs a new replay, so the outputs of the last one
        are no longer read."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def keeps_gradients(self) -> bool:
        """Whether gradients must stay allocated (through validation too) rather than be freed."""
        return self.cuda_graphs

    def zero_grad(self, optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
        """Lightning's ``optimizer_zero_grad``: set to None, or under CUDA graphs zeroed in place."""
        if not self.cuda_graphs:
            optimizer.zero_grad(set_to_none=True)
            return
        torch._foreach_zero_(allocated_gradients(params))

    def before_backward(self, params: Iterable[nn.Parameter]) -> None:
        """Under CUDA graphs, allocate any gradient still missing: Lightning zeroes gradients only at a
        step's first micro-batch, and a run resumed from a checkpoint written between micro-batches starts
        its backward without that."""
        if self.cuda_graphs:
            allocated_gradients(params)

    def start_fit(self) -> None:
        """A new fit (also a second one after an exception): check CUDA graphs again."""
        self._graphs_checked = False

    def after_first_batch(self) -> None:
        """After a fit's first batch (which compiled the step): warn if CUDA graphs were skipped."""
        if self.cuda_graphs and not self._graphs_checked:
            self._graphs_checked = True
            warn_if_cuda_graphs_skipped()


@contextlib.contextmanager
def tensor_core_matmuls(enabled: bool = True) -> Iterator[None]:
    """Within the block, fp32 matrix products in TF32 on tensor cores (``set_float32_matmul_precision("high")``);
    the previous precision after it, so that nothing run later in the process (an evaluation) is affected.

    For a bf16-mixed fit: TF32 keeps 10 of fp32's 23 mantissa bits, bf16 only 7, so the Gram term's products of
    bf16 VGG16 features (cast to fp32) are the same products, accumulated in fp32, at tensor-core speed, wherever
    the mask is 0 or 1 (fractional mask weights and the backward pass's fp32 gradients are rounded to TF32).
    docs/benchmarks.md has what the Gram term cost without it. Set before the fit's first compile, since
    Dynamo guards compiled code on it. Convolutions in fp32 use TF32 anyway (PyTorch's default for cuDNN).
    """
    before = torch.get_float32_matmul_precision()
    if enabled:
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def allocated_gradients(params: Iterable[nn.Parameter]) -> list[Tensor]:
    """The gradients of the trainable ``params``, allocated (as zeros) where missing."""
    grads = []
    for param in params:
        if param.requires_grad:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
    return grads
