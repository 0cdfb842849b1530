"""``posttrain``: from a base checkpoint and a folder of videos to a better, exported tokenizer.

Steps: shards (unless the folder is already an energon dataset) -> preflight -> baseline
evaluation -> training -> evaluation against the baseline -> export with a model card.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..checkpoint import CheckpointError, read_weights, resolve_config
from ..config import (
    DataConfig,
    LogConfig,
    LoRAConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ResumeConfig,
    TrainerConfig,
)
from ..data.energon import dataset_splits
from ..data.preflight import DataError
from ..losses import find_vgg16_weights


def prepare_data(videos: Path, run_dir: Path, val_fraction: float) -> Path:
    """An energon dataset: ``videos`` itself when prepared, else shards made in ``run_dir/data``."""
    if dataset_splits(videos):
        return videos
    out = run_dir / "data"
    cmd = [
        sys.executable,
        "-m",
        "data_tools",
        "make-shards",
        str(videos),
        str(out),
        "--val-fraction",
        str(val_fraction),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _root_path()})
    if result.returncode != 0:
        raise DataError(f"making shards from {videos} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return out


def _root_path() -> str:
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def perceptual_weight(requested: float | None) -> float:
    """The requested weight; by default 0.1 when the VGG16 file is there, else 0 with a notice."""
    if requested is not None:
        return requested
    try:
        find_vgg16_weights()
    except FileNotFoundError:
        print(
            "note: no VGG16 weights found, training with L1 only (pass --perceptual-weight 0.1 and put "
            "vgg16-397923af.pth in the torch hub cache to use the perceptual loss)",
            flush=True,
        )
        return 0.0
    return 0.1


def run(args: argparse.Namespace) -> int:
    from ..evaluate import evaluate
    from ..train import train

    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        base = read_weights(args.base)
        config = resolve_config(base, args.model, {})
        data_path = prepare_data(Path(args.videos), run_dir, args.val_fraction)
        clip = {"frames": args.frames, "size": args.size, "resize_short_side": args.resize_short_side}
        print(f"[1/4] baseline evaluation of {args.base}", flush=True)
        before = evaluate(args.base, str(data_path), str(run_dir / "eval_baseline"), max_clips=args.eval_clips, **clip)
        print(f"[2/4] training {config.name} for {args.steps} steps", flush=True)
        has_val = "val" in dataset_splits(data_path)
        train(
            model=ModelConfig(
                model=config.full_name,
                jit_ckpt_pth=str(args.base),
                channels=config.channels,
                trainable=args.trainable,
                lora=LoRAConfig(rank=args.lora_rank),
            ),
            data=DataConfig(
                path=str(data_path),
                frames=args.frames,
                height=args.size,
                width=args.size,
                resize_short_side=args.resize_short_side,
                global_batch_size=args.batch_size,
                micro_batch_size=args.batch_size,
                num_workers=args.num_workers,
            ),
            trainer=TrainerConfig(
                accelerator=args.accelerator,
                max_steps=args.steps,
                devices="1",
                val_check_interval=max(1, args.steps // 4) if has_val else args.steps,
                checkpoint_every_n_steps=max(1, args.steps // 4),
            ),
            optim=OptimConfig(lr=args.lr, schedule="cosine", warmup_steps=max(1, args.steps // 20)),
            resume=ResumeConfig(),
            log=LogConfig(log_dir=str(run_dir), name="train"),
            loss=LossConfig(perceptual_weight=perceptual_weight(args.perceptual_weight)),
        )
        export_dir = run_dir / "export"
        if export_dir.exists():
            shutil.rmtree(export_dir)
        shutil.copytree(run_dir / "train" / "export", export_dir)
        print("[3/4] evaluation against the baseline", flush=True)
        after = evaluate(
            str(export_dir),
            str(data_path),
            str(run_dir / "eval"),
            baseline=str(args.base),
            max_clips=args.eval_clips,
            **clip,
        )
    except (CheckpointError, DataError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    print("[4/4] export and report", flush=True)
    from .export_cmd import model_card

    (export_dir / "README.md").write_text(
        model_card(
            run_dir / "train" / "checkpoints" / "last.ckpt",
            {"model": config.full_name, "global_step": args.steps},
            after,
            ema=False,
        )
    )
    psnr_before, psnr_after = before["metrics"]["psnr"], after["metrics"]["psnr"]
    summary = {
        "psnr_before": psnr_before,
        "psnr_after": psnr_after,
        "export": str(export_dir),
        "report": str(run_dir / "eval" / "report.md"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"PSNR on held-out clips: {psnr_before:.2f} dB -> {psnr_after:.2f} dB\n"
        f"export: {export_dir}\nreport: {run_dir / 'eval' / 'report.md'}",
        flush=True,
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "posttrain", help="the whole job: shards, baseline, train, evaluate, export", description=__doc__
    )
    parser.add_argument("--base", required=True, help="base checkpoint (folder with autoencoder.jit, or a file)")
    parser.add_argument("--videos", required=True, help="folder of videos, or an energon dataset made by data_tools")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("--model", help="model name (default: inferred from the checkpoint)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--trainable", choices=("all", "decoder", "encoder"), default="all")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--frames", type=int, default=17, help="frames per clip (1 + 8k)")
    parser.add_argument("--size", type=int, default=256, help="square crop size")
    parser.add_argument("--resize-short-side", type=int, help="resize frames before cropping")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--accelerator", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--perceptual-weight", type=float, help="default: 0.1 when VGG16 weights are found, else 0")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="held-out share when making shards")
    parser.add_argument("--eval-clips", type=int, default=32, help="held-out clips to evaluate")
    parser.set_defaults(func=run)
