"""How far a post-trained encoder's latent statistics moved from its base's: what a world model that normalizes
with the base's ``mean_std.pt`` sees (the evaluation report and the model card show it)."""

from __future__ import annotations

from typing import Any

from ..core.errors import EvaluationError
from .latent_stats import LatentStats


def stats_shift(new: LatentStats, base: LatentStats) -> dict[str, Any]:
    """What a downstream model normalizing with ``base``'s statistics sees of latents distributed as ``new``'s,
    per channel, over the latent positions both cover: the mean offset ``(mean - base mean) / base std`` (0: no
    shift) and the std ratio ``std / base std`` (1: no change), averaged and at the worst position."""
    if new.mean.shape[0] != base.mean.shape[0]:
        raise EvaluationError(f"latent statistics of {new.mean.shape[0]} and {base.mean.shape[0]} channels differ")
    positions = min(new.mean.shape[1], base.mean.shape[1])
    offset = (new.mean[:, :positions] - base.mean[:, :positions]) / base.std[:, :positions]
    ratio = new.std[:, :positions] / base.std[:, :positions]
    worst = offset.abs().argmax(dim=1)
    channels = [
        {
            "channel": c,
            "mean_offset": offset[c].mean().item(),
            "worst_mean_offset": offset[c, worst[c]].item(),
            "std_ratio": ratio[c].mean().item(),
            "worst_std_ratio": ratio[c, (ratio[c] - 1).abs().argmax()].item(),
        }
        for c in range(offset.shape[0])
    ]
    return {
        "positions": positions,
        "max_abs_mean_offset": offset.abs().max().item(),
        "max_std_change": (ratio - 1).abs().max().item(),
        "channels": channels,
    }


def shift_markdown(shift: dict[str, Any]) -> list[str]:
    """The per-channel table of :func:`stats_shift`, as markdown lines (evaluation report and model card)."""
    lines = [
        "## Latent statistics against the base",
        "",
        "A world model trained on the base tokenizer normalizes latents with the base's `mean_std.pt`; the "
        "post-trained encoder's latents then have, per channel (in units of the base std, over "
        f"{shift['positions']} latent frames), this mean offset and std ratio. Largest offset "
        f"{shift['max_abs_mean_offset']:.4f}, largest std change {shift['max_std_change']:.2%}.",
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
