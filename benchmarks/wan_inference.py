"""Whole-video inference speed and peak memory of the Wan VAEs: one causal pass over a long 720p video, in chunks
of time, encode and decode timed apart (what the speed issue compares with Wan's own code: 93x720x1280 in bf16,
Wan2.1 2.44 s / 4.02 s in 10.7 GiB, Wan2.2 1.21 s / 4.32 s in 12.9 GiB on one H200).

Per model and ``--time-chunks`` value (latent frames per chunk; 0 = the whole video at once): the network's
``encoder_output`` and ``decode`` on a video already on the GPU, under bf16 autocast over fp32 weights (as
``reconstruct --dtype bf16`` runs them), median of ``--repeats`` after one warm-up, and the peak memory of each;
``--channels-last`` also times the channels-last layout. The video is the Big Buck Bunny sample
(``--video``, 1280x720, its first frames) or, without one, random pixels (the speed is the same; the numbers
below the table say which). The weights are random unless ``--weights`` names a Wan ``.pth``. Not a test.

    PYTHONPATH=. python3 benchmarks/wan_inference.py --models Wan2.1-VAE Wan2.2-VAE --time-chunks 1 2 4 \
        --video .bench_media/bigbuckbunny.mp4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tokenizer_posttrain import load_tokenizer
from tokenizer_posttrain.network import VideoTokenizer, build_tokenizer
from tokenizer_posttrain.training.acceleration import configure_network


def clip(path: str | None, frames: int, height: int, width: int, device: torch.device) -> Tensor:
    """``[1, 3, frames, height, width]`` in [-1, 1]: the video's first frames, or random pixels."""
    if path is None:
        return torch.rand(1, 3, frames, height, width, device=device) * 2 - 1
    import av  # only for a real video

    with av.open(path) as container:
        images = [f.to_ndarray(format="rgb24") for _, f in zip(range(frames), container.decode(video=0), strict=False)]
    if len(images) < frames:
        raise SystemExit(f"{path} has {len(images)} frames; --frames {frames} asks more")
    video = torch.from_numpy(np.stack(images)).to(device)[:, :height, :width]
    return video.permute(3, 0, 1, 2).unsqueeze(0).float() / 127.5 - 1


def timed(fn: Callable[[], Tensor], repeats: int, device: torch.device) -> tuple[float, float, Tensor]:
    """Median seconds of ``fn`` after a warm-up, its peak GiB above what was allocated before (0 on a CPU), and
    its output."""
    cuda = device.type == "cuda"
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if cuda else 0.0
    return statistics.median(times), peak, out


def network_of(name: str, weights: str | None, channels: int | None) -> VideoTokenizer:
    if weights:
        return load_tokenizer(weights)
    return build_tokenizer(name, **({"channels": channels} if channels else {}))


def measure(network: VideoTokenizer, x: Tensor, repeats: int, device: torch.device) -> dict[str, float]:
    """Encode and decode of ``x`` as the network is switched: seconds, peak GiB, and the round trip's PSNR."""
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        enc_s, enc_gib, z = timed(lambda: network.encoder_output(x), repeats, device)
        mu = z[:, : z.shape[1] // 2]
        dec_s, dec_gib, y = timed(lambda: network.decode(mu), repeats, device)
    psnr = (10 * torch.log10(4 / (y.float().clamp(-1, 1) - x).square().mean())).item()
    return {
        "encode_s": round(enc_s, 3),
        "decode_s": round(dec_s, 3),
        "encode_gib": round(enc_gib, 2),
        "decode_gib": round(dec_gib, 2),
        "psnr_db": round(psnr, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["Wan2.1-VAE", "Wan2.2-VAE"])
    parser.add_argument("--weights", nargs="*", default=[], help="a .pth per model (default: random weights)")
    parser.add_argument("--frames", type=int, default=93)
    parser.add_argument("--height", type=int, default=720)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--time-chunks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--channels-last", action="store_true", help="also time the channels-last layout")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--video", default=None, help="a video file (the first --frames frames are used)")
    parser.add_argument("--json", default=None, help="results file (default $OUT/wan_inference.json when OUT is set)")
    parser.add_argument("--channels", type=int, default=None, help="base width (8: tiny, for a CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {gpu}", flush=True)
    x = clip(args.video, args.frames, args.height, args.width, device)
    rows = []
    for i, name in enumerate(args.models):
        weights = args.weights[i] if i < len(args.weights) else None
        network = network_of(name, weights, args.channels).to(device).eval()
        for layout in (False, True) if args.channels_last else (False,):
            for time_chunk in args.time_chunks:
                configure_network(network, channels_last=layout, time_chunk=time_chunk)
                row = {"model": name, "clip": f"{args.frames}x{args.height}x{args.width}"}
                row |= measure(network, x, args.repeats, device)
                row["layout"], row["time_chunk"] = "channels-last" if layout else "contiguous", time_chunk
                rows.append(row)
                print(json.dumps(row), flush=True)
        configure_network(network)
        del network
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n| model | layout | time_chunk | encode s | decode s | encode GiB | decode GiB | PSNR dB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layout']} | {r['time_chunk']} | {r['encode_s']} | {r['decode_s']} | "
            f"{r['encode_gib']} | {r['decode_gib']} | {r['psnr_db']} |"
        )
    print(f"\nvideo: {args.video or 'random pixels'}; weights: {', '.join(args.weights) or 'random'}")
    out = args.json or (os.path.join(os.environ["OUT"], "wan_inference.json") if "OUT" in os.environ else None)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
