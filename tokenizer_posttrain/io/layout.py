"""The official file set and key layout of a tokenizer: file names, the shapes a model's weights must have, and
how a set of weights differs from them (shared by loading, export and the diffusers format)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from ..core.errors import CheckpointError
from ..network import build_network, family_of
from ..network.family import NetworkConfig

JIT_AUTOENCODER = "autoencoder.jit"
JIT_ENCODER = "encoder.jit"
JIT_DECODER = "decoder.jit"
SAFETENSORS = "model.safetensors"
CONFIG_JSON = "config.json"
LIGHTNING_PREFIX = "network."
"""Prefix of the tokenizer's keys inside our Lightning checkpoints."""
CONFIG_KEY = "tokenizer_config"
"""Key under which Lightning checkpoints and ``config.json`` store the tokenizer config."""


@dataclass
class Weights:
    """Tokenizer weights read from a file, in autoencoder-layout keys, and the config stored with them."""

    state: dict[str, Tensor]
    source: str
    config: NetworkConfig | None = None


def load_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file (nothing in it runs); :class:`CheckpointError` naming it when it is
    truncated or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}. The file looks truncated or corrupt.") from err


def expected_shapes(config: NetworkConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the autoencoder layout of ``config`` (built on the meta device, once per config)."""
    return dict(_layout(config))


@lru_cache(maxsize=256)
def _layout(config: NetworkConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    # Every load compares the weights with each registered model's layout: building those networks, even on the
    # meta device, took ~0.6 s a load, and a workflow loads the same few models again and again.
    with torch.device("meta"):
        net = build_network(config)
    return tuple((k, tuple(v.shape)) for k, v in net.state_dict().items())


@dataclass
class LayoutDiff:
    missing: list[str]
    unexpected: list[str]
    wrong_shape: list[str]

    @property
    def size(self) -> int:
        return len(self.missing) + len(self.unexpected) + len(self.wrong_shape)

    def describe(self, limit: int = 5) -> str:
        parts = []
        for label, items in (
            ("missing keys", self.missing),
            ("unexpected keys", self.unexpected),
            ("wrong shapes", self.wrong_shape),
        ):
            if items:
                shown = ", ".join(items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "")
                parts.append(f"{label}: {shown}")
        return "; ".join(parts)


def diff_layout(state: dict[str, Tensor], expected: dict[str, tuple[int, ...]]) -> LayoutDiff:
    got = {k: tuple(v.shape) for k, v in state.items()}
    return LayoutDiff(
        missing=sorted(set(expected) - set(got)),
        unexpected=sorted(set(got) - set(expected)),
        wrong_shape=[f"{k} {got[k]} (expected {expected[k]})" for k in expected if k in got and got[k] != expected[k]],
    )


def describe_config(cfg: NetworkConfig) -> str:
    """The model name, with every setting (its width, its latent channels...) that is not the registered one's."""
    base = family_of(cfg).configs[cfg.name].to_dict()
    changed = [f"{k}={v}" for k, v in cfg.to_dict().items() if base.get(k) != v]
    return cfg.name + (f" ({', '.join(changed)})" if changed else "")
