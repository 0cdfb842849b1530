"""Choosing what trains: all weights, the decoder or the encoder side, or LoRA adapters."""

from __future__ import annotations

from ..network import VideoTokenizer
from ..network.lora import apply_lora
from .config import LoRAConfig


def configure_trainable(network: VideoTokenizer, trainable: str, lora: LoRAConfig) -> list[str]:
    """Freeze what does not train; with ``lora.rank > 0`` add adapters (and train only them).

    Returns the names of the parameters that train.
    """
    if lora.rank > 0:
        # Freezes every base weight; only the convolutions the family allows take adapters.
        apply_lora(network, lora.rank, lora.alpha, lora.dropout, lora.targets, network.lora_modules)
    if trainable != "all":
        for name, param in network.named_parameters():
            if not name.startswith(network.sides[trainable]):
                param.requires_grad_(False)
    names = [n for n, p in network.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError(f"nothing to train with model.trainable={trainable} and model.lora.targets={lora.targets}")
    return names
