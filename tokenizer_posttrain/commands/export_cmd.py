"""``export``: a training checkpoint -> the official file set plus a model card."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointError, load_tokenizer
from ..export import export_tokenizer


def model_card(checkpoint: Path, info: dict[str, Any], results: dict[str, Any] | None, ema: bool) -> str:
    """The README.md written next to the exported files."""
    hp = info.get("hyper_parameters") or {}
    model, data = hp.get("model") or {}, hp.get("data") or {}
    lines = [
        f"# {info['model']} (post-trained)",
        "",
        "Exported by tokenizer-posttrain in the official Cosmos layout: `encoder.jit`, `decoder.jit` and "
        "`autoencoder.jit` load with plain `torch.jit.load` and follow the official call contract; "
        "`model.safetensors` holds the same weights.",
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
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    checkpoint = Path(args.checkpoint)
    try:
        network = load_tokenizer(checkpoint, ema=args.ema)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", flush=True, file=__import__("sys").stderr)
        return 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out = export_tokenizer(network, args.out, dtype=dtype)
    info: dict[str, Any] = {"model": network.config.full_name}
    if checkpoint.suffix == ".ckpt":
        ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
        info.update(global_step=ckpt.get("global_step"), hyper_parameters=ckpt.get("hyper_parameters"))
    results_path = Path(args.results) if args.results else checkpoint.parent.parent / "eval" / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else None
    (out / "README.md").write_text(model_card(checkpoint, info, results, args.ema))
    print(
        f"exported {network.config.full_name} to {out} (encoder.jit, decoder.jit, autoencoder.jit, "
        "model.safetensors, config.json, README.md)"
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write encoder.jit/decoder.jit/autoencoder.jit and a model card", description=__doc__
    )
    parser.add_argument("--checkpoint", required=True, help="RUN/checkpoints/last.ckpt, or any loadable checkpoint")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (runs with model.ema_decay)")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="weights of the .jit files (the official release is bf16)",
    )
    parser.add_argument(
        "--results",
        help="results.json of an evaluation to put in the model card (default: RUN/eval/results.json when it exists)",
    )
    parser.set_defaults(func=run)
