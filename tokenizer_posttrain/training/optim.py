"""AdamW with per-prefix learning rates, warmup and cosine/linear decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig


def param_groups(network: nn.Module, lr: float, lr_groups: dict[str, float] | None) -> list[dict]:
    """Trainable parameters grouped by the longest matching name prefix in ``lr_groups``."""
    prefixes = sorted(lr_groups or {}, key=len, reverse=True)
    groups: dict[str, dict] = {}
    for name, param in network.named_parameters():
        if not param.requires_grad:
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), "")
        group = groups.setdefault(
            prefix, {"name": prefix or "default", "params": [], "lr": lr_groups[prefix] if prefix else lr}
        )
        group["params"].append(param)
    unused = [p for p in prefixes if p not in groups]
    if unused:
        # The model's own top-level names: they differ between tokenizer families.
        tops = sorted({name.split(".")[0] + "." for name, param in network.named_parameters() if param.requires_grad})
        raise ValueError(
            f"optim.lr_groups prefixes {unused} match no trainable parameter "
            f"(the trainable names start with {', '.join(repr(t) for t in tops)})"
        )
    if not groups:
        raise ValueError("nothing to train: every parameter is frozen (check model.trainable and model.lora)")
    return list(groups.values())


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * decay


def build_optimizer(network: nn.Module, cfg: OptimConfig, max_steps: int, fused: bool) -> dict:
    """The ``configure_optimizers`` dict: AdamW and a per-step LambdaLR."""
    if cfg.schedule != "constant" and max_steps <= 0:
        raise ValueError(f"optim.schedule={cfg.schedule} decays to trainer.max_steps; set trainer.max_steps")
    optimizer = torch.optim.AdamW(
        param_groups(network, cfg.lr, cfg.lr_groups),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=fused,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, cfg.schedule, max_steps, cfg.min_lr_ratio)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
