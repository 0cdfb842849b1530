"""How far a post-trained encoder's latent statistics moved from its base's: what a world model that normalizes
with the base's statistics sees (the evaluation report, ``summary.json`` and the model card show it).

The base's statistics are its files (Cosmos' ``mean_std.pt``), or, for a family whose consumers hard-code
per-channel constants (the Wan VAEs), those constants: no file changes what such a consumer subtracts and
divides by, so the shift from them is exactly what it sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..core.errors import EvaluationError
from ..network.family import NetworkConfig
from .latent_stats import LatentStats, base_latent_stats, read_latent_stats

FILES = "files"
"""A shift against the base's statistics files, per channel and latent frame."""
CONSTANTS = "constants"
"""A shift against the base's hard-coded per-channel constants."""


def _pooled(stats: LatentStats, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std over the first ``positions`` latent frames, each counted alike: what one value per
    channel normalizes."""
    mean, std = stats.mean[:, :positions].double(), stats.std[:, :positions].double()
    pooled = mean.mean(dim=1)
    variance = (std.square() + mean.square()).mean(dim=1) - pooled.square()
    return pooled, variance.clamp_min(0).sqrt()


def stats_shift(new: LatentStats, base: LatentStats, reference: str = FILES) -> dict[str, Any]:
    """What a downstream model normalizing with ``base``'s statistics sees of latents distributed as ``new``'s,
    per channel, over the latent positions both cover: the mean offset ``(mean - base mean) / base std`` (0: no
    shift) and the std ratio ``std / base std`` (1: no change), on average and at the worst position. Against
    :data:`CONSTANTS` (one value per channel), the average is that of the channel's pooled statistics."""
    if new.mean.shape[0] != base.mean.shape[0]:
        raise EvaluationError(f"latent statistics of {new.mean.shape[0]} and {base.mean.shape[0]} channels differ")
    positions = min(new.mean.shape[1], base.mean.shape[1])
    offset = (new.mean[:, :positions] - base.mean[:, :positions]) / base.std[:, :positions]
    ratio = new.std[:, :positions] / base.std[:, :positions]
    if reference == CONSTANTS:
        pooled_mean, pooled_std = _pooled(new, positions)
        mean_offset = ((pooled_mean - base.mean[:, 0].double()) / base.std[:, 0].double()).float()
        std_ratio = (pooled_std / base.std[:, 0].double()).float()
    else:
        mean_offset, std_ratio = offset.mean(dim=1), ratio.mean(dim=1)
    worst = offset.abs().argmax(dim=1)
    channels = [
        {
            "channel": c,
            "mean_offset": mean_offset[c].item(),
            "worst_mean_offset": offset[c, worst[c]].item(),
            "std_ratio": std_ratio[c].item(),
            "worst_std_ratio": ratio[c, (ratio[c] - 1).abs().argmax()].item(),
        }
        for c in range(offset.shape[0])
    ]
    return {
        "reference": reference,
        "positions": positions,
        "max_abs_mean_offset": offset.abs().max().item(),
        "max_std_change": (ratio - 1).abs().max().item(),
        "channels": channels,
    }


def reference_stats(config: NetworkConfig, base: str | Path | None) -> tuple[LatentStats, str] | None:
    """What ``config``'s world models normalized with before post-training, and which of :data:`FILES` or
    :data:`CONSTANTS` it is: the family's hard-coded constants where it has them, else the statistics files
    beside ``base``; None when there are neither."""
    constants = base_latent_stats(config)
    if constants is not None:
        return constants, CONSTANTS
    files = read_latent_stats(base, config) if base else None
    return (files, FILES) if files is not None else None


def shift_from_base(new: LatentStats, config: NetworkConfig, base: str | Path | None) -> dict[str, Any] | None:
    """:func:`stats_shift` of ``new`` against :func:`reference_stats` (None without a reference)."""
    reference = reference_stats(config, base)
    return None if reference is None else stats_shift(new, *reference)


def _against(shift: dict[str, Any]) -> str:
    if shift.get("reference") == CONSTANTS:
        return "the base's per-channel constants"
    return "the base's statistics"


def shift_line(shift: dict[str, Any]) -> str:
    """One line for the terminal: the largest mean offset and std change, and their channels."""
    channels = shift["channels"]
    worst_mean = max(channels, key=lambda c: abs(c["worst_mean_offset"]))
    worst_std = max(channels, key=lambda c: abs(c["worst_std_ratio"] - 1))
    return (
        f"latent statistics against {_against(shift)}: largest mean offset {shift['max_abs_mean_offset']:.4f} base "
        f"std (channel {worst_mean['channel']}), largest std change {shift['max_std_change']:.2%} (channel "
        f"{worst_std['channel']})"
    )


def shift_markdown(shift: dict[str, Any]) -> list[str]:
    """The per-channel table of :func:`stats_shift`, as markdown lines (evaluation report and model card)."""
    if shift.get("reference") == CONSTANTS:
        intro = (
            "A world model trained on the base tokenizer normalizes latents with the base's per-channel constants, "
            "which its code (and the base's diffusers config) hard-codes and no file changes; the post-trained "
            f"encoder's latents have, per channel (in units of the base std; pooled over {shift['positions']} latent "
            "frames, and at the worst frame), this mean offset and std ratio, exactly the shift such a model sees."
        )
    else:
        intro = (
            "A world model trained on the base tokenizer normalizes latents with the base's `mean_std.pt`; the "
            "post-trained encoder's latents then have, per channel (in units of the base std, over "
            f"{shift['positions']} latent frames), this mean offset and std ratio."
        )
    lines = [
        "## Latent statistics against the base",
        "",
        f"{intro} Largest offset {shift['max_abs_mean_offset']:.4f}, largest std change {shift['max_std_change']:.2%}.",
        "",
        "| channel | mean offset | worst position | std ratio | worst position |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {c['channel']} | {c['mean_offset']:+.4f} | {c['worst_mean_offset']:+.4f} | {c['std_ratio']:.4f} | "
        f"{c['worst_std_ratio']:.4f} |"
        for c in shift["channels"]
    ]
    return [*lines, ""]
