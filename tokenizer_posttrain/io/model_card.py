"""The README.md written beside exported files: what the model is, what it was trained on, how it scores."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .checkpoint import read_checkpoint
from .formats import DEFAULT_FORMAT, placements


def _files(formats: tuple[str, ...]) -> list[str]:
    # One paragraph: each format's sentence, the first one's files in the export folder, the others' in theirs.
    return [" ".join(fmt.card(subfolder) for fmt, subfolder in placements(formats))]


def card_title(model: str, channels: int | None) -> str:
    """The card's heading: the model's name, and where its width is not the released model's (a test-size
    model), the architecture and width instead, so that a width-16 model is not taken for the released one."""
    from ..network import get_config

    try:
        released = get_config(model)
    except ValueError:  # a name outside the registry: nothing to compare the width with
        return f"{model} (post-trained)"
    if channels is None or channels == released.channels:
        return f"{model} (post-trained)"
    return (
        f"{released.name} architecture at width {channels} (post-trained; not the released {released.full_name}, "
        f"which has width {released.channels})"
    )


# Each metric's key, label (with the better direction) and format for people: the model card here and the
# evaluation report (a layer up) show them alike.
METRICS = (
    ("psnr", "PSNR (dB) ↑", "{:.2f}"),
    ("ssim", "SSIM ↑", "{:.4f}"),
    ("lpips", "LPIPS-style VGG16 distance ↓", "{:.4f}"),
    ("flicker", "temporal flicker ↓", "{:.5f}"),
    ("codebook_usage", "codebook usage ↑", "{:.4f}"),
    ("perplexity", "code perplexity ↑", "{:.1f}"),
)
COMPARISONS = (
    ("latent_drift", "latent drift vs baseline (relative L2)", "{:.5f}"),
    ("token_flip_rate", "token flip rate vs baseline", "{:.5f}"),
)


def metric_text(key: str, value: float | None) -> str:
    """A metric rounded for people, as the evaluation report shows it (PSNR to 0.01 dB, SSIM to 4 decimals...)."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    fmt = next((f for name, _, f in METRICS if name == key), "{:.4g}")
    return fmt.format(value)


def model_card(
    checkpoint: Path,
    info: dict[str, Any],
    results: dict[str, Any] | None,
    ema: bool,
    verdict: str | None = None,
    formats: tuple[str, ...] = (DEFAULT_FORMAT,),
    sections: list[str] | None = None,
    drift: str | None = None,
    latent_stats: str | None = None,
) -> str:
    """The README.md written next to the exported files; ``verdict`` (how it compares with its base, e.g.
    ``WORSE than the base: PSNR 6.34 -> 5.92 dB ...``) goes above everything else, then ``drift`` (a latent drift
    above its limit, :func:`~..evaluation.report.drift_warning`); ``sections`` (markdown lines) at the end.
    ``formats``: the export formats written (names of :data:`~.formats.FORMATS`: ``cosmos``, ``diffusers``;
    with both, the diffusers folder is ``vae/``). ``info``: ``model`` (its name), optionally ``channels`` (its
    width), ``global_step`` and a training checkpoint's ``hyper_parameters`` (base, what trained, data, learning
    rate). ``latent_stats``: what the export's latent statistics are (measured on which clips, copied from the
    base, or the base's hard-coded constants kept by a decoder-only run), a row of the table."""
    hp = info.get("hyper_parameters") or {}
    model, data, optim = hp.get("model") or {}, hp.get("data") or {}, hp.get("optim") or {}
    channels = info.get("channels", model.get("channels"))
    lr = optim.get("lr")
    schedule = ""
    if optim.get("schedule"):
        schedule = f" ({optim['schedule']} schedule, {optim.get('warmup_steps')} warmup steps)"
    lines = [
        f"# {card_title(info['model'], channels)}",
        "",
        *([f"**Verdict: {verdict}.**", ""] if verdict else []),
        *([f"**Warning: {drift}.**", ""] if drift else []),
        *_files(formats),
        "",
        "| | |",
        "|---|---|",
        f"| base model | {model.get('model', info['model'])} from `{model.get('jit_ckpt_pth')}` |",
        f"| trained | {model.get('trainable', 'all')}"
        + (f", LoRA rank {model['lora']['rank']} (merged)" if (model.get("lora") or {}).get("rank") else "")
        + " |",
        f"| data | `{data.get('path') or 'synthetic clips'}`, clips {data.get('frames')}x{data.get('height')}x"
        f"{data.get('width')} |",
        f"| steps | {info.get('global_step')} |",
        *([f"| learning rate | {lr:g}{schedule} |"] if isinstance(lr, int | float) else []),
        f"| weights | {'EMA average' if ema else 'last'} from `{checkpoint}` |",
        *([f"| latent statistics | {latent_stats} |"] if latent_stats else []),
    ]
    if results:
        lines += ["", "## Last evaluation", ""]
        clips, videos = results.get("n_clips"), results.get("n_videos")
        if clips:
            where = f" of {videos} video{'s' if videos != 1 else ''}" if videos else ""
            lines += [f"On {clips} held-out clip{'s' if clips != 1 else ''}{where}.", ""]
        lines += ["| metric | baseline | post-trained |", "|---|---|---|"]
        base, new = results.get("baseline_metrics") or {}, results.get("metrics") or {}
        for key, value in new.items():
            if isinstance(value, int | float):
                lines.append(f"| {key} | {metric_text(key, base.get(key))} | {metric_text(key, value)} |")
        limit = results.get("drift_limit")
        for key, value in (results.get("comparison") or {}).items():
            if isinstance(value, int | float):
                bound = f" (limit {limit:g})" if isinstance(limit, int | float) else ""
                lines.append(f"| {key.replace('_', ' ')}{bound} | - | {value:.4f} |")
    if sections:
        lines += ["", *sections]
    return "\n".join(lines).rstrip("\n") + "\n"


def checkpoint_card(
    checkpoint: Path,
    model: str,
    results: dict[str, Any] | None,
    ema: bool,
    global_step: int | None = None,
    verdict: str | None = None,
    formats: tuple[str, ...] = (DEFAULT_FORMAT,),
    sections: list[str] | None = None,
    channels: int | None = None,
    drift: str | None = None,
    latent_stats: str | None = None,
) -> str:
    """The model card of weights exported from ``checkpoint``: base model, what trained, data and clip, steps and
    learning rate are read from a training checkpoint's hyperparameters (``global_step`` overrides its step: an
    export made at the end of a run can be newer than its last checkpoint; ``channels``, the model's width,
    overrides theirs). The one path the export command and the posttrain workflow share. ``verdict``,
    ``formats``, ``sections``, ``drift`` and ``latent_stats``: see :func:`model_card`."""
    info: dict[str, Any] = {"model": model}
    if checkpoint.suffix == ".ckpt" and checkpoint.is_file():
        ckpt = read_checkpoint(checkpoint, mmap=True)
        info.update(global_step=ckpt.get("global_step"), hyper_parameters=ckpt.get("hyper_parameters"))
    if global_step is not None:
        info["global_step"] = global_step
    if channels is not None:
        info["channels"] = channels
    return model_card(checkpoint, info, results, ema, verdict, formats, sections, drift, latent_stats)
