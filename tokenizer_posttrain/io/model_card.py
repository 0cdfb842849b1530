"""The README.md written beside exported files: what the model is, what it was trained on, how it scores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import read_checkpoint
from .diffusers_format import DIFFUSERS_CLASS, PIPELINE_SUBFOLDER


def _files(formats: tuple[str, ...]) -> list[str]:
    lines = []
    if "cosmos" in formats:
        lines.append(
            "Exported by tokenizer-posttrain in the official Cosmos layout: `encoder.jit`, `decoder.jit` and "
            "`autoencoder.jit` load with plain `torch.jit.load` and follow the official call contract; "
            "`model.safetensors` holds the same weights."
        )
    if "diffusers" in formats:
        where = f"`{PIPELINE_SUBFOLDER}/` holds them" if lines else "Exported by tokenizer-posttrain"
        lines.append(
            f"{where} as a diffusers `{DIFFUSERS_CLASS}` folder, which `{DIFFUSERS_CLASS}.from_pretrained` loads and "
            "a diffusers Cosmos pipeline takes as its `vae`; its `config.json` holds the latent statistics "
            "(`latents_mean`, `latents_std`)."
        )
    return [" ".join(lines)]


def model_card(
    checkpoint: Path,
    info: dict[str, Any],
    results: dict[str, Any] | None,
    ema: bool,
    verdict: str | None = None,
    formats: tuple[str, ...] = ("cosmos",),
    sections: list[str] | None = None,
) -> str:
    """The README.md written next to the exported files; ``verdict`` (how it compares with its base, e.g.
    ``WORSE than the base: PSNR 6.34 -> 5.92 dB ...``) goes above everything else; ``sections`` (markdown
    lines) at the end. ``formats``: the export formats written (``cosmos``, ``diffusers``; with both, the
    diffusers folder is ``vae/``)."""
    hp = info.get("hyper_parameters") or {}
    model, data = hp.get("model") or {}, hp.get("data") or {}
    lines = [
        f"# {info['model']} (post-trained)",
        "",
        *([f"**Verdict: {verdict}.**", ""] if verdict else []),
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
        f"| weights | {'EMA average' if ema else 'last'} from `{checkpoint}` |",
    ]
    if results:
        lines += ["", "## Last evaluation", "", "| metric | baseline | post-trained |", "|---|---|---|"]
        base, new = results.get("baseline_metrics") or {}, results.get("metrics") or {}
        for key, value in new.items():
            if isinstance(value, (int, float)):
                before = base.get(key)
                lines.append(f"| {key} | {before if before is not None else '-'} | {value} |")
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
    formats: tuple[str, ...] = ("cosmos",),
    sections: list[str] | None = None,
) -> str:
    """The model card of weights exported from ``checkpoint``: base model, what trained, data and clip and steps
    are read from a training checkpoint's hyperparameters (``global_step`` overrides its step: an export made
    at the end of a run can be newer than its last checkpoint). The one path the export command and the
    posttrain workflow share. ``verdict``, ``formats`` and ``sections``: see :func:`model_card`."""
    info: dict[str, Any] = {"model": model}
    if checkpoint.suffix == ".ckpt" and checkpoint.is_file():
        ckpt = read_checkpoint(checkpoint, mmap=True)
        info.update(global_step=ckpt.get("global_step"), hyper_parameters=ckpt.get("hyper_parameters"))
    if global_step is not None:
        info["global_step"] = global_step
    return model_card(checkpoint, info, results, ema, verdict, formats, sections)
