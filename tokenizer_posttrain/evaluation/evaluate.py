"""Evaluate a (post-trained) tokenizer on held-out clips, optionally against a baseline (before/after).

Clips are deterministic (middle frames, centre crop), so model and baseline see the same pixels. Per clip: PSNR on
uint8 frames, SSIM, a VGG16 perceptual distance (when the weights file is there), temporal flicker; for DV, codebook
usage and perplexity; with a baseline, how far latents (continuous: a VAE's posterior mean) or tokens (DV) moved;
for continuous models, the PSNR of reconstructions decoded from noised latents (:data:`NOISE_LEVELS`).
Arguments are plain strings and numbers, so :func:`evaluate` can be wrapped as a NeMo-Run ``Partial``.
:mod:`.report` writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..core.errors import EvaluationError
from ..core.progress import progress
from ..data.batch import CLIP_FRAMES, CLIP_SIZE
from ..io.checkpoint import load_tokenizer
from ..losses.perceptual import VGG16_FILE, VGG16_URL, PerceptualLoss, find_vgg16_weights
from ..network import VideoTokenizer, family_of
from ..network.family import channel_scale
from .clips import held_out_clips, video_fps
from .inference import DTYPES
from .latent_shift import shift_from_base
from .latent_stats import read_latent_stats
from .media import to_frames, to_uint8
from .metrics import clip_psnr, clip_ssim, codebook_stats, latent_drift, temporal_flicker, token_flip_rate
from .report import LATENT_DRIFT_LIMIT, NOISED

PER_CLIP = ("psnr", "ssim", "lpips", "flicker")
EVAL_CLIPS_PER_VIDEO = 8
"""Clips drawn at most from one held-out video (the first centred, the others at random starts and crops): a
verdict needs several clips (:data:`.report.MIN_VERDICT_CLIPS`) even from a few held-out videos, while clips
overlapping in one video add less and less."""
NOISE_LEVELS = (0.05, 0.1, 0.2)
"""Noise levels, in units of each latent channel's spread (:func:`~..network.family.channel_scale`: the Wan VAEs'
hard-coded std, else the clip latent's own per-channel std), of the noised-latent PSNR: a world model hands the
decoder latents close to, not equal to, the encoder's, off by about this much in the normalised space it works in.
0.05 is :data:`.report.LATENT_DRIFT_LIMIT`'s size; 0.1 and 0.2 are a world model's larger misses. One extra decode
per level, per clip and tokenizer."""
NOISE_SEED = 0
"""Seed of the latent noise: clip ``i`` draws its noise from ``NOISE_SEED + i`` on the CPU (the same on any
device), one draw scaled to every level, the same for the model and the baseline, so reruns give the same numbers
and the two tokenizers are compared on the same noise."""
LPIPS_NOTE = (
    "VGG16 perceptual distance of the training loss (LPIPS input scaling, weighted L1 of relu1_2..relu5_3 "
    "features); comparable between runs with the same VGG file, not the calibrated LPIPS network"
)


# -- evaluation -----------------------------------------------------------------------------------------------


class _Side:
    """One tokenizer under evaluation and what it has accumulated over the clips."""

    def __init__(self, checkpoint: str, device: str, dtype: torch.dtype, noise_levels: tuple[float, ...]) -> None:
        self.checkpoint = checkpoint
        self.net: VideoTokenizer = load_tokenizer(checkpoint).to(device, dtype).eval()
        self.config = self.net.config
        self.dtype = dtype
        self.per_clip: dict[str, list[float]] = {name: [] for name in PER_CLIP}
        # Discrete tokenizers: world models hand their decoder token indices, exact or wrong, never a little off.
        self.noised: dict[float, list[float]] = {} if self.config.is_discrete else {lv: [] for lv in noise_levels}
        self.errors = torch.zeros(256, dtype=torch.long)  # |error| histogram in uint8 levels
        self.codes = torch.zeros(self.config.codebook_size, dtype=torch.long) if self.config.is_discrete else None

    def run(self, video: Tensor, perceptual: PerceptualLoss | None, index: int = 0) -> tuple[Tensor, Tensor]:
        """Reconstruct clip number ``index`` ``[1, 3, T, H, W]``, record its metrics; returns (reconstruction,
        latent)."""
        encoding = self.net.encoding(video.to(self.dtype))
        # DV: indices are what downstream models consume, codes what the decoder takes.
        latent = encoding.tokens
        recon = self.net.decode(encoding.latent).float().clamp(-1, 1)
        # On the uint8 frames a viewer of the decoded video gets (data range 255).
        pred, ref = to_uint8(recon).float(), to_uint8(video).float()
        self.per_clip["psnr"].append(clip_psnr(pred, ref, data_range=255.0).item())
        if self.noised:
            self._run_noised(encoding.latent, ref, index)
        self.per_clip["ssim"].append(clip_ssim(pred, ref, data_range=255.0).item())
        self.per_clip["flicker"].append(temporal_flicker(recon, video).item())
        if perceptual is not None:
            self.per_clip["lpips"].append(perceptual(recon, video).item())
        diff = (to_uint8(recon).short() - to_uint8(video).short()).abs()
        self.errors += torch.bincount(diff.flatten().long(), minlength=256).cpu()
        if self.codes is not None:
            self.codes += torch.bincount(latent.flatten().long(), minlength=self.codes.numel()).cpu()
        return recon, latent

    def _run_noised(self, latent: Tensor, ref: Tensor, index: int) -> None:
        """The PSNR of the clip decoded from ``latent + level x channel_scale x noise`` at each noise level."""
        generator = torch.Generator().manual_seed(NOISE_SEED + index)
        noise = torch.randn(latent.shape, generator=generator).to(latent.device)
        scaled = channel_scale(self.config, latent) * noise
        for level, values in self.noised.items():
            noised = (latent.float() + level * scaled).to(self.dtype)
            recon = self.net.decode(noised).float().clamp(-1, 1)
            values.append(clip_psnr(to_uint8(recon).float(), ref, data_range=255.0).item())

    def summary(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """({"checkpoint", "name", "kind"}, metric means); lpips is None without a perceptual network; continuous
        models add :data:`~.report.NOISED`, ``{"0.05": dB, ...}`` by noise level."""
        means: dict[str, Any] = {k: (sum(v) / len(v) if v else None) for k, v in self.per_clip.items()}
        if self.noised and all(self.noised.values()):
            means[NOISED] = {f"{level:g}": sum(v) / len(v) for level, v in self.noised.items()}
        if self.codes is not None:
            means["codebook_usage"], means["perplexity"] = codebook_stats(self.codes)
        info = {"checkpoint": self.checkpoint, "name": self.config.name, "kind": _kind(self.config)}
        return info, means


def _kind(config: Any) -> str:
    """``CV``/``DV`` for Cosmos models, ``continuous``/``discrete`` for families without such a name."""
    return getattr(config, "kind", None) or ("discrete" if config.is_discrete else "continuous")


def _perceptual(vgg_weights: str | None, device: str, notes: dict[str, str]) -> PerceptualLoss | None:
    if vgg_weights is not None and not Path(vgg_weights).expanduser().is_file():
        # Asked for explicitly: a missing file is an error, not a silent null.
        raise EvaluationError(f"VGG16 weights {vgg_weights} (--vgg-weights) not found; download {VGG16_URL}")
    try:
        path = find_vgg16_weights(vgg_weights)
    except FileNotFoundError:
        cache = Path(torch.hub.get_dir()) / "checkpoints" / VGG16_FILE
        # Flag-free where it counts: posttrain's report reads this too, and posttrain has no --vgg-weights.
        notes["lpips"] = (
            f"not computed: no VGG16 weights at {cache}; put {VGG16_URL} there (the evaluate command also takes "
            "--vgg-weights FILE)"
        )
        return None
    notes["lpips"] = f"{LPIPS_NOTE}; weights {path}"
    return PerceptualLoss(str(path), frame_chunk=8).to(device)


def _select(ranked: list[int], count: int) -> list[tuple[str, int, int]]:
    """(best|worst, rank, clip index) of the ``count`` best and the ``count`` worst clips, none twice."""
    best = ranked[:count]
    worst = [i for i in reversed(ranked) if i not in best][:count]
    return [("best", n + 1, i) for n, i in enumerate(best)] + [("worst", n + 1, i) for n, i in enumerate(worst)]


def _noised_note(config: Any, levels: tuple[float, ...]) -> str:
    """What the noised-latent PSNR is, or why a discrete model has none."""
    if config.is_discrete:
        return (
            f"PSNR from noised latents not measured: {config.name} is discrete (world models hand its decoder token "
            "indices, exact or wrong, not latents a little off)"
        )
    spread = (
        "its family's hard-coded per-channel std"
        if family_of(config).latent_constants is not None
        else "each clip latent's own per-channel std"
    )
    return (
        f"PSNR of reconstructions decoded from latent + level x σ x Gaussian noise, σ {spread} (what a world "
        f"model normalises with), levels {', '.join(f'{lv:g}' for lv in levels)}; the same noise (seed "
        f"{NOISE_SEED} + clip number) for both tokenizers: how the decoder copes with a world model's imperfect "
        "latents"
    )


def _deltas(model: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    """Model minus baseline of every metric both have; by level for the noised PSNR."""
    deltas: dict[str, Any] = {}
    for key, value in model.items():
        other = (base or {}).get(key)
        if isinstance(value, dict) and isinstance(other, dict):
            deltas[key] = {level: v - other[level] for level, v in value.items() if other.get(level) is not None}
        elif value is not None and other is not None and not isinstance(value, dict):
            deltas[key] = value - other
    return deltas


def _compare(sides: dict[str, _Side], latent: Tensor, base: Tensor, notes: dict[str, str]) -> tuple[str | None, float]:
    """(metric name, value) of how far the model's latent or tokens moved from the baseline's on one clip."""
    model, reference = sides["model"].config, sides["baseline"].config
    if _kind(model) != _kind(reference) or latent.shape != base.shape:
        notes["comparison"] = (
            f"model ({model.name}) and baseline ({reference.name}) latents differ in kind or shape: drift not measured"
        )
        return None, 0.0
    if model.is_discrete:
        return "token_flip_rate", token_flip_rate(latent, base).item()
    return "latent_drift", latent_drift(latent, base).item()


def evaluate(
    checkpoint: str,
    data: str,
    out_dir: str,
    baseline: str | None = None,
    frames: int = CLIP_FRAMES,
    size: int = CLIP_SIZE,
    resize_short_side: int | None = None,
    max_clips: int = 64,
    device: str = "cpu",
    dtype: str = "fp32",
    videos_per_side: int = 2,
    vgg_weights: str | None = None,
    clips_per_video: int = EVAL_CLIPS_PER_VIDEO,
    drift_limit: float = LATENT_DRIFT_LIMIT,
    noise_levels: list[float] | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` (and ``baseline``) on up to ``max_clips`` held-out clips of the energon dataset ``data``.

    Clips are the middle ``frames`` frames and the centre ``size`` x ``size`` crop (after resizing the short side
    to ``resize_short_side`` when given) of each video of the val split, else of the train split; while clips
    are wanted, further passes draw up to ``clips_per_video`` clips per video in all, each from a random start and
    crop drawn from the pass's seed (the same in every evaluation: :func:`.clips.held_out_clips`). Defaults: the
    training clip (``data.batch.CLIP_FRAMES`` x ``CLIP_SIZE`` x ``CLIP_SIZE``, as ``data.*`` defaults to), 64
    clips, 8 per video. A latent drift (continuous models) or token flip rate (DV) against the baseline above
    ``drift_limit`` makes the verdict ``drifted`` (unless it is ``worse``: :class:`.report.Verdict`).
    Continuous models are also decoded from their latents plus Gaussian noise of each of ``noise_levels`` times
    each channel's spread (default :data:`NOISE_LEVELS`; an empty list: none), noise drawn from fixed seeds
    (:data:`NOISE_SEED`): ``metrics["psnr_noised"]`` (and ``baseline_metrics``), ``{"0.05": dB, ...}``.
    ``dtype`` (``fp32`` or ``bf16``) is the precision the networks run in; metrics are computed in fp32.
    ``vgg_weights`` is the VGG16 file for the perceptual distance (default: torch hub cache; missing there ->
    ``lpips`` null with the reason).
    Writes ``results.json``, ``report.md``, PNG plots and side-by-side mp4s of the ``videos_per_side`` best and
    worst clips (by the model's PSNR) into ``out_dir``; returns the results dict.
    """
    from . import report

    if isinstance(dtype, torch.dtype):  # convenience for Python callers; the CLI and NeMo-Run pass strings
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    if dtype not in DTYPES:
        raise EvaluationError(f"dtype {dtype!r} is not one of fp32, bf16")
    if max_clips < 1 or videos_per_side < 0 or clips_per_video < 1:
        raise EvaluationError("max_clips and clips_per_video must be >= 1, videos_per_side >= 0")
    levels = tuple(NOISE_LEVELS if noise_levels is None else noise_levels)
    if any(not 0 < level < float("inf") for level in levels):
        raise EvaluationError(f"noise levels must be positive and finite, got {' '.join(f'{lv:g}' for lv in levels)}")
    if not Path(data).expanduser().exists():  # before loading the networks: fail in a blink
        raise EvaluationError(f"data {data} does not exist")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvaluationError(f"device {device} asked for, but torch sees no CUDA GPU (use --device cpu)")
    sides = {"model": _Side(checkpoint, device, DTYPES[dtype], levels)}
    if baseline is not None:
        sides["baseline"] = _Side(baseline, device, DTYPES[dtype], levels)
    for which, side in sides.items():
        problems = side.config.clip_problems(frames, size, size, names=("--frames", "--size", "--size"))
        if problems:
            raise EvaluationError(
                f"{which} ({side.config.name}) cannot take {frames}x{size}x{size} clips: {'; '.join(problems)}"
            )
    notes: dict[str, str] = {}
    perceptual = _perceptual(vgg_weights, device, notes)
    if levels:
        notes[NOISED] = _noised_note(sides["model"].config, levels)
    skipped: list[str] = []
    source, clips = held_out_clips(data, frames, size, size, resize_short_side, skipped, clips_per_video)

    keys: list[str] = []
    videos: list[str] = []  # the video each clip was cut from
    comparison: dict[str, list[float]] = {}
    psnr = sides["model"].per_clip["psnr"]
    panels: dict[int, list[Tensor]] = {}  # uint8 [T, H, W, 3] per panel, only of clips that may be shown
    # Up to max_clips: a dataset with fewer ends sooner. Lines in a log file, a bar in a terminal (core.progress).
    with torch.inference_mode(), progress("evaluate", max_clips, "clips") as clip_progress:
        for key, video_key, clip in clips:
            video = clip.unsqueeze(0).to(device)
            outputs = {which: side.run(video, perceptual, len(keys)) for which, side in sides.items()}
            if baseline is not None:
                name, values = _compare(sides, outputs["model"][1], outputs["baseline"][1], notes)
                if name:
                    comparison.setdefault(name, []).append(values)
            keys.append(key)
            videos.append(video_key)
            clip_progress.update(len(keys), mean_psnr=f"{sum(psnr) / len(psnr):.2f} dB")
            shown = [video, *([outputs["baseline"][0]] if baseline is not None else []), outputs["model"][0]]
            panels[len(keys) - 1] = [to_frames(v[0]) for v in shown]
            # Keep only the running best and worst: memory stays bounded by 2 x videos_per_side clips.
            keep = {i for _, _, i in _select(sorted(panels, key=lambda i: -psnr[i]), videos_per_side)}
            panels = {i: p for i, p in panels.items() if i in keep}
            if len(keys) >= max_clips:
                break
    if not keys:
        why = "; ".join(skipped[:5]) or "the data holds no videos"
        raise EvaluationError(f"no usable {frames}x{size}x{size} clip in {data}: {why}")

    model_info, model_means = sides["model"].summary()
    base_info, base_means = sides["baseline"].summary() if baseline is not None else (None, None)
    results: dict[str, Any] = {
        "model": model_info,
        "baseline": base_info,
        "data": {"path": str(data), "source": source},
        "clip": {"frames": frames, "height": size, "width": size, "resize_short_side": resize_short_side},
        "device": device,
        "dtype": dtype,
        "n_clips": len(keys),
        "n_videos": len(set(videos)),
        "drift_limit": drift_limit,
        "skipped": skipped,
        # Flat model means plus baseline_metrics: the layout the export command's model card reads.
        "metrics": model_means,
        "baseline_metrics": base_means,
        "comparison": {name: sum(values) / len(values) for name, values in comparison.items()},
        "deltas": _deltas(model_means, base_means),
        "per_clip": {
            "keys": keys,
            "videos": videos,
            **{which: {k: (v or None) for k, v in side.per_clip.items()} for which, side in sides.items()},
            **comparison,
        },
        "error_histogram": {which: side.errors.tolist() for which, side in sides.items()},
        "notes": notes,
    }
    if baseline is not None and not sides["model"].config.is_discrete:
        # Against what the base's world models normalize with: its files, or its family's hard-coded constants.
        new = read_latent_stats(checkpoint, sides["model"].config)
        shift = shift_from_base(new, sides["baseline"].config, baseline) if new is not None else None
        if shift is not None:
            results["latent_stats_shift"] = shift
    ranked = sorted(range(len(keys)), key=lambda i: -psnr[i])
    labels = ["input", *(["baseline"] if baseline is not None else []), "post-trained"]
    chosen = _select(ranked, videos_per_side)
    rates = video_fps(data, sorted({videos[i] for _, _, i in chosen}))
    selection = [(kind, rank, keys[i], psnr[i], panels[i], rates.get(videos[i])) for kind, rank, i in chosen]
    results["videos"] = report.write_videos(Path(out_dir), selection, labels)
    report.write_report(results, Path(out_dir))
    return results
