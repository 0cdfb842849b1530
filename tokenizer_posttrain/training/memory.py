"""What a training step's activations take, estimated on the CPU without the memory: the network runs on fake
tensors (shapes and dtypes, no data) while every storage an operation creates is counted for as long as it lives.

An estimate, not a GPU's figure: a CPU's convolution backward keeps other workspaces than cuDNN's, and neither the
allocator's fragmentation nor compiled code's fusion is modelled. It ranks the memory switches (activation
checkpointing, chunks of time) and sizes a clip before a GPU is at hand; ``benchmarks/memory_estimate.py`` prints it
beside the weights' and optimizer's share.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..network import build_tokenizer
from .acceleration import configure_network


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages that operations create, while they are alive (:attr:`live`), and the
    most at any one time (:attr:`peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                if storage not in self._sizes:
                    nbytes = storage.nbytes()
                    self._sizes[storage] = nbytes
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, nbytes)
        return out


def step_activation_bytes(
    model: str,
    clip: tuple[int, int, int],
    batch: int = 1,
    activation_checkpointing: bool = False,
    time_chunk: int = 0,
    **config: Any,
) -> int:
    """Peak bytes of the activations of an encode, a decode of the posterior (or latent) and an L1 loss under bf16
    autocast, and its backward, for ``batch`` clips of ``clip`` = (frames, height, width); the weights are not
    counted. ``model``: a model name, built with ``config`` (e.g. ``channels``) on fake tensors."""
    with FakeTensorMode():
        network = build_tokenizer(model, **config)
        configure_network(network, activation_checkpointing=activation_checkpointing, time_chunk=time_chunk)
        video = torch.rand(batch, 3, *clip) * 2 - 1
        counter = LiveStorages()
        with counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                encoding = network.encoding(video)
                loss = (network.decode(encoding.latent).float() - video).abs().mean()
            loss.backward()
    return counter.peak
